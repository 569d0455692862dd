"""Generators as resident Ray actors (`loop=async loop.engine=ray`), end to end on real Ray: a
two-node cluster on loopback (`ray.cluster_utils.Cluster`, one CPU a node, shared by the
module) that the flow joins, and a local instance the flow starts and stops itself (the run
stopped by SIGTERM, which Ray's own handler must not end at once). The rollout table, the
usage records, the workers' stats (which prove where each generator ran: the Ray node id) and
Prefect's task runs are read back; then the faults: a placement the cluster cannot hold is
refused before any work, a generator actor killed mid-run is replaced and nothing is lost or
stored twice, a generator whose replacements are used up stops the run with one line, after
which `resume=RUN` finishes it, and a lost node's generator is replaced on a spare node, or
stops the run where no node has room."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import engine_runs
from tests.conftest import ROOT
from tests.engine_runs import (assert_no_leftovers, check_rollouts, check_tables, finish, free_port, prefect_states,
                               read_stats, stopped_at_the_end, wait_for)
from tests.servers import prefect_env

ray = pytest.importorskip("ray", reason="loop.engine=ray needs pip install 'ray==2.60.*'")
# Cluster.add_node starts a node's processes from this process, where lance is loaded: fork and exec.
pytestmark = pytest.mark.filterwarnings("ignore:lance is not fork-safe:UserWarning")

STEPS = 3
# Generators wait while the learner has used each row less than once, and the learner waits
# while a round would use rows more than twice on average: the two go in step, so a run cannot
# finish on the rows its generator stored before a fault.
PACED = ("loop.replay_floor=1.0", "loop.replay_cap=2.0")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """One run root (and Prefect home) for the module: the warm start is cached once."""
    return tmp_path_factory.mktemp("ray-runs")


@pytest.fixture(scope="module")
def cluster():
    """A two-node Ray cluster on this machine: the head and one more node, one CPU each (Ray's
    resources are logical), so two generators' bundles of {CPU: 1} land one on each node."""
    # a lost node is marked dead after 3 missed health checks a second apart (Ray's default: 5 of 3 s)
    with engine_runs.two_node_cluster(1, _system_config={"health_check_period_ms": 1000,
                                                         "health_check_failure_threshold": 3}) as nodes:
        yield nodes


def start(root: Path, run_id: str, steps: int, *extra: str) -> subprocess.Popen:
    return engine_runs.start(root, run_id, steps, "ray", *extra)


def node_ids(cluster) -> set[str]:
    return {node.node_id for node in cluster.list_all_nodes()}


def kill_generator(root: Path, run_id: str, proc: subprocess.Popen, batches: int = 2) -> tuple[dict, float]:
    """SIGKILL generator 0's actor process once it has stored `batches` batches; its stats then
    and the time of the kill."""
    stats = wait_for(lambda: (s := read_stats(root, run_id, 0)).get("batches", 0) >= batches and s, 240,
                     "the generator's first batches", proc)
    os.kill(stats["pid"], signal.SIGKILL)
    return stats, time.monotonic()


