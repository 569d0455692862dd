"""`model.device` in real runs, and the generator closed once at the end of every run,
finished or failed.

The generator's `close` is observed, not replaced: the counting wrapper calls the real one.
The GPU case runs only where torch sees CUDA (skipped here, with the reason, under -ra).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from replay_pipeline.training.checkpoints import load_optimizer_state
from replay_pipeline.config import load_config
from replay_pipeline.generation import TransformersGenerator
from replay_pipeline.models.loading import load_pretrained
from replay_pipeline.models.policy import policy_dir
from replay_pipeline.run.build import build_run
from replay_pipeline.run.loop import sync_round
from replay_pipeline.run.phases import TrainingRun
from replay_pipeline.tracking.tracker import NullTracker
from tests.conftest import TINY_OVERRIDES

# The pipeline is under test, not learning: no warm-start training, no evaluation beyond the first.
FAST = [*TINY_OVERRIDES, "model.warmstart.target_accuracy=0", "loop.eval_every=0", "loop.passk_every=0"]
CUDA = torch.cuda.is_available()


@pytest.fixture
def closed(monkeypatch) -> list:
    """Every generator whose close() ran (the real close runs too)."""
    calls = []
    real = TransformersGenerator.close

    def counting(self):
        calls.append(self)
        real(self)

    monkeypatch.setattr(TransformersGenerator, "close", counting)
    return calls


def _mlflow_status(root: Path) -> str:
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    run, = client.search_runs([client.get_experiment_by_name("replay-pipeline").experiment_id])
    return run.info.status


def test_a_finished_run_closes_its_generator_once(tmp_path, closed):
    from flows.train import train

    summary = train([f"tracking.root_dir={tmp_path}", *FAST, "run_id=done", "loop.steps=2"])
    assert summary["status"] == "FINISHED"
    assert len(closed) == 1 and isinstance(closed[0], TransformersGenerator)


def test_a_failed_run_closes_its_generator_too(tmp_path, closed):
    from flows.train import train

    # A file where the first checkpoint's directory goes: saving it fails for real.
    blocker = tmp_path / "failing" / "checkpoints" / "step-000001"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a checkpoint")
    with pytest.raises(OSError):
        train([f"tracking.root_dir={tmp_path}", *FAST, "run_id=failing", "loop.steps=2", "loop.checkpoint_every=1"])
    assert len(closed) == 1
    assert _mlflow_status(tmp_path) == "FAILED"


def _rounds(root: Path, run_id: str, *overrides: str, steps: int = 2) -> TrainingRun:
    cfg = load_config([f"tracking.root_dir={root}", *FAST, f"run_id={run_id}", f"loop.steps={steps}", *overrides])
    run = build_run(cfg, log=lambda _: None, tracker=NullTracker())
    for step in range(steps):
        sync_round(run, step)
    run.flush_writes()
    return run


def test_an_explicit_cpu_run_is_the_default_run_bit_for_bit(tmp_path, closed):
    default = _rounds(tmp_path, "default")
    explicit = _rounds(tmp_path, "cpu", "model.device=cpu")
    for run in (default, explicit):
        assert run.learner.device == run.generator.device == torch.device("cpu")
    for (name, a), (_, b) in zip(default.learner.model.state_dict().items(),
                                 explicit.learner.model.state_dict().items()):
        assert torch.equal(a, b), name
    logprobs = [r.store.window(64, ["behaviour_logprobs"]).column("behaviour_logprobs").to_pylist()
                for r in (default, explicit)]
    assert logprobs[0] == logprobs[1]
    # The directory the policy came from, found again without loading it (flows.evaluate's vLLM fallback).
    assert policy_dir(default.settings, default.task, default.paths) == Path(default.policy_info["path"])
    for run in (default, explicit):
        run.finish()
    assert closed == [default.generator, explicit.generator]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_training_on_cuda_writes_checkpoints_that_load_on_the_cpu(tmp_path):
    run = _rounds(tmp_path, "gpu", "model.device=cuda", steps=3)
    assert run.learner.device.type == "cuda" and run.generator.device == run.learner.device
    assert run.generator.shares_weights and run.policy_version == 3
    assert run.learner.steps == 3 * run.settings.loop.updates_per_step
    path = run.checkpoint(3)
    model, _ = load_pretrained(path / "model")
    assert next(model.parameters()).device.type == "cpu"
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, run.learner.model.state_dict()[name].cpu()), name
    state = load_optimizer_state(path)["state"]
    assert all(t.device.type == "cpu" for s in state.values() for t in s.values() if torch.is_tensor(t))
    run.finish()
