"""Usage records: which rollouts every learner step used, stored durably beside the rollouts.

DESIGN principle 3: reuse counts, staleness at use and steps-since-last-use come from these
records, not from counters kept in memory, so they survive a crash, a resume and a fork, and
any run can be analysed afterwards. One row per (learner step, minibatch position), in the
table ``usage_<run_id>`` of the same LanceDB database as ``rollouts_<run_id>``.

Decisions:

* **Deterministic ids.** ``usage_id = make_usage_id(run_id, learner_step, position)``, so
  recording is idempotent like appending rollouts: retrying a committed batch adds nothing and
  makes no commit (the machinery is :class:`~replay_pipeline.buffer.lance_table.LanceTable`).
* **Denormalised.** Each record copies the rollout's ``seq``, ``step`` and ``policy_version``
  and the learner's policy version, so reuse and staleness queries never join the rollout
  table. ``staleness = policy_version - rollout_policy_version`` is checked on record.
* **Indexed on ``usage_id``, ``rollout_seq`` and ``learner_step``**: reuse counts over a window
  (a ``rollout_seq`` range) and a step's records are read from the index, not a scan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .lance_table import LanceTable, StoreError, int_filter

__all__ = ["USAGE_SCHEMA", "UsageStore", "make_usage_id", "make_usage_ids"]

USAGE_SCHEMA: pa.Schema = pa.schema(
    [
        pa.field("usage_id", pa.string()),
        pa.field("run_id", pa.string()),
        pa.field("learner_step", pa.int64()),  # global, 0-based
        pa.field("step", pa.int64()),  # generation step during which it was used
        pa.field("position", pa.int32()),  # row within the minibatch
        pa.field("rollout_id", pa.string()),
        pa.field("rollout_seq", pa.int64()),
        pa.field("rollout_step", pa.int64()),
        pa.field("rollout_policy_version", pa.int64()),
        pa.field("policy_version", pa.int64()),  # the learner's, at use
        pa.field("staleness", pa.int64()),  # policy_version - rollout_policy_version
        pa.field("created_at", pa.timestamp("us", tz="UTC")),
    ]
)


def _before(learner_step: int | None) -> str:
    return "" if learner_step is None else f" AND learner_step < {int(learner_step)}"


def make_usage_id(run_id: str, learner_step: int, position: int) -> str:
    """The deterministic id of one use: ``{run_id}/l{learner_step:08d}/p{position:05d}``."""
    for name, value in (("learner_step", learner_step), ("position", position)):
        if int(value) != value or value < 0:
            raise ValueError(f"make_usage_id: {name} must be a non-negative integer, got {value!r}")
    return _USAGE_ID.format(run_id, int(learner_step), int(position))


_USAGE_ID = "{}/l{:08d}/p{:05d}"


def make_usage_ids(run_id: str, learner_steps: Sequence[int], positions: Sequence[int]) -> list[str]:
    """:func:`make_usage_id` for many records at once (the values are checked once, as arrays)."""
    steps, pos = np.asarray(learner_steps), np.asarray(positions)
    for name, values in (("learner_step", steps), ("position", pos)):
        if values.size and (values.dtype.kind not in "iu" or values.min() < 0):
            raise ValueError(f"make_usage_ids: {name} must be non-negative integers, got {values.tolist()[:5]}")
    return [_USAGE_ID.format(run_id, s, p) for s, p in zip(steps.tolist(), pos.tolist())]


class UsageStore(LanceTable):
    """The run's usage records: one row per rollout used by a learner step, never deleted.

    Opened and created like :class:`~replay_pipeline.buffer.store.RolloutStore` (same ``uri``
    and ``run_id``; the table is ``usage_<run_id>``).
    """

    SCHEMA = USAGE_SCHEMA
    SCHEMA_NAME = "USAGE_SCHEMA"
    KIND = "usage"
    TABLE_PREFIX = "usage_"
    ID_COLUMN = "usage_id"
    ORDER = ("learner_step", "position")
    INDEXED = ("usage_id", "rollout_seq", "learner_step")

    def record(self, table_or_rows: pa.Table | pa.RecordBatch | Sequence[Mapping[str, Any]],
               known_new: bool = False) -> int:
        """Store usage records; returns the number of rows actually inserted.

        ``table_or_rows`` is a pyarrow Table in :data:`USAGE_SCHEMA` or a list of row dicts
        with exactly its keys. Idempotent on ``usage_id``: retrying a committed batch adds
        nothing and makes no commit. Rows must belong to this run, have unique ids and a
        ``staleness`` equal to ``policy_version - rollout_policy_version``; otherwise
        :class:`StoreError` is raised and nothing is written. ``known_new`` as in
        :meth:`RolloutStore.append`.
        """
        return self._append(table_or_rows, known_new=known_new)

    def _check_batch(self, data: pa.Table) -> None:
        super()._check_batch(data)
        expected = pc.subtract(data.column("policy_version"), data.column("rollout_policy_version"))
        wrong = pc.invert(pc.fill_null(pc.equal(data.column("staleness"), expected), False))
        if pc.any(wrong).as_py():
            ids = data.column("usage_id").filter(wrong).to_pylist()
            raise StoreError(
                f"cannot append to {self.table_name!r}: staleness must equal policy_version - "
                f"rollout_policy_version; it does not for {ids[:5]}"
            )

    def reuse_counts(self, seq_min: int, seq_max: int | None = None, before: int | None = None) -> dict[int, int]:
        """``rollout_seq -> number of uses`` for the rollouts with ``seq_min <= seq <= seq_max``
        (no upper bound if None) that were used at least once. Pushed down to the index.

        ``before`` counts only the uses by learner steps ``< before``: the counts as they were
        at that learner step (a resumed run replays steps whose records are already stored)."""
        where = f"rollout_seq >= {int(seq_min)}" + ("" if seq_max is None else f" AND rollout_seq <= {int(seq_max)}")
        used = self._query(where + _before(before), ["rollout_seq"])
        counts = used.group_by("rollout_seq").aggregate([("rollout_seq", "count")])
        return dict(zip(counts.column("rollout_seq").to_pylist(), counts.column("rollout_seq_count").to_pylist()))

    def uses(self, seq_min: int, seq_max: int, before: int | None = None) -> tuple[dict[int, int], dict[int, int]]:
        """``(reuse counts, last use)`` of the rollouts with ``seq_min <= seq <= seq_max`` in one
        pushed-down read: what :meth:`reuse_counts` and :meth:`last_use` give separately."""
        where = f"rollout_seq >= {int(seq_min)} AND rollout_seq <= {int(seq_max)}" + _before(before)
        used = self._query(where, ["rollout_seq", "learner_step"])
        agg = used.group_by("rollout_seq").aggregate([("learner_step", "count"), ("learner_step", "max")])
        seqs = agg.column("rollout_seq").to_pylist()
        return (dict(zip(seqs, agg.column("learner_step_count").to_pylist())),
                dict(zip(seqs, agg.column("learner_step_max").to_pylist())))

    def last_use(self, rollout_seqs: Sequence[int] | np.ndarray, before: int | None = None) -> dict[int, int]:
        """``rollout_seq -> newest learner_step that used it``, for those of ``rollout_seqs``
        ever used (one pushed-down range for a window's seqs, else ``IN`` lists); ``before``
        as in :meth:`reuse_counts`."""
        wanted = np.unique(np.asarray(rollout_seqs, dtype=np.int64))
        parts = [self._query(flt + _before(before), ["rollout_seq", "learner_step"])
                 for flt in int_filter("rollout_seq", wanted)]
        if not parts:
            return {}
        used = pa.concat_tables(parts)
        used = used.filter(pc.is_in(used.column("rollout_seq"), value_set=pa.array(wanted)))
        last = used.group_by("rollout_seq").aggregate([("learner_step", "max")])
        return dict(zip(last.column("rollout_seq").to_pylist(), last.column("learner_step_max").to_pylist()))

    def count_before(self, learner_step: int) -> int:
        """Records of learner steps ``< learner_step``."""
        return int(self._table.count_rows(f"learner_step < {int(learner_step)}"))

    def max_learner_step(self) -> int:
        """The newest learner step recorded (-1 if none)."""
        steps = self._query(None, ["learner_step"]).column("learner_step")
        return int(pc.max(steps).as_py()) if len(steps) else -1

    def rows(self, where: str | None = None, columns: Sequence[str] | None = None) -> pa.Table:
        """Records matching the SQL filter ``where`` (all if None), sorted by
        ``(learner_step, position)``, with only ``columns`` if given."""
        return self._ordered(where, columns)
