"""Screenshots of a run as a person sees it in the rollout viewer and in the MLflow and Prefect
UIs (the docs' pictures, docs/images/).

    python infra/screenshots.py ROOT [RUN_ID] [--out docs/images] [--viewer-only]

RUN_ID defaults to the newest run under ROOT (a run's tracking.root_dir). Starts the rollout
viewer (`python -m flows.view ROOT`) on a free local port and saves with headless Chromium
viewer-runs.png (the runs list), viewer-run.png (the run's charts), viewer-step.png (its middle
step's groups) and viewer-rollout.png (that step's most-used rollout: its tokens and uses).
Unless --viewer-only, it then starts an MLflow UI on ROOT's mlflow.db and a Prefect server on
ROOT's .prefect (PREFECT_HOME, with PREFECT_UI_API_URL pointing the UI at it), each on a free
local port, and saves the experiment's runs table and the run's metric charts in MLflow (opened
with `?workflowType=machine_learning`: MLflow 3's GenAI view is the default otherwise) and the
run's flow-run page in Prefect (its task runs, artifacts and logs): mlflow-experiment.png,
mlflow-run.png, prefect-flow-run.png. Every server is stopped afterwards.
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

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: the library from this checkout
    sys.path.insert(0, str(REPO))

from replay_pipeline.reports import viewer  # noqa: E402  (after sys.path is set)
from replay_pipeline.system.runs import list_runs  # noqa: E402


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


def shoot(chromium: str, url: str, path: Path, size: str = "1400,1000") -> None:
    subprocess.run([chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={size}", "--virtual-time-budget=180000", f"--screenshot={path}", url],
                   capture_output=True, timeout=180, check=True)
    print(f"{path} ({path.stat().st_size} bytes): {url}")


def _stop(server: subprocess.Popen) -> None:
    os.killpg(server.pid, 15)
    server.wait(timeout=30)


def viewer_pages(root: Path, run_id: str) -> dict[str, str]:
    """The viewer's pages to show, by picture name: the runs, the run, its middle step and that
    step's most-used rollout."""
    steps = viewer.series(root, run_id)["steps"]
    if not steps:
        raise SystemExit(f"run {run_id} under {root} has no rollouts yet")
    step = steps[len(steps) // 2]
    members = [m for g in viewer.groups(root, run_id, step) for m in g["members"]]
    most = max(members, key=lambda m: m["reuse_count"])
    return {"viewer-runs.png": "/", "viewer-run.png": f"/run/{run_id}", "viewer-step.png": f"/run/{run_id}/step/{step}",
            "viewer-rollout.png": f"/run/{run_id}/rollout/{most['rollout_id']}"}


def shoot_viewer(chromium: str, root: Path, run_id: str, out: Path) -> None:
    pages = viewer_pages(root, run_id)
    port = _port()
    server = subprocess.Popen([sys.executable, "-m", "flows.view", str(root), "--port", str(port)], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait(base + "/")
        for name, path in pages.items():
            shoot(chromium, base + path, out / name, "1400,1300" if name == "viewer-run.png" else "1400,1000")
    finally:
        _stop(server)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="the run's tracking.root_dir")
    parser.add_argument("run_id", nargs="?", help="the run (default: the newest under ROOT)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    parser.add_argument("--viewer-only", action="store_true", help="the viewer's pictures only, no MLflow or Prefect")
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("error: no chromium on PATH: sh infra/install-browser.sh", file=sys.stderr)
        return 2
    root = args.root.resolve()
    runs = list_runs(root)
    run_id = args.run_id or (runs[-1] if runs else None)
    if run_id is None or run_id not in runs:
        print(f"error: no run {run_id or ''} under {root}; its runs: {runs or 'none'}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    shoot_viewer(chromium, root, run_id, args.out)
    if args.viewer_only:
        return 0
    info = json.loads((root / run_id / "run.json").read_text())
    flow_run = info["prefect_flow_runs"][-1]
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
            _stop(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
