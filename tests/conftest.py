"""Shared test set-up: Prefect's ephemeral state in a throw-away home, small configs."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_home = Path(tempfile.mkdtemp(prefix="rp-prefect-"))
os.environ.setdefault("PREFECT_HOME", str(_home))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "CRITICAL")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# A model and task small enough that the warm start takes seconds: tests exercise the
# pipeline, not the learning (the README's default run shows the learning); the warm
# start still reaches ~30% so that groups have mixed rewards and non-zero advantages.
TINY_OVERRIDES = [
    "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
    "model.intermediate_size=64", "model.warmstart.target_accuracy=0.3",
    "model.warmstart.lr=3e-3", "model.warmstart.warmup_steps=5", "model.warmstart.eval_every=10",
    "task.digits=1", "task.heldout_size=20", "task.validation_size=20",
    "loop.prompts_per_step=4", "loop.group_size=4", "loop.minibatch_size=16",
    "buffer.capacity=32", "tracking.progress=false",
]
