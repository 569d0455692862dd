"""What the end-to-end tests of the async loop's engines share (tests/e2e/test_ray.py,
test_ray_learner.py, test_async.py): the tiny async run as a process in its own session, the checks that
nothing it started is left behind, that its tables hold every batch whole and once, and the
states Prefect recorded."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from replay_pipeline.buffer import RolloutStore
from replay_pipeline.buffer.usage import UsageStore
from replay_pipeline.run.files import AsyncDir
from tests.conftest import ROOT, TINY_OVERRIDES
from tests.servers import prefect_env

B, K, R, G = 16, 2, 16, 4  # minibatch, updates per round, rollouts per generator batch, group size (TINY_OVERRIDES)


def command(root: Path, run_id: str, steps: int, engine: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "flows.train", f"tracking.root_dir={root}", *TINY_OVERRIDES, f"run_id={run_id}",
            "loop=async", f"loop.engine={engine}", "model.torch_threads=1", "loop.worker_threads=1",
            f"loop.steps={steps}", "loop.eval_every=0", "loop.passk_every=0", "loop.eval_samples=2",
            "loop.checkpoint_every=0", *extra]


def start(root: Path, run_id: str, steps: int, engine: str, *extra: str) -> subprocess.Popen:
    """The flow in its own session, so that everything it starts can be found (and, when a
    test kills the learner, stopped) by the session id. The module's runs share a Prefect
    server (tests/servers.py)."""
    env = {**os.environ, **prefect_env(root / ".prefect")}
    return subprocess.Popen(command(root, run_id, steps, engine, *extra), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the flow did not end within {timeout} s:\n{out[-3000:]}")
    return out


def session_processes(sid: int) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return found


def assert_no_leftovers(sid: int, grace: float = 15.0) -> None:
    deadline = time.monotonic() + grace
    while session_processes(sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [(p.pid, " ".join(p.cmdline())[:120]) for p in session_processes(sid)]
    assert not left, f"processes left behind by the flow: {left}"


def stop_session(sid: int) -> None:
    """SIGKILL the process group `sid` (a flow, or a cluster's process a test started)."""
    try:
        os.killpg(sid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@contextmanager
def stopped_at_the_end(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """The flow `proc` for the body of the `with`; SIGKILLed with its session if it still runs
    after it (a test that failed half-way)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            stop_session(proc.pid)


def check_rollouts(root: Path, run_id: str, workers: int) -> dict:
    """The rollout table of an async run, finished or stopped mid-way: no row stored twice,
    every prompt group whole, and each worker's batches numbered 0, 1, ... with none missing
    (each whole), under its own ids."""
    store = RolloutStore.open(root / "lancedb", run_id)
    rows = store.window(100_000, columns=["rollout_id", "worker", "step", "group_id"]).to_pydict()
    assert len(rows["rollout_id"]) == len(set(rows["rollout_id"])) >= B  # no row stored twice
    groups = Counter(zip(rows["step"], rows["worker"], rows["group_id"]))
    assert set(groups.values()) == {G}, groups  # every prompt group whole
    assert set(rows["worker"]) == set(range(workers))  # every generator stored rows, with its id
    for w in range(workers):
        steps_of_w = [s for s, ww in zip(rows["step"], rows["worker"]) if ww == w]
        assert sorted(set(steps_of_w)) == list(range(max(steps_of_w) + 1))
        assert len(steps_of_w) == R * (max(steps_of_w) + 1)
        assert all(rid.startswith(f"{run_id}/w{w:02d}/") for rid, ww in zip(rows["rollout_id"], rows["worker"])
                   if ww == w)
    return rows


def check_tables(root: Path, run_id: str, steps: int, workers: int) -> tuple[dict, dict]:
    """`check_rollouts`, and the usage records of a finished run of `steps` rounds: K x B a
    round, each naming a stored row."""
    rows = check_rollouts(root, run_id, workers)
    usage = UsageStore.open(root / "lancedb", run_id).rows().to_pydict()
    assert len(usage["usage_id"]) == steps * K * B
    assert set(usage["rollout_id"]) <= set(rows["rollout_id"])  # every use names a stored row
    return rows, usage


def prefect_states(root: Path, run_id: str) -> tuple[dict[str, str], str, str]:
    """The generator task runs, the state and the state message of the flow run of `run_id`."""
    with sqlite3.connect(root / ".prefect" / "prefect.db") as db:
        flows = db.execute("SELECT f.id, f.state_type, s.message FROM flow_run f JOIN flow_run_state s "
                           "ON s.id = f.state_id WHERE f.parameters LIKE ?", (f'%"run_id={run_id}"%',)).fetchall()
        assert len(flows) == 1, flows
        tasks = dict(db.execute("SELECT name, state_type FROM task_run WHERE flow_run_id = ? AND name LIKE "
                                "'generator-%'", (flows[0][0],)).fetchall())
    return tasks, flows[0][1], flows[0][2] or ""


def read_stats(root: Path, run_id: str, worker: int) -> dict:
    return AsyncDir.of(root / run_id).read_stats(worker)


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the flow ended before {what}:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def two_node_cluster(num_cpus: int, **head: object) -> Iterator[object]:
    """A two-node Ray cluster on this machine (`ray.cluster_utils.Cluster`): the head and one
    more node of `num_cpus` logical CPUs each (`head`: more of the head's arguments), shut down
    at the end."""
    from ray.cluster_utils import Cluster  # optional dependency (ray): the Ray tests only

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": num_cpus, "include_dashboard": False, **head})
    try:
        nodes.add_node(num_cpus=num_cpus)
        nodes.wait_for_nodes()
        yield nodes
    finally:
        nodes.shutdown()
