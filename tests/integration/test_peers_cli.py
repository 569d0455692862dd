"""replay_pipeline.benchmarks.peers refuses bad input before any work, saying what to fix
(nothing here trains)."""

from __future__ import annotations

import pytest

from replay_pipeline.benchmarks.peers import main


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps 0 must be an integer >= 1"),
    (["--steps", "3", "--eval-every", "-1"], "--eval-every -1 must be >= 0"),
    (["--steps", "3", "loop.steps=5"], "use --steps"),
    (["--steps", "3", "algo=asymre"], "GRPOTrainer's loss is the GRPO clip"),
    (["--steps", "3", "loop.updates_per_step=2", "loop.minibatch_size=32"], "loop.updates_per_step=2"),
    (["--steps", "3", "algo.lrr=1e-4"], "Invalid configuration"),
    (["--steps", "3", "notanoverride"], "not overrides"),
    (["--steps", "3", "--repeats", "0"], "--repeats 0 must be >= 1"),
    (["--steps", "3", "run_id=mine"], "each repeat of our side names its own run"),
    (["--steps", "3", "--slice-seconds", "0"], "--slice-seconds 0.0 must be > 0"),
])
def test_bad_input_is_refused_before_any_work(tmp_path, capsys, args, message):
    root = tmp_path / "never-created"
    assert main([*args, "--root", str(root)]) == 2
    assert message in capsys.readouterr().err
    assert not root.exists()


@pytest.mark.parametrize("args, message", [
    (["--sides", "ours,verl"], "distinct sides among ours, trl, bare"),
    (["--interleave", "threads"], "invalid choice: 'threads'"),
])
def test_an_unknown_choice_is_refused_by_the_parser(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--root", str(tmp_path / "never-created")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "never-created").exists()
