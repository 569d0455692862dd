"""The run's rollout table: a versioned LanceDB table that is the replay buffer's source of truth.

Decisions (see DESIGN.md, principles 1, 4 and 5):

* **Append only; nothing is deleted to evict.** Every rollout the run ever generated stays in
  the table. "The buffer" is a query over it: :meth:`RolloutStore.window` returns the newest
  ``capacity`` rows. Old rows stay available for analysis, resume and fork.
* **``seq`` orders the rows.** Each row gets its 0-based position in the run's append order,
  ``seq = rows already stored + i``. The FIFO window is then the filter
  ``seq >= count - capacity``, which Lance evaluates during the scan (and with the btree index on
  ``seq``); it never reads the whole table. Timestamps would not do: they are set by
  generators on different clocks and are not unique.
* **Appends are idempotent, via ``merge_insert`` on ``rollout_id``.** Ids are deterministic
  (:func:`~replay_pipeline.buffer.schema.make_rollout_id`), so a write whose outcome is unknown
  can be retried: ``merge_insert("rollout_id").when_not_matched_insert_all()`` inserts only the
  ids that are not stored yet. Before merging, :meth:`RolloutStore.append` looks up which ids of
  the batch are already stored (a pushed-down ``rollout_id IN (...)`` filter) and leaves them
  out, so that (a) the new rows' ``seq`` values have no gaps and (b) a fully committed batch
  that is retried makes no commit at all. (With lancedb 0.40 a ``merge_insert`` that inserts
  nothing still commits a new, empty table version.) The merge then still guards against a
  retry racing the original write.
* **Versions and tags.** Every commit is a new Lance table version; :meth:`RolloutStore.tag`
  names one (a checkpoint names the version it had seen) and :meth:`RolloutStore.read_at` reads
  the table as it was then, through a separate handle, so the live handle keeps following the
  newest version.
* **Other writers are visible.** The connection uses ``read_consistency_interval=timedelta(0)``,
  so every read checks for commits by other handles and processes (generator workers).

Concurrency limits (lancedb 0.40): several processes may append to one table and all commits
succeed. ``seq`` is computed from the row count before the commit, so two writers that commit
at the same moment can give rows the same ``seq``; :meth:`window` tolerates that (ties are
ordered by ``rollout_id`` and the filter is widened until ``capacity`` rows are found), but
exact FIFO order needs writes to a run to be serialised (the sync loop does that). Concurrent
``merge_insert`` of the *same* new id can duplicate it (upstream bug), so each writer must own
its ids, which deterministic ids per (step, group, sample) give.

Indexes: :meth:`create` builds btree scalar indexes on ``seq`` and ``policy_version``. With
lancedb 0.40 this is cheap (milliseconds, also on an empty table) and appends keep working
unchanged. An index covers only the rows present when it was built (or last optimised); rows
appended later are scanned (correct, just not accelerated) until :meth:`compact` runs
(the training loop calls it every ``buffer.compact_every`` steps). Tables opened with
:meth:`open` are never modified, so no index is added there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lancedb
import numpy as np
import pyarrow as pa

from .schema import ROLLOUT_SCHEMA, SchemaMismatch, rows_to_table, schema_mismatches

__all__ = ["RolloutStore", "StoreError", "TABLE_PREFIX"]

TABLE_PREFIX = "rollouts_"
_RUN_ID_RE = re.compile(r"[A-Za-z0-9_-]+")
_INDEXED_COLUMNS = ("seq", "policy_version")
# Ids per `rollout_id IN (...)` lookup; keeps the SQL string a reasonable size.
_ID_LOOKUP_CHUNK = 1024


class StoreError(RuntimeError):
    """A rollout-store operation was refused; the message says why and what to do instead."""


def _validate_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
        raise StoreError(
            f"invalid run_id {run_id!r}: use only letters, digits, '_' and '-' "
            f"(it becomes part of the table name {TABLE_PREFIX}<run_id>)"
        )
    return run_id


def _connect(uri: str | Path, storage_options: Mapping[str, str] | None) -> lancedb.DBConnection:
    return lancedb.connect(
        str(uri),
        read_consistency_interval=timedelta(0),
        storage_options=dict(storage_options) if storage_options else None,
    )


def _table_names(db: lancedb.DBConnection) -> list[str]:
    names: list[str] = []
    token = None
    while True:
        resp = db.list_tables(page_token=token)
        names.extend(resp.tables)
        token = resp.page_token
        if not token:
            return names


def _is_local(uri: str | Path) -> bool:
    return "://" not in str(uri) or str(uri).startswith("file://")


def _sql_str(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


class RolloutStore:
    """The run's rollout table: every rollout ever generated, appended and never deleted.

    Use :meth:`create` for a new run, :meth:`open` to resume one and :meth:`open_or_create`
    when either is fine. The table is ``rollouts_<run_id>`` inside the LanceDB database at
    ``uri`` (a local directory, or an object-store URI with ``storage_options``).
    """

    def __init__(self, db: lancedb.DBConnection, table: Any, uri: str, run_id: str):
        # Use the classmethods; this only wires an already opened table.
        self._db = db
        self._table = table
        self.uri = uri
        self.run_id = run_id
        self.table_name = self.table_name_for(run_id)

    # ------------------------------------------------------------------ opening
    @staticmethod
    def table_name_for(run_id: str) -> str:
        """``rollouts_<run_id>``, after checking ``run_id`` matches ``[A-Za-z0-9_-]+``."""
        return TABLE_PREFIX + _validate_run_id(run_id)

    @classmethod
    def create(
        cls, uri: str | Path, run_id: str, *, storage_options: Mapping[str, str] | None = None
    ) -> "RolloutStore":
        """Create the (empty) rollout table of a new run. Refuses if the run's table exists."""
        name = cls.table_name_for(run_id)
        db = _connect(uri, storage_options)
        exists_msg = (
            f"rollout table {name!r} for run {run_id!r} already exists in {str(uri)!r}; "
            f"use RolloutStore.open(...) to resume the run (or open_or_create), "
            f"or choose a new run_id"
        )
        if name in _table_names(db):
            raise StoreError(exists_msg)
        try:
            table = db.create_table(name, schema=ROLLOUT_SCHEMA)
        except ValueError as exc:  # lost a race with another creator
            if "already exists" in str(exc):
                raise StoreError(exists_msg) from exc
            raise
        for column in _INDEXED_COLUMNS:
            table.create_scalar_index(column, index_type="BTREE")
        return cls(db, table, str(uri), run_id)

    @classmethod
    def open(
        cls, uri: str | Path, run_id: str, *, storage_options: Mapping[str, str] | None = None
    ) -> "RolloutStore":
        """Open an existing run's rollout table; checks its schema and modifies nothing."""
        name = cls.table_name_for(run_id)
        if _is_local(uri) and not Path(str(uri).removeprefix("file://")).exists():
            raise StoreError(
                f"no rollout table for run {run_id!r}: {str(uri)!r} does not exist; "
                f"use RolloutStore.create(...) to start a new run"
            )
        db = _connect(uri, storage_options)
        names = _table_names(db)
        if name not in names:
            runs = sorted(n[len(TABLE_PREFIX):] for n in names if n.startswith(TABLE_PREFIX))
            raise StoreError(
                f"no rollout table for run {run_id!r} in {str(uri)!r} (runs there: {runs or 'none'}); "
                f"use RolloutStore.create(...) to start a new run"
            )
        table = db.open_table(name)
        problems = schema_mismatches(table.schema, require_seq=True)
        if problems:
            raise StoreError(
                f"rollout table {name!r} in {str(uri)!r} does not match ROLLOUT_SCHEMA: "
                + "; ".join(problems)
                + " (the table was left unchanged)"
            )
        return cls(db, table, str(uri), run_id)

    @classmethod
    def open_or_create(
        cls, uri: str | Path, run_id: str, *, storage_options: Mapping[str, str] | None = None
    ) -> "RolloutStore":
        """Open the run's table if it exists, else create it."""
        cls.table_name_for(run_id)  # validates run_id
        if run_id in cls.list_runs(uri, storage_options=storage_options):
            return cls.open(uri, run_id, storage_options=storage_options)
        try:
            return cls.create(uri, run_id, storage_options=storage_options)
        except StoreError:  # created by someone else in between
            return cls.open(uri, run_id, storage_options=storage_options)

    @staticmethod
    def list_runs(uri: str | Path, *, storage_options: Mapping[str, str] | None = None) -> list[str]:
        """The run ids that have a rollout table at ``uri``, sorted; [] if ``uri`` does not exist."""
        if _is_local(uri) and not Path(str(uri).removeprefix("file://")).exists():
            return []  # connecting would create the directory
        db = _connect(uri, storage_options)
        return sorted(n[len(TABLE_PREFIX):] for n in _table_names(db) if n.startswith(TABLE_PREFIX))

    # ------------------------------------------------------------------ writing
    def _to_input_table(self, data: Any) -> pa.Table:
        if isinstance(data, pa.RecordBatch):
            data = pa.Table.from_batches([data])
        if not isinstance(data, pa.Table):
            if isinstance(data, Mapping):
                raise StoreError("append takes a pyarrow Table or a list of row dicts, not a single dict")
            try:
                return rows_to_table(list(data))
            except SchemaMismatch as exc:
                raise StoreError(f"cannot append to {self.table_name!r}: {exc}") from exc
        problems = schema_mismatches(data.schema, require_seq=False)
        if problems:
            raise StoreError(
                f"cannot append to {self.table_name!r}: the batch does not match ROLLOUT_SCHEMA: "
                + "; ".join(problems)
                + " (nothing was written)"
            )
        if "seq" in data.column_names:
            if data.column("seq").null_count != data.num_rows:
                raise StoreError(
                    f"cannot append to {self.table_name!r}: the batch has seq values, but seq is "
                    f"assigned by the store; drop the column or leave it null"
                )
        else:
            data = data.append_column("seq", pa.nulls(data.num_rows, pa.int64()))
        return data.select(ROLLOUT_SCHEMA.names).cast(ROLLOUT_SCHEMA)

    def _stored_ids(self, ids: Sequence[str]) -> set[str]:
        found: set[str] = set()
        for start in range(0, len(ids), _ID_LOOKUP_CHUNK):
            chunk = ids[start : start + _ID_LOOKUP_CHUNK]
            flt = "rollout_id IN (" + ", ".join(_sql_str(i) for i in chunk) + ")"
            hit = self._query(flt, ["rollout_id"])
            found.update(hit.column("rollout_id").to_pylist())
        return found

    def append(self, table_or_rows: pa.Table | pa.RecordBatch | Sequence[Mapping[str, Any]]) -> int:
        """Append rollouts; returns the number of rows actually inserted.

        ``table_or_rows`` is a pyarrow Table in :data:`ROLLOUT_SCHEMA` without ``seq`` (or with
        an all-null ``seq``), or a list of row dicts (see
        :func:`~replay_pipeline.buffer.schema.rows_to_table`). Every row's ``run_id`` must be
        this store's run and rollout ids must be unique within the batch.

        Idempotent: rows whose ``rollout_id`` is already stored are skipped, so retrying a
        committed batch inserts 0 rows and makes no commit. New rows get
        ``seq = count() + i`` in batch order. A batch that fails validation raises
        :class:`StoreError` naming the offending columns, and nothing is written.
        """
        data = self._to_input_table(table_or_rows)
        if data.num_rows == 0:
            return 0
        ids = data.column("rollout_id")
        if ids.null_count:
            raise StoreError(f"cannot append to {self.table_name!r}: {ids.null_count} rows have a null rollout_id")
        id_list = ids.to_pylist()
        if len(set(id_list)) != len(id_list):
            seen: set[str] = set()
            dups = sorted({i for i in id_list if i in seen or seen.add(i)})
            raise StoreError(
                f"cannot append to {self.table_name!r}: duplicate rollout_id within the batch: {dups[:5]}"
            )
        run_ids = set(data.column("run_id").to_pylist())
        if run_ids != {self.run_id}:
            raise StoreError(
                f"cannot append to {self.table_name!r}: rows carry run_id {sorted(map(str, run_ids))}, "
                f"expected only {self.run_id!r}"
            )

        stored = self._stored_ids(id_list)
        if stored:
            keep = pa.array([i not in stored for i in id_list])
            data = data.filter(keep)
            if data.num_rows == 0:
                return 0
        start = self.count()
        seq = pa.array(np.arange(start, start + data.num_rows, dtype=np.int64))
        data = data.set_column(ROLLOUT_SCHEMA.get_field_index("seq"), ROLLOUT_SCHEMA.field("seq"), seq)
        result = self._table.merge_insert("rollout_id").when_not_matched_insert_all().execute(data)
        return int(result.num_inserted_rows)

    # ------------------------------------------------------------------ reading
    def _query(self, where: str | None, columns: Sequence[str] | None, table: Any = None) -> pa.Table:
        q = (table if table is not None else self._table).search()
        if where is not None:
            q = q.where(where)
        if columns is not None:
            q = q.select(list(columns))
        return q.limit(None).to_arrow()  # search() defaults to limit 10

    @staticmethod
    def _check_columns(columns: Sequence[str] | None) -> list[str] | None:
        if columns is None:
            return None
        columns = list(columns)
        unknown = [c for c in columns if c not in ROLLOUT_SCHEMA.names]
        if unknown:
            raise StoreError(f"unknown columns {unknown}; the rollout table has {ROLLOUT_SCHEMA.names}")
        return columns

    def _ordered(self, where: str | None, columns: Sequence[str] | None, table: Any = None) -> pa.Table:
        """Rows matching ``where``, sorted by (seq, rollout_id), with only ``columns``."""
        columns = self._check_columns(columns)
        fetch = None if columns is None else list(dict.fromkeys([*columns, "seq", "rollout_id"]))
        out = self._query(where, fetch, table)
        out = out.sort_by([("seq", "ascending"), ("rollout_id", "ascending")])
        return out if columns is None else out.select(columns)

    def count(self) -> int:
        """Rows stored (all writers' commits so far)."""
        return self._table.count_rows()

    def window(self, capacity: int, columns: list[str] | None = None) -> pa.Table:
        """The FIFO replay window: the newest ``capacity`` rows by ``seq``, sorted by ``seq``.

        The filter ``seq >= count - capacity`` is pushed down to Lance; only the window's rows
        (and only ``columns``, if given) are read. Returns all rows if the table holds fewer
        than ``capacity``. If concurrent writers gave rows duplicate ``seq`` values the filter
        is widened until ``capacity`` rows are found.
        """
        if isinstance(capacity, bool) or int(capacity) != capacity or capacity < 1:
            raise StoreError(f"window capacity must be a positive integer, got {capacity!r}")
        capacity = int(capacity)
        columns = self._check_columns(columns)
        fetch = None if columns is None else list(dict.fromkeys([*columns, "seq", "rollout_id"]))
        n = self.count()
        want = min(capacity, n)
        lo = n - capacity
        while True:
            out = self._query(f"seq >= {max(lo, 0)}", fetch)
            if out.num_rows >= want or lo <= 0:
                break
            lo -= want - out.num_rows  # duplicate seqs from racing writers: look further back
        out = out.sort_by([("seq", "ascending"), ("rollout_id", "ascending")])
        if out.num_rows > capacity:  # rows appended by others since count(), or duplicate seqs
            out = out.slice(out.num_rows - capacity)
        return out if columns is None else out.select(columns)

    def rows_for_versions(self, lo: int, hi: int, columns: list[str] | None = None) -> pa.Table:
        """Rows generated by policy versions ``lo..hi`` (inclusive), sorted by ``seq``."""
        return self._ordered(f"policy_version >= {int(lo)} AND policy_version <= {int(hi)}", columns)

    def rows_for_step(self, step: int, columns: list[str] | None = None) -> pa.Table:
        """Rows generated at generation step ``step``, sorted by ``seq``."""
        return self._ordered(f"step = {int(step)}", columns)

    def compact(self) -> None:
        """Merge small per-append fragments and refresh the scalar indexes (Lance
        ``optimize``). Rows, versions and tags are kept; a run calls this every
        ``buffer.compact_every`` steps so append and window costs stay flat as it grows."""
        self._table.optimize()

    # ------------------------------------------------------------------ versions and tags
    @property
    def version(self) -> int:
        """The table's current (newest) Lance version."""
        return int(self._table.version)

    @property
    def table(self) -> Any:
        """The underlying ``lancedb`` table (for fork/shallow_clone, maintenance and queries)."""
        return self._table

    def tags(self) -> dict[str, int]:
        """Tag name -> table version."""
        return {name: int(info["version"]) for name, info in self._table.tags.list().items()}

    def tag(self, name: str, version: int | None = None) -> None:
        """Tag ``version`` (default: the current one) as ``name``.

        Idempotent: re-tagging the same version is a no-op; a tag that already points at a
        different version is an error (tags are never moved). Names may use letters, digits,
        ``.``, ``-`` and ``_``.
        """
        version = self.version if version is None else int(version)
        existing = self.tags()
        if name in existing:
            if existing[name] == version:
                return
            raise StoreError(
                f"tag {name!r} on {self.table_name!r} already points at version {existing[name]}, "
                f"not {version}; tags are never moved, choose another name"
            )
        try:
            self._table.tags.create(name, version)
        except (RuntimeError, ValueError) as exc:
            now = self.tags()
            if now.get(name) == version:  # created concurrently by a retry of the same call
                return
            raise StoreError(f"cannot tag version {version} of {self.table_name!r} as {name!r}: {exc}") from exc

    def read_at(self, tag_or_version: str | int, columns: list[str] | None = None) -> pa.Table:
        """The whole table as it was at a tag or version, sorted by ``seq``.

        Reads through a separate handle, so this store keeps following the newest version.
        """
        if isinstance(tag_or_version, str):
            tags = self.tags()
            if tag_or_version not in tags:
                raise StoreError(
                    f"no tag {tag_or_version!r} on {self.table_name!r}; tags: {sorted(tags) or 'none'}"
                )
            version = tags[tag_or_version]
        elif isinstance(tag_or_version, (int, np.integer)) and not isinstance(tag_or_version, bool):
            version = int(tag_or_version)
        else:
            raise StoreError(f"read_at takes a tag name or a version number, got {tag_or_version!r}")
        try:
            old = self._db.open_table(self.table_name, version=version)
        except (ValueError, RuntimeError) as exc:
            raise StoreError(
                f"cannot read version {version} of {self.table_name!r} (current version {self.version}): {exc}"
            ) from exc
        return self._ordered(None, columns, table=old)

    def __repr__(self) -> str:
        return f"RolloutStore(uri={self.uri!r}, run_id={self.run_id!r}, version={self.version})"
