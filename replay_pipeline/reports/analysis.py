"""Offline analysis of a run's replay buffer: rollouts and usage records as Arrow tables.

Every run keeps two LanceDB tables side by side in one database (``<root>/lancedb``):

* ``rollouts_<run_id>``: every rollout the run generated (:mod:`replay_pipeline.buffer.store`);
* ``usage_<run_id>``: one row per (learner step, minibatch position), naming the rollout the
  learner used (:mod:`replay_pipeline.buffer.usage`). Runs older than the usage log have none;
  their rollouts read as used 0 times.

The functions here only read. Each returns a ``pyarrow.Table`` (``.to_pandas()`` works on it,
or pass ``as_pandas=True``)::

    from replay_pipeline.reports import analysis
    analysis.list_runs("runs/lancedb")
    analysis.rollouts("runs/lancedb", run_id, versions=(10, 20), correct=True, min_reuse=2)
    analysis.per_version_summary("runs/lancedb", run_id, as_pandas=True)

Decisions:

* **Filters are pushed down.** Policy version, step, reward and correctness become one SQL
  ``where`` string that Lance evaluates during the scan (with the btree index on
  ``policy_version`` where it covers the rows); only the requested columns are read. The reuse
  filter cannot be pushed down (reuse counts live in the usage table), so it is a vectorised
  pyarrow join on ``seq`` over the rows the SQL filter already narrowed.
* **Ranges are inclusive** ``(lo, hi)`` pairs; either end may be ``None`` (open).
* **Order.** Rollouts come back sorted by ``(seq, rollout_id)`` (append order), usage records
  by ``(learner_step, position)``. A ``limit`` without the reuse filter is pushed down too, so
  it keeps the first rows in storage order, which is append order.
* **Bad input raises ValueError saying how to fix it**; a filter that matches nothing is not
  an error and returns an empty table with the right columns.

* **Damaged tables** (a data file missing or corrupt): a read that meets one raises
  :class:`~replay_pipeline.buffer.lance_table.DamagedTable` (a ``StoreError``) naming the run,
  table, file and version, and the repair command; :func:`list_runs` lists such a run with
  its ``damaged`` column set (the other runs are unaffected). Inside
  ``with analysis.intact_reads():`` every function reads only the intact rows instead, with
  a warning naming what it skipped (``python -m flows.query ... --skip-damaged``).

The usage table is read through ``UsageStore`` (``open``, ``count``, ``reuse_counts``,
``rows``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lancedb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replay_pipeline.buffer.lance_table import (DamagedTable, _exists, describe_storage_error, intact_reads,
                                                is_object_store, normalize_storage_options, read_rows, table_names)
from replay_pipeline.buffer.store import TABLE_PREFIX as ROLLOUT_PREFIX
from replay_pipeline.buffer.usage import USAGE_SCHEMA, UsageStore

__all__ = [
    "DamagedTable",
    "USAGE_PREFIX",
    "intact_reads",
    "USAGE_SCHEMA",
    "list_runs",
    "run_info",
    "rollouts",
    "count_rollouts",
    "usage",
    "count_usage",
    "per_version_summary",
    "staleness_histogram",
    "reuse_histogram",
    "steps_since_last_use_histogram",
]

USAGE_PREFIX = UsageStore.TABLE_PREFIX

REUSE_COLUMN = "reuse_count"


# ------------------------------------------------------------------ opening
def _connect(uri: str | Path, storage_options: Mapping[str, str] | None) -> lancedb.DBConnection:
    # lancedb.connect creates a missing local directory; an analysis must not, and a wrong
    # path is far more likely than an empty database.
    if not _exists(uri):
        path = Path(str(uri).removeprefix("file://")).expanduser()
        raise ValueError(
            f"no LanceDB database at {str(path.resolve())!r} (the directory does not exist); "
            f"a training run writes its rollouts to <tracking.root_dir>/lancedb, "
            f"e.g. runs/lancedb: point uri at that directory"
        )
    try:
        return lancedb.connect(str(uri), storage_options=normalize_storage_options(storage_options))
    except (ValueError, RuntimeError, OSError) as exc:  # an object store: say what to set
        if not is_object_store(uri):
            raise
        raise ValueError(describe_storage_error(uri, storage_options, exc)) from exc


class _Run:
    """One run's opened tables: the rollout table and, if the run has one, its usage reader."""

    def __init__(self, uri: str | Path, run_id: str, storage_options: Mapping[str, str] | None = None):
        db = _connect(uri, storage_options)
        names = set(table_names(db))
        if not isinstance(run_id, str) or ROLLOUT_PREFIX + run_id not in names:
            runs = sorted(n[len(ROLLOUT_PREFIX):] for n in names if n.startswith(ROLLOUT_PREFIX))
            raise ValueError(
                f"unknown run id {run_id!r}: no table {ROLLOUT_PREFIX}{run_id} in {str(uri)!r}; "
                f"runs there: {runs or 'none'}"
            )
        self.db = db
        self.names = names
        self.uri = str(uri)
        self.run_id = run_id
        self.rollouts = db.open_table(ROLLOUT_PREFIX + run_id)
        self.usage = _open_usage(db, uri, run_id, names, storage_options)


