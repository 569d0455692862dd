"""The rollout table's schema: one row per generated completion, with its full provenance.

Every column a later loss or analysis needs is stored (DESIGN principle 2): the policy version
that generated the row, prompt/group ids, token ids, per-token behaviour log-probs, the reward
and the group advantage frozen at generation time, the seed and a timestamp.

``seq`` is the row's 0-based position in the run's append order. It is assigned by
:class:`~replay_pipeline.buffer.store.RolloutStore` (callers never supply it) and is what the
FIFO window is defined over.

``rollout_id`` is deterministic (:func:`make_rollout_id`), which is what makes appends
idempotent: retrying a write whose outcome is unknown matches the stored ids and inserts nothing.

``worker`` (nullable int32, right after ``step``) is the generator worker of the async loop
(``loop=async``) that produced the row, and null in the sync loop; ``step`` is then that worker's
own batch counter.

``reward_error`` (nullable string, right after ``reward``) is null for a rollout whose verifier
returned a finite number, and otherwise says why it was flagged: ``"reward raised ValueError:
boom"``, ``"reward was nan"``, ``"reward was inf"`` (see :func:`replay_pipeline.algo.scoring.safe_reward`).
A flagged rollout is stored like any other with ``reward`` 0.0 and ``correct`` False. It is, with
``worker``, a column a row dict may leave out (:data:`OPTIONAL_INPUT_COLUMNS`): :func:`rows_to_table`
fills a missing one with null, so row builders written before the column existed
keep working. A pyarrow *table* must still carry every column (the store checks it).

``temperature`` and ``top_p`` (nullable float64, after ``seed``) are the sampling settings the
rollout was generated with; the learner re-scores a row at its own temperature (so a fork that
changes generator.temperature does not bias the ratio on the rows it inherits). Null: not
recorded (a table migrated from before the columns existed): re-scored at the run's
generator.temperature, as before.

Tables created before ``reward_error`` existed do not match this schema;
``RolloutStore.open`` refuses them with a ``StoreError`` naming the missing column and leaves
them unchanged. Tables created before ``temperature`` and ``top_p`` existed are refused the same
way, naming :data:`ADDED_LATER`'s migration (``python -m flows.query migrate --run RUN``), which
adds both as null columns in a new table version.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = [
    "ROLLOUT_SCHEMA",
    "INPUT_COLUMNS",
    "OPTIONAL_INPUT_COLUMNS",
    "ADDED_LATER",
    "make_rollout_id",
    "group_rollout_ids",
    "rows_to_table",
    "columns_to_table",
    "SchemaMismatch",
    "schema_mismatches",
]

ROLLOUT_SCHEMA: pa.Schema = pa.schema(
    [
        pa.field("rollout_id", pa.string()),
        pa.field("seq", pa.int64()),
        pa.field("run_id", pa.string()),
        pa.field("policy_version", pa.int64()),
        pa.field("step", pa.int64()),
        pa.field("worker", pa.int32(), nullable=True),
        pa.field("prompt_id", pa.string()),
        pa.field("group_id", pa.string()),
        pa.field("sample_index", pa.int32()),
        pa.field("prompt", pa.string()),
        pa.field("completion", pa.string()),
        pa.field("prompt_ids", pa.list_(pa.int32())),
        pa.field("completion_ids", pa.list_(pa.int32())),
        pa.field("behaviour_logprobs", pa.list_(pa.float32())),
        pa.field("reward", pa.float32()),
        pa.field("reward_error", pa.string(), nullable=True),
        pa.field("correct", pa.bool_()),
        pa.field("advantage", pa.float32()),
        pa.field("group_reward_mean", pa.float32()),
        pa.field("finish_reason", pa.string()),
        pa.field("num_tokens", pa.int32()),
        pa.field("seed", pa.int64()),
        pa.field("temperature", pa.float64(), nullable=True),
        pa.field("top_p", pa.float64(), nullable=True),
        pa.field("created_at", pa.timestamp("us", tz="UTC")),
    ]
)

#: The columns a caller supplies: every column except ``seq``, which the store assigns.
INPUT_COLUMNS: tuple[str, ...] = tuple(n for n in ROLLOUT_SCHEMA.names if n != "seq")

#: Input columns a row dict may leave out; :func:`rows_to_table` stores them as null.
OPTIONAL_INPUT_COLUMNS: tuple[str, ...] = ("reward_error", "worker", "temperature", "top_p")

#: Columns added to the schema after tables existed (nullable: null means "not recorded"). A
#: table without them is refused on open, naming the migration that adds them
#: (RolloutStore.migrate, `python -m flows.query migrate`), which changes no stored value.
ADDED_LATER: tuple[str, ...] = ("temperature", "top_p")


class SchemaMismatch(ValueError):
    """Rows or a table do not match their schema. The message names the columns."""


def make_rollout_id(run_id: str, step: int, group_index: int, sample_index: int, worker: int | None = None) -> str:
    """The deterministic id of one rollout: ``{run_id}/s{step:06d}/g{group:04d}/i{sample:03d}``,
    or ``{run_id}/w{worker:02d}/s{step:06d}/...`` for generator worker ``worker`` of the async
    loop (``step`` is then that worker's own batch counter).

    The same (run, generation step, group, sample) always yields the same id, so a retried
    write matches the rows it already stored. Zero padding keeps ids sortable as strings.
    """
    for name, value in (("step", step), ("group_index", group_index), ("sample_index", sample_index)):
        if int(value) != value or value < 0:
            raise ValueError(f"make_rollout_id: {name} must be a non-negative integer, got {value!r}")
    return group_rollout_ids(run_id, step, group_index, 1, worker, first=sample_index)[0]


def group_rollout_ids(run_id: str, step: int, group_index: int, n: int, worker: int | None = None,
                      first: int = 0) -> list[str]:
    """:func:`make_rollout_id` of samples ``first .. first + n - 1`` of one group, formatted
    from one checked prefix (the training loop names a group's rollouts at once)."""
    for name, value in (("step", step), ("group_index", group_index), ("sample_index", first)):
        if int(value) != value or value < 0:
            raise ValueError(f"make_rollout_id: {name} must be a non-negative integer, got {value!r}")
    prefix = run_id if worker is None else f"{run_id}/w{int(worker):02d}"
    group = f"{prefix}/s{int(step):06d}/g{int(group_index):04d}/i"
    return [f"{group}{i:03d}" for i in range(int(first), int(first) + int(n))]


def schema_mismatches(
    schema: pa.Schema,
    *,
    require_seq: bool = True,
    expected: pa.Schema = ROLLOUT_SCHEMA,
    optional: Sequence[str] = (),
) -> list[str]:
    """Human-readable differences between ``schema`` and ``expected`` (empty if none).

    Compares names and types only (not nullability or field metadata). Columns named in
    ``optional`` may be missing; ``require_seq=False`` is shorthand for ``optional=("seq",)``.
    ``expected`` defaults to :data:`ROLLOUT_SCHEMA`; the usage table passes its own schema.
    """
    may_miss = set(optional) | (set() if require_seq else {"seq"})
    want = {f.name: f.type for f in expected}
    got = {f.name: f.type for f in schema}
    problems: list[str] = []
    missing = [n for n in want if n not in got and n not in may_miss]
    extra = [n for n in got if n not in want]
    if missing:
        problems.append(f"missing columns {missing}")
    if extra:
        problems.append(f"unexpected columns {extra}")
    for name, typ in got.items():
        if name in want and not typ.equals(want[name]):
            problems.append(f"column {name!r} has type {typ}, expected {want[name]}")
    return problems


def rows_to_table(
    rows: Sequence[Mapping[str, Any]],
    schema: pa.Schema = ROLLOUT_SCHEMA,
    *,
    assigned: Sequence[str] = ("seq",),
    noun: str = "rollout",
    optional: Sequence[str] = OPTIONAL_INPUT_COLUMNS,
) -> pa.Table:
    """Build a table in ``schema`` (default :data:`ROLLOUT_SCHEMA`) from row dicts.

    Every dict must have exactly the schema's keys except the ``assigned`` ones (``seq``, which
    the store fills in); the error names the missing and extra keys (and the first offending
    row, as "``noun`` row i"). Assigned columns come back all-null. Keys in ``optional``
    (default :data:`OPTIONAL_INPUT_COLUMNS`, i.e. ``reward_error``; names the schema lacks are
    ignored) may be left out, per row, and are then null. Values are converted to the
    schema's types column by column, and a value that cannot be converted raises
    :class:`SchemaMismatch` naming the column. Naive ``created_at`` datetimes are taken as UTC.
    """
    rows = list(rows)
    filled = [n for n in schema.names if n in assigned]
    expected = {n for n in schema.names if n not in filled}
    may_miss = expected & set(optional)
    for i, row in enumerate(rows):
        keys = set(row.keys()) | may_miss
        if keys != expected:
            missing = sorted(expected - keys)
            extra = sorted(keys - expected)
            parts = []
            if missing:
                parts.append(f"missing keys {missing}")
            if extra:
                by_store = [n for n in extra if n in filled]
                note = f" ({', '.join(by_store)} is assigned by the store)" if by_store else ""
                parts.append(f"extra keys {extra}" + note)
            raise SchemaMismatch(f"{noun} row {i}: " + "; ".join(parts))
    columns = {n: [row.get(n) for row in rows] for n in schema.names if n not in filled}
    return columns_to_table(columns, len(rows), schema, noun=noun)


def columns_to_table(columns: Mapping[str, Any], num_rows: int, schema: pa.Schema = ROLLOUT_SCHEMA, *,
                     noun: str = "rollout") -> pa.Table:
    """Build a table in ``schema`` from column values (lists, arrays or scalars repeated over
    the ``num_rows`` rows); a column left out is all-null. Each value list is converted to its
    field's type, and one that cannot be raises :class:`SchemaMismatch` naming the column.

    The columnar path of :func:`rows_to_table`, for builders that already hold columns (the
    training loop's scoring and usage records): no per-row dicts."""
    unknown = sorted(set(columns) - set(schema.names))
    if unknown:
        raise SchemaMismatch(f"{noun} rows: unexpected columns {unknown}")
    arrays = []
    for field in schema:
        values = columns.get(field.name)
        if values is None:
            arrays.append(pa.nulls(num_rows, type=field.type))
            continue
        if not isinstance(values, (list, tuple, pa.Array, np.ndarray)):
            values = [values] * num_rows
        try:
            arrays.append(pa.array(values, type=field.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as exc:
            raise SchemaMismatch(
                f"{noun} rows: column {field.name!r} cannot be converted to {field.type}: {exc}"
            ) from exc
        if len(arrays[-1]) != num_rows:
            raise SchemaMismatch(f"{noun} rows: column {field.name!r} has {len(arrays[-1])} values, "
                                 f"expected {num_rows}")
    return pa.Table.from_arrays(arrays, schema=schema)
