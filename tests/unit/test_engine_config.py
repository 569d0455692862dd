"""The async loop's engine settings: refused by validation (pure) or, for what needs the
machine (is ray installed? do the generators' Ray bundles fit the nodes?), by the pre-flight, saying how to fix it. (In the unit tier: none of these starts
a run or a Ray instance.)"""

from __future__ import annotations

import pytest

from replay_pipeline.config import ConfigError, load_config
from replay_pipeline.run.preflight import preflight
from replay_pipeline.run.placement import placement_problem
from replay_pipeline.run.ray_engine import check_placement


@pytest.mark.parametrize("overrides, message", [
    (["loop=async", "loop.engine=spark"], "loop.engine='spark' is not one of ['local', 'ray']"),
    (["loop=async", "loop.engine=dask"], "loop.engine=dask was retired: Ray does everything it did"),
    (["loop.engine=ray"], "loop.engine=ray with the sync loop and one learner process places nothing on Ray: add "
                          "loop=async"),
    (["learner.backend=mpi"], "learner.backend='mpi' is not one of ['auto', 'gloo', 'nccl']"),
    (["loop=async", "ray.address=10.0.0.5:6379"], "ray.address=10.0.0.5:6379 is only used with loop.engine=ray"),
    (["loop=async", "loop.engine=ray", "ray.address=10.0.0.5"], "is not a Ray head's address; give HOST:PORT"),
    (["loop=async", "loop.engine=ray", "ray.address=10.0.0.5:6379", "ray.num_cpus=2"],
     "ray.num_cpus=2 sizes the local instance, which ray.address=10.0.0.5:6379 replaces"),
    (["loop=async", "loop.engine=ray", "ray.placement_timeout=0"], "ray.placement_timeout=0.0 must be"),
    (["loop=async", "loop.engine=ray", "ray.max_restarts=-1"], "ray.max_restarts=-1 must be"),
    (["loop=async", "loop.heartbeat_timeout=0.5"], "loop.heartbeat_timeout=0.5 must be >= 1 (seconds; default 180)"),
])
def test_engine_settings_are_validated(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    assert message in str(info.value)


def test_the_ray_engine_without_ray_installed_says_how_to_install_it(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    cfg = load_config(["loop=async", "loop.engine=ray", f"tracking.root_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"loop.engine=ray needs ray, which is not installed: pip install 'ray==2.60"):
        preflight(cfg)


GENERATORS = [f"generator {w}" for w in range(4)]


def test_bundles_that_the_nodes_cannot_hold_are_named_with_what_the_cluster_has():
    one_cpu = {"CPU": 1.0}
    two_nodes = [{"CPU": 1.0, "memory": 1e9}, {"CPU": 1.0}]
    assert placement_problem([one_cpu] * 2, GENERATORS[:2], two_nodes, "10.0.0.5:6379") is None
    assert placement_problem([one_cpu] * 4, GENERATORS, two_nodes, "10.0.0.5:6379") == (
        "4 generator bundle(s) of {CPU: 1} need 4 CPUs; the cluster at 10.0.0.5:6379 has 2 CPUs on 2 node(s) "
        "({CPU: 1}, {CPU: 1})")
    # Enough CPUs in all, but a bundle is never split across nodes.
    assert placement_problem([{"CPU": 2.0}] * 2, GENERATORS[:2], [{"CPU": 3.0}, {"CPU": 1.0}], "h:1") == (
        "2 generator bundle(s) of {CPU: 2} do not fit: generator 1's bundle {CPU: 2} finds no node with that much "
        "left (a bundle is never split across nodes); the cluster at h:1 has 4 CPUs on 2 node(s) ({CPU: 3}, {CPU: 1})")
    # vLLM generators ask for a GPU each; other bundles (the learner's ranks) join the same check.
    gpu = {"CPU": 1.0, "GPU": 1.0}
    assert placement_problem([gpu, gpu, {"CPU": 2.0}], ["generator 0", "generator 1", "learner rank 1"],
                             [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 4.0}], "h:1") == (
        "2 generator bundle(s) of {CPU: 1, GPU: 1} and 1 learner rank bundle(s) of {CPU: 2} need 2 GPUs; the "
        "cluster at h:1 has 12 CPUs, 1 GPUs on 2 node(s) ({CPU: 8, GPU: 1}, {CPU: 4})")


def test_a_local_instance_too_small_for_the_generators_is_refused_without_starting_ray(tmp_path):
    cfg = load_config(["loop=async", "loop.engine=ray", "loop.workers=3", "ray.num_cpus=2", "ray.num_gpus=0",
                       f"tracking.root_dir={tmp_path}"])
    with pytest.raises(ConfigError) as info:
        check_placement(cfg)
    assert ("3 generator bundle(s) of {CPU: 1} need 3 CPUs; the cluster at this machine (a local instance, "
            "ray.address null) has 2 CPUs on 1 node(s) ({CPU: 2})") in str(info.value)
    assert "raise ray.num_cpus" in str(info.value)  # says how to fix it
    check_placement(load_config(["loop=async", "loop.engine=ray", "loop.workers=2", "ray.num_cpus=2",
                                 "ray.num_gpus=0"]))  # fits: no error


def test_a_learner_too_large_for_a_local_instance_is_refused_without_starting_ray(tmp_path):
    """The learner's ranks 1..N-1 join the generators in the pre-flight's placement check (their
    own PACK group: replay_pipeline/run/ray_ranks.py)."""
    from replay_pipeline.run.ray_ranks import rank_bundles

    cfg = load_config(["loop=async", "loop.engine=ray", "loop.workers=1", "learner.world_size=3",
                       "model.torch_threads=1", "ray.num_cpus=2", "ray.num_gpus=0", f"tracking.root_dir={tmp_path}"])
    with pytest.raises(ConfigError) as info:
        check_placement(cfg, rank_bundles(cfg, "cpu"))
    said = str(info.value)
    assert "loop.engine=ray cannot place the generators and the learner's ranks" in said, said
    assert "1 generator bundle(s) of {CPU: 1} and 2 learner rank bundle(s) of {CPU: 1} need 3 CPUs" in said, said
    sync = load_config(["loop.engine=ray", "learner.world_size=3", "model.torch_threads=1", "ray.num_cpus=2",
                        "ray.num_gpus=0"])  # the sync loop: the ranks alone, which fit
    check_placement(sync, rank_bundles(sync, "cpu"))