# ------------------------------------------------------------------ the usage table
def _open_usage(
    db: lancedb.DBConnection,
    uri: str | Path,
    run_id: str,
    names: set[str],
    storage_options: Mapping[str, str] | None,
) -> UsageStore | None:
    """The run's usage store, or None for a run without a usage table (older runs)."""
    if USAGE_PREFIX + run_id not in names:
        return None
    return UsageStore.open(str(uri), run_id, storage_options=storage_options)


# ------------------------------------------------------------------ scanning and validation
def _scan(table: Any, where: str | None, columns: Sequence[str] | None, limit: int | None = None,
          count: bool = False) -> Any:
    """Rows of a lancedb table matching ``where`` (evaluated by Lance during the scan), with
    only ``columns``; at most ``limit`` rows (their number instead, ``count``). Every read of a
    rollout table goes through here, to the Lance dataset under it
    (:func:`~replay_pipeline.buffer.lance_table.read_rows`: damaged files are reported, or
    skipped inside :func:`intact_reads`)."""
    dataset = table.to_lance()
    name = str(table.name)
    return read_rows(dataset, where, columns, limit, table=name, run_id=name[len(ROLLOUT_PREFIX):],
                     uri=str(dataset.uri).rstrip("/").rsplit("/", 1)[0], count=count)


def _range(name: str, value: Any) -> tuple[int | None, int | None] | None:
    """Validate an inclusive ``(lo, hi)`` range of integers; None ends are open."""
    if value is None:
        return None
    example = f"{name}=(0, 10)"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(
            f"{name} must be an inclusive (lo, hi) pair of integers, e.g. {example} "
            f"(None for an open end), got {value!r}"
        )
    lo, hi = value
    for end in (lo, hi):
        if end is not None and (isinstance(end, bool) or not isinstance(end, (int, np.integer))):
            raise ValueError(
                f"{name}=({lo!r}, {hi!r}): both ends must be integers or None, e.g. {example}"
            )
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(
            f"{name}=({lo}, {hi}) is an empty range: lo must be <= hi (both ends inclusive), "
            f"e.g. {name}=({hi}, {lo})"
        )
    return (None if lo is None else int(lo), None if hi is None else int(hi))


def _range_sql(column: str, rng: tuple[int | None, int | None] | None) -> list[str]:
    if rng is None:
        return []
    lo, hi = rng
    if lo is not None and lo == hi:
        return [f"{column} = {lo}"]
    out = []
    if lo is not None:
        out.append(f"{column} >= {lo}")
    if hi is not None:
        out.append(f"{column} <= {hi}")
    return out


