"""Prefect flows and the command-line entry points (python -m flows.<name>).

Prefect reads its settings when it is first imported, so this package sets the embedded
defaults before any flow module imports it: Prefect's ephemeral state lives under the
run root (`<tracking.root_dir>/.prefect`), Prefect's analytics and MLflow's usage telemetry
(a thread of its own in every process that loads MLflow) are off, and the temporary server's
own shutdown chatter is silenced. Anything already set in the environment wins, so the
same flows run against a real Prefect server when PREFECT_API_URL is set.

It also spares every command the interpreter's final garbage collection, 2.3-2.6 s of CPU at
each exit here (replay_pipeline/system/process_exit.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from replay_pipeline.system.process_exit import skip_final_collection


def root_dir_from_argv(argv: list[str]) -> str:
    """The run root a command line names (`tracking.root_dir=`), else REPLAY_PIPELINE_ROOT, else
    "runs": read before anything composes the configuration."""
    for arg in argv:
        for prefix in ("tracking.root_dir=", "++tracking.root_dir="):
            if arg.startswith(prefix):
                return arg[len(prefix):]
    return os.environ.get("REPLAY_PIPELINE_ROOT", "runs")


def prepare_environment(argv: list[str] | None = None) -> None:
    root = Path(root_dir_from_argv(sys.argv[1:] if argv is None else argv)).expanduser().resolve()
    os.environ.setdefault("PREFECT_HOME", str(root / ".prefect"))
    try:  # Prefect only warns when it cannot create its home, then times out starting
        Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # reported with a fix by RunPaths.ensure() before any work
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "CRITICAL")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no usage reports from a training run
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


prepare_environment()
skip_final_collection()
