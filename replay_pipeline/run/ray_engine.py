"""The Ray engine of the async loop's generators (`loop.engine=ray`, needs `ray`, imported only
here and only when used): each generator is a resident Ray actor whose one long method runs
the same `generator_worker` (replay_pipeline/run/workers.py), placed in its own bundle of one
placement group, on a Ray instance the flow starts and shuts down (`ray.address` null) or on
an existing cluster it joins as the driver (left running).

    flow (the Ray driver)                       Ray cluster
    ─────────────────────                       ───────────
    preflight: bundles fit the cluster? ─────── ray.nodes(): every alive node's resources
    placement group, one bundle a generator ─── SPREAD over the nodes; ready within a timeout
    generator-W Prefect task: start actor W ─── actor in bundle W: generator_worker(...)
      wait on its ObjectRef; actor died? ─────── killed, process or node lost: a new actor
      a new one in the same bundle                in the same bundle claims worker W

Decisions:
* **The flow is the driver, Prefect supervises.** Every generator is a `generator-W` task in
  the flow's process that creates its actor and waits on the ObjectRef of its `run`; the flow
  keeps Prefect's default (thread) task runner. prefect-ray's `RayTaskRunner` runs stateless
  tasks only, not a resident engine, and a task runner would send *every* task of the flow to
  the cluster, but the learner's tasks share one in-process `TrainingRun` (model, optimizer,
  table and MLflow handles) that must not move; a Prefect task run on a remote node would also
  report its state from a machine that cannot reach the flow's embedded (ephemeral) Prefect
  server. Supervising from the flow keeps every generator a task run in the UI, with the
  embedded server and with a real one.
* **Placed before any work.** The generators' bundles (`generator_bundles`: {CPU:
  loop.worker_threads}, plus {GPU: 1} with generator.backend=vllm) are compared with the
  cluster's nodes in the pre-flight (`check_placement`; the pure check is
  replay_pipeline/run/placement.py's, a bundle never split across nodes), so a placement
  that cannot be satisfied is refused before the run exists, naming what is missing and what
  the cluster has; the placement group itself must be ready within ray.placement_timeout
  (`ray_placement`), never a silent wait. `placement_bundles` lists the run's bundles for
  both, and `ray_placement` takes any, so the learner's ranks can join the same check and
  group.
* **Replaced, not restarted by Ray.** Actors are created with Ray's max_restarts=0: a
  generator whose actor died (ray.kill, its process SIGKILLed, its node removed) is replaced
  by the supervisor (`run_ray_worker`) with a new actor in the same bundle, up to
  ray.max_restarts times, with one line in the log. The replacement claims the worker id
  (`AsyncDir.claim`: an old copy still running elsewhere stops) and resumes the worker's batch
  counter from the table, so the batch in flight is generated again, whole, and the
  idempotent append never duplicates a row. Restarts used up, or no bundle placed again
  within ray.placement_timeout (a lost node, no spare resources): the generator's task fails
  with one line naming it and the cause, the run stops, and `resume=RUN` continues it. A
  generator that raised is not replaced: its error is the run's.
* **Quiet.** `log_to_driver=False`, no dashboard, Ray's own logging at WARNING: the actors'
  output stays in Ray's session logs (/tmp/ray/session_*/logs); a generator's error reaches
  the run's error line through the ObjectRef.
* **Signals stay the flow's.** ray.init replaces the driver's SIGTERM handler (exit at once,
  after its core worker's stack dump); the flow's is put back (`handlers_kept`), so Ctrl-C and
  SIGTERM still stop the run at its next safe point.
* **Provenance.** Each worker's stats record `engine: ray`, `host`, `pid`, `ray_node` (the
  node id), `ray_actor` and `ray_restarts`.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from replay_pipeline.config import ConfigError
from replay_pipeline.run.files import AsyncDir
from replay_pipeline.run.placement import amounts, describe_cluster, placement_fix, placement_problem
from replay_pipeline.run.workers import generator_worker
from replay_pipeline.system.stopping import handlers_kept

#: Seconds to reach a Ray head's GCS port (a TCP connect) before joining it.
RAY_CONNECT_TIMEOUT = 10.0
#: The generators' placement: SPREAD puts each bundle on a different node while nodes are free,
#: so a lost node costs the fewest generators and they do not share a node's cores and memory
#: bandwidth; unlike STRICT_SPREAD it still places several on one node when there are fewer
#: nodes than generators (one machine, or a small cluster).
GENERATOR_STRATEGY = "SPREAD"


def generator_bundles(loop: Any, backend: str) -> tuple[list[dict[str, float]], list[str]]:
    """One bundle a generator ({CPU: loop.worker_threads}, {GPU: 1} more with vLLM) and its name."""
    bundle = {"CPU": float(loop.worker_threads), **({"GPU": 1.0} if backend == "vllm" else {})}
    return [dict(bundle) for _ in range(loop.workers)], [f"generator {w}" for w in range(loop.workers)]


def placement_bundles(cfg: Any) -> tuple[list[dict[str, float]], list[str]]:
    """The generators' bundles (generator W in bundle W of their placement group) and their
    names, as the pre-flight checks and `ray_generators` places them; none in the sync loop.
    A data-parallel learner's ranks have a group of their own (replay_pipeline/run/ray_ranks.py)."""
    if cfg.loop.mode != "async":
        return [], []
    return generator_bundles(cfg.loop, cfg.generator.backend)


