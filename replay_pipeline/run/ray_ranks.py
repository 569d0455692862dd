"""The learner's ranks 1..N-1 as Ray actors (`learner.world_size` > 1 with `loop.engine=ray`):
one placement group of N-1 bundles ({CPU: model.torch_threads}, plus {GPU: 1} on a CUDA
device), each actor's one long method running `learner_rank` (replay_pipeline/run/ranks.py),
which joins rank 0's store and process group at this driver's node address.

    flow (Ray driver, rank 0)                    Ray cluster
    ─────────────────────────                    ───────────
    ray_session: join (or start) the cluster     placement group "learner", PACK
    TCPStore on this node's address:PORT ──────► actor r in bundle r-1: learner_rank(r, ..., address, PORT)

Decisions:
* **PACK.** The ranks all-reduce every step, so they go on as few nodes as fit (the generators
  SPREAD: replay_pipeline/run/ray_engine.py). Rank 0 is the driver itself: it must run on a
  node with the learner's device (the flow's machine), which placement does not decide.
* **Checked with the generators before any work** (`rank_bundles` joins the pre-flight's
  placement check), and placed within ray.placement_timeout, else ConfigError naming what is
  missing and what the cluster has.
* **Not replaced.** A rank holds a replica of the optimizer state that only rank 0 could hand
  over again mid-run; a rank that dies stops the run (RankLost, one line) and `resume=RUN`
  continues from the newest checkpoint, bit for bit. (Generators are replaced: they hold nothing.)
"""

from __future__ import annotations

import os
import time
from contextlib import ExitStack
from typing import Any, Callable

from replay_pipeline.run.ranks import learner_rank
from replay_pipeline.run.ray_engine import actor_death, ray_placement, ray_session

#: The ranks' placement: as few nodes as the bundles fit on (their collectives run every step).
RANK_STRATEGY = "PACK"


def rank_bundles(settings: Any, device_type: str) -> tuple[list[dict[str, float]], list[str]]:
    """One bundle for each rank but rank 0 (the driver) and its name."""
    threads = max(int(settings.model.torch_threads or 1), 1)
    bundle = {"CPU": float(threads), **({"GPU": 1.0} if device_type == "cuda" else {})}
    n = int(settings.learner.world_size)
    return [dict(bundle) for _ in range(1, n)], [f"learner rank {r}" for r in range(1, n)]


class RankActor:
    """A learner rank's process (made a Ray actor class by `ActorLauncher`)."""

    def run(self, *args: Any) -> dict[str, Any]:
        return learner_rank(*args)


class RayRank:
    """Rank r's actor as LearnerRanks sees it: alive until its `run` returned or it died."""

    def __init__(self, actor: Any, ref: Any):
        self.actor, self.ref = actor, ref

    def is_alive(self) -> bool:
        import ray  # optional dependency (the ray extra)

        ready, _ = ray.wait([self.ref], timeout=0)
        return not ready

    def kill(self) -> None:
        import ray  # optional dependency (the ray extra)

        ray.kill(self.actor, no_restart=True)

    def describe(self) -> str:
        import ray  # optional dependency (the ray extra)

        if self.is_alive():
            return "Ray actor alive"
        try:
            ray.get(self.ref, timeout=1)
            return "Ray actor ended"
        except Exception as exc:  # RayActorError (died), RayTaskError (raised)
            return f"Ray actor died: {actor_death(exc)}"


class ActorLauncher:
    """loop.engine=ray: the Ray session and the ranks' placement group for as long as the ranks
    live (`close`), and `launch(ranks, args_for)` for LearnerRanks.start."""

    def __init__(self, settings: Any, device_type: str, log: Callable[[str], Any]):
        import ray  # optional dependency (the ray extra)

        self.resources = ExitStack()
        with self.resources as resources:  # left open unless the placement fails
            where = resources.enter_context(ray_session(settings.ray, log))
            bundles, what = rank_bundles(settings, device_type)
            self.group = ray_placement(bundles, RANK_STRATEGY, settings.ray.placement_timeout, what, where,
                                       settings.ray.address, name=f"learner-{os.getpid()}-{time.time_ns()}")
            resources.callback(self._remove_group)
            self.resources = resources.pop_all()
        self.bundle = bundles[0]
        self.actor_class = ray.remote(RankActor)
        self.host = ray.util.get_node_ip_address()  # rank 0's store listens here

    def _remove_group(self) -> None:
        import ray  # optional dependency (the ray extra)
        from ray.util.placement_group import remove_placement_group

        if ray.is_initialized():
            remove_placement_group(self.group)

    def launch(self, ranks: list[int], args_for: Callable[[int], tuple]) -> dict[int, RayRank]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # optional dependency (ray)

        handles = {}
        for rank in ranks:
            actor = self.actor_class.options(
                num_cpus=self.bundle["CPU"], num_gpus=self.bundle.get("GPU", 0), max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank - 1)
            ).remote()
            handles[rank] = RayRank(actor, actor.run.remote(*args_for(rank)))
        return handles

    def close(self) -> None:
        self.resources.close()
