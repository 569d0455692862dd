"""Where a run's files live. Everything is under one root directory (tracking.root_dir):

    <root>/<run_id>/config.yaml        the resolved configuration
    <root>/<run_id>/checkpoints/step-000020/   model, optimizer and state (checkpoints.py)
    <root>/lancedb/                    rollout tables, one per run (rollouts_<run_id>)
    <root>/mlflow.db, <root>/mlartifacts/      MLflow tracking store and artifacts
    <root>/cache/                      warm-start checkpoints, shared by runs ($REPLAY_PIPELINE_CACHE_DIR
                                       moves it, e.g. to share it between roots)
    <root>/.prefect/                   Prefect's ephemeral state (PREFECT_HOME)

Ground floor: imports nothing of the project.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


#: Environment variable naming a warm-start cache shared by every run root (RunPaths.cache).
CACHE_ENV = "REPLAY_PIPELINE_CACHE_DIR"


def new_run_id() -> str:
    """Sortable and unique: 20261129-171530-3fa2c1."""
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


@dataclass(frozen=True)
class RunPaths:
    root: Path
    run_id: str

    @classmethod
    def make(cls, root: str | Path, run_id: str) -> "RunPaths":
        return cls(Path(root).expanduser().resolve(), run_id)

    @property
    def run_dir(self) -> Path:
        return self.root / self.run_id

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def lancedb(self) -> Path:
        return self.root / "lancedb"

    @property
    def cache(self) -> Path:
        """Warm starts: <root>/cache, or the directory named by $REPLAY_PIPELINE_CACHE_DIR (shared
        by every root on the machine: warm starts are content-addressed by their settings)."""
        shared = os.environ.get(CACHE_ENV)
        return Path(shared).expanduser().resolve() if shared else self.root / "cache"

    @property
    def mlflow_uri(self) -> str:
        return f"sqlite:///{self.root / 'mlflow.db'}"

    @property
    def artifact_location(self) -> Path:
        return self.root / "mlartifacts"

    @property
    def prefect_home(self) -> Path:
        return self.root / ".prefect"

    def ensure(self) -> None:
        """Create the directories, failing early (before any work) if root is unwritable."""
        ensure_writable(self.root)
        for d in (self.run_dir, self.checkpoints, self.cache, self.artifact_location):
            d.mkdir(parents=True, exist_ok=True)


def list_runs(root: str | Path) -> list[str]:
    """The run ids under `root` (directories holding a config.yaml), oldest first: by the
    `created_at` of their run.json, else by when their config.yaml was first written."""
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        return []
    found = []
    for config in root.glob("*/config.yaml"):
        try:
            created = json.loads((config.parent / "run.json").read_text()).get("created_at")
        except (OSError, ValueError):
            created = None
        if not created:
            created = datetime.fromtimestamp(config.stat().st_mtime, timezone.utc).isoformat(timespec="seconds")
        found.append((str(created), config.parent.name))
    return [run_id for _, run_id in sorted(found)]


def ensure_writable(root: str | Path) -> Path:
    """Create `root` and prove a file can be written there; PermissionError says how to fix it."""
    root = Path(root).expanduser().resolve()
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-test-{secrets.token_hex(4)}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise PermissionError(
            f"cannot write under {root} ({exc.strerror or exc}); set tracking.root_dir to a "
            "writable directory, e.g. tracking.root_dir=$HOME/replay-runs") from exc
    return root


def artifact_location(cfg: Any, paths: RunPaths, mlflow_uri: str) -> str | None:
    """Where a new MLflow experiment keeps its artifacts: tracking.artifact_location if set;
    else a tracking server decides (its --artifacts-destination), and a local store keeps
    them under the run root."""
    if cfg.tracking.artifact_location:
        return str(cfg.tracking.artifact_location)
    remote = str(mlflow_uri).startswith(("http://", "https://", "databricks"))
    return None if remote else str(paths.artifact_location)
