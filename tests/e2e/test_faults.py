"""Crashes, as a user meets them: `python -m flows.train` killed with SIGKILL at the points
that matter (replay_pipeline/system/faults.py), resumed with `resume=<run_id>` each time, must end
with exactly the rollouts, usage records, losses and weights of a run that was never
stopped; SIGTERM must leave MLflow and Prefect with a terminal state."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from replay_pipeline.buffer import RolloutStore
from replay_pipeline.buffer.usage import UsageStore
from replay_pipeline.training.checkpoints import checkpoint_step
from replay_pipeline.system.faults import ENV, SIGNAL_ENV
from tests.conftest import ROOT, TINY_OVERRIDES
from tests.servers import prefect_env


STEPS = 7
PER_STEP = 16


def command(root: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "flows.train", f"tracking.root_dir={root}", *extra]


def env_for(root: Path, crash: str | None = None, signal_at: str | None = None) -> dict[str, str]:
    env = {**os.environ, "PREFECT_HOME": str(root / ".prefect")}
    env.pop(ENV, None)
    env.pop(SIGNAL_ENV, None)
    if crash:
        env[ENV] = crash
    if signal_at:
        env[SIGNAL_ENV] = signal_at
    return env


def train(root: Path, *extra: str, crash: str | None = None, own_server: bool = False,
          signal_at: str | None = None) -> subprocess.CompletedProcess:
    """Run the CLI in its own process group, on the root's shared Prefect server
    (tests/servers.py) unless `own_server`. Whatever the killed trainer started is killed with
    its group, and output goes to files so no orphan holds a pipe open."""
    out, err = root / "stdout.txt", root / "stderr.txt"
    env = env_for(root, crash, signal_at) | ({} if own_server else prefect_env(root / ".prefect"))
    with out.open("w") as fo, err.open("w") as fe:
        proc = subprocess.Popen(command(root, *extra), cwd=ROOT, env=env, stdout=fo,
                                stderr=fe, text=True, start_new_session=True)
        try:
            code = proc.wait(timeout=600)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return subprocess.CompletedProcess(proc.args, code, out.read_text(), err.read_text())


def first_run_args(run_id: str) -> list[str]:
    return [*TINY_OVERRIDES, f"run_id={run_id}", f"loop.steps={STEPS}", "loop.checkpoint_every=2",
            "loop.keep_checkpoints=5", "loop.eval_every=0", "loop.passk_every=0", "loop.eval_samples=2",
            "buffer.strategy=prioritized", "buffer.reuse_cap=3"]


def rows(root: Path, run_id: str) -> dict[str, list]:
    store = RolloutStore.open(root / "lancedb", run_id)
    return store.window(10_000, columns=["seq", "step", "policy_version", "reward", "completion_ids",
                                         "behaviour_logprobs", "advantage", "rollout_id"]).to_pydict()


def usage(root: Path, run_id: str) -> dict[str, list]:
    return UsageStore.open(root / "lancedb", run_id).rows(
        columns=["learner_step", "position", "rollout_seq", "rollout_id", "staleness"]).to_pydict()


def mlflow_run(root: Path, run_id: str):
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string=f"tags.`replay_pipeline.run_id` = '{run_id}'")
    return client, runs


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def reference(root):
    proc = train(root, *first_run_args("ref"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return rows(root, "ref"), usage(root, "ref")


def test_kill_9_at_every_point_then_resume_loses_and_duplicates_nothing(root, reference):
    ref_rows, ref_usage = reference
    ckpts = root / "chain" / "checkpoints"
    # 1. during generation of step 1 (no checkpoint yet; step 0's rollouts stored)
    proc = train(root, *first_run_args("chain"), crash="generate:1")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert sorted(set(rows(root, "chain")["step"])) == [0]
    # 2. after step 3's append, before its learning and the checkpoint of 4
    proc = train(root, "resume=chain", crash="after_append:3")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert sorted(set(rows(root, "chain")["step"])) == [0, 1, 2, 3]
    assert [p.name for p in ckpts.glob("step-*")] == ["step-000002"]
    # 3. while the checkpoint of 4 is written (every file there, not yet renamed)
    proc = train(root, "resume=chain", crash="checkpoint_write:4")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert [p.name for p in ckpts.glob("step-*")] == ["step-000002"]
    assert [p.name.rsplit("-", 1)[0] for p in ckpts.glob(".tmp-*")] == [".tmp-step-000004"]
    # 4. after the checkpoint of 6 is in place, before MLflow is told
    proc = train(root, "resume=chain", crash="after_checkpoint:6")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert "removed .tmp-step-000004" in proc.stdout
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000002", "step-000004", "step-000006"]
    client, runs = mlflow_run(root, "chain")
    assert runs[0].data.tags["checkpoint.latest_step"] == "4"  # 6 never reached MLflow
    # 5. to the end
    proc = train(root, "resume=chain")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Run chain finished" in proc.stdout

    got = rows(root, "chain")
    assert len(got["rollout_id"]) == len(set(got["rollout_id"])) == STEPS * PER_STEP  # none lost, none twice
    for key in ("seq", "step", "policy_version", "reward", "completion_ids", "behaviour_logprobs", "advantage"):
        assert got[key] == ref_rows[key], key
    u = usage(root, "chain")
    assert len(u["learner_step"]) == len(ref_usage["learner_step"]) == STEPS * 2 * 16
    assert len(set(zip(u["learner_step"], u["position"]))) == len(u["learner_step"])
    for key in ("learner_step", "position", "rollout_seq", "staleness"):
        assert u[key] == ref_usage[key], key
    assert set(u["rollout_id"]) <= set(got["rollout_id"])  # every use names a stored rollout

    client, runs = mlflow_run(root, "chain")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # one MLflow run across 5 processes
    assert runs[0].data.tags["replay_pipeline.resumes"] == "4"
    _, ref_runs = mlflow_run(root, "ref")
    for metric in ("learn/loss", "score/reward_mean", "buffer/reuse_mean"):
        mine = {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, metric)}
        theirs = {m.step: m.value for m in client.get_metric_history(ref_runs[0].info.run_id, metric)}
        assert mine == theirs, metric  # replayed steps log the same values again
    final = load_file(next((ckpts / f"step-{STEPS:06d}" / "model").glob("*.safetensors")))
    ref_final = load_file(next((root / "ref" / "checkpoints" / f"step-{STEPS:06d}" / "model").glob("*.safetensors")))
    assert final.keys() == ref_final.keys()
    assert all(torch.equal(final[k], ref_final[k]) for k in final)


def test_sigterm_marks_mlflow_killed_and_prefect_crashed(tmp_path):
    root = tmp_path  # its own Prefect database: the killed runs above stay RUNNING in theirs
    # Far more steps than it can take before the signal: a short run can finish first.
    args = [*first_run_args("term"), "loop.steps=100000", "loop.checkpoint_every=1"]
    log = root / "term-stderr.txt"
    proc = subprocess.Popen(command(root, *args), cwd=ROOT, env=env_for(root), stdout=subprocess.DEVNULL,
                            stderr=log.open("w"), text=True, start_new_session=True)
    ckpts = root / "term" / "checkpoints"
    deadline = time.time() + 400
    # Any checkpoint at step 2 or later: with one every step and five kept, step-000002
    # itself is gone again a few steps later, and a poll every 0.5 s can miss it.
    while not any(checkpoint_step(p) >= 2 for p in ckpts.glob("step-*")):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, "no checkpoint within 400 s"
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)  # to the trainer only, as `kill <pid>` does
    assert proc.wait(timeout=120) != 0
    err = log.read_text()
    _, runs = mlflow_run(root, "term")
    assert len(runs) == 1 and runs[0].info.status == "KILLED", err[-2000:]
    with sqlite3.connect(root / ".prefect" / "prefect.db") as db:
        states = db.execute("SELECT state_type FROM flow_run").fetchall()
    term_states = {s for (s,) in states}
    assert "RUNNING" not in term_states and term_states & {"CRASHED", "CANCELLED"}, term_states
    # The stopped run kept whole steps only (each step's rows are one commit; a write in
    # flight when SIGTERM came is finished, not torn). How many steps it got through after
    # checkpoint 2 depends on when the signal landed.
    stored = RolloutStore.open(root / "lancedb", "term").count()
    assert stored % PER_STEP == 0 and stored >= 2 * PER_STEP, stored
    # And the run resumes from where it was stopped: steps 0-3, plus any later step the
    # stopped run had already stored (kept as buffer data, never duplicated).
    done = train(root, "resume=term", "loop.steps=4", own_server=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = RolloutStore.open(root / "lancedb", "term")
    assert table.count() == max(stored, 4 * PER_STEP)
    steps = table.window(100_000, columns=["step", "rollout_id"]).to_pydict()
    assert set(range(4)) <= set(steps["step"]) and len(set(steps["rollout_id"])) == len(steps["rollout_id"])