def the_one_error_line(proc: subprocess.Popen, out: str) -> str:
    """A failed run's one line (exit code 1): `error: run RUN failed at step N of M: ...`."""
    assert proc.returncode == 1, out[-4000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out[-4000:]
    return errors[0]


def test_two_generators_one_on_each_node_of_an_existing_cluster(root, cluster):
    proc = start(root, "ray-two", STEPS, "loop.workers=2", f"ray.address={cluster.address}")
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert f"Ray: the cluster at {cluster.address} has 2 CPUs on 2 node(s) ({{CPU: 1}}, {{CPU: 1}})" in out
    assert "Run ray-two finished: 3 steps" in out
    check_tables(root, "ray-two", STEPS, workers=2)
    stats = [read_stats(root, "ray-two", w) for w in (0, 1)]
    for s in stats:  # each generator ran in an actor process of the cluster, not in the flow
        assert s["engine"] == "ray" and s["ray_restarts"] == 0 and s["stop_reason"] == "stop flag", s
        assert s["pid"] != proc.pid and s["batches"] >= 1
    assert {s["ray_node"] for s in stats} == node_ids(cluster)  # one on each node (SPREAD)
    tasks, flow_state, _ = prefect_states(root, "ray-two")
    assert tasks == {"generator-0": "COMPLETED", "generator-1": "COMPLETED"} and flow_state == "COMPLETED"
    assert_no_leftovers(proc.pid)
    assert not any(node.dead_processes() for node in cluster.list_all_nodes())  # the cluster is left running


def test_a_local_instance_the_flow_starts_and_stops_also_when_sigterm_stops_the_run(root):
    """ray.init puts its own SIGTERM handler in the driver (exit at once, after a stack dump):
    the flow keeps its own, so SIGTERM still stops the run at its next safe point."""
    proc = start(root, "ray-local", 100_000, "loop.workers=2", "ray.num_cpus=2", *PACED)
    with stopped_at_the_end(proc):
        wait_for(lambda: all(read_stats(root, "ray-local", w).get("batches", 0) >= 2 for w in (0, 1)), 240,
                 "both generators' batches", proc)
        proc.send_signal(signal.SIGTERM)
        out = finish(proc, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out[-4000:]
    assert "stopped by SIGTERM" in out and "resume with: python -m flows.train resume=ray-local" in out
    assert "(a local Ray instance of this run) has 2 CPUs on 1 node(s)" in out
    for noise in ("Token authentication", "fork", "SIGTERM received"):  # Ray's noise stays off the console
        assert noise not in out, out[-4000:]
    stats = [read_stats(root, "ray-local", w) for w in (0, 1)]
    assert all(s["engine"] == "ray" and s["stop_reason"] == "stop flag" for s in stats)
    assert stats[0]["ray_node"] == stats[1]["ray_node"]
    check_rollouts(root, "ray-local", workers=2)
    assert_no_leftovers(proc.pid)  # the instance's GCS, raylet and actor processes are gone


def test_a_placement_the_cluster_cannot_hold_is_refused_before_any_work(tmp_path, cluster):
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect")}

    def refused(run_id: str, *extra: str) -> str:
        done = subprocess.run(engine_runs.command(tmp_path, run_id, 3, "ray", *extra), cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
        assert not (tmp_path / run_id).exists() and not (tmp_path / "mlflow.db").exists()
        assert not (tmp_path / "lancedb").exists()  # no rollout table
        return done.stderr

    err = refused("ray-big", "loop.workers=3", f"ray.address={cluster.address}")
    assert (f"loop.engine=ray cannot place the generators: 3 generator bundle(s) of {{CPU: 1}} need 3 CPUs; the "
            f"cluster at {cluster.address} has 2 CPUs on 2 node(s) ({{CPU: 1}}, {{CPU: 1}})") in err
    assert f"ray start --address={cluster.address} --num-cpus N" in err  # says how to fix it
    address = f"127.0.0.1:{free_port()}"
    err = refused("ray-none", f"ray.address={address}")
    assert f"ray.address={address}: cannot connect" in err and "ray start --head" in err


def test_a_killed_generator_actor_is_replaced_and_nothing_is_lost(root, cluster):
    steps = 8
    proc = start(root, "ray-kill", steps, *PACED, f"ray.address={cluster.address}")
    with stopped_at_the_end(proc):
        before, killed = kill_generator(root, "ray-kill", proc)
        after = wait_for(lambda: (s := read_stats(root, "ray-kill", 0)).get("pid") != before["pid"] and s, 120,
                         "the replacement actor", proc)
        up = time.monotonic() - killed
        wait_for(lambda: read_stats(root, "ray-kill", 0).get("batches", 0) > after["batches"], 120,
                 "the replacement's first batch", proc)
        first_batch = time.monotonic() - killed
        out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert out.count("generator 0: its Ray actor died") == 1 and "(1 of ray.max_restarts=3)" in out
    final = read_stats(root, "ray-kill", 0)
    assert final["ray_restarts"] == 1 and final["ray_actor"] != before["ray_actor"] and final["pid"] != before["pid"]
    rows, _ = check_tables(root, "ray-kill", steps, workers=1)  # ids unique, groups whole, steps contiguous
    print(f"\nray-kill: replacement up {up:.1f} s after the SIGKILL, first batch after {first_batch:.1f} s; "
          f"{len(rows['rollout_id'])} rows, 0 lost or duplicated (batches before the kill: {before['batches']:.0f})")
    tasks, flow_state, _ = prefect_states(root, "ray-kill")
    assert tasks == {"generator-0": "COMPLETED"} and flow_state == "COMPLETED"
    assert_no_leftovers(proc.pid)


def test_restarts_used_up_stop_the_run_with_one_line_and_it_resumes(root, cluster):
    steps = 8
    proc = start(root, "ray-dead", steps, *PACED, "loop.checkpoint_every=2", "ray.max_restarts=0",
                 f"ray.address={cluster.address}")
    with stopped_at_the_end(proc):
        wait_for(lambda: any((root / "ray-dead" / "checkpoints").glob("step-*")), 240, "the first checkpoint", proc)
        _, killed = kill_generator(root, "ray-dead", proc, batches=0)
        out = finish(proc, timeout=120)
        stopped = time.monotonic() - killed
    error = the_one_error_line(proc, out)
    assert ("RuntimeError: generator 0 of ray-dead: its Ray actor died and ray.max_restarts=0 replacement(s) are "
            "used up") in error and "resume with: python -m flows.train resume=ray-dead" in error
    tasks, flow_state, _ = prefect_states(root, "ray-dead")
    assert tasks == {"generator-0": "FAILED"} and flow_state == "FAILED"
    assert_no_leftovers(proc.pid)
    print(f"\nray-dead: the run ended {stopped:.1f} s after the SIGKILL with: {error}")

    env = {**os.environ, **prefect_env(root / ".prefect")}
    resumed = subprocess.run([sys.executable, "-m", "flows.train", f"tracking.root_dir={root}", "resume=ray-dead",
                              "ray.max_restarts=1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"Run ray-dead finished: {steps} steps" in resumed.stdout
    check_tables(root, "ray-dead", steps, workers=1)


def test_a_lost_node_s_generator_is_replaced_where_there_is_room_and_stops_the_run_where_not(root, cluster):
    """Last in the module: it adds a node and removes two. Three nodes of one CPU, two
    generators: the node of one (not the head) is lost, its bundle is placed again on the node
    neither held and a replacement goes on; then the node of the other is lost with no node left to
    take it, and the run stops with one line once ray.placement_timeout has passed."""
    spare = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    proc = start(root, "ray-node", 100_000, "loop.workers=2", *PACED, "ray.placement_timeout=30",
                 f"ray.address={cluster.address}")
    nodes = {node.node_id: node for node in cluster.list_all_nodes()}

    def lose_a_generator_node() -> tuple[int, dict, float]:
        stats = wait_for(lambda: (s := [read_stats(root, "ray-node", w) for w in (0, 1)])
                         and all(x.get("batches", 0) >= 2 for x in s) and s, 240, "both generators' batches", proc)
        w = next(w for w in (0, 1) if stats[w]["ray_node"] != cluster.head_node.node_id)
        cluster.remove_node(nodes[stats[w]["ray_node"]], allow_graceful=False)  # its raylet and actors SIGKILLed
        return w, stats, time.monotonic()

    with stopped_at_the_end(proc):
        w, at_loss, lost = lose_a_generator_node()
        before, other = at_loss[w], at_loss[1 - w]
        after = wait_for(lambda: (s := read_stats(root, "ray-node", w)).get("ray_restarts") == 1
                         and s.get("batches", 0) > before["batches"] and s, 180, "the replacement's first batch", proc)
        replaced = time.monotonic() - lost
        # on the node no generator held (SPREAD put the two on any two of the three nodes)
        assert after["ray_node"] not in (before["ray_node"], other["ray_node"])
        w2, _, lost = lose_a_generator_node()  # no node has room for it now
        out = finish(proc, timeout=240)
        stopped = time.monotonic() - lost
    error = the_one_error_line(proc, out)
    assert f"generator {w2}'s actor did not start within ray.placement_timeout=30 s" in error
    assert "not placed: the cluster at" in error, error
    print(f"\nray-node: generator {w} replaced on the free node {replaced:.1f} s after its node was lost (to its "
          f"first batch); the run stopped {stopped:.1f} s after the second loss with: {error}")
    rows = check_rollouts(root, "ray-node", workers=2)
    print(f"ray-node: {len(rows['rollout_id'])} rows, none lost or stored twice")
    assert spare.node_id in nodes
    assert_no_leftovers(proc.pid)