def local_node(ray_cfg: Any) -> dict[str, float]:
    """The resources a local instance (ray.address null) will declare: ray.num_cpus (this
    machine's CPU count) and ray.num_gpus (the GPUs torch sees)."""
    gpus = ray_cfg.num_gpus
    if gpus is None:
        import torch  # start-up cost: only to count GPUs for a local instance

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"CPU": float(ray_cfg.num_cpus or os.cpu_count() or 1), "GPU": float(gpus)}


def check_placement(cfg: Any, more: tuple[list[dict[str, float]], list[str]] = ([], [])) -> None:
    """The pre-flight's check of loop.engine=ray (ray installed): the cluster at ray.address
    answers, and the generators' bundles (the async loop) and the bundles `more` (the learner's
    other ranks, their own group: replay_pipeline/run/ray_ranks.py) fit its nodes (or the local
    instance's resources). Raises ConfigError saying how to fix it; starts no Ray instance."""
    bundles, what = placement_bundles(cfg)
    bundles, what = bundles + more[0], what + more[1]
    address = cfg.ray.address
    if address is None:
        nodes, where = [local_node(cfg.ray)], "this machine (a local instance, ray.address null)"
    else:
        import ray  # optional dependency (the ray extra)

        with ray_connection(cfg.ray) as where:
            nodes = alive_nodes(ray)
    problem = placement_problem(bundles, what, nodes, where)
    if problem:
        whose = " and ".join(name for name, prefix in (("the generators", "generator"), ("the learner's ranks", "learner"))
                             if any(w.startswith(prefix) for w in what))
        raise ConfigError(f"Invalid configuration:\n  - loop.engine=ray cannot place {whose}: {problem}; "
                          f"{placement_fix(address)}")


def alive_nodes(ray: Any) -> list[dict[str, float]]:
    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


@contextmanager
def _local_start_quiet() -> Iterator[None]:
    """Starting a local instance without two kinds of noise: Ray's note that it turned token
    authentication on (it stays on), and lance's warnings that a process forked (Ray's
    subprocesses fork and exec at once, which is safe)."""
    note = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = note.level
    note.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*(lance|lancedb) .*fork")
            yield
    finally:
        note.setLevel(level)


@contextmanager
def ray_connection(ray_cfg: Any, log: Callable[[str], Any] | None = None) -> Iterator[str]:
    """This process as the driver of a Ray cluster for the body of the `with`: a local instance
    started here (ray.num_cpus, ray.num_gpus) and shut down at the end when ray.address is
    null, else the cluster at ray.address, joined after a TCP probe and left running. Yields
    the cluster's description for messages (`127.0.0.1:6379`, `a local Ray instance`)."""
    import ray  # optional dependency (the ray extra)

    quiet = dict(log_to_driver=False, logging_level=logging.WARNING)
    address = ray_cfg.address
    if address is None:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no prompt, no network call
        node = local_node(ray_cfg)
        with _local_start_quiet(), handlers_kept():
            ray.init(address="local", num_cpus=int(node["CPU"]), num_gpus=int(node["GPU"]), include_dashboard=False,
                     **quiet)
        where = f"{ray.get_runtime_context().gcs_address} (a local Ray instance of this run)"
    else:
        host, _, port = str(address).rpartition(":")
        fix = (f"start the head with `ray start --head --port={port or 6379}` (and `ray start --address={address}` "
               "on each other node), fix ray.address, or drop it to start a local instance")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_TIMEOUT).close()
        except (OSError, ValueError) as exc:
            raise ConfigError(f"ray.address={address}: cannot connect ({exc}); {fix}") from exc
        try:
            with handlers_kept():
                ray.init(address=address, **quiet)
        except Exception as exc:  # ConnectionError, or a port that is not a Ray head's GCS
            raise ConfigError(f"ray.address={address}: joining the cluster failed ({type(exc).__name__}: "
                              f"{' '.join(str(exc).split())[:200]}); {fix}") from exc
        where = str(address)
    try:
        if log is not None:
            log(f"Ray: {describe_cluster(alive_nodes(ray), where)}")
        yield where
    finally:
        ray.shutdown()  # a local instance's processes end with it; a joined cluster stays


