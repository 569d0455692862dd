"""The run's rollout table: a versioned LanceDB table that is the replay buffer's source of truth.

Decisions (see DESIGN.md, principles 1, 4 and 5; the machinery shared with the usage table,
idempotent appends, indexes, versions and tags, is described in
:mod:`replay_pipeline.buffer.lance_table`):

* **Append only; nothing is deleted to evict.** Every rollout the run ever generated stays in
  the table. "The buffer" is a query over it: :meth:`RolloutStore.window` returns the newest
  ``capacity`` rows. Old rows stay available for analysis, resume and fork.
* **``seq`` orders the rows.** Each row gets its 0-based position in the run's append order,
  ``seq = rows already stored + i``. The FIFO window is then the filter
  ``seq >= count - capacity``, answered from the btree index on ``seq``; it never reads the
  whole table. Timestamps would not do: they are set by generators on different clocks and
  are not unique.
* **Samplers read light columns, then only the rows they chose.** :meth:`window_meta` returns
  a few small columns of the window; a sampler picks ``seq`` values and :meth:`take_seqs` reads
  just those rows' token data (a pushed-down ``seq IN (...)`` filter on the index).
* **The positive-bias window** (the paper's delta buffer): :meth:`positive_bias_window` is the
  freshest ``(1 - delta) N`` rows plus the freshest ``delta N`` correct rows older than those,
  found by scanning backwards from the fresh part in growing ``seq`` ranges, each pushed down.

Indexed columns: ``rollout_id`` (the idempotency lookup), ``seq`` (windows, takes),
``step`` and ``policy_version`` (history queries).

Concurrency limits (lancedb 0.40): ``seq`` is computed from the row count before the commit,
so two writers that commit at the same moment can give rows the same ``seq``. :meth:`window`
tolerates that (ties are ordered by ``rollout_id`` and the filter is widened until ``capacity``
rows are found) and :meth:`take_seqs` returns the first of the tied rows, but exact FIFO order
needs writes to a run to be serialised (the sync loop does that). Each writer must own its
rollout ids (see :mod:`~replay_pipeline.buffer.lance_table`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .lance_table import LanceTable, StoreError, int_filter
from .schema import ADDED_LATER, ROLLOUT_SCHEMA

__all__ = ["META_COLUMNS", "RolloutStore", "StoreError", "TABLE_PREFIX"]

TABLE_PREFIX = "rollouts_"
#: The light columns :meth:`RolloutStore.window_meta` reads by default (what samplers weigh).
META_COLUMNS = ("seq", "policy_version", "correct", "advantage")
# Rows of the first backwards range of the positive-bias scan (per correct row still wanted;
# the range doubles after each probe).
_POSITIVE_SCAN_FACTOR = 4


def _check_capacity(capacity: Any) -> int:
    if isinstance(capacity, bool) or int(capacity) != capacity or capacity < 1:
        raise StoreError(f"window capacity must be a positive integer, got {capacity!r}")
    return int(capacity)


class RolloutStore(LanceTable):
    """The run's rollout table: every rollout ever generated, appended and never deleted.

    Use :meth:`create` for a new run, :meth:`open` to resume one and :meth:`open_or_create`
    when either is fine. The table is ``rollouts_<run_id>`` inside the LanceDB database at
    ``uri`` (a local directory, or an object-store URI with ``storage_options``).
    """

    SCHEMA = ROLLOUT_SCHEMA
    SCHEMA_NAME = "ROLLOUT_SCHEMA"
    KIND = "rollout"
    TABLE_PREFIX = TABLE_PREFIX
    ID_COLUMN = "rollout_id"
    ORDER = ("seq", "rollout_id")
    INDEXED = ("rollout_id", "seq", "step", "policy_version")
    ASSIGNED = ("seq",)
    ADDED_LATER = ADDED_LATER

    # ------------------------------------------------------------------ writing
    def append(self, table_or_rows: pa.Table | pa.RecordBatch | Sequence[Mapping[str, Any]],
               known_new: bool = False, seq_start: int | None = None) -> int:
        """Append rollouts; returns the number of rows actually inserted.

        ``table_or_rows`` is a pyarrow Table in :data:`ROLLOUT_SCHEMA` without ``seq`` (or with
        an all-null ``seq``), or a list of row dicts (see
        :func:`~replay_pipeline.buffer.schema.rows_to_table`). Every row's ``run_id`` must be
        this store's run and rollout ids must be unique within the batch.

        Idempotent: rows whose ``rollout_id`` is already stored are skipped, so retrying a
        committed batch inserts 0 rows and makes no commit. New rows get
        ``seq = count() + i`` in batch order. A batch that fails validation raises
        :class:`StoreError` naming the offending columns, and nothing is written.

        ``known_new=True`` skips the idempotency lookup: only for a first attempt whose ids the
        caller knows are not stored (the sync loop's fresh steps); a retry must leave it False.

        ``seq_start``: the ``seq`` the batch's first row has, when the batch is one already
        numbered (a resume's replayed step): a row missing from the table (lost with a damaged
        file, see :mod:`~replay_pipeline.buffer.repair`) is stored again with its own ``seq``,
        ``seq_start`` + its position in the batch, not at the end; refused if that ``seq`` is
        held by another row.
        """
        self._seq_start = seq_start
        try:
            return self._append(table_or_rows, known_new=known_new)
        finally:
            self._seq_start = None

    _seq_start: int | None = None

    def _assign(self, data: pa.Table, start: int | None = None, positions: np.ndarray | None = None) -> pa.Table:
        if self._seq_start is not None:  # refilling a numbered batch: each row's own seq
            at = np.arange(data.num_rows) if positions is None else positions
            seq = pa.array(int(self._seq_start) + at.astype(np.int64))
            clash = pa.concat_tables([self._query(flt, ["seq"]) for flt in int_filter("seq", seq.to_numpy())])
            clash = pc.filter(clash.column("seq"), pc.is_in(clash.column("seq"), value_set=seq))
            if len(clash):
                raise StoreError(
                    f"cannot store the rows of {self.table_name!r} again at seq {self._seq_start}+: seq "
                    f"{sorted(set(clash.to_pylist()))[:5]} is held by other rows (the table was changed "
                    "since those rows were numbered); nothing was written")
        else:
            start = self.count() if start is None else int(start)
            seq = pa.array(np.arange(start, start + data.num_rows, dtype=np.int64))
        return data.set_column(ROLLOUT_SCHEMA.get_field_index("seq"), ROLLOUT_SCHEMA.field("seq"), seq)

    # ------------------------------------------------------------------ the buffer
    def window(self, capacity: int, columns: Sequence[str] | None = None, end: int | None = None) -> pa.Table:
        """The FIFO replay window: the newest ``capacity`` rows by ``seq``, sorted by ``seq``.

        The filter ``seq >= count - capacity`` is pushed down to Lance; only the window's rows
        (and only ``columns``, if given) are read. Returns all rows if the table holds fewer
        than ``capacity``. If concurrent writers gave rows duplicate ``seq`` values the filter
        is widened until ``capacity`` rows are found.

        ``end`` (exclusive ``seq``) reads the window as it stood when the table held ``end``
        rows: a resumed run replays the steps after its checkpoint against the buffer it had
        then, although the rows generated after the checkpoint are already stored.
        """
        capacity = _check_capacity(capacity)
        columns = self._check_columns(columns)
        return self._newest(capacity, self._fetch_columns(columns), columns, end)

    def _newest(self, capacity: int, fetch: list[str] | None, columns: list[str] | None,
                end: int | None = None) -> pa.Table:
        n = self.count() if end is None else int(end)
        upper = "" if end is None else f" AND seq < {n}"
        want = min(capacity, n)
        lo = n - capacity
        while True:
            out = self._query(f"seq >= {max(lo, 0)}{upper}", fetch)
            if out.num_rows >= want or lo <= 0:
                break
            lo -= want - out.num_rows  # duplicate seqs from racing writers: look further back
        out = self._sorted(out, None)
        if out.num_rows > capacity:  # rows appended by others since count(), or duplicate seqs
            out = out.slice(out.num_rows - capacity)
        return out if columns is None else out.select(columns)

    def window_meta(self, capacity: int, columns: Sequence[str] = META_COLUMNS, end: int | None = None) -> pa.Table:
        """:meth:`window` with only light columns (default :data:`META_COLUMNS`): what a
        sampler needs to choose rows, which it then reads with :meth:`take_seqs`."""
        return self.window(capacity, columns=list(columns), end=end)

    def take_seqs(self, seqs: Sequence[int] | np.ndarray, columns: Sequence[str] | None = None) -> pa.Table:
        """The rows with these ``seq`` values, in the order of ``seqs``.

        Duplicates are allowed and repeat the row (a uniform draw with replacement can pick a
        row twice). The filter (``seq IN (...)``, or one ``seq`` range when the values are dense)
        is pushed down to the index; only the distinct rows are read. A ``seq`` shared by rows
        of racing writers yields the first of them by ``rollout_id``. Raises
        :class:`StoreError` if a ``seq`` is not stored.
        """
        wanted = np.asarray(seqs).reshape(-1)
        if wanted.size and not np.issubdtype(wanted.dtype, np.integer):
            raise StoreError(f"take_seqs takes integer seq values, got dtype {wanted.dtype}")
        wanted = wanted.astype(np.int64)
        columns = self._check_columns(columns)
        fetch = self._fetch_columns(columns)
        if wanted.size == 0:
            return self._empty(columns)
        found = pa.concat_tables([self._query(flt, fetch) for flt in int_filter("seq", wanted)])
        stored, first = np.unique(found.column("seq").to_numpy(), return_index=True)
        if len(stored) < found.num_rows:  # a seq shared by racing writers: the first by rollout_id
            found = self._sorted(found, None)
            stored, first = np.unique(found.column("seq").to_numpy(), return_index=True)
        at = np.searchsorted(stored, wanted)
        ok = at < len(stored)
        ok[ok] = stored[at[ok]] == wanted[ok]
        if not ok.all():
            n = self.count()
            raise StoreError(
                f"no rows with seq {sorted(set(wanted[~ok].tolist()))[:5]} in {self.table_name!r} "
                f"({n} rows, seq 0..{n - 1})"
            )
        out = found.take(first[at])
        return out if columns is None else out.select(columns)

    def positive_bias_window(self, capacity: int, delta: float, columns: Sequence[str] | None = None,
                             end: int | None = None) -> pa.Table:
        """The paper's positive-bias buffer, sorted by ``seq``.

        The freshest ``capacity - round(delta * capacity)`` rows (``round((1 - delta) *
        capacity)`` but for rounding ties, so the two parts add up to ``capacity``) plus the
        freshest ``round(delta * capacity)`` rows with ``correct = true`` that are older than
        those. Fewer rows if the table holds fewer, or too few correct ones. The correct rows
        are found by scanning backwards from the fresh part in ``seq`` ranges (each pushed
        down, each twice the last), so the whole table is read only if correct rows are rare.
        ``end`` as in :meth:`window`.
        """
        capacity = _check_capacity(capacity)
        if isinstance(delta, bool) or not 0 <= delta <= 1:
            raise StoreError(f"positive-bias delta must be in [0, 1], got {delta!r}")
        columns = self._check_columns(columns)
        fetch = self._fetch_columns(columns)
        n_positive = round(delta * capacity)
        n_fresh = capacity - n_positive
        fresh = self._newest(n_fresh, fetch, None, end) if n_fresh else self._empty(fetch)
        if fresh.num_rows < n_fresh:  # the table holds no older rows
            return fresh if columns is None else fresh.select(columns)
        hi = fresh.column("seq")[0].as_py() if n_fresh else (self.count() if end is None else int(end))
        span = max(_POSITIVE_SCAN_FACTOR * n_positive, 1024)
        parts = [fresh]
        still = n_positive
        while still > 0 and hi > 0:
            lo = max(hi - span, 0)
            older = self._query(f"correct = true AND seq >= {lo} AND seq < {hi}", fetch)
            older = self._sorted(older, None)
            parts.append(older.slice(max(older.num_rows - still, 0)))
            still -= parts[-1].num_rows
            hi, span = lo, span * 2
        out = self._sorted(pa.concat_tables(parts), None)
        return out if columns is None else out.select(columns)

    # ------------------------------------------------------------------ history
    def rows_for_versions(self, lo: int, hi: int, columns: Sequence[str] | None = None) -> pa.Table:
        """Rows generated by policy versions ``lo..hi`` (inclusive), sorted by ``seq``."""
        return self._ordered(f"policy_version >= {int(lo)} AND policy_version <= {int(hi)}", columns)

    def rows_for_step(self, step: int, columns: Sequence[str] | None = None) -> pa.Table:
        """Rows generated at generation step ``step``, sorted by ``seq``."""
        return self._ordered(f"step = {int(step)}", columns)

    def max_step(self, worker: int | None = None) -> int:
        """The newest generation step stored (-1 for an empty table); with ``worker``, the
        newest batch of that async generator worker."""
        where = None if worker is None else f"worker = {int(worker)}"
        steps = self._query(where, ["step"]).column("step")
        return int(pc.max(steps).as_py()) if len(steps) else -1

    def max_seq(self) -> int:
        """The largest ``seq`` stored (-1 for an empty table); ``count() - 1`` unless rows were
        lost (a repaired table) or racing writers shared a seq."""
        seqs = self._query(None, ["seq"]).column("seq")
        return int(pc.max(seqs).as_py()) if len(seqs) else -1

    def _numbered_to(self) -> int:
        return self.max_seq() + 1

    def seq_end(self, step: int) -> int:
        """One past the largest ``seq`` of the rows of generation steps ``<= step``: the
        table's size right after ``step``'s rows were appended, when steps are appended in
        order (the sync loop)."""
        seqs = self._query(f"step = {int(step)}", ["seq"]).column("seq")
        if not len(seqs):
            seqs = self._query(f"step <= {int(step)}", ["seq"]).column("seq")
        return int(pc.max(seqs).as_py()) + 1 if len(seqs) else 0