def _number(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or np.isnan(value):
        raise ValueError(f"{name} must be a number, e.g. {name}=0.5, got {value!r}")
    return float(value)


def _count_arg(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, e.g. {name}=2, got {value!r}")
    return int(value)


def _limit(limit: Any) -> int | None:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 1:
        raise ValueError(f"limit must be a positive integer (or None for all rows), got {limit!r}")
    return int(limit)


def _columns(requested: Sequence[str] | None, valid: Sequence[str], what: str) -> list[str] | None:
    if requested is None:
        return None
    if isinstance(requested, str):
        requested = [requested]
    requested = list(requested)
    if not requested:
        raise ValueError(f"columns is empty; name at least one of the {what} columns: {list(valid)}")
    unknown = [c for c in requested if c not in valid]
    if unknown:
        raise ValueError(f"unknown {what} columns {unknown}; valid columns: {list(valid)}")
    return list(dict.fromkeys(requested))


def _sql_float(x: float) -> str:
    return repr(float(x))


def _out(table: pa.Table, as_pandas: bool) -> Any:
    return table.to_pandas() if as_pandas else table


def _empty(schema: pa.Schema, columns: Sequence[str] | None = None) -> pa.Table:
    table = schema.empty_table()
    return table if columns is None else table.select(list(columns))


# ------------------------------------------------------------------ reuse counts
def _reuse_counts_for(reader: Any, seqs: pa.ChunkedArray | pa.Array) -> pa.Array:
    """Uses of each rollout ``seq`` in ``seqs`` (int64, 0 where never used or no usage table)."""
    seqs = seqs.combine_chunks() if isinstance(seqs, pa.ChunkedArray) else seqs
    if reader is None or len(seqs) == 0:
        return pa.array(np.zeros(len(seqs), dtype=np.int64))
    bounds = pc.min_max(seqs)
    counts = reader.reuse_counts(int(bounds["min"].as_py()), int(bounds["max"].as_py()))
    if not counts:
        return pa.array(np.zeros(len(seqs), dtype=np.int64))
    keys = pa.array(list(counts.keys()), pa.int64())
    values = pa.array(list(counts.values()), pa.int64())
    idx = pc.index_in(seqs.cast(pa.int64()), value_set=keys)
    return pc.fill_null(pc.take(values, idx), 0)


# ------------------------------------------------------------------ runs
def _run_row(db: lancedb.DBConnection, names: set[str], uri: str | Path, run_id: str,
             storage_options: Mapping[str, str] | None) -> dict[str, Any]:
    table = db.open_table(ROLLOUT_PREFIX + run_id)
    reader = _open_usage(db, uri, run_id, names, storage_options)
    # Two narrow columns, not the rows: cheap even for a long run.
    try:
        cols = _scan(table, None, ["policy_version", "created_at"])
    except DamagedTable as exc:  # listed with what is known without reading it
        return {"run_id": run_id, "rollouts": int(table.count_rows()),
                "usage_records": reader.count() if reader is not None else 0, "version": int(table.version),
                "tags": sorted(table.tags.list()), "damaged": ", ".join(p.removeprefix(exc.uri.rstrip("/") + "/") for p in exc.paths)}
    n = cols.num_rows
    versions = pc.min_max(cols["policy_version"]) if n else None
    created = pc.min_max(cols["created_at"]) if n else None
    tags = sorted(table.tags.list().items(), key=lambda kv: (int(kv[1]["version"]), kv[0]))
    return {
        "run_id": run_id,
        "rollouts": n,
        "usage_records": reader.count() if reader is not None else 0,
        "min_policy_version": versions["min"].as_py() if n else None,
        "max_policy_version": versions["max"].as_py() if n else None,
        "first_created_at": created["min"].as_py() if n else None,
        "last_created_at": created["max"].as_py() if n else None,
        "version": int(table.version),
        "tags": [name for name, _ in tags],
        "damaged": None,
    }


_RUNS_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string()),
        pa.field("rollouts", pa.int64()),
        pa.field("usage_records", pa.int64()),
        pa.field("min_policy_version", pa.int64()),
        pa.field("max_policy_version", pa.int64()),
        pa.field("first_created_at", pa.timestamp("us", tz="UTC")),
        pa.field("last_created_at", pa.timestamp("us", tz="UTC")),
        pa.field("version", pa.int64()),
        pa.field("tags", pa.list_(pa.string())),
        pa.field("damaged", pa.string()),
    ]
)


def list_runs(uri: str | Path, *, as_pandas: bool = False,
              storage_options: Mapping[str, str] | None = None) -> Any:
    """One row per run with a rollout table at ``uri``, sorted by run id.

    Columns: run_id, rollouts, usage_records (0 for a run without a usage table),
    min/max_policy_version and first/last_created_at of its rollouts (null for an empty
    table), version (the rollout table's current Lance version), tags (tag names, oldest
    version first) and damaged (null, or the damaged rollout table and its unreadable files:
    that run's row then gives only what needs no read). An existing database without runs
    gives an empty table.
    """
    db = _connect(uri, storage_options)
    names = set(table_names(db))
    run_ids = sorted(n[len(ROLLOUT_PREFIX):] for n in names if n.startswith(ROLLOUT_PREFIX))
    rows = [_run_row(db, names, uri, r, storage_options) for r in run_ids]
    return _out(pa.Table.from_pylist(rows, schema=_RUNS_SCHEMA), as_pandas)


