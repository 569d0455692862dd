"""replay_pipeline.benchmarks.trl_compare refuses bad input before any work, saying what to
fix (moved out of the e2e tier: nothing here trains)."""

from __future__ import annotations

import pytest

from replay_pipeline.benchmarks.trl_compare import main


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps 0 must be an integer >= 1"),
    (["--steps", "3", "--eval-every", "-1"], "--eval-every -1 must be >= 0"),
    (["--steps", "3", "loop.steps=5"], "use --steps"),
    (["--steps", "3", "algo=asymre"], "GRPOTrainer's loss is the GRPO clip"),
    (["--steps", "3", "loop.updates_per_step=2", "loop.minibatch_size=32"], "loop.updates_per_step=2"),
    (["--steps", "3", "algo.lrr=1e-4"], "Invalid configuration"),
    (["--steps", "3", "notanoverride"], "not overrides"),
])
def test_bad_input_is_refused_before_any_work(tmp_path, capsys, args, message):
    root = tmp_path / "never-created"
    assert main([*args, "--root", str(root)]) == 2
    assert message in capsys.readouterr().err
    assert not root.exists()
