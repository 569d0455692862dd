"""The flows against real servers on loopback: a `prefect server`, a process work pool with a
`prefect worker`, and an `mlflow server`; each started and stopped by this test, by process id.

The train and sweep flows are registered as deployments (python -m flows.deploy), launched
through the Prefect API with Hydra overrides as parameters, picked up by the worker, and must
log to the MLflow server: the run, its metrics and its artifacts (through the server's
artifact proxy); a deployed run also drives an existing Ray cluster as its driver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY_OVERRIDES
from tests.servers import LOOPBACK, free_port, log_tail, start_process, stop_process, wait_for_http

POOL = "rp-test-pool"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    base = tmp_path_factory.mktemp("servers")
    prefect_port, mlflow_port = free_port(), free_port()
    api = f"http://{LOOPBACK}:{prefect_port}/api"
    env = {
        "PREFECT_HOME": str(base / "prefect-home"), "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{base / 'prefect.db'}",
        "PREFECT_SERVER_LOGGING_LEVEL": "WARNING", "PREFECT_LOGGING_LEVEL": "WARNING",
    }
    procs = []
    try:
        prefect = start_process([sys.executable, "-m", "prefect", "server", "start", "--host", LOOPBACK,
                                 "--port", str(prefect_port)], base / "prefect-server.log", env=env)
        procs.append(prefect)
        mlflow = start_process([sys.executable, "-m", "mlflow", "server", "--host", LOOPBACK,
                                "--port", str(mlflow_port), "--workers", "1",
                                "--backend-store-uri", f"sqlite:///{base / 'mlflow.db'}",
                                "--artifacts-destination", str(base / "mlflow-artifacts")],
                               base / "mlflow-server.log")
        procs.append(mlflow)
        wait_for_http(f"{api}/health", timeout=180, proc=prefect)
        wait_for_http(f"http://{LOOPBACK}:{mlflow_port}/health", timeout=180, proc=mlflow)
        deployed = subprocess.run([sys.executable, "-m", "flows.deploy", "--pool", POOL, "--flows", "train", "sweep"],
                                  cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        assert "deployment train/train" in deployed.stdout and "deployment sweep/sweep" in deployed.stdout
        worker = start_process([sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL,
                                "--type", "process", "--limit", "1"], base / "worker.log", env=env, cwd=base)
        procs.append(worker)
        yield {"base": base, "env": env, "api": api, "mlflow": f"http://{LOOPBACK}:{mlflow_port}", "procs": procs}
    finally:
        for proc in reversed(procs):
            stop_process(proc)


def run_deployment(servers, name: str, parameters: dict, timeout: int = 900) -> dict:
    """Launch a deployment through the Prefect API (from a separate process that talks to the
    server, as the UI would) and wait for its final state."""
    code = textwrap.dedent(f"""
        import json, sys
        from prefect.deployments import run_deployment
        run = run_deployment({name!r}, parameters=json.loads(sys.argv[1]), timeout={timeout})
        print(json.dumps({{"id": str(run.id), "state": run.state.type.value, "message": run.state.message}}))
    """)
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(parameters)], cwd=servers["base"],
                          env={**os.environ, **servers["env"]}, capture_output=True, text=True, timeout=timeout + 60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    worker = servers["procs"][-1]
    assert out["state"] == "COMPLETED", f"{out}\nworker log:\n{log_tail(worker.log_path, 6000)}"
    return out


def prefect_api(servers, path: str, body: dict | None = None) -> dict | list:
    import urllib.request

    req = urllib.request.Request(f"{servers['api']}{path}", method="POST" if body is not None else "GET",
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def test_a_deployed_train_run_with_overrides_logs_to_the_mlflow_server(servers):
    from mlflow.tracking import MlflowClient

    root = servers["base"] / "runs"
    overrides = [f"tracking.root_dir={root}", *TINY_OVERRIDES, "run_id=deployed-train", "loop.steps=2",
                 "loop.eval_every=0", "loop.passk_every=0", "loop.eval_samples=2", "algo.lr=3e-4",
                 f"tracking.mlflow_uri={servers['mlflow']}", "tracking.experiment=deployed"]
    flow_run = run_deployment(servers, "train/train", {"overrides": overrides})

    # Prefect: the flow run ran on the worker, with its rounds as task runs.
    tasks = prefect_api(servers, "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run["id"]]}}})
    names = {t["name"] for t in tasks}
    # the run's last round is always evaluated: the rounds task ends with it
    assert {"rounds-0-1+evaluate-v2", "checkpoint-2"} <= names and any(n.startswith("setup") for n in names), names
    assert all(t["state_type"] == "COMPLETED" for t in tasks)

    # MLflow: the run lives on the server, with the overridden config, metrics and artifacts.
    client = MlflowClient(tracking_uri=servers["mlflow"])
    exp = client.get_experiment_by_name("deployed")
    assert exp is not None and exp.artifact_location.startswith("mlflow-artifacts:")
    runs = client.search_runs([exp.experiment_id], "tags.`replay_pipeline.run_id` = 'deployed-train'")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["algo.lr"] == "0.0003" and run.data.params["loop.steps"] == "2"
    history = client.get_metric_history(run.info.run_id, "learn/policy_version")
    assert [m.value for m in history] == [1.0, 2.0]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "summary.json"} <= artifacts
    stored = list((servers["base"] / "mlflow-artifacts").rglob("summary.json"))
    assert stored, "artifacts went through the server's proxy into its --artifacts-destination"
    # The run's own files (checkpoints, rollouts) are where the overrides put them.
    assert (root / "deployed-train" / "checkpoints").is_dir()
    assert any((root / "lancedb").glob("rollouts_deployed-train*"))


def test_a_deployed_sweep_nests_its_children_under_one_mlflow_parent(servers):
    from mlflow.tracking import MlflowClient

    root = servers["base"] / "runs"
    common = [f"tracking.root_dir={root}", *TINY_OVERRIDES, "loop.steps=1", "loop.eval_every=0",
              "loop.passk_every=0", "loop.eval_samples=2", f"tracking.mlflow_uri={servers['mlflow']}",
              "tracking.experiment=deployed-sweep"]
    run_deployment(servers, "sweep/sweep", {"configs": {"small": ["buffer.capacity=16"], "large": ["buffer.capacity=64"]},
                                            "seeds": [0], "overrides": common, "name": "dsweep"})
    client = MlflowClient(tracking_uri=servers["mlflow"])
    exp = client.get_experiment_by_name("deployed-sweep")
    parents = client.search_runs([exp.experiment_id], "tags.`replay_pipeline.sweep` = 'dsweep'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent_id = parents[0].info.run_id
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_id}'")
    assert sorted(c.data.params["buffer.capacity"] for c in children) == ["16", "64"]
    assert all(c.info.status == "FINISHED" for c in children)
    summary = client.download_artifacts(parent_id, "sweep.json", str(servers["base"]))
    data = json.loads(Path(summary).read_text())
    assert [c["status"] for c in data["children"]] == ["FINISHED", "FINISHED"]


def test_a_deployed_run_drives_a_ray_cluster(servers):
    """A run launched through a Prefect deployment is the driver of an existing Ray cluster
    (issue 47): the worker's flow process joins it, places a generator actor and a learner
    rank there, and reports to Prefect and the MLflow server as any deployed run does."""
    pytest.importorskip("ray", reason="loop.engine=ray needs pip install 'ray==2.60.*'")
    from mlflow.tracking import MlflowClient
    from ray.cluster_utils import Cluster

    from tests.engine_runs import read_stats

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        root = servers["base"] / "runs"
        overrides = [f"tracking.root_dir={root}", *TINY_OVERRIDES, "run_id=deployed-ray", "loop=async",
                     "loop.engine=ray", f"ray.address={cluster.address}", "learner.world_size=2",
                     "loop.worker_threads=1", "loop.steps=2", "loop.eval_every=0", "loop.passk_every=0",
                     f"tracking.mlflow_uri={servers['mlflow']}", "tracking.experiment=deployed-ray"]
        flow_run = run_deployment(servers, "train/train", {"overrides": overrides})
        tasks = prefect_api(servers, "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run["id"]]}}})
        assert {t["name"]: t["state_type"] for t in tasks}["generator-0"] == "COMPLETED"
        stats = read_stats(root, "deployed-ray", 0)
        assert stats["engine"] == "ray" and stats["ray_node"] in {n.node_id for n in cluster.list_all_nodes()}
        client = MlflowClient(tracking_uri=servers["mlflow"])
        (run,) = client.search_runs([client.get_experiment_by_name("deployed-ray").experiment_id])
        assert run.info.status == "FINISHED" and run.data.params["learner.world_size"] == "2"
    finally:
        cluster.shutdown()