def run_info(uri: str | Path, run_id: str, *, storage_options: Mapping[str, str] | None = None) -> dict[str, Any]:
    """:func:`list_runs`'s row for one run, as a dict (ValueError for an unknown run)."""
    run = _Run(uri, run_id, storage_options)  # validates the run id, listing the runs there
    return _run_row(run.db, run.names, uri, run_id, storage_options)


# ------------------------------------------------------------------ rollouts
def rollout_where(versions, steps, reward_min, reward_max, correct) -> str | None:
    """The Lance SQL filter of the rollout filters (None: no filter); ValueError for bad values."""
    versions = _range("versions", versions)
    steps = _range("steps", steps)
    reward_min = _number("reward_min", reward_min)
    reward_max = _number("reward_max", reward_max)
    if reward_min is not None and reward_max is not None and reward_min > reward_max:
        raise ValueError(
            f"reward_min={reward_min} > reward_max={reward_max} matches nothing; "
            f"give reward_min <= reward_max (both inclusive)"
        )
    if correct is not None and not isinstance(correct, (bool, np.bool_)):
        raise ValueError(f"correct must be True, False or None (no filter), got {correct!r}")
    parts = _range_sql("policy_version", versions) + _range_sql("step", steps)
    if reward_min is not None:
        parts.append(f"reward >= {_sql_float(reward_min)}")
    if reward_max is not None:
        parts.append(f"reward <= {_sql_float(reward_max)}")
    if correct is not None:
        parts.append(f"correct = {'true' if correct else 'false'}")
    return " AND ".join(parts) if parts else None


def _reuse_bounds(min_reuse, max_reuse) -> tuple[int | None, int | None]:
    lo = _count_arg("min_reuse", min_reuse)
    hi = _count_arg("max_reuse", max_reuse)
    lo = None if lo == 0 else lo  # every rollout is used >= 0 times; keeps the limit pushed down
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(
            f"min_reuse={lo} > max_reuse={hi} matches nothing; give min_reuse <= max_reuse (both inclusive)"
        )
    return lo, hi


def _select_rollouts(run: _Run, where: str | None, reuse: tuple[int | None, int | None],
                     columns: list[str] | None, limit: int | None) -> pa.Table:
    schema_names = run.rollouts.schema.names
    reuse_filter = reuse != (None, None)
    want = [*schema_names, REUSE_COLUMN] if columns is None else columns
    need_reuse = reuse_filter or REUSE_COLUMN in want
    stored = [c for c in want if c != REUSE_COLUMN]
    fetch = list(dict.fromkeys([*stored, "seq", "rollout_id"]))
    # The reuse filter is applied after the scan, so the limit can only be pushed down without it.
    rows = _scan(run.rollouts, where, fetch, None if reuse_filter else limit)
    if need_reuse:
        counts = _reuse_counts_for(run.usage, rows["seq"])
        rows = rows.append_column(pa.field(REUSE_COLUMN, pa.int64()), counts)
        if reuse_filter:
            lo, hi = reuse
            mask = None
            if lo is not None:
                mask = pc.greater_equal(rows[REUSE_COLUMN], lo)
            if hi is not None:
                upper = pc.less_equal(rows[REUSE_COLUMN], hi)
                mask = upper if mask is None else pc.and_(mask, upper)
            rows = rows.filter(mask)
    rows = rows.sort_by([("seq", "ascending"), ("rollout_id", "ascending")])
    if limit is not None and rows.num_rows > limit:
        rows = rows.slice(0, limit)
    return rows.select(want)