@contextmanager
def ray_session(ray_cfg: Any, log: Callable[[str], Any] | None = None) -> Iterator[str]:
    """`ray_connection`, unless this process is a Ray driver already (the learner's ranks
    joined the cluster when the run was built): then that connection, left open for its owner."""
    import ray  # optional dependency (the ray extra)

    if ray.is_initialized():
        yield str(ray_cfg.address or f"{ray.get_runtime_context().gcs_address} (a local Ray instance of this run)")
        return
    with ray_connection(ray_cfg, log) as where:
        yield where


def ray_placement(bundles: list[dict[str, float]], strategy: str, timeout: float, what: list[str],
                  where: str, address: str | None = None, name: str = "") -> Any:
    """A placement group of `bundles` (named by `what`, e.g. `generator 0`, `learner rank 1`)
    with `strategy`, ready within `timeout` seconds; ConfigError naming what is missing and
    what the cluster has when it cannot be satisfied (checked against the alive nodes first)
    or is not placed in time (other jobs hold the resources). Needs a Ray connection."""
    import ray  # optional dependency (the ray extra)
    from ray.util.placement_group import placement_group, remove_placement_group

    nodes = alive_nodes(ray)
    problem = placement_problem(bundles, what, nodes, where)
    if problem:
        raise ConfigError(f"cannot place {len(bundles)} bundle(s): {problem}; {placement_fix(address)}")
    group = placement_group(bundles, strategy=strategy, name=name)
    ready, _ = ray.wait([group.ready()], timeout=timeout)
    if not ready:
        free = amounts(ray.available_resources(), sorted(_sum(bundles)))
        remove_placement_group(group)
        raise ConfigError(f"{', '.join(what)}: the placement group ({strategy}, {len(bundles)} bundle(s) of "
                          f"{amounts(bundles[0])}) was not placed within ray.placement_timeout={timeout:g} s; "
                          f"{describe_cluster(nodes, where)}, {free} of it unreserved (other jobs hold the rest?); "
                          f"{placement_fix(address)}, or raise ray.placement_timeout")
    return group


class GeneratorActor:
    """A resident generator (made a Ray actor class by `RayGenerators`): `where()` answers once
    its process is up; `run()` is the generator worker's whole life."""

    def where(self) -> dict[str, Any]:
        import ray  # optional dependency (the ray extra): inside the actor's process

        context = ray.get_runtime_context()
        return {"engine": "ray", "ray_node": context.get_node_id(), "ray_actor": context.get_actor_id(),
                "host": socket.gethostname(), "pid": os.getpid()}

    def run(self, cfg_container: dict[str, Any], run_id: str, worker: int, session: str | None,
            restarts: int) -> dict[str, Any]:
        return generator_worker(cfg_container, run_id, worker, None, session,
                                where={**self.where(), "ray_restarts": restarts})


class RayGenerator:
    """Generator W's slot, as the learner sees it: `is_alive()` until its supervisor gave up or
    it ended (a replacement under way counts as alive), `kill()` (no replacement follows),
    `error()` once it has failed."""

    def __init__(self) -> None:
        self.actor: Any = None
        self.ended = False
        self.killed = False
        self.failure = ""

    def is_alive(self) -> bool:
        return not self.ended

    def kill(self) -> None:
        self.killed = True
        if self.actor is not None:
            import ray  # optional dependency (the ray extra)

            ray.kill(self.actor, no_restart=True)

    def error(self) -> str:
        return self.failure or ("killed" if self.killed else "ended")


class RayGenerators:
    """The generators' placement group on a joined cluster (`ray_generators`) and how to start
    generator W's actor in its bundle."""

    def __init__(self, group: Any, settings: Any, where: str, log: Callable[[str], Any]):
        import ray  # optional dependency (the ray extra)

        self.group, self.ray_cfg, self.where, self.log = group, settings.ray, where, log
        bundles, _ = generator_bundles(settings.loop, settings.generator.backend)
        self.bundle = bundles[0]
        env = {"py_executable": str(settings.ray.generator_python)} if settings.ray.generator_python else None
        self.actor_class = ray.remote(GeneratorActor)
        self.options = dict(num_cpus=self.bundle["CPU"], num_gpus=self.bundle.get("GPU", 0), max_restarts=0,
                            runtime_env=env)

    def start(self, worker: int) -> tuple[Any, dict[str, Any]]:
        """Generator `worker`'s actor, up in its bundle, and where it runs. An actor that dies
        before it is up (its bundle was on a node just lost, not yet placed again) is tried
        again; RuntimeError when none is up within ray.placement_timeout (no node has room)."""
        import ray  # optional dependency (the ray extra)
        from ray.exceptions import RayActorError
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        timeout = self.ray_cfg.placement_timeout
        deadline = time.monotonic() + timeout
        while True:
            actor = self.actor_class.options(**self.options, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=worker)).remote()
            ready, _ = ray.wait([actor.where.remote()], timeout=max(deadline - time.monotonic(), 0.0))
            if ready:
                try:
                    return actor, ray.get(ready[0], timeout=timeout)
                except RayActorError:
                    if time.monotonic() < deadline:
                        time.sleep(1.0)
                        continue
            ray.kill(actor, no_restart=True)
            raise RuntimeError(f"generator {worker}'s actor did not start within ray.placement_timeout={timeout:g} s "
                               f"(its bundle {amounts(self.bundle)} not placed: "
                               f"{describe_cluster(alive_nodes(ray), self.where)}, "
                               f"{amounts(ray.available_resources(), sorted(self.bundle))} of it unreserved)")


