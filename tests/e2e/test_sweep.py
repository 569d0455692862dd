"""End to end: `python -m flows.sweep` with a tiny configuration as a user runs it: two
configurations (one generating half as much a step, so run for twice the steps), a
learning-rate stage and the report, read back from the real MLflow store; a sweep killed
part-way and continued with --continue."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from mlflow.tracking import MlflowClient

from replay_pipeline.buffer import RolloutStore
from replay_pipeline.reports import report
from tests.conftest import ROOT, TINY_OVERRIDES



def test_a_sweep_runs_its_configurations_then_the_learning_rate_stage_then_the_report(tmp_path):
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect")}
    cmd = [sys.executable, "-m", "flows.sweep", "--name", "tiny", "--seeds", "0",
           "--config", "no_buffer=experiment=no_buffer", "--config", "replay=experiment=replay,buffer.capacity=32,loop.prompts_per_step=2",
           "--lr-factors", "2", f"tracking.root_dir={tmp_path}", *TINY_OVERRIDES,
           "loop.steps=3", "loop.eval_every=1", "loop.passk_every=0", "loop.checkpoint_every=0",
           "tracking.experiment=tiny-sweep"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tiny-sweep")
    (parent,) = client.search_runs([exp.experiment_id], "tags.`replay_pipeline.sweep` = 'tiny'")
    record = json.loads(open(client.download_artifacts(parent.info.run_id, "sweep.json", str(tmp_path))).read())
    best = record["best_stage1"]
    expected = {"no_buffer", "replay", "no_buffer-lrx2"} | ({f"{best}-lrx2"} if best else set())
    assert {c["config"] for c in record["children"]} == expected
    assert all(c["status"] == "FINISHED" for c in record["children"])
    assert record["families"]["no_buffer-lrx2"] == "no_buffer" and record["baseline"] == "no_buffer"
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(children) == len(expected)
    lrs = {c.data.tags["mlflow.runName"].split("-s0-")[0]: float(c.data.params["algo.lr"]) for c in children}
    assert lrs["tiny-no_buffer-lrx2"] == pytest.approx(2 * lrs["tiny-no_buffer"])
    # equal budget: half the rollouts a step, so twice the steps, evaluated every other step
    params = {c.data.tags["mlflow.runName"].split("-s0-")[0]: c.data.params for c in children}
    assert (params["tiny-replay"]["loop.steps"], params["tiny-replay"]["loop.eval_every"]) == ("6", "2")
    assert (params["tiny-no_buffer"]["loop.steps"], params["tiny-no_buffer"]["loop.eval_every"]) == ("3", "1")
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert {"report/report.md", "report/report.json", "report/accuracy_vs_tokens.png"} <= artifacts, artifacts
    report = json.loads(open(client.download_artifacts(parent.info.run_id, "report/report.json", str(tmp_path))).read())
    assert set(report["configs"]) == expected
    assert "report:" in proc.stdout and parent.info.status == "FINISHED"


def test_a_sweep_without_its_baseline_runs_and_says_why_it_makes_no_report(tmp_path):
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect")}
    cmd = [sys.executable, "-m", "flows.sweep", "--name", "alone", "--seeds", "0", "--lr-factors", "",
           "--config", "replay=experiment=replay,buffer.capacity=32", f"tracking.root_dir={tmp_path}", *TINY_OVERRIDES,
           "loop.steps=2", "loop.eval_every=1", "loop.passk_every=0", "loop.checkpoint_every=0"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no report: no configuration is named 'no_buffer', the baseline every ratio is taken against" in proc.stderr
    assert "--baseline NAME" in proc.stderr


def test_a_sweep_killed_part_way_continues_where_each_child_was(tmp_path):
    """A sweep killed (SIGKILL: a session's end, a power cut) after its first child finished and
    while its second had a checkpoint continues with `--continue SWEEP_ID`: the finished child
    is kept as it was (not trained again), the stopped one resumes from its checkpoint with no
    rollout lost or repeated, and the report is made; other settings for the same id are refused."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect")}
    cmd = [sys.executable, "-m", "flows.sweep", "--name", "cut", "--seeds", "0", "--lr-factors", "",
           "--config", "no_buffer=experiment=no_buffer", "--config", "replay=experiment=replay,buffer.capacity=32",
           f"tracking.root_dir={tmp_path}", *TINY_OVERRIDES, "loop.steps=8", "loop.eval_every=2",
           "loop.passk_every=0", "loop.checkpoint_every=2", "tracking.experiment=cut-sweep"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its process group: the sweep and the Prefect server it started
    seen = []
    while not (seen and seen[-1].startswith("sweep cut-")):  # after Prefect's own lines
        seen.append(proc.stdout.readline())
        assert seen[-1] or proc.poll() is None, "".join(seen)
    sweep_id = seen[-1].split("--continue ")[-1].strip()
    assert sweep_id, seen[-1]
    threading.Thread(target=lambda: seen.extend(proc.stdout), daemon=True).start()  # a full pipe would block it
    second = tmp_path / f"cut-replay-s0-{sweep_id}" / "checkpoints"
    deadline = time.monotonic() + 600
    while not (second.is_dir() and any(p.name.startswith("step-") for p in second.iterdir())):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(seen)
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # a power cut: the sweep and everything it started, nothing left over
    proc.wait(timeout=30)

    first_id = f"cut-no_buffer-s0-{sweep_id}"
    first_info = json.loads((tmp_path / first_id / "run.json").read_text())
    assert first_info["status"] == "FINISHED"
    # what it finished is reported on before it is continued: an interim report
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (cut,) = client.search_runs([client.get_experiment_by_name("cut-sweep").experiment_id],
                                "tags.`replay_pipeline.sweep` = 'cut'")
    interim = report.build_report(client.tracking_uri, cut.info.run_id, out=tmp_path / "interim")
    assert interim.summary["sweep"]["pending"] == [f"cut-replay-s0-{sweep_id}"]
    lines = interim.path.read_text().splitlines()
    assert lines[4].startswith("**Interim report**: 1 child run(s) of the sweep have not ended yet "
                               f"(cut-replay-s0-{sweep_id}); this report reads the 1 that have"), lines[:6]
    assert f"--continue {sweep_id})" in lines[4]
    refused = subprocess.run([*cmd[:6], "1", *cmd[7:], "--continue", sweep_id], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "ran other settings (sweep.seeds differ)" in refused.stderr, refused.stderr

    again = subprocess.run([*cmd, "--continue", sweep_id], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert json.loads((tmp_path / first_id / "run.json").read_text())["last_started_at"] == first_info["last_started_at"]
    for config, per_step in (("no_buffer", 16), ("replay", 16)):
        store = RolloutStore.open(tmp_path / "lancedb", f"cut-{config}-s0-{sweep_id}")
        seqs = store.window(10_000, columns=["seq", "step"])
        assert seqs.num_rows == 8 * per_step and len(set(seqs.column("seq").to_pylist())) == 8 * per_step
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("cut-sweep")
    (parent,) = client.search_runs([exp.experiment_id], "tags.`replay_pipeline.sweep` = 'cut'")
    record = json.loads(open(client.download_artifacts(parent.info.run_id, "sweep.json", str(tmp_path))).read())
    assert [(c["config"], c["status"], c.get("continued")) for c in record["children"]] == [
        ("no_buffer", "FINISHED", "already finished"), ("replay", "FINISHED", "resumed")]
    assert record["pending"] == []
    assert parent.info.status == "FINISHED" and "report:" in again.stdout
