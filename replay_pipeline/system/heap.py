"""The interpreter's cycle collector while a command starts: no full collections while the
libraries load, and the start-up heap frozen before the first round.

Loading torch, transformers, Prefect, MLflow and LanceDB grows the heap to about 1.5M
objects. Python runs a full (generation-2) collection each time the long-lived objects have
grown by a quarter, and each one walks the whole heap as it is then: 10 of them during a
default run's start-up here, 15 to 370 ms each, 1.5 s in all, finding next to nothing (module
objects live for the whole process). Later full collections walk the same objects again: one
in the middle of a 40-step run took 408 ms, a stall inside one learner step.

* `defer_full_collections()` (the first line of `python -m flows.train`, before the heavy
  imports) keeps the young generations collecting as usual but lets no full collection run.
* `freeze_startup_heap()` (at the first round: `train_loop`, replay_pipeline/run/loop.py)
  moves every object alive then to the permanent generation (`gc.freeze`) and gives the
  collector its thresholds back: from then on a full collection walks only what the run
  itself made. The run logs how many it froze as `startup/frozen_objects`.

What is given up: reference cycles that became garbage during start-up and survived two
young collections are frozen with the rest and never freed: at a default run's first round,
about 1% of the tracked objects, which a full collection there would take some 400 ms to
find. Only a process that deferred gets frozen: a test or a sweep that calls
`flows.train.train()` in a longer-lived process keeps the collector as it was.
Ground floor: imports nothing of the project.
"""

from __future__ import annotations

import gc

__all__ = ["defer_full_collections", "freeze_startup_heap", "deferring"]

#: A generation-2 threshold no start-up reaches: Python counts generation-1 collections
#: against it (about one per 7,000 surviving allocations).
NEVER = 1 << 30

_saved: tuple[int, int, int] | None = None


def defer_full_collections() -> None:
    """No full collection until `freeze_startup_heap()`; the young generations as before.
    Idempotent."""
    global _saved
    if _saved is None:
        _saved = gc.get_threshold()
        gc.set_threshold(_saved[0], _saved[1], NEVER)


def deferring() -> bool:
    """Whether this process is deferring full collections (between the two calls)."""
    return _saved is not None


def freeze_startup_heap() -> int:
    """If full collections are deferred: freeze every object alive now (`gc.freeze`) and
    give the collector its thresholds back. Returns how many objects are frozen (0: this
    process never deferred, and is left as it is)."""
    global _saved
    if _saved is None:
        return 0
    gc.freeze()
    gc.set_threshold(*_saved)
    _saved = None
    return gc.get_freeze_count()
