"""Writes behind the learner: the training loop's table writes run on a background thread
while the learner computes, with at most one write in flight.

Decisions (DESIGN.md, principles 3 and 5):

* **One write in flight, in order.** :meth:`WriteBehind.submit` first waits for the previous
  write, so writes land in the order they were issued (a round's rollouts before the usage
  records that name them) and a crash loses at most the one write in flight: the work of the
  step since the last checkpoint, which a resume redoes deterministically.
* **Validated before, committed behind.** The caller validates a batch and assigns its ``seq``
  values on its own thread (:meth:`LanceTable.prepare`), so bad data fails where it was made;
  only the commit (and a compaction that falls due) runs behind.
* **Errors are not lost.** A write that failed (after its retries) raises from the next
  :meth:`wait` or :meth:`submit`, on the training thread; the loop waits before every usage
  record (or, with grouped commits, before every group: replay_pipeline/buffer/tables.py),
  before a checkpoint and at the end, so a failure never passes a checkpoint.
* **Why.** On the default CPU run a rollout append and a usage record cost ~5-10 ms each,
  ~5% of a round; on object storage a commit takes tens of milliseconds. Behind the
  learner's forward and backward passes they cost the round almost nothing.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from replay_pipeline.system.threadnames import name_os_thread

__all__ = ["WriteBehind"]


class WriteBehind:
    """At most one table write in flight on a background thread (``enabled=False``: every
    write runs at once, on the caller's thread)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self.waited = 0.0
        """Seconds the caller spent waiting for writes to finish."""

    def submit(self, write: Callable[[], Any]) -> None:
        """Run ``write`` behind the caller, after the previous write finished."""
        self.wait()
        if not self.enabled:
            write()
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="table-writer",
                                            initializer=name_os_thread)
        self._pending = self._pool.submit(write)

    def wait(self) -> Any:
        """Block until the write in flight (if any) is done; returns its result, or raises
        the error it failed with."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        start = time.perf_counter()
        try:
            return pending.result()
        finally:
            self.waited += time.perf_counter() - start

    @property
    def busy(self) -> bool:
        return self._pending is not None

    def close(self) -> None:
        """Wait for the write in flight, then stop the thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
