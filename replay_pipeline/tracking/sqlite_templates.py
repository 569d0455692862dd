"""New SQLite databases from kept templates: a store that migrates a new database on its first
open starts instead from a copy of an empty, migrated one.

Prefect's server and MLflow's tracking store each migrate a new SQLite file on first open
(Prefect about 14 s of CPU here, MLflow about 2.3 s of wall time), and every new run root has
a new one of each. The first process to make one migrates it in place and keeps a copy, before
anything is written to it, as `<cache>/<name>` (`<cache>`: REPLAY_PIPELINE_CACHE_DIR, else
~/.cache/replay-pipeline; `<name>` carries the store's version, so an upgrade makes a new
template). A later new database is that copy, linked into place only while no file exists, so a
database that another process already writes is never replaced. The store then finds its schema
at head and migrates nothing. Any failure here leaves the database to the store's own
migration, as if this module did not exist.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
from pathlib import Path
from typing import Callable

from replay_pipeline.system.runs import CACHE_ENV


def template_path(name: str) -> Path:
    """Where the template `name` (e.g. "mlflow-db-3.17.2/mlflow.db") is kept."""
    shared = os.environ.get(CACHE_ENV)
    cache = Path(shared).expanduser() if shared else Path.home() / ".cache" / "replay-pipeline"
    return cache / name


def seed(path: Path, name: str, migrate: Callable[[Path], None]) -> bool:
    """Make the new database `path` from the template `name`, or with `migrate(path)` (which
    creates and migrates `path` in place) and keep a copy as the template. Nothing when `path`
    exists or its folder is missing or unwritable (the store reports that itself). True when
    `path` now exists, migrated, because of this call (also when only keeping the template
    failed)."""
    if path.exists() or not (path.parent.is_dir() and os.access(path.parent, os.W_OK)):
        return False
    template = template_path(name)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        if template.is_file():
            shutil.copyfile(template, tmp)
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)  # only while none exists: never over a live database
                return True
            return False
        migrate(path)
    except Exception:  # noqa: BLE001  (any failure: the store migrates the database itself, as before)
        return False
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    with contextlib.suppress(Exception):  # no template kept: the next new database migrates too
        _keep(path, template)
    return True


def _keep(path: Path, template: Path) -> None:
    """A copy of the migrated `path`, before anything is written to it, as `template`."""
    template.parent.mkdir(parents=True, exist_ok=True)
    kept = template.with_name(f".{template.name}.{os.getpid()}")
    try:
        with contextlib.closing(sqlite3.connect(path)) as source, contextlib.closing(sqlite3.connect(kept)) as copy:
            source.backup(copy)
            copy.execute("PRAGMA journal_mode=DELETE")  # one self-contained file (no -wal beside it)
        os.replace(kept, template)
    finally:
        kept.unlink(missing_ok=True)
