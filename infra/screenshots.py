"""Screenshots of a run as a person sees it in the Prefect and MLflow UIs (the docs' pictures,
docs/images/).

    python infra/screenshots.py ROOT RUN_ID [--out docs/images]

Starts an MLflow UI on ROOT's mlflow.db and a Prefect server on ROOT's .prefect (PREFECT_HOME,
with PREFECT_UI_API_URL pointing the UI at it), each on a free local port, and saves with
headless Chromium: the experiment's runs table and the run's metric charts in MLflow (opened
with `?workflowType=machine_learning`: MLflow 3's GenAI view is the default otherwise), and the
run's flow-run page in Prefect (its task runs, artifacts and logs). The servers are stopped
afterwards. The viewer's own screenshots come from tests/e2e/test_viewer.py
(VIEWER_SCREENSHOTS=docs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not answer within {seconds:.0f} s")
            time.sleep(0.5)


def shoot(chromium: str, url: str, path: Path) -> None:
    subprocess.run([chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1400,1000", "--virtual-time-budget=40000", f"--screenshot={path}", url],
                   capture_output=True, timeout=180, check=True)
    print(f"{path} ({path.stat().st_size} bytes): {url}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("run_id")
    parser.add_argument("--out", type=Path, default=Path("docs"))
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("error: no chromium on PATH: sh infra/install-browser.sh", file=sys.stderr)
        return 2
    root = args.root.resolve()
    info = json.loads((root / args.run_id / "run.json").read_text())
    flow_run = info["prefect_flow_runs"][-1]
    args.out.mkdir(parents=True, exist_ok=True)
    mlflow_port, prefect_port = _port(), _port()
    env = {**os.environ, "PREFECT_HOME": str(root / ".prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_API_URL": f"http://127.0.0.1:{prefect_port}/api"}
    servers = [subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", info["mlflow_uri"],
                                 "--port", str(mlflow_port)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True),
               subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--port", str(prefect_port)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)]
    try:
        mlflow, prefect = f"http://127.0.0.1:{mlflow_port}", f"http://127.0.0.1:{prefect_port}"
        _wait(mlflow + "/health")
        _wait(prefect + "/api/health")
        # start-up cost: mlflow, once the servers are up
        from mlflow.tracking import MlflowClient

        run = MlflowClient(mlflow).get_run(info["mlflow_run_id"])
        experiment = run.info.experiment_id
        shoot(chromium, f"{mlflow}/#/experiments/{experiment}/runs?workflowType=machine_learning",
              args.out / "mlflow-experiment.png")
        shoot(chromium, f"{mlflow}/#/experiments/{experiment}/runs/{run.info.run_id}/model-metrics"
                        "?workflowType=machine_learning", args.out / "mlflow-run.png")
        shoot(chromium, f"{prefect}/runs/flow-run/{flow_run}", args.out / "prefect-flow-run.png")
    finally:
        for server in servers:
            os.killpg(server.pid, 15)
            server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