def rollouts(
    uri: str | Path,
    run_id: str,
    *,
    versions: tuple[int | None, int | None] | None = None,
    steps: tuple[int | None, int | None] | None = None,
    reward_min: float | None = None,
    reward_max: float | None = None,
    correct: bool | None = None,
    min_reuse: int | None = None,
    max_reuse: int | None = None,
    columns: Sequence[str] | None = None,
    limit: int | None = None,
    as_pandas: bool = False,
    storage_options: Mapping[str, str] | None = None,
) -> Any:
    """The run's rollouts matching every given filter, sorted by ``seq``, plus ``reuse_count``.

    ``versions`` (policy version that generated the rollout) and ``steps`` (generation step)
    are inclusive ``(lo, hi)`` ranges; ``reward_min``/``reward_max`` are inclusive bounds;
    ``correct`` keeps correct (True) or incorrect (False) rollouts. These are pushed down to
    Lance as one SQL filter. ``min_reuse``/``max_reuse`` (inclusive) filter on ``reuse_count``,
    the number of usage records that name the rollout (0 for a run without a usage table).
    ``columns`` picks columns (any rollout column and ``reuse_count``); default all of them.
    ``limit`` keeps the first rows by ``seq``.
    """
    where = rollout_where(versions, steps, reward_min, reward_max, correct)
    reuse = _reuse_bounds(min_reuse, max_reuse)
    limit = _limit(limit)
    run = _Run(uri, run_id, storage_options)
    columns = _columns(columns, [*run.rollouts.schema.names, REUSE_COLUMN], "rollout")
    return _out(_select_rollouts(run, where, reuse, columns, limit), as_pandas)


def count_rollouts(
    uri: str | Path,
    run_id: str,
    *,
    versions=None,
    steps=None,
    reward_min=None,
    reward_max=None,
    correct=None,
    min_reuse=None,
    max_reuse=None,
    storage_options: Mapping[str, str] | None = None,
) -> int:
    """How many rollouts :func:`rollouts` would return with these filters and no limit.

    Without a reuse filter this is Lance's ``count_rows(where)``, which reads no rows.
    """
    where = rollout_where(versions, steps, reward_min, reward_max, correct)
    reuse = _reuse_bounds(min_reuse, max_reuse)
    run = _Run(uri, run_id, storage_options)
    if reuse == (None, None):
        return int(_scan(run.rollouts, where, None, count=True))
    return _select_rollouts(run, where, reuse, ["seq"], None).num_rows


# ------------------------------------------------------------------ usage records
def _usage_where(learner_steps, steps, versions) -> str | None:
    parts = (
        _range_sql("learner_step", _range("learner_steps", learner_steps))
        + _range_sql("step", _range("steps", steps))
        + _range_sql("policy_version", _range("versions", versions))
    )
    return " AND ".join(parts) if parts else None


def usage(
    uri: str | Path,
    run_id: str,
    *,
    learner_steps: tuple[int | None, int | None] | None = None,
    steps: tuple[int | None, int | None] | None = None,
    versions: tuple[int | None, int | None] | None = None,
    columns: Sequence[str] | None = None,
    limit: int | None = None,
    as_pandas: bool = False,
    storage_options: Mapping[str, str] | None = None,
) -> Any:
    """The run's usage records, sorted by ``(learner_step, position)``.

    ``learner_steps``, ``steps`` (generation step at use) and ``versions`` (the learner's
    policy version at use, column ``policy_version``) are inclusive ``(lo, hi)`` ranges,
    pushed down to the usage table as SQL. A run without a usage table gives an empty table.
    """
    where = _usage_where(learner_steps, steps, versions)
    limit = _limit(limit)
    run = _Run(uri, run_id, storage_options)
    schema = run.usage.table.schema if run.usage is not None else USAGE_SCHEMA
    columns = _columns(columns, schema.names, "usage")
    if run.usage is None:
        return _out(_empty(schema, columns), as_pandas)
    order = [c for c in ("learner_step", "position") if c in schema.names]
    fetch = None if columns is None else list(dict.fromkeys([*columns, *order]))
    rows = run.usage.rows(where=where, columns=fetch)
    rows = rows.sort_by([(c, "ascending") for c in order])
    if limit is not None and rows.num_rows > limit:
        rows = rows.slice(0, limit)
    return _out(rows if columns is None else rows.select(columns), as_pandas)


def count_usage(uri: str | Path, run_id: str, *, learner_steps=None, steps=None, versions=None,
                storage_options: Mapping[str, str] | None = None) -> int:
    """How many usage records :func:`usage` would return with these filters and no limit."""
    where = _usage_where(learner_steps, steps, versions)
    run = _Run(uri, run_id, storage_options)
    if run.usage is None:
        return 0
    if where is None:
        return int(run.usage.count())
    return run.usage.rows(where=where, columns=["learner_step"]).num_rows


