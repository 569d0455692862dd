"""Fault injection for the crash tests: kill this process with SIGKILL at a named point.

Set ``REPLAY_PIPELINE_CRASH_AT=<point>:<step>`` and the training run dies, as a power cut
or the OOM killer would end it (no cleanup, no finally blocks), when it reaches that point at
that step. The points (see TrainingRun):

    generate          after sampling the step's completions, before they are scored or stored
    after_append      after the step's rollouts are committed, before learning and checkpoint
    checkpoint_write  with every checkpoint file written but the directory not yet renamed
    after_checkpoint  after the checkpoint is in place, before MLflow hears of it

For checkpoints, ``step`` is the number of steps done (the checkpoint's name). Unset, a
crash point costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "REPLAY_PIPELINE_CRASH_AT"
POINTS = ("generate", "after_append", "checkpoint_write", "after_checkpoint")


def crash_point(point: str, step: int) -> None:
    spec = os.environ.get(ENV)
    if spec and spec == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
