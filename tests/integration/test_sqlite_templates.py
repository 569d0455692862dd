"""replay_pipeline.tracking.sqlite_templates with MLflow's real SQLite store: a new store is a copy of
the migrated template the first new store left, opens at head with its own default experiment
and artifact location, and a store that exists (or a URI that is not a local file) is never
touched."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

from mlflow.tracking import MlflowClient

from replay_pipeline.tracking import sqlite_templates
from replay_pipeline.tracking.tracker import MlflowTracker, seed_sqlite_store


def _tracker(root: Path, name: str) -> MlflowTracker:
    return MlflowTracker(f"sqlite:///{root / 'mlflow.db'}", "exp", root / "mlartifacts", run_name=name)


def test_a_new_store_is_the_template_and_opens_with_its_own_experiment(tmp_path, monkeypatch):
    monkeypatch.setenv("REPLAY_PIPELINE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "a").mkdir()
    first = _tracker(tmp_path / "a", "one")
    first.finish("FINISHED")
    (template,) = (tmp_path / "cache").glob("mlflow-db-*/mlflow.db")
    with contextlib.closing(sqlite3.connect(template)) as db:
        assert db.execute("SELECT count(*) FROM experiments").fetchone() == (0,)  # migrated, nothing logged
        assert db.execute("SELECT count(*) FROM alembic_version").fetchone() == (1,)
        db.execute("CREATE TABLE template_marker (x)")  # to tell a copy from MLflow's own migration
    (tmp_path / "b").mkdir()
    second = _tracker(tmp_path / "b", "two")
    second.finish("FINISHED")
    with contextlib.closing(sqlite3.connect(tmp_path / "b" / "mlflow.db")) as db:
        assert db.execute("SELECT name FROM sqlite_master WHERE name = 'template_marker'").fetchall()
    client = MlflowClient(f"sqlite:///{tmp_path / 'b' / 'mlflow.db'}")
    runs = client.search_runs([second.experiment_id])
    assert [r.info.run_name for r in runs] == ["two"]
    assert runs[0].info.artifact_uri.startswith((tmp_path / "b" / "mlartifacts").as_uri())
    default = client.get_experiment("0")  # MLflow's own, made on the copy's first open
    assert default.name == "Default" and "template" not in default.artifact_location
    # A store that exists keeps its runs: opened again, it is not replaced by the template.
    again = _tracker(tmp_path / "a", "three")
    again.finish("FINISHED")
    names = sorted(r.info.run_name for r in MlflowClient(f"sqlite:///{tmp_path / 'a' / 'mlflow.db'}")
                   .search_runs([again.experiment_id]))
    assert names == ["one", "three"]
    with contextlib.closing(sqlite3.connect(tmp_path / "a" / "mlflow.db")) as db:
        assert not db.execute("SELECT name FROM sqlite_master WHERE name = 'template_marker'").fetchall()


def test_only_a_missing_local_file_is_seeded(tmp_path, monkeypatch):
    monkeypatch.setenv("REPLAY_PIPELINE_CACHE_DIR", str(tmp_path / "cache"))
    for uri in ("http://127.0.0.1:1", "sqlite:///", f"sqlite:///{tmp_path / 'x.db'}?mode=ro",
                f"sqlite:///{tmp_path / 'missing-folder' / 'mlflow.db'}"):
        seed_sqlite_store(uri)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "missing-folder").exists()
    kept = tmp_path / "kept.db"
    kept.write_bytes(b"not a database, but somebody's file")
    seed_sqlite_store(f"sqlite:///{kept}")
    assert kept.read_bytes() == b"not a database, but somebody's file"


def test_a_failed_migration_leaves_no_template_and_no_file(tmp_path, monkeypatch):
    monkeypatch.setenv("REPLAY_PIPELINE_CACHE_DIR", str(tmp_path / "cache"))

    def broken(path: Path) -> None:
        raise OSError("disk full")

    assert sqlite_templates.seed(tmp_path / "new.db", "t/new.db", broken) is False
    assert not (tmp_path / "new.db").exists() and not sqlite_templates.template_path("t/new.db").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary file left behind