# ------------------------------------------------------------------ summaries
def per_version_summary(uri: str | Path, run_id: str, *, as_pandas: bool = False,
                        storage_options: Mapping[str, str] | None = None) -> Any:
    """One row per policy version: rollouts, mean_reward, accuracy (fraction correct) and
    mean_length (mean completion tokens, ``num_tokens``), sorted by policy_version."""
    run = _Run(uri, run_id, storage_options)
    cols = _scan(run.rollouts, None, ["policy_version", "reward", "correct", "num_tokens"])
    cols = pa.table(
        {
            "policy_version": cols["policy_version"],
            "reward": pc.cast(cols["reward"], pa.float64()),
            "correct": pc.cast(cols["correct"], pa.float64()),
            "num_tokens": pc.cast(cols["num_tokens"], pa.float64()),
        }
    )
    agg = cols.group_by("policy_version").aggregate(
        [("policy_version", "count"), ("reward", "mean"), ("correct", "mean"), ("num_tokens", "mean")]
    )
    out = pa.table(
        {
            "policy_version": agg["policy_version"].cast(pa.int64()),
            "rollouts": agg["policy_version_count"].cast(pa.int64()),
            "mean_reward": agg["reward_mean"],
            "accuracy": agg["correct_mean"],
            "mean_length": agg["num_tokens_mean"],
        }
    ).sort_by("policy_version")
    return _out(out, as_pandas)


def _histogram(values: pa.ChunkedArray, key: str, count: str) -> pa.Table:
    if len(values) == 0:
        return pa.table({key: pa.array([], pa.int64()), count: pa.array([], pa.int64())})
    agg = pa.table({key: values.cast(pa.int64())}).group_by(key).aggregate([(key, "count")])
    return pa.table({key: agg[key], count: agg[f"{key}_count"].cast(pa.int64())}).sort_by(key)


def staleness_histogram(uri: str | Path, run_id: str, *, as_pandas: bool = False,
                        storage_options: Mapping[str, str] | None = None) -> Any:
    """How many uses had each staleness (learner's policy version at use minus the rollout's
    version): columns staleness, uses, sorted by staleness. Empty for a run without usage."""
    run = _Run(uri, run_id, storage_options)
    if run.usage is None:
        values = pa.chunked_array([], pa.int64())
    else:
        values = run.usage.rows(columns=["staleness"])["staleness"]
    return _out(_histogram(values, "staleness", "uses"), as_pandas)


def reuse_histogram(uri: str | Path, run_id: str, *, as_pandas: bool = False,
                    storage_options: Mapping[str, str] | None = None) -> Any:
    """How many rollouts were used each number of times, never-used rollouts included
    (reuse_count 0): columns reuse_count, rollouts, sorted by reuse_count."""
    run = _Run(uri, run_id, storage_options)
    seqs = _scan(run.rollouts, None, ["seq"])["seq"]
    counts = pa.chunked_array([_reuse_counts_for(run.usage, seqs)])
    return _out(_histogram(counts, REUSE_COLUMN, "rollouts"), as_pandas)


def steps_since_last_use_histogram(uri: str | Path, run_id: str, *, as_pandas: bool = False,
                                   storage_options: Mapping[str, str] | None = None) -> Any:
    """How many uses came each number of learner steps after the rollout's previous use:
    columns steps_since_last_use, uses, sorted. A rollout's first use has no previous use and
    is not counted; a repeat within one learner step (a draw with replacement) counts 0, as
    the paper counts it and as the run's ``buffer/steps_since_last_use_mean`` does. Empty for
    a run without usage.

    Vectorised: every use's (rollout_seq, learner_step), sorted, differenced within each
    rollout."""
    run = _Run(uri, run_id, storage_options)
    if run.usage is None:
        return _out(_histogram(pa.chunked_array([], pa.int64()), "steps_since_last_use", "uses"), as_pandas)
    used = run.usage.rows(columns=["rollout_seq", "learner_step"])
    pairs = used.sort_by([("rollout_seq", "ascending"), ("learner_step", "ascending")])
    seq = pairs["rollout_seq"].to_numpy()
    step = pairs["learner_step"].to_numpy()
    gaps = np.diff(step)[seq[1:] == seq[:-1]]
    return _out(_histogram(pa.chunked_array([pa.array(gaps, pa.int64())]), "steps_since_last_use", "uses"),
                as_pandas)
