"""A SIGTERM that lands inside a tracking-store call must not leave the SQLite store locked:
the run is still marked KILLED (a real MLflow SQLite store, real signals to this process)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from replay_pipeline.tracking.tracker import MlflowTracker, deferred_signals


class Stop(BaseException):
    """What Prefect's SIGTERM handler raises (TerminationSignal is a BaseException too)."""


@pytest.fixture
def raising_sigterm():
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(Stop()))
    yield
    signal.signal(signal.SIGTERM, previous)


def test_a_signal_inside_the_block_is_raised_when_it_ends(raising_sigterm):
    reached = []
    with pytest.raises(Stop):
        with deferred_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            reached.append("after the kill")  # the handler has not run yet
    assert reached == ["after the kill"]
    with deferred_signals():  # nothing pending: nothing raised, and the handler is back
        pass
    with pytest.raises(Stop):
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a bytecode boundary for the handler


def test_sigterm_during_store_writes_still_marks_the_run_killed(tmp_path, raising_sigterm):
    # Without the deferral, 5 of 20 such runs left the store locked ("database is locked")
    # and could not be marked KILLED.
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    for trial in range(12):
        tracker = MlflowTracker(uri, "signals", tmp_path / "art", f"run-{trial}")
        threading.Timer(0.05 + trial * 0.013, os.kill, (os.getpid(), signal.SIGTERM)).start()
        with pytest.raises(Stop):
            while True:
                tracker.log_metrics({"m": 1.0}, step=trial)
                tracker.set_tags({"checkpoint.latest_step": str(trial)})
        tracker.finish("KILLED")
        assert tracker.status() == "KILLED"
