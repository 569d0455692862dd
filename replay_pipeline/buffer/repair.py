"""Repairing a damaged run table: what ``python -m flows.query repair RUN_ID`` does.

A table is damaged when data files of its current version are missing or do not decode
(:func:`~replay_pipeline.buffer.lance_table.scan_damage` reads every fragment, every column).
:func:`repair_table` then, for one table:

1. **keeps every readable row**: a new table version drops just the damaged fragments (Lance's
   ``Delete`` of whole fragments; every other fragment, index and tag is untouched);
2. **brings back what older versions still hold**: Lance keeps the files of older versions
   (a week after a compaction rewrote them, and as long as a checkpoint's tag points at them),
   so the rows of a damaged file often survive in the files they were first written to.
   Walking back from the newest version, every fragment not seen yet is read, and the rows
   whose id the table no longer holds are appended again exactly as they were (their ``seq``
   too). The walk stops at a version that deleted or rewrote rows other than by compaction
   (a fork's or an async resume's deletion: rows older than that may be gone on purpose, and
   are not brought back) and once every lost row is found;
3. **never deletes data**: the damaged files that still exist are moved aside into
   ``<table>.lance/_damaged/<UTC time>/`` with ``repair.json`` (what was found and done); the
   repaired version is tagged ``repaired-<UTC time>`` (older versions and tags stay, their
   damaged files now under ``_damaged/``).

The result (:class:`TableRepair`) says what was kept, brought back and lost, the versions
before and after, and for the rollout table which ``seq`` values are gone: what a resume
needs (replay_pipeline/run/lineage.py, ``resume_table_problems``) to decide whether the
lost rows can be generated again or the run must be forked from an earlier checkpoint.
Moving files aside needs a local table; on an object store they are left where they are
(the repaired version no longer refers to them).

Choice: "drop the damaged fragments, then add back the rows older versions hold" is used
instead of restoring an older version wholesale: the newest version whose files all read
is usually older than rows appended since, which a restore would throw away; this keeps
those rows and the older version's copy of the lost ones both.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .lance_table import DamagedFile, LanceTable, _fragment_problem, _fragment_rows, _file_path, is_object_store, scan_damage

__all__ = ["DAMAGED_DIR", "TableRepair", "repair_table"]

#: Where the damaged files are moved, inside the table's directory.
DAMAGED_DIR = "_damaged"
# Operations a walk back through the versions may cross: they add rows or rewrite them
# unchanged (compaction), or touch only indexes and settings.
_SAFE_OPERATIONS = ("Append", "Rewrite", "CreateIndex", "Merge", "Project", "UpdateConfig")


@dataclass
class TableRepair:
    """What :func:`repair_table` found and did to one table (``dry_run``: would do)."""

    table: str
    run_id: str
    version_before: int
    rows_before: int
    damaged: list[DamagedFile] = field(default_factory=list)
    rows_kept: int = 0
    rows_recovered: int = 0
    recovered_from: list[int] = field(default_factory=list)
    """The older versions the recovered rows were read from."""
    rows_lost: int = 0
    lost_seqs: list[tuple[int, int]] = field(default_factory=list)
    """Rollout table: the inclusive ``seq`` ranges no longer stored."""
    version_after: int | None = None
    moved_to: str | None = None
    dry_run: bool = False

    def lines(self) -> list[str]:
        """The report, one line per fact."""
        if not self.damaged:
            return [f"{self.table}: intact ({self.rows_before} rows, version {self.version_before}); nothing to do"]
        would = "would " if self.dry_run else ""
        out = [f"{self.table} (run {self.run_id}, version {self.version_before}, {self.rows_before} rows): "
               f"{len(self.damaged)} damaged file(s)"]
        out += [f"  damaged: {f.describe()}" for f in self.damaged]
        out.append(f"  {would}keep {self.rows_kept} readable rows; {would}bring back {self.rows_recovered} rows"
                   + (f" from version(s) {', '.join(map(str, self.recovered_from))}" if self.recovered_from else "")
                   + f"; {self.rows_lost} rows {'would be ' if self.dry_run else ''}lost")
        if self.lost_seqs:
            out.append("  seq lost: " + ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in self.lost_seqs))
        if self.dry_run:
            out.append("  dry run: nothing was changed")
        else:
            out.append(f"  repaired: version {self.version_after}"
                       + (f"; damaged files moved to {self.moved_to}" if self.moved_to else
                          "; damaged files left in place (object store), no longer referenced"))
        return out

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")


def _conform(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    """Rows of an older version in the current schema (columns added since are null)."""
    cols = [rows.column(f.name).cast(f.type) if f.name in rows.column_names else pa.nulls(rows.num_rows, f.type)
            for f in schema]
    return pa.Table.from_arrays(cols, schema=schema)


def _recover(dataset: Any, id_column: str, have: set[str], wanted: int, seen: set[str],
             bad: set[str]) -> tuple[list[pa.Table], list[int]]:
    """Rows of older versions whose id is not in ``have`` (at most ``wanted``), from fragments
    whose files are not in ``seen`` (read already) or ``bad`` (damaged); see the module
    docstring for where the walk stops."""
    parts: list[pa.Table] = []
    sources: list[int] = []
    found = 0
    newer = int(dataset.version)
    for version in sorted((int(v["version"]) for v in dataset.versions()), reverse=True):
        if version >= dataset.version:
            continue
        if not all(_safe(dataset, v) for v in range(version + 1, newer + 1)):  # what made the newer ones
            break
        newer = version
        old = dataset.checkout_version(version)
        for fragment in old.get_fragments():
            paths = {_file_path(old, f) for f in fragment.data_files()}
            if paths & bad or paths <= seen:
                continue
            seen |= paths
            if _fragment_problem(fragment, deep=True) is not None:
                bad |= paths
                continue
            rows = fragment.to_table()
            rows = rows.filter(pc.invert(pc.is_in(rows.column(id_column), value_set=pa.array(sorted(have), pa.string()))))
            if rows.num_rows:
                parts.append(_conform(rows, dataset.schema))
                have |= set(rows.column(id_column).to_pylist())
                found += rows.num_rows
                if version not in sources:
                    sources.append(version)
        if found >= wanted:
            break
    return parts, sources


def _safe(dataset: Any, version: int) -> bool:
    try:
        txn = dataset.read_transaction(version)
    except (OSError, ValueError, RuntimeError):  # its transaction file is gone: unknown
        return False
    return txn is not None and type(txn.operation).__name__ in _SAFE_OPERATIONS


def _ranges(values: np.ndarray) -> list[tuple[int, int]]:
    if not len(values):
        return []
    breaks = np.flatnonzero(np.diff(values) != 1)
    starts = np.concatenate([[0], breaks + 1])
    ends = np.concatenate([breaks, [len(values) - 1]])
    return [(int(values[a]), int(values[b])) for a, b in zip(starts, ends)]


def repair_table(store: LanceTable, dry_run: bool = False) -> TableRepair:
    """Repair one table as the module docstring says (``dry_run``: only report)."""
    dataset = store._dataset()
    report = TableRepair(store.table_name, store.run_id, int(dataset.version), int(dataset.count_rows()),
                         dry_run=dry_run)
    report.damaged = scan_damage(dataset)
    if not report.damaged:
        report.rows_kept = report.rows_before
        return report
    bad_ids = {f.fragment for f in report.damaged}
    fragments = dataset.get_fragments()
    intact = [f for f in fragments if f.fragment_id not in bad_ids]
    lost = sum(_fragment_rows(f) for f in fragments if f.fragment_id in bad_ids)
    key = [store.ID_COLUMN] + (["seq"] if "seq" in dataset.schema.names else [])
    kept = dataset.scanner(columns=key, fragments=intact).to_table() if intact else _conform(
        pa.table({}), pa.schema([dataset.schema.field(c) for c in key]))
    report.rows_kept = kept.num_rows
    seen = {_file_path(dataset, d) for f in intact for d in f.data_files()}
    bad = {f.path for f in report.damaged}
    parts, report.recovered_from = _recover(dataset, store.ID_COLUMN, set(kept.column(store.ID_COLUMN).to_pylist()),
                                            lost, seen, bad)
    recovered = pa.concat_tables(parts) if parts else None
    report.rows_recovered = 0 if recovered is None else recovered.num_rows
    report.rows_lost = max(lost - report.rows_recovered, 0)
    if "seq" in key:
        present = kept.column("seq").to_numpy()
        if recovered is not None:
            present = np.concatenate([present, recovered.column("seq").to_numpy()])
        expected = np.arange(max(report.rows_before, int(present.max()) + 1 if len(present) else 0))
        report.lost_seqs = _ranges(np.setdiff1d(expected, present))
    if dry_run:
        return report
    stamp = _now()
    op = lance.LanceOperation.Delete([], sorted(bad_ids), f"repair {stamp}: drop unreadable fragments {sorted(bad_ids)}")
    lance.LanceDataset.commit(dataset, op, read_version=dataset.version)
    if recovered is not None:
        store._dataset().insert(recovered)
    report.version_after = store.version
    store.tag(f"repaired-{stamp}")
    report.moved_to = _move_aside(str(dataset.uri), report, stamp)
    return report


def _move_aside(table_uri: str, report: TableRepair, stamp: str) -> str | None:
    """Move the damaged files that exist into ``<table>/_damaged/<stamp>/`` beside a
    ``repair.json``; None on an object store (nothing is moved there)."""
    if is_object_store(table_uri):
        return None
    target = Path(table_uri.removeprefix("file://")) / DAMAGED_DIR / stamp
    target.mkdir(parents=True, exist_ok=True)
    for damaged in report.damaged:
        path = Path(damaged.path.removeprefix("file://"))
        if path.exists():
            shutil.move(str(path), str(target / path.name))
    (target / "repair.json").write_text(json.dumps(report.as_dict(), indent=2, default=str))
    return str(target)
