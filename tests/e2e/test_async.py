"""The asynchronous loop end to end: `python -m flows.train loop=async` with generator
processes and the learner running at once, meeting only at the rollout table and the
published weights; then the table, the usage records, MLflow's compute ledger and Prefect's
task runs are read back."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from replay_pipeline.buffer import RolloutStore
from replay_pipeline.buffer.usage import UsageStore
from tests.conftest import ROOT, TINY_OVERRIDES


B, K, R = 16, 2, 16  # minibatch, updates per round, rollouts per generator batch (TINY_OVERRIDES)


def run_async(root: Path, run_id: str, steps: int, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_HOME": str(root / ".prefect")}
    cmd = [sys.executable, "-m", "flows.train", f"tracking.root_dir={root}", *TINY_OVERRIDES, f"run_id={run_id}",
           "loop=async", "model.torch_threads=1", f"loop.steps={steps}", "loop.eval_every=0",
           "loop.passk_every=0", "loop.eval_samples=2", "loop.checkpoint_every=0", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def check_tables(root: Path, run_id: str, steps: int, workers: int) -> tuple[dict, dict]:
    store = RolloutStore.open(root / "lancedb", run_id)
    rows = store.window(100_000, columns=["rollout_id", "worker", "step", "policy_version", "seq"]).to_pydict()
    assert len(rows["rollout_id"]) == len(set(rows["rollout_id"])) >= B
    assert set(rows["worker"]) == set(range(workers))
    for w in range(workers):  # each worker's batches are complete and numbered 0, 1, 2, ...
        steps_of_w = [s for s, ww in zip(rows["step"], rows["worker"]) if ww == w]
        assert sorted(set(steps_of_w)) == list(range(max(steps_of_w) + 1))
        assert len(steps_of_w) == R * (max(steps_of_w) + 1)
    assert set(rows["policy_version"]) <= set(range(steps + 1))  # only published versions
    usage = UsageStore.open(root / "lancedb", run_id).rows().to_pydict()
    assert len(usage["usage_id"]) == steps * K * B
    assert sorted(set(usage["learner_step"])) == list(range(steps * K))
    assert all(s >= 0 for s in usage["staleness"])
    assert set(usage["rollout_id"]) <= set(rows["rollout_id"])
    return rows, usage


def mlflow_metrics(root: Path, run_id: str) -> dict[str, float]:
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    run = client.search_runs([e.experiment_id for e in client.search_experiments()],
                             filter_string=f"tags.`replay_pipeline.run_id` = '{run_id}'")[0]
    assert run.info.status == "FINISHED"
    return run.data.metrics


def test_one_generator_and_the_learner_with_a_replay_cap(tmp_path):
    steps, cap = 6, 1.0
    proc = run_async(tmp_path, "async-1", steps, f"loop.replay_cap={cap}")
    assert "Run async-1 finished: 6 steps" in proc.stdout
    rows, usage = check_tables(tmp_path, "async-1", steps, workers=1)
    assert len(usage["usage_id"]) / len(rows["rollout_id"]) <= cap + 1e-9  # the learner waited for data
    m = mlflow_metrics(tmp_path, "async-1")
    assert m["compute/gen_rollouts"] >= len(usage["usage_id"]) / cap - 1e-9
    assert m["compute/gen_tokens"] > 0 and m["compute/gen_seconds"] > 0 and m["compute/train_seconds"] > 0
    for key in ("compute/mu", "compute/gamma", "compute/gen_train_ratio", "compute/gen_flops",
                "compute/train_flops", "learn/wait_seconds", "learn/staleness_mean", "buffer/replay_ratio"):
        assert key in m, key
    assert m["learn/policy_version"] == steps
    with sqlite3.connect(tmp_path / ".prefect" / "prefect.db") as db:
        tasks = dict(db.execute("SELECT name, state_type FROM task_run WHERE name LIKE 'generator-%'").fetchall())
        flows = db.execute("SELECT state_type FROM flow_run").fetchall()
    assert tasks == {"generator-0": "COMPLETED"}  # the generator is its own task run in the UI
    assert flows == [("COMPLETED",)]
    assert (tmp_path / "async-1" / "async" / "STOP").exists()


def test_two_generators_with_a_replay_floor(tmp_path):
    steps, floor = 4, 1.0
    run_async(tmp_path, "async-2", steps, "loop.workers=2", f"loop.replay_floor={floor}")
    rows, usage = check_tables(tmp_path, "async-2", steps, workers=2)
    # Generators wait while uses / rows < floor once a minibatch is stored: at most one batch
    # per worker can be in flight beyond that point.
    assert len(rows["rollout_id"]) <= max(len(usage["usage_id"]) / floor, B) + 2 * 2 * R


def test_an_async_run_resumes_and_extends(tmp_path):
    run_async(tmp_path, "async-r", 3)
    rows_before = RolloutStore.open(tmp_path / "lancedb", "async-r").count()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect")}
    proc = subprocess.run([sys.executable, "-m", "flows.train", f"tracking.root_dir={tmp_path}", "resume=async-r",
                           "loop.steps=5"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resume async-r at step 3" in proc.stdout
    # It says what it keeps (issue 22), not "0 steps ... reused" while keeping them all.
    assert f"{rows_before:,} stored rollouts kept as buffer data" in proc.stdout
    rows, usage = check_tables(tmp_path, "async-r", 5, workers=1)  # usage: exactly 5 rounds' worth
    assert len(rows["rollout_id"]) > rows_before  # the worker continued its own numbering
    m = mlflow_metrics(tmp_path, "async-r")
    assert m["learn/policy_version"] == 5
