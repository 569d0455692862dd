"""Stopping a run on a signal: Ctrl-C (SIGINT) and SIGTERM (`kill`, Docker, a Prefect
deployment's cancellation) ask the run to stop at its next safe point instead of raising
wherever the process happens to be.

Why: an exception raised by a signal handler lands anywhere, inside a Prefect task's setup
("Task run is not set"), in the middle of a store write or of an HTTP call to the Prefect API,
so the same key press ended a run in different ways. Here the handler only records the
request; the run checks it at points where stopping leaves nothing half done:

* between rounds (replay_pipeline/run/loop.py), after the round's rows are handed to the
  writer;
* between generation batches (replay_pipeline/generation/transformers_backend.py), so an
  evaluation or a long generation does not hold the stop up;
* between warm-start steps (replay_pipeline/models/warmstart.py).

`check()` raises :class:`RunStopped` there; the flow (flows/train.py) ends the run as KILLED
in MLflow and CANCELLED in Prefect, and everything already stored stays resumable. A second
signal while the first is being honoured raises KeyboardInterrupt at once (the way out when
a stop takes too long).

Ground floor: imports nothing of the project. Signal handlers run in the main thread only;
`install` elsewhere does nothing.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunStopped(Exception):
    """The run was asked to stop (a signal) and stopped at a safe point."""

    def __init__(self, signame: str, where: str = ""):
        self.signame = signame
        self.where = where
        super().__init__(f"stopped by {signame}" + (f" during {where}" if where else ""))


_requested: str | None = None
_announce: Callable[[str], Any] | None = None


def requested() -> str | None:
    """The name of the signal that asked the run to stop (SIGINT, SIGTERM), or None."""
    return _requested


def check(where: str = "") -> None:
    """Raise RunStopped if a stop was requested."""
    if _requested is not None:
        raise RunStopped(_requested, where)


def request(signame: str) -> None:
    """Ask the run to stop (what the signal handler does; also for tests and embedders)."""
    global _requested
    first = _requested is None
    _requested = signame
    if first and _announce is not None:
        _announce(signame)


def reset() -> None:
    global _requested
    _requested = None


def _handler(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    if _requested is not None:  # the second signal: stop now
        raise KeyboardInterrupt(f"{name} again: stopping at once")
    request(name)


def install(announce: Callable[[str], Any] | None = None) -> bool:
    """Install the handlers for SIGINT and SIGTERM (main thread only; returns whether it
    did). `announce(signame)` is called once, at the first signal."""
    global _announce
    if threading.current_thread() is not threading.main_thread():
        return False
    if announce is not None:
        _announce = announce
    for signum in SIGNALS:
        signal.signal(signum, _handler)
    return True


@contextmanager
def installed(announce: Callable[[str], Any] | None = None) -> Iterator[None]:
    """The handlers for the body of the `with`, then the previous ones back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with handlers_kept():
        install(announce)
        yield


@contextmanager
def handlers_kept() -> Iterator[None]:
    """SIGINT's and SIGTERM's handlers as they are now, put back when the body ends, whatever
    it installed (a library that sets its own: ray.init). Only the main thread has handlers."""
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in SIGNALS} if main else {}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if handler is not None:
                signal.signal(signum, handler)
