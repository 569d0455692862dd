"""The rollout table's schema: one row per generated completion, with its full provenance.

Every column a later loss or analysis needs is stored (DESIGN principle 2): the policy version
that generated the row, prompt/group ids, token ids, per-token behaviour log-probs, the reward
and the group advantage frozen at generation time, the seed and a timestamp.

``seq`` is the row's 0-based position in the run's append order. It is assigned by
:class:`~replay_pipeline.buffer.store.RolloutStore` (callers never supply it) and is what the
FIFO window is defined over.

``rollout_id`` is deterministic (:func:`make_rollout_id`), which is what makes appends
idempotent: retrying a write whose outcome is unknown matches the stored ids and inserts nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

__all__ = [
    "ROLLOUT_SCHEMA",
    "INPUT_COLUMNS",
    "make_rollout_id",
    "rows_to_table",
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
        pa.field("prompt_id", pa.string()),
        pa.field("group_id", pa.string()),
        pa.field("sample_index", pa.int32()),
        pa.field("prompt", pa.string()),
        pa.field("completion", pa.string()),
        pa.field("prompt_ids", pa.list_(pa.int32())),
        pa.field("completion_ids", pa.list_(pa.int32())),
        pa.field("behaviour_logprobs", pa.list_(pa.float32())),
        pa.field("reward", pa.float32()),
        pa.field("correct", pa.bool_()),
        pa.field("advantage", pa.float32()),
        pa.field("finish_reason", pa.string()),
        pa.field("num_tokens", pa.int32()),
        pa.field("seed", pa.int64()),
        pa.field("created_at", pa.timestamp("us", tz="UTC")),
    ]
)

#: The columns a caller supplies: every column except ``seq``, which the store assigns.
INPUT_COLUMNS: tuple[str, ...] = tuple(n for n in ROLLOUT_SCHEMA.names if n != "seq")


class SchemaMismatch(ValueError):
    """Rows or a table do not match :data:`ROLLOUT_SCHEMA`. The message names the columns."""


def make_rollout_id(run_id: str, step: int, group_index: int, sample_index: int) -> str:
    """The deterministic id of one rollout: ``{run_id}/s{step:06d}/g{group:04d}/i{sample:03d}``.

    The same (run, generation step, group, sample) always yields the same id, so a retried
    write matches the rows it already stored. Zero padding keeps ids sortable as strings.
    """
    for name, value in (("step", step), ("group_index", group_index), ("sample_index", sample_index)):
        if int(value) != value or value < 0:
            raise ValueError(f"make_rollout_id: {name} must be a non-negative integer, got {value!r}")
    return f"{run_id}/s{int(step):06d}/g{int(group_index):04d}/i{int(sample_index):03d}"


def schema_mismatches(schema: pa.Schema, *, require_seq: bool) -> list[str]:
    """Human-readable differences between ``schema`` and :data:`ROLLOUT_SCHEMA` (empty if none).

    Compares names and types only (not nullability or field metadata). With
    ``require_seq=False`` a missing ``seq`` column is not a difference.
    """
    expected = {f.name: f.type for f in ROLLOUT_SCHEMA}
    got = {f.name: f.type for f in schema}
    problems: list[str] = []
    missing = [n for n in expected if n not in got and (require_seq or n != "seq")]
    extra = [n for n in got if n not in expected]
    if missing:
        problems.append(f"missing columns {missing}")
    if extra:
        problems.append(f"unexpected columns {extra}")
    for name, typ in got.items():
        if name in expected and not typ.equals(expected[name]):
            problems.append(f"column {name!r} has type {typ}, expected {expected[name]}")
    return problems


def rows_to_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Build a table in :data:`ROLLOUT_SCHEMA` from row dicts that lack ``seq``.

    Every dict must have exactly the keys in :data:`INPUT_COLUMNS`; the error names the missing
    and extra keys (and the first offending row). ``seq`` comes back all-null: the store fills
    it in on append. Values are converted to the schema's types column by column, and a value
    that cannot be converted raises :class:`SchemaMismatch` naming the column.
    Naive ``created_at`` datetimes are taken as UTC.
    """
    rows = list(rows)
    expected = set(INPUT_COLUMNS)
    for i, row in enumerate(rows):
        keys = set(row.keys())
        if keys != expected:
            missing = sorted(expected - keys)
            extra = sorted(keys - expected)
            parts = []
            if missing:
                parts.append(f"missing keys {missing}")
            if extra:
                parts.append(f"extra keys {extra}" + (" (seq is assigned by the store)" if "seq" in extra else ""))
            raise SchemaMismatch(f"rollout row {i}: " + "; ".join(parts))
    arrays = []
    for field in ROLLOUT_SCHEMA:
        if field.name == "seq":
            arrays.append(pa.nulls(len(rows), type=field.type))
            continue
        values = [row[field.name] for row in rows]
        try:
            arrays.append(pa.array(values, type=field.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as exc:
            raise SchemaMismatch(
                f"rollout rows: column {field.name!r} cannot be converted to {field.type}: {exc}"
            ) from exc
    return pa.Table.from_arrays(arrays, schema=ROLLOUT_SCHEMA)
