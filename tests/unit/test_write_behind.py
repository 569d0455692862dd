"""WriteBehind (replay_pipeline/buffer/writer.py): one write in flight, in order, errors raised
on the caller's thread."""

from __future__ import annotations

import threading
import time

import pytest

from replay_pipeline.buffer.writer import WriteBehind


def test_writes_run_behind_the_caller_one_at_a_time_in_order():
    writes = WriteBehind()
    log: list[tuple[str, int, float]] = []
    caller = threading.get_ident()
    threads = set()

    release = threading.Event()  # write 0 lasts until the caller has seen submit() return

    def write(k: int) -> int:
        threads.add(threading.get_ident())
        log.append(("start", k, time.perf_counter()))
        if k == 0:
            release.wait(10)
        else:
            time.sleep(0.05)
        log.append(("end", k, time.perf_counter()))
        return k

    writes.submit(lambda: write(0))
    assert ("end", 0) not in [e[:2] for e in log]  # returned before the write finished
    assert writes.busy
    threading.Timer(0.05, release.set).start()
    writes.submit(lambda: write(1))  # waits for write 0 first
    assert [e[:2] for e in log[:2]] == [("start", 0), ("end", 0)]
    assert writes.wait() == 1
    assert [e[:2] for e in log] == [("start", 0), ("end", 0), ("start", 1), ("end", 1)]
    assert caller not in threads and not writes.busy
    assert writes.waited > 0.04
    writes.close()


def test_a_failed_write_raises_on_the_callers_next_wait_or_submit():
    writes = WriteBehind()

    def fail():
        raise OSError("disk full")

    writes.submit(fail)
    with pytest.raises(OSError, match="disk full"):
        writes.wait()
    assert writes.wait() is None  # raised once, not again
    writes.submit(fail)
    with pytest.raises(OSError, match="disk full"):
        writes.submit(lambda: None)  # the next write is not started after a failure
    writes.close()


def test_disabled_runs_every_write_at_once_on_the_caller():
    writes = WriteBehind(enabled=False)
    seen = []
    writes.submit(lambda: seen.append(threading.get_ident()))
    assert seen == [threading.get_ident()] and not writes.busy
    with pytest.raises(ValueError):
        writes.submit(lambda: (_ for _ in ()).throw(ValueError("bad")))
    writes.close()


def test_close_waits_for_the_write_in_flight():
    writes = WriteBehind()
    done = []
    writes.submit(lambda: (time.sleep(0.05), done.append(True)))
    writes.close()
    assert done == [True]