@contextmanager
def ray_generators(settings: Any, log: Callable[[str], Any] = print) -> Iterator[RayGenerators]:
    """loop.engine=ray for the body of the `with`: the Ray connection (`ray_connection`) and the
    generators' placement group (SPREAD, one bundle each), removed at the end."""
    with ray_session(settings.ray, log) as where:
        import ray  # optional dependency (the ray extra), connected above
        from ray.util.placement_group import remove_placement_group

        bundles, what = placement_bundles(settings)
        group = ray_placement(bundles, GENERATOR_STRATEGY, settings.ray.placement_timeout, what, where,
                              settings.ray.address, name=f"generators-{os.getpid()}-{time.time_ns()}")
        try:
            yield RayGenerators(group, settings, where, log)
        finally:
            if ray.is_initialized():
                remove_placement_group(group)


def actor_death(exc: BaseException) -> str:
    """Why an actor died, in a few words: Ray's own reason without its paragraph of common causes
    (`pid 123 on 10.0.0.5: its worker process has died. Worker exit type: SYSTEM_ERROR ...`)."""
    text = str(exc)
    reason = re.search(r"The actor is dead because (.*?)(?:\s+Some common causes|$)", text, re.S)
    pid, ip = re.search(r"pid: (\d+)", text), re.search(r"ip: (\S+)", text)
    said = " ".join((reason[1] if reason else text).split())
    where = f"pid {pid[1]}" + (f" on {ip[1]}" if ip else "") + ": " if pid else ""
    said = where + said
    return said if len(said) <= 200 else said[:197] + "..."


def run_ray_worker(generators: RayGenerators, cfg_container: dict[str, Any], run_id: str, worker: int,
                   control: AsyncDir, registry: dict[int, Any], session: str | None = None) -> dict[str, Any]:
    """loop.engine=ray: generator `worker` as an actor in its bundle, registered in `registry`,
    waited for and replaced when it dies while the run is going (up to ray.max_restarts
    times); returns its stats. Raises with the generator's own error when it failed, and with
    the cause when its restarts are used up or no replacement could start."""
    import ray  # optional dependency (the ray extra)
    from ray.exceptions import RayActorError, RayTaskError

    handle = registry[worker] = RayGenerator()
    limit = generators.ray_cfg.max_restarts
    restarts, where = 0, {}
    try:
        while True:
            try:
                handle.actor, where = generators.start(worker)
                return ray.get(handle.actor.run.remote(cfg_container, run_id, worker, session, restarts))
            except RayTaskError as exc:  # the generator raised: its own error, not replaced
                node = where.get("ray_node", "?")[:12]
                handle.failure = f"generator worker {worker} of {run_id} failed on Ray node {node} " \
                                 f"({where.get('host')}, pid {where.get('pid')}): {exc.cause!r}"
                raise RuntimeError(handle.failure) from exc.cause
            except RayActorError as exc:
                if handle.killed or control.stopped():
                    return control.read_stats(worker)
                cause = actor_death(exc)
                if restarts >= limit:
                    handle.failure = (f"generator {worker} of {run_id}: its Ray actor died and ray.max_restarts="
                                      f"{limit} replacement(s) are used up ({cause})")
                    raise RuntimeError(handle.failure) from exc
                restarts += 1
                ray.kill(handle.actor, no_restart=True)  # one merely unreachable must not write beside its replacement
                generators.log(f"generator {worker}: its Ray actor died ({cause}); starting a replacement in "
                               f"its bundle ({restarts} of ray.max_restarts={limit})")
            except RuntimeError as exc:  # no replacement started in time
                handle.failure = handle.failure or f"generator {worker} of {run_id}: {exc}"
                raise RuntimeError(handle.failure) from exc
    finally:
        handle.ended = True
        if handle.actor is not None and ray.is_initialized():
            ray.kill(handle.actor, no_restart=True)  # frees the bundle; an ended actor is gone already
