"""Metric rows written straight into MLflow's own SQLite store: the per-round metrics' fast
path, used by tracking.MlflowTracker's writer thread for a `sqlite:///` tracking URI.

Why: MLflow's `SqlAlchemyStore.log_batch` builds an ORM object per metric and reads and updates
`latest_metrics` through the ORM: 80-110 us of CPU per metric on a 2-core machine, tens of
milliseconds for a one-second batch of the default run (~6 rounds of 95 metrics;
docs/performance.md, "Metrics into MLflow's SQLite store"), in a thread that shares the
interpreter lock and both cores with generation and training. The same rows through sqlite3's
`executemany` take a small fraction of that (`python -m replay_pipeline.benchmarks.metrics`
measures both).

What it writes is what `log_batch` writes for metrics that name no logged model (ours never
do), in one transaction:
* a row per (key, value, timestamp, step) in `metrics`, an identical row skipped (log_batch
  skips it too: the table's primary key is the whole row);
* `latest_metrics` kept, per key, at the row with the largest (step, timestamp, value),
  MLflow's own rule (`_update_latest_metrics_if_necessary`);
after checking, as log_batch does, that the run exists and is not deleted, and each key once
with MLflow's own name check. Values are finite floats (the tracker drops the rest before
they are queued), so MLflow's NaN/inf encoding never applies.

`open_writer` returns None, and the tracker keeps `log_batch`, unless both tables have exactly
the columns this was written against and MLflow's name check is where it was (MLflow 3's
schema; an MLflow that changes them falls back by itself, and
tests/integration/test_mlflow_sqlite.py compares the two paths row for row). Ground floor:
imports nothing of the project.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Iterable

__all__ = ["SqliteMetricWriter", "open_writer", "sqlite_path"]

# The columns of MLflow's two metric tables this writer fills (PRAGMA table_info order-free).
METRICS_COLUMNS = frozenset({"key", "value", "timestamp", "run_uuid", "step", "is_nan"})
LATEST_COLUMNS = frozenset({"key", "value", "timestamp", "step", "is_nan", "run_uuid"})

_INSERT = "INSERT OR IGNORE INTO metrics (key, value, timestamp, run_uuid, step, is_nan) VALUES (?, ?, ?, ?, ?, 0)"
# MLflow's rule: the latest is the largest (step, timestamp, value); rows of one batch are
# applied in order, so a key logged twice in one batch ends at the larger.
_LATEST = ("INSERT INTO latest_metrics (key, value, timestamp, step, is_nan, run_uuid) VALUES (?, ?, ?, ?, 0, ?) "
           "ON CONFLICT(key, run_uuid) DO UPDATE SET value = excluded.value, timestamp = excluded.timestamp, "
           "step = excluded.step, is_nan = excluded.is_nan "
           "WHERE (excluded.step, excluded.timestamp, excluded.value) > "
           "(latest_metrics.step, latest_metrics.timestamp, latest_metrics.value)")

Row = tuple[str, float, int, int]  # key, value, timestamp (ms), step


def sqlite_path(uri: str) -> Path | None:
    """The database file of a plain `sqlite:///PATH` tracking URI, else None (a server, another
    database, or a URI with query options, which only SQLAlchemy would read the same way)."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix) or "?" in uri or uri == prefix:
        return None
    return Path(uri[len(prefix):])


def _name_check():
    """MLflow's own metric-name check (raises MlflowException), or None where this MLflow
    has none by that name: then open_writer leaves the store to log_batch."""
    try:
        # start-up cost: mlflow, in the tracker's process only (which imported it already)
        from mlflow.utils.validation import _validate_metric_name
    except ImportError:
        return None
    return _validate_metric_name


def _columns(conn: sqlite3.Connection, table: str) -> frozenset[str]:
    return frozenset(row[1] for row in conn.execute(f"PRAGMA table_info({table})"))


class SqliteMetricWriter:
    """Writes metric rows of one MLflow run into the SQLite store at `path`, from one thread at
    a time (the tracker's writer thread); `close()` when done."""

    def __init__(self, path: Path, run_id: str, timeout: float = 60.0):
        self.path = Path(path)
        self.run_id = run_id
        # autocommit mode: write() opens and ends its own transaction; waits up to `timeout`
        # seconds for another writer of the store (MLflow's own connections) to finish
        self._conn = sqlite3.connect(str(self.path), timeout=timeout, isolation_level=None,
                                     check_same_thread=False)
        self._checked: set[str] = set()
        self._validate = _name_check()

    def compatible(self) -> bool:
        """Whether MLflow's name check is there and both metric tables have exactly the
        columns this writer fills."""
        return (self._validate is not None and _columns(self._conn, "metrics") == METRICS_COLUMNS
                and _columns(self._conn, "latest_metrics") == LATEST_COLUMNS)

    def _check_keys(self, rows: list[Row]) -> None:
        new = {key for key, *_ in rows} - self._checked
        for key in sorted(new):
            self._validate(key)
        self._checked |= new

    def write(self, rows: Iterable[Row]) -> None:
        """Store `rows` (key, value, timestamp in ms, step) in one transaction. Raises
        ValueError for a run that is gone or deleted, MLflow's MlflowException for a bad key,
        sqlite3.Error for a store that cannot be written; nothing of the batch is then stored."""
        rows = list(rows)
        if not rows:
            return
        self._check_keys(rows)
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            found = conn.execute("SELECT lifecycle_stage FROM runs WHERE run_uuid = ?", (self.run_id,)).fetchone()
            if found is None or found[0] != "active":
                raise ValueError(f"MLflow run {self.run_id} is {'not in' if found is None else 'deleted from'} "
                                 f"the store at {self.path}; its metrics cannot be logged (restore the run in "
                                 "MLflow, or start a new training run)")
            run = self.run_id
            conn.executemany(_INSERT, [(k, v, t, run, s) for k, v, t, s in rows])
            conn.executemany(_LATEST, [(k, v, t, s, run) for k, v, t, s in rows])
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def close(self) -> None:
        self._conn.close()


def open_writer(uri: str, run_id: str) -> SqliteMetricWriter | None:
    """A writer for run `run_id` when `uri` is a plain SQLite store whose metric tables this
    writer knows; None otherwise (the caller keeps MLflow's log_batch)."""
    path = sqlite_path(uri)
    if path is None or not path.is_file():
        return None
    try:
        writer = SqliteMetricWriter(path, run_id)
    except sqlite3.Error:
        return None
    try:
        if writer.compatible():
            return writer
    except sqlite3.Error:
        pass
    writer.close()
    return None
