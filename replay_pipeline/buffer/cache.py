"""An in-memory mirror of the replay window: the newest rows of a run's rollout table and their
usage counts, so that the sampler's per-round reads (the window's light columns, the chosen
rows' token data, the window's reuse counts) are not three LanceDB queries every round.

Decisions (DESIGN.md, principles 1 and 3 still hold):

* **A mirror of stored rows, never a second source of truth.** A row enters the mirror only
  after the append that stored it returned (:meth:`WindowCache.appended`, the sync loop's own
  appends) or when it is read from the table (:meth:`WindowCache.refresh`, rows other processes
  committed). Usage counts enter only after the usage records were committed
  (:meth:`WindowCache.used`). The mirror is built from the tables when a process starts, so a
  resume or fork sees exactly what is stored; nothing in it is ever written back.
* **Only the live window is mirrored.** Reads bounded in the past (a resumed run replaying the
  steps after its checkpoint: ``end`` below the stored rows, usage counts ``before`` a learner
  step) and the positive-bias window (which reaches back for correct rows of any age) go to
  LanceDB as before. :meth:`WindowCache.window` returns None for them and whenever the mirror
  does not cover the request; the caller then reads the table, and :meth:`WindowCache.fill`
  rebuilds the mirror from the table.
* **Other writers' rows are found by fragment.** In the async loop the generators append to the
  table; every Lance append adds a fragment, so :meth:`refresh` reads only the fragments it has
  not seen (each filtered to the mirrored ``seq`` range and deduplicated by ``rollout_id``, which
  also makes a compaction's rewritten fragments harmless). Rows of racing writers that share a
  ``seq`` are ordered by ``rollout_id``, as :meth:`RolloutStore.window` orders them.
* **Read ahead in the async loop.** With ``prefetch``, a background thread (:class:`_Prefetch`,
  its own table handle) looks for new fragments every ``interval`` seconds, scans them and
  holds the rows and the table's row count as of that look; :meth:`refresh` then only merges
  what it holds, and :meth:`stored` gives that count (the rows a round may use). So the
  learner does not read the generators' fragments between its learner steps (20-40 ms a
  round on the default model): the reading overlaps the learner's compute. Rows still enter
  the mirror only once committed (they are read from the table), and a :meth:`fill` discards
  whatever the thread read before it.
* **Bounded.** The mirror keeps the newest ``keep`` sequence numbers (the window plus one
  round's appends), so its memory does not grow with the run.

Measured effect (``python -m replay_pipeline.benchmarks.overhead``): the sampler's three reads
took 24-41 ms a round on the default run (more as un-compacted fragments pile up between
compactions); served from the mirror they take well under a millisecond.
``buffer.read_cache=false`` turns the mirror off; results are identical either way (tested).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replay_pipeline.system.threadnames import os_named

from .store import RolloutStore
from .usage import UsageStore

__all__ = ["WindowCache"]


class WindowCache:
    """The newest rows (``columns``) of ``store`` with ``seq`` in ``[lo, hi)`` and their usage
    counts from ``usage``. ``shared``: other processes append too (the async loop); call
    :meth:`refresh` before reading."""

    def __init__(self, store: RolloutStore, usage: UsageStore, columns: Sequence[str], keep: int,
                 shared: bool = False, prefetch: bool = False, interval: float = 0.05):
        self.store, self.usage = store, usage
        self.columns = list(dict.fromkeys([*columns, *RolloutStore.ORDER]))
        self.keep = int(keep)
        self.shared = shared
        self.rows: pa.Table | None = None  # sorted by (seq, rollout_id)
        self.lo = self.hi = 0
        self.counts: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.total = 0
        self.fragments: set[int] = set()
        self.hits = self.misses = 0
        self._prefetch = _Prefetch(store.handle(), self.columns, interval) if shared and prefetch else None

    def invalidate(self) -> None:
        self.rows = None

    def stored(self) -> int:
        """Rows in the table: as of the read-ahead thread's newest look when it runs (what
        :meth:`refresh` merges), else counted now."""
        if self._prefetch is None:
            return self.store.count()
        self._prefetch.check()
        return self._prefetch.count

    def close(self) -> None:
        """Stop the read-ahead thread (if any)."""
        if self._prefetch is not None:
            self._prefetch.stop()

    # ------------------------------------------------------------------ filling
    def fill(self, end: int) -> None:
        """Rebuild the mirror from the tables: every stored row with ``end - keep <= seq <
        end`` (shared tables: every stored row from ``end - keep`` on) and all usage records of
        those rows (the live counts)."""
        ds = self.store._dataset()
        lo = max(int(end) - self.keep, 0)
        # Shared tables: every row stored by now, also those other writers committed after
        # `end` was counted (their fragments count as seen below, so they must be held).
        bound = "" if self.shared else f" AND seq < {int(end)}"
        rows = ds.to_table(columns=self.columns, filter=f"seq >= {lo}{bound}")
        self.fragments = {f.fragment_id for f in ds.get_fragments()} if self.shared else set()
        self.rows = rows.sort_by([(c, "ascending") for c in RolloutStore.ORDER])
        top = int(pc.max(rows.column("seq")).as_py()) + 1 if self.shared and rows.num_rows else 0
        self.lo, self.hi = lo, max(int(end), top)
        if self._prefetch is not None:  # it reads on from what the table held here
            self._prefetch.reset(self.fragments, lo, ds.count_rows(), self.rows)
        self.counts, self.last = self.usage.uses(lo, self.hi - 1) if self.hi > lo else ({}, {})
        self.total = self.usage.count()

    def appended(self, rows: pa.Table) -> None:
        """Rows this process just stored (with their assigned ``seq``); a gap (rows stored by
        someone else in between) drops the mirror, to be refilled from the table."""
        if self.rows is None or rows.num_rows == 0:
            return
        seqs = rows.column("seq").to_numpy()
        if int(seqs.min()) != self.hi:
            self.invalidate()
            return
        self._merge(rows.select(self.columns))

    def refresh(self) -> None:
        """Shared tables: fold in the rows of fragments committed since the last look (with
        read-ahead: the rows the thread has read so far)."""
        if self.rows is None:
            return
        if self._prefetch is not None:
            rows, covered = self._prefetch.take()
        else:
            ds = self.store._dataset()
            self.fragments, rows = _new_rows(ds, self.fragments, self.columns, self.lo)
            covered = ds.count_rows() if rows is not None else 0
        # Every row of the table as of that look is mirrored now, and none has a seq at or past
        # hi; racing writers that shared seq values leave fewer seqs than rows, so the table's
        # count may exceed hi: a window ending there is the one ending at hi (as fill() has it).
        self.hi = max(self.hi, covered)
        if rows is None or rows.num_rows == 0:
            return
        keep = pc.greater_equal(rows.column("seq"), self.lo)
        if self._prefetch is None:  # (the read-ahead thread drops the rows it delivered before)
            held = self.rows.column("rollout_id").combine_chunks()
            keep = pc.and_(keep, pc.invert(pc.is_in(rows.column("rollout_id"), value_set=held)))
        rows = rows.filter(keep)
        if rows.num_rows:
            self._merge(rows)
            if self._prefetch is not None:
                self._prefetch.lo = self.lo  # it need not read rows the mirror has let go

    def _merge(self, rows: pa.Table) -> None:
        order = [(c, "ascending") for c in RolloutStore.ORDER]
        if not rows.schema.equals(self.rows.schema):
            rows = rows.cast(self.rows.schema)
        seq = rows.column("seq").to_numpy()
        if len(seq) > 1 and not (np.diff(seq) > 0).all():  # own appends are numbered in order already
            rows = rows.sort_by(order)
        in_order = self.rows.num_rows == 0 or rows.column("seq")[0].as_py() > self.rows.column("seq")[-1].as_py()
        table = pa.concat_tables([self.rows, rows])
        if table.column("seq").num_chunks > 8:  # reads (window, take) slow down with many chunks
            table = table.combine_chunks()
        # The sync loop's own appends come after every mirrored row: no re-sort of the mirror.
        self.rows = table if in_order else table.sort_by(order)
        self.hi = max(self.hi, int(pc.max(rows.column("seq")).as_py()) + 1)
        lo = self.hi - self.keep
        if lo > self.lo:
            first = int(np.searchsorted(self.rows.column("seq").to_numpy(), lo, side="left"))
            if first:
                self.rows = self.rows.slice(first)
            self.counts = {q: c for q, c in self.counts.items() if q >= lo}
            self.last = {q: s for q, s in self.last.items() if q >= lo}
            self.lo = lo

    def used(self, records: pa.Table) -> None:
        """Usage records that were just committed (a table in the usage table's schema)."""
        if self.rows is None:
            return
        self.total += records.num_rows
        for q, step in zip(records.column("rollout_seq").to_pylist(), records.column("learner_step").to_pylist()):
            if q >= self.lo:
                self.counts[q] = self.counts.get(q, 0) + 1
                self.last[q] = max(self.last.get(q, -1), step)

    # ------------------------------------------------------------------ reading
    def window(self, size: int, end: int) -> tuple[pa.Table, dict[int, int], dict[int, int], int] | None:
        """The newest ``size`` rows with ``seq < end`` (sorted), their reuse counts and last
        uses and the run's total usage records; None if the mirror does not hold them."""
        if self.rows is None or end > self.hi or end - size < self.lo and self.lo > 0:
            self.misses += 1
            return None
        seqs = self.rows.column("seq").to_numpy()
        stop = int(np.searchsorted(seqs, end, side="left"))
        start = max(stop - int(size), 0)
        if stop - start < min(size, end) and self.lo > 0:  # duplicate seqs pushed rows below lo
            self.misses += 1
            return None
        self.hits += 1
        rows = self.rows.slice(start, stop - start)
        window = rows.column("seq").to_numpy()
        counts = {int(q): self.counts[q] for q in window if q in self.counts}
        last = {int(q): self.last[q] for q in window if q in self.last}
        return rows, counts, last, self.total

    def take(self, seqs: np.ndarray, columns: Sequence[str]) -> pa.Table | None:
        """The mirrored rows with these ``seq`` values, in order (the first of tied rows, as
        :meth:`RolloutStore.take_seqs`); None if one is not mirrored."""
        if self.rows is None:
            return None
        stored = self.rows.column("seq").to_numpy()
        wanted = np.asarray(seqs, dtype=np.int64).reshape(-1)
        at = np.searchsorted(stored, wanted, side="left")
        if (at >= len(stored)).any() or (stored[np.minimum(at, len(stored) - 1)] != wanted).any():
            return None
        return self.rows.select(list(columns)).take(pa.array(at))


def _new_rows(ds, known: set[int], columns: list[str], lo: int) -> tuple[set[int], pa.Table | None]:
    """The dataset's fragment ids, and the rows with ``seq >= lo`` of its fragments not in
    ``known`` (None if there are none)."""
    fragments = ds.get_fragments()
    new = [f for f in fragments if f.fragment_id not in known]
    ids = {f.fragment_id for f in fragments}
    if not new:
        return ids, None
    # One scan over the new fragments (a scan per fragment costs several times more).
    return ids, ds.scanner(columns=columns, fragments=new, filter=f"seq >= {lo}").to_table()


class _Prefetch:
    """The read-ahead thread of a shared :class:`WindowCache`: every ``interval`` seconds it
    reads the fragments committed since its last look (through its own table handle) and keeps
    their rows and the table's row count until :meth:`take`, less the rows it has delivered or
    the mirror held at its last :meth:`reset` (a compaction rewrites stored rows into new
    fragments). It reads nothing until the mirror was filled once; a read that straddles a
    reset is dropped. An error stops the thread and is raised on the caller's thread by the
    next :meth:`check` or :meth:`take`."""

    def __init__(self, store: RolloutStore, columns: list[str], interval: float):
        self.store, self.columns, self.interval = store, columns, interval
        self.lock = threading.Lock()
        self.fragments: set[int] | None = None  # None: not filled yet, count only
        self.held: dict[str, int] = {}  # rollout_id -> seq of the rows mirrored or delivered
        self._prune_at = 4096
        self.lo = 0
        self.count = store.count()
        self.pending: pa.Table | None = None  # one chunk: the mirror's reads slow down with many
        self.epoch = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=os_named(self._run), name="window-read-ahead", daemon=True)
        self.thread.start()

    def reset(self, fragments: set[int], lo: int, count: int, rows: pa.Table) -> None:
        held = dict(zip(rows.column("rollout_id").to_pylist(), rows.column("seq").to_pylist()))
        with self.lock:
            self.fragments, self.lo, self.count, self.held = set(fragments), lo, count, held
            self.pending = None
            self.epoch += 1

    def take(self) -> tuple[pa.Table | None, int]:
        """The rows read since the last take, and the table's row count as of the look that
        read the newest of them (0 before the first fill)."""
        self.check()
        with self.lock:
            pending, self.pending = self.pending, None
            return pending, self.count if self.fragments is not None else 0

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"reading the generators' new rows failed: {self.error!r}") from self.error

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except BaseException as exc:  # raised on the learner's thread by check()
                self.error = exc
                return

    def poll(self) -> None:
        ds = self.store._dataset()
        with self.lock:
            known, lo, epoch = self.fragments, self.lo, self.epoch
        if known is None:
            count = ds.count_rows()
            with self.lock:
                if self.epoch == epoch:
                    self.count = count
            return
        ids, rows = _new_rows(ds, known, self.columns, lo)
        count = ds.count_rows()
        with self.lock:
            if self.epoch != epoch:  # the mirror was refilled meanwhile: it holds these rows
                return
            self.fragments = ids
            self.count = count
            if rows is not None and rows.num_rows:
                rows = self._unseen(rows)
                if rows.num_rows:
                    both = rows if self.pending is None else pa.concat_tables([self.pending, rows])
                    self.pending = both.combine_chunks()

    def _unseen(self, rows: pa.Table) -> pa.Table:
        """The rows not delivered before (under the lock); remembers them."""
        held = self.held
        ids, seqs = rows.column("rollout_id").to_pylist(), rows.column("seq").to_pylist()
        new = [i not in held for i in ids]
        held.update((i, q) for i, q, n in zip(ids, seqs, new) if n)
        if len(held) > self._prune_at:  # forget the rows the mirror has let go
            self.held = {i: q for i, q in held.items() if q >= self.lo}
            self._prune_at = max(4096, 2 * len(self.held))
        return rows if all(new) else rows.filter(pa.array(new))
