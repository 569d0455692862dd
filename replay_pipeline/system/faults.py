"""Fault injection for the crash and stop tests: a signal at a named point of a run.

``REPLAY_PIPELINE_CRASH_AT=<point>:<step>`` kills this process with SIGKILL when the run
reaches that point at that step, as a power cut or the OOM killer would end it (no cleanup,
no finally blocks). ``REPLAY_PIPELINE_SIGNAL_AT=<point>:<step>:<SIGNAL>`` sends SIGINT to the
process group (what Ctrl-C in a terminal does), or SIGTERM / SIGKILL to this process (what
`kill` does) there instead, after writing the time it did so to
``$REPLAY_PIPELINE_SIGNAL_LOG`` when that is set (infra/faults.py times the exit from it).

The points (see TrainingRun and the loop):

    warm_start        before warm-start step <step> (the built-in model's supervised start)
    generate          after sampling the step's completions, before they are scored or stored
    after_append      after the step's rollouts are committed, before learning and checkpoint
    between_tasks     after the rounds task ending with step <step> (and the evaluations due
                      among its rounds, which run inside it) returned, before the next Prefect
                      task (a checkpoint or the next rounds)
    evaluate          inside the evaluation after <step> rounds, between its greedy and
                      sampled parts
    checkpoint_write  with every checkpoint file written but the directory not yet renamed
    after_checkpoint  after the checkpoint is in place, before MLflow hears of it
    learner_rank      in a learner rank other than 0 (learner.world_size > 1), before it applies
                      the round whose first learner step is <step> (rank 0 is the flow's process)

For checkpoints, ``step`` is the number of steps done (the checkpoint's name). Unset, a
point costs two dictionary lookups.

Ground floor: imports nothing of the project.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "REPLAY_PIPELINE_CRASH_AT"
SIGNAL_ENV = "REPLAY_PIPELINE_SIGNAL_AT"
SIGNAL_LOG_ENV = "REPLAY_PIPELINE_SIGNAL_LOG"
POINTS = ("warm_start", "generate", "after_append", "between_tasks", "evaluate", "checkpoint_write",
          "after_checkpoint", "learner_rank")


def crash_point(point: str, step: int) -> None:
    spec = os.environ.get(ENV)
    if spec and spec == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
    spec = os.environ.get(SIGNAL_ENV)
    if spec and spec.rsplit(":", 1)[0] == f"{point}:{step}":
        os.environ.pop(SIGNAL_ENV)  # once: a resumed or repeated step does not signal again
        sig = signal.Signals[spec.rsplit(":", 1)[1]]
        log = os.environ.get(SIGNAL_LOG_ENV)
        if log:
            with open(log, "w") as f:
                f.write(f"{time.time()}\n")
        if sig == signal.SIGINT:  # SIGSTOP is allowed too: a process that stops answering
            os.killpg(os.getpgrp(), sig)
        else:
            os.kill(os.getpid(), sig)
