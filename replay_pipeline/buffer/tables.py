"""A run's two tables behind one door: rollout appends, usage records, their retries, the
writes behind the learner and the compaction schedule.

The training loop writes the tables only through `RunTables`; it holds the rollout table
(`store`), the usage table (`usage`), the writer thread (`writes`, buffer.write_behind) and the
in-memory mirror of the live window (`cache`, buffer.read_cache), so that every row enters
the mirror exactly as it is written. It does not choose what is written (the run's phases do)
and never reads the window (replay_pipeline/run/replay.py does).

Rules (DESIGN.md, principles 3 and 5):
* A *fresh* batch (one no process stored before) is validated and numbered here, on the
  caller's thread, and committed behind the learner; a *replayed* one (a resume's steps whose
  rows a stopped process may have stored) goes through the idempotent append at once.
* Every write is retried through the idempotent append (`retry_storage`): a retry after a
  commit whose outcome was lost inserts nothing. Except when a numbered append finds rows it
  did not number from (`ConcurrentAppend`): only another driver on the table explains that,
  and the run stops rather than interleave two runs' steps.
* Compaction: both tables every buffer.compact_every rounds (sync), or every compact_every
  table versions (async: each generator batch is one), on the writer thread.
* Grouped commits (sync loop, with the mirror; buffer.commit_seconds > 0): a round's rows and
  usage records are validated and numbered at once, as above, but held in memory and committed
  together with those of the following rounds, once at least commit_seconds have passed since
  the previous group: one rollout commit and one usage commit per group instead of two
  commits a round (each a LanceDB transaction, a fragment and a manifest). The sampler reads
  the live window from the mirror, which holds the held rows; any read of the tables themselves
  waits for them first (`wait`), and so do checkpoints and the end of the run, stopped or
  failed. A process killed outright (SIGKILL, power cut) loses the rounds held: at most about
  commit_seconds of rounds since the last group, never a checkpoint's; a resume regenerates
  them from their step seeds, as it regenerates the one write in flight without grouping.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable

import pyarrow as pa

from replay_pipeline.system import faults
from replay_pipeline.buffer.cache import WindowCache
from replay_pipeline.buffer.lance_table import ConcurrentAppend
from replay_pipeline.buffer.store import RolloutStore
from replay_pipeline.buffer.usage import UsageStore
from replay_pipeline.buffer.writer import WriteBehind


def retry_storage(fn: Callable[[int], Any], attempts: int = 3, delay: float = 1.0) -> Any:
    """fn(attempt) until it returns, for storage calls that may fail transiently (safe for
    idempotent writes: a retry after a commit whose outcome was lost inserts nothing)."""
    for attempt in range(attempts):
        try:
            return fn(attempt)
        except ConcurrentAppend:
            raise  # another driver on this table: a retry would interleave two runs' steps
        except (OSError, RuntimeError) as exc:
            if attempt == attempts - 1:
                raise
            warnings.warn(f"retrying after a storage error: {exc}")
            time.sleep(delay)


class RunTables:
    """The rollout and usage tables of one run, and every write to them."""

    def __init__(self, store: RolloutStore, usage: UsageStore, *, compact_every: int, shared: bool,
                 write_behind: bool = True, cache: WindowCache | None = None, commit_seconds: float = 0.0):
        self.store = store
        self.usage = usage
        self.compact_every = compact_every
        self.shared = shared
        """True in the async loop: generator processes append too (the learner still compacts)."""
        self.writes = WriteBehind(enabled=write_behind)
        self.cache = cache
        self._compacted_at = 0
        """Async loop: the rollout-table version of the last compaction."""
        self.commit_seconds = float(commit_seconds) if cache is not None and not shared else 0.0
        """Grouped commits (module docstring): 0 without the mirror and in the async loop."""
        self._held = _Held()
        self._group_began = time.monotonic()

    # ------------------------------------------------------------------ rollouts
    def append_fresh(self, table: pa.Table, step: int, count: int | None) -> pa.Table | None:
        """Validate and number a fresh step's rows now (from `count`, the rows the sync loop
        knows are stored; None: read it), commit them behind the learner (then compact when
        due). Returns the rows as they will be stored (None: nothing new)."""
        if self.commit_seconds and count is not None:  # `count` includes the held rows
            stored = self.store.prepare(table, known_new=True, start=count)
            self._held.rollouts.append((stored, table, step, count))
        else:
            self.wait()  # the held rounds and the previous write (raises if it failed)
            stored = self.store.prepare(table, known_new=True, start=count)
            self.writes.submit(lambda: self._commit_rollouts(stored, table, step, count))
        self._mirror(stored)
        return stored

    def append_replayed(self, table: pa.Table, step: int) -> pa.Table | None:
        """A replayed step's rows through the idempotent append, at once (adds nothing if a
        stopped process stored them). Returns the rows added (the caller then compacts when
        due: `compact_if_due`)."""
        self.wait()
        # The step's rows were numbered from the rows of the steps before it: a row a repair
        # lost (replay_pipeline/buffer/repair.py) goes back to its own seq, not to the end.
        start = self.store.seq_end(step - 1) if step > 0 else 0
        retry_storage(lambda attempt: self.store.append(table, seq_start=start))
        stored = self.store.last_appended
        faults.crash_point("after_append", step)
        self._mirror(stored)
        return stored

    def append_behind(self, table: pa.Table) -> None:
        """An async generator's batch: through the idempotent append, on the writer thread
        (one write in flight; a failed write raises at the next call)."""
        self.writes.submit(lambda: retry_storage(lambda attempt: self.store.append(table)))

    def _commit_rollouts(self, rows: pa.Table | None, table: pa.Table, step: int, count: int | None) -> float:
        """The writer thread's half of a fresh append (retried through the idempotent append);
        then the compaction when due. Returns the compaction's seconds."""
        if rows is not None:
            retry_storage(lambda attempt: self.store.insert(rows, expect_count=count) if attempt == 0
                          else self.store.append(table))
        faults.crash_point("after_append", step)
        return self.compact_if_due(step)

    def _mirror(self, stored: pa.Table | None) -> None:
        if self.cache is not None and stored is not None:
            self.cache.appended(stored)

    # ------------------------------------------------------------------ usage records
    def record_usage(self, used: pa.Table, fresh: bool) -> None:
        """This round's usage records: validated now and committed behind the next round's
        work (`fresh`), or, for a replayed round whose records are already stored, through
        the idempotent append at once."""
        if fresh and self.commit_seconds:
            self._held.usage.append((self.usage.prepare(used, known_new=True), used))
            if time.monotonic() - self._group_began >= self.commit_seconds:
                self._commit_held()
        elif fresh:
            prepared = self.usage.prepare(used, known_new=True)
            self.writes.submit(lambda: retry_storage(
                lambda attempt: self.usage.insert(prepared) if attempt == 0 else self.usage.record(used)))
        else:
            self.wait()
            retry_storage(lambda attempt: self.usage.record(used))
        if self.cache is not None:
            self.cache.used(used)

    # ------------------------------------------------------------------ grouped commits
    def _commit_held(self) -> None:
        """Hand the held rounds to the writer thread as one group (after the write in flight)."""
        held, self._held = self._held, _Held()
        self._group_began = time.monotonic()
        if held.rollouts or held.usage:
            self.writes.submit(lambda: self._commit_group(held))

    def _commit_group(self, held: "_Held") -> float:
        """The writer thread's half of a group: its rollouts in one commit, then its usage
        records (which name them) in one; each retried through the idempotent append. Then the
        compaction, if one fell due in the group (once). Returns the compaction's seconds."""
        rows = [stored for stored, _, _, _ in held.rollouts if stored is not None]
        if rows:
            first_count = held.rollouts[0][3]
            together = pa.concat_tables(rows)
            raw = pa.concat_tables([table for _, table, _, _ in held.rollouts])
            retry_storage(lambda attempt: self.store.insert(together, expect_count=first_count) if attempt == 0
                          else self.store.append(raw))
        for _, _, step, _ in held.rollouts:
            faults.crash_point("after_append", step)
        if held.usage:
            prepared = pa.concat_tables([p for p, _ in held.usage])
            raw = pa.concat_tables([u for _, u in held.usage])
            retry_storage(lambda attempt: self.usage.insert(prepared) if attempt == 0 else self.usage.record(raw))
        every = self.compact_every
        due = [step for _, _, step, _ in held.rollouts if every and (step + 1) % every == 0]
        return self.compact_if_due(due[0]) if due else 0.0

    # ------------------------------------------------------------------ compaction
    def compact_if_due(self, step: int) -> float:
        """Compact both tables when due (see the module docstring); returns the seconds."""
        every = self.compact_every
        if not every:
            return 0.0
        if self.shared:
            if self.store.version - self._compacted_at < every:
                return 0.0
        elif (step + 1) % every:
            return 0.0
        start = time.perf_counter()
        self.store.compact()
        self.usage.compact()
        self._compacted_at = self.store.version
        return time.perf_counter() - start

    def compact_behind(self, step: int) -> None:
        """Async learner: the compaction, when due, on the writer thread."""
        self.writes.submit(lambda: self.compact_if_due(step))

    # ------------------------------------------------------------------ settling
    def wait(self) -> Any:
        """Commit the held rounds (grouped commits) and wait for the write in flight (raising
        its error): afterwards the tables hold every row handed to them. Returns the write's
        result (a compaction's seconds, or None)."""
        self._commit_held()
        return self.writes.wait()

    def wait_in_flight(self) -> Any:
        """Wait for the write in flight only (held rounds stay held); returns its result."""
        return self.writes.wait()

    def settle(self, close: bool = False, run_id: str = "") -> bool:
        """Commit the held rounds and wait for the write in flight (and stop the writer thread
        if `close`); False, with a warning, if it failed: at the end of a run, which then ends
        FAILED."""
        try:
            self._commit_held()
            self.writes.close() if close else self.writes.wait()
            return True
        except Exception as exc:  # the checkpoint raised it already, or the run fails now
            warnings.warn(f"the last table write of {run_id} failed: {exc!r}")
            return False

    def close(self, run_id: str = "") -> bool:
        """Stop the mirror's reader and the writer thread; False if the last write failed."""
        if self.cache is not None:
            self.cache.close()
        return self.settle(close=True, run_id=run_id)


class _Held:
    """Rounds validated and numbered but not yet committed (grouped commits)."""

    def __init__(self) -> None:
        self.rollouts: list[tuple[pa.Table | None, pa.Table, int, int]] = []
        """(rows as they will be stored, the batch as scored, step, count numbered from)."""
        self.usage: list[tuple[pa.Table, pa.Table]] = []
        """(records as they will be stored, as made)."""
