"""Generators on a Dask cluster (`loop=async loop.engine=dask`), end to end on real clusters on
loopback: a LocalCluster the flow starts and closes itself, and an existing scheduler with a
worker (`dask scheduler` + `dask worker` processes this module starts and stops by pid). The
rollout table, the usage records, the workers' stats (which prove where the generators ran)
and Prefect's task runs are read back; then the liveness rules: a generator whose learner
stopped beating ends by itself, a generator killed mid-run fails the flow with its error, and
an unreachable scheduler fails the command before any work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from replay_pipeline.run.files import AsyncDir, Heartbeat
from replay_pipeline.run.workers import generator_worker
from replay_pipeline.buffer import RolloutStore
from tests import engine_runs
from tests.conftest import ROOT
from tests.engine_runs import (assert_no_leftovers, check_tables, finish, free_port, prefect_states, read_stats,
                               stop_session, wait_for)

distributed = pytest.importorskip("distributed", reason="loop.engine=dask needs pip install 'dask[distributed]'")

STEPS = 3


# ------------------------------------------------------------------ helpers
@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """One run root (and Prefect home) for the module: the warm start is cached once."""
    return tmp_path_factory.mktemp("dask-runs")


def command(root: Path, run_id: str, steps: int, *extra: str) -> list[str]:
    return engine_runs.command(root, run_id, steps, "dask", *extra)


def start(root: Path, run_id: str, steps: int, *extra: str) -> subprocess.Popen:
    return engine_runs.start(root, run_id, steps, "dask", *extra)


# ------------------------------------------------------------------ an existing cluster
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """`dask scheduler` and one `dask worker` (one thread, with a nanny) on loopback, each in
    its own session and stopped by its id at the end. The scheduler fails a task whose worker
    died at once (allowed-failures 0) instead of retrying it elsewhere."""
    home = tmp_path_factory.mktemp("dask-cluster")
    sched_file = home / "scheduler.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "0"}
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                               "--port", "0", "--no-dashboard", "--scheduler-file", str(sched_file)],
                              cwd=home, env=env, stdout=subprocess.DEVNULL, stderr=open(home / "scheduler.log", "w"),
                              start_new_session=True)]
    try:
        wait_for(lambda: sched_file.exists() and json.loads(sched_file.read_text() or "{}").get("address"),
                 60, "the Dask scheduler")
        address = json.loads(sched_file.read_text())["address"]
        procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address,
                                       "--nthreads", "1", "--nworkers", "1", "--no-dashboard", "--memory-limit", "0",
                                       "--local-directory", str(home / "worker")],
                                      cwd=home, env=env, stdout=subprocess.DEVNULL,
                                      stderr=open(home / "worker.log", "w"), start_new_session=True))
        with distributed.Client(address, timeout=30) as client:
            client.wait_for_workers(1, timeout=60)
            yield address, client, home
    finally:
        for proc in reversed(procs):  # worker (with its nanny's child), then the scheduler
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=20)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                stop_session(proc.pid)
                proc.wait(timeout=10)
        for proc in procs:
            assert_no_leftovers(proc.pid, grace=10)


def worker_processes(client) -> dict[str, int]:
    """{worker address: pid of the Dask worker process} of the existing cluster."""
    client.wait_for_workers(1, timeout=60)
    return client.run(os.getpid)


# ------------------------------------------------------------------ tests
def test_two_generators_on_a_local_cluster_the_flow_starts_and_closes(root):
    proc = start(root, "dask-local", STEPS, "loop.workers=2")
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "Dask LocalCluster at tcp://127.0.0.1:" in out and "Run dask-local finished: 3 steps" in out
    check_tables(root, "dask-local", STEPS, workers=2)
    stats = [read_stats(root, "dask-local", w) for w in (0, 1)]
    for s in stats:  # each generator ran as a task in a Dask worker process, not in the flow
        assert s["engine"] == "dask" and s["dask_worker"].startswith("tcp://127.0.0.1:"), s
        assert s["pid"] != proc.pid and s["batches"] >= 1 and s["stop_reason"] == "stop flag"
    assert stats[0]["pid"] != stats[1]["pid"] and stats[0]["dask_worker"] != stats[1]["dask_worker"]
    tasks, flow_state, _ = prefect_states(root, "dask-local")
    assert tasks == {"generator-0": "COMPLETED", "generator-1": "COMPLETED"} and flow_state == "COMPLETED"
    assert_no_leftovers(proc.pid)  # the cluster's scheduler and worker processes (in its session) are gone


def test_an_existing_scheduler_and_a_generator_whose_learner_stopped_beating(root, cluster):
    address, client, _ = cluster
    workers = worker_processes(client)
    proc = start(root, "dask-ext", STEPS, f"loop.dask_address={address}")
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert f"Dask scheduler at {address}: 1 worker(s), 1 thread(s)" in out
    check_tables(root, "dask-ext", STEPS, workers=1)
    stats = read_stats(root, "dask-ext", 0)
    assert stats["engine"] == "dask" and stats["stop_reason"] == "stop flag"
    assert workers[stats["dask_worker"]] == stats["pid"]  # that worker process of that cluster ran it
    tasks, flow_state, _ = prefect_states(root, "dask-ext")
    assert tasks == {"generator-0": "COMPLETED"} and flow_state == "COMPLETED"
    assert_no_leftovers(proc.pid)
    assert client.run(os.getpid) == workers  # the flow left a cluster it did not start running
    wait_for(lambda: not any(client.processing().values()), 10, "the cluster to be idle")

    # The learner of a run is gone without writing STOP (as after a SIGKILL): the test plays
    # the learner with the real heartbeat, then stops beating; the generator on the cluster
    # must end by itself within loop.heartbeat_timeout. Then a generator gives way to a newer
    # copy of itself, and to a newer learner session.
    run_dir = root / "dask-ext"
    control = AsyncDir.of(run_dir)
    control.reset()
    cfg = _saved_config(run_dir)
    cfg["loop"]["heartbeat_timeout"] = 2.0
    with Heartbeat(control, 2.0) as heartbeat:
        future = client.submit(generator_worker, cfg, "dask-ext", 0, None, heartbeat.session, pure=False)
        wait_for(lambda: control.ready() == 1, 60, "the generator to be ready")
        time.sleep(3.0)
        assert not future.done()  # alive past the timeout while the learner beats
        stopped_beating = time.monotonic()
    final = future.result(timeout=30)
    assert final["stop_reason"].startswith("no learner heartbeat"), final
    assert 1.0 <= time.monotonic() - stopped_beating < 20
    assert not control.stopped()  # it was the heartbeat, not the STOP flag

    control.reset()
    with Heartbeat(control, 60.0) as heartbeat:
        future = client.submit(generator_worker, cfg, "dask-ext", 0, None, heartbeat.session, pure=False)
        wait_for(lambda: control.ready() == 1, 60, "the generator to be ready")
        control.claim(0)  # as a copy of generator 0 that Dask restarted elsewhere does
        final = future.result(timeout=60)
    assert final["stop_reason"].startswith("another copy of generator 0 took over"), final

    control.reset()
    with Heartbeat(control, 60.0):  # a learner whose session is not the generator's
        future = client.submit(generator_worker, cfg, "dask-ext", 0, None, "an-older-learner", pure=False)
        final = future.result(timeout=60)
    assert final["stop_reason"].startswith("another learner took over"), final


def _saved_config(run_dir: Path) -> dict:
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True)
    cfg["run_id"] = run_dir.name
    return cfg


def test_a_generator_killed_mid_run_fails_the_flow_with_its_error(root, cluster):
    address, client, _ = cluster
    worker_processes(client)
    proc = start(root, "dask-crash", 500, f"loop.dask_address={address}")
    try:
        stats = wait_for(lambda: (s := read_stats(root, "dask-crash", 0)).get("batches", 0) >= 2 and s, 180,
                         "the generator's first batches", proc)
        os.kill(stats["pid"], signal.SIGKILL)  # the Dask worker process running the generator dies
        out = finish(proc, timeout=120)
    finally:
        if proc.poll() is None:
            stop_session(proc.pid)
    assert proc.returncode == 1, out[-4000:]
    assert "generator worker 0 of dask-crash failed on " + stats["dask_worker"] in out
    assert "KilledWorker" in out  # the generator's own error, not only "no generator alive"
    tasks, flow_state, message = prefect_states(root, "dask-crash")
    assert tasks == {"generator-0": "FAILED"} and flow_state == "FAILED"
    assert "generator worker 0 of dask-crash failed" in message and "KilledWorker" in message, message
    assert_no_leftovers(proc.pid)


def test_an_unreachable_scheduler_fails_the_command_before_any_work(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect")}
    proc = subprocess.run(command(tmp_path, "dask-none", 3, f"loop.dask_address={address}"), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"loop.dask_address={address}: cannot connect" in proc.stderr
    assert "dask scheduler" in proc.stderr and "dask worker" in proc.stderr  # says how to fix it
    assert not (tmp_path / "dask-none").exists() and not (tmp_path / "mlflow.db").exists()


def test_a_custom_task_and_a_reward_term_by_file_path_run_in_dask_workers(root, tmp_path):
    """Issue 23: the task file and the reward term's file are imported again in the Dask
    worker's process from the run's config (recorded absolute), so a user's task works there."""
    task_file = tmp_path / "digits.py"
    task_file.write_text((ROOT / "replay_pipeline" / "tasks" / "template.py").read_text())
    bonus = tmp_path / "bonus.py"
    bonus.write_text("def half(prompt, completion, finish_reason):\n    return 0.5\n")
    proc = start(root, "dask-custom", 2, "loop.workers=1", "task=custom", f"task.target={task_file}:make_task",
                 "task.digits=3", "task.heldout_size=20", "task.validation_size=20", "model.warmstart.target_accuracy=0.0",
                 f"+reward.terms.half.target={bonus}:half")
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert read_stats(root, "dask-custom", 0)["engine"] == "dask"
    rows = RolloutStore.open(root / "lancedb", "dask-custom").window(1000, columns=["prompt", "reward", "correct"])
    assert all(p.count("+") == 2 for p in rows.column("prompt").to_pylist())  # the template's prompts
    assert [r - 0.5 for r in rows.column("reward").to_pylist()] == [float(c) for c in rows.column("correct").to_pylist()]
