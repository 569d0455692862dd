"""The learner's ranks as Ray actors (`learner.world_size=2 loop.engine=ray`,
replay_pipeline/run/ray_ranks.py), end to end on real Ray: a two-node cluster on loopback with
the async loop's two generators, one on each node, and a 2-rank learner; and a rank actor
killed mid-run (the sync loop on a local instance the flow starts: the fault point's variable
reaches the actor through it) stopping the run with one line, after which `resume=RUN`
finishes it. That a resume after a killed rank is
bit for bit is shown on the local engine (tests/e2e/test_learner_ranks.py): the ranks' code is
the same, only their processes are Ray's here. A learner the cluster cannot hold is refused by
the pre-flight's placement check (tests/unit/test_engine_config.py, without a cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import engine_runs
from tests.conftest import TINY_OVERRIDES
from tests.e2e.test_faults import train
from tests.engine_runs import assert_no_leftovers, check_tables, finish, read_stats

ray = pytest.importorskip("ray", reason="loop.engine=ray needs pip install 'ray==2.60.*'")
pytestmark = pytest.mark.filterwarnings("ignore:lance is not fork-safe:UserWarning")

STEPS = 3


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ray-ranks")


@pytest.fixture(scope="module")
def cluster():
    """Two nodes of two (logical) CPUs: the generators' two bundles SPREAD one to a node, the
    learner rank's bundle goes where one is left."""
    with engine_runs.two_node_cluster(2) as nodes:
        yield nodes


def test_generators_on_both_nodes_and_a_two_rank_learner(root, cluster):
    proc = engine_runs.start(root, "ray-ranks", STEPS, "ray", "loop.workers=2", "learner.world_size=2",
                             f"ray.address={cluster.address}")
    out = finish(proc, timeout=420)
    assert proc.returncode == 0, out[-4000:]
    assert "learner: 2 data-parallel ranks (gloo)" in out and "Run ray-ranks finished: 3 steps" in out
    check_tables(root, "ray-ranks", STEPS, workers=2)  # usage records written once, by rank 0
    stats = [read_stats(root, "ray-ranks", w) for w in (0, 1)]
    assert len({s["ray_node"] for s in stats}) == 2  # a generator on each node
    assert_no_leftovers(proc.pid)  # no rank or generator process outlives the flow


def test_a_killed_rank_actor_stops_the_run_with_one_line_and_resume_finishes_it(tmp_path):
    args = [*TINY_OVERRIDES, "run_id=ray-killed", "loop.steps=4", "loop.checkpoint_every=2", "loop.eval_every=0",
            "loop.passk_every=0", "loop.engine=ray", "ray.num_cpus=2", "learner.world_size=2"]
    crashed = train(tmp_path, *args, crash="learner_rank:4")  # rank 1 SIGKILLs itself before step 2's updates
    assert crashed.returncode == 1, crashed.stdout[-3000:] + crashed.stderr[-3000:]
    (line,) = [x for x in crashed.stderr.splitlines() if x.startswith("error:")]
    assert "RankLost: learner rank 1 (Ray actor died" in line, line
    assert "resume with: python -m flows.train resume=ray-killed" in line
    resumed = train(tmp_path, "resume=ray-killed")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resume ray-killed at step 2" in resumed.stdout and "Run ray-killed finished: 4 steps" in resumed.stdout
