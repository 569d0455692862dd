"""The tiny run: command-line overrides for a model and task small enough that the warm start
takes seconds. The tests, the fault and bad-input tables (infra/) and the process-end benchmark
use it to exercise the pipeline, not the learning (the default run shows the learning:
docs/quickstart.md); the warm start still reaches ~30% held-out accuracy, so that groups have
mixed rewards and non-zero advantages.
"""

from __future__ import annotations


def tiny_overrides(torch_threads: int = 1) -> list[str]:
    """The tiny run's overrides at `torch_threads` (fixed, not auto: runs compared with each
    other then sum alike)."""
    return ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=64",
            "model.warmstart.target_accuracy=0.3", "model.warmstart.lr=3e-3", "model.warmstart.warmup_steps=5",
            "model.warmstart.eval_every=10", "task.digits=1", "task.heldout_size=20", "task.validation_size=20",
            "loop.prompts_per_step=4", "loop.group_size=4", "loop.minibatch_size=16", "buffer.capacity=32",
            "tracking.progress=false", f"model.torch_threads={torch_threads}"]
