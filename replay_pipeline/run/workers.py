"""The async loop's generator workers (`loop=async`): each runs in its own process (or Ray
actor, replay_pipeline/run/ray_engine.py),
rebuilds task, generator and table handles from the run's resolved configuration, and loops
generate -> score -> append until the learner tells it to stop through the file protocol
(replay_pipeline/run/files.py).

    generator worker w (own process)                   learner (the flow's process)
    ───────────────────────────────                    ────────────────────────────
    newest published weights ──────────────────────────  publish v+1 every K learner steps
    generate R rollouts, score, append  ──► rollout table ──► sample B from the window
    (stats → <run_dir>/async/worker-w.json)                  learn, record usage
    stop: STOP flag, stale heartbeat  ◄── <run_dir>/async/ ◄── heartbeat every few seconds

Decisions:
* **Two engines, one body.** `loop.engine=local` (default) starts each worker as a
  `multiprocessing` process with spawn (fork can hang LanceDB and torch, `run_worker_process`);
  `loop.engine=ray` runs the same `generator_worker` as the long method of a resident Ray
  actor, replaced when it dies (replay_pipeline/run/ray_engine.py). Either way the worker
  builds its own task, model and table handles, with `loop.worker_threads` torch threads
  (keep workers x threads + the learner's within the cores).
* **Shared paths.** Workers read the weights and write their stats and ready markers under
  `<tracking.root_dir>/<run_id>/` (the flow passes the root as an absolute path), so on a
  multi-machine cluster the run root must be on a filesystem every machine mounts at the same
  path; the rollout table may be on object storage (`buffer.uri=s3://...`). See
  infra/distributed.md.
* **Liveness.** The learner writes `<run_dir>/async/HEARTBEAT` every few seconds from a
  thread (`Heartbeat`), naming its session. A worker stops before its next batch when STOP
  exists, when the heartbeat has not changed for `loop.heartbeat_timeout` seconds of the
  worker's own clock (the learner was killed; no clock sync needed), when it names another
  session (a newer learner, e.g. a resume, took over), when another copy of the same worker
  id claimed `owner-W` (Ray's supervisor replaced it), or,
  with the local engine, when its parent process is gone. It records why in its stats
  (`stop_reason`). The learner sees a dead worker through `is_alive()` of the process or
  of the Ray generator's slot (`any_alive`, `wait_until_ready`), and a
  worker that failed fails the flow with its own error.
* **Weights.** The learner publishes after every round of `loop.updates_per_step` learner
  steps (one policy version); a worker checks LATEST before every batch and loads a newer
  version, so it is at most one batch behind. Each worker builds its generator with
  `models.loading.generator_from_pretrained` (`generator.backend`): a transformers model on the
  worker's `model.device`, or (loop.engine=local only) a vLLM engine of its own, built from
  `weights/base/` and fed every later version through `load_weights`; closed when it stops.
* **Ids.** Worker w's rollouts carry `worker = w` and ids `{run}/w{w:02d}/s{step:06d}/...`,
  where `step` is the worker's own batch counter (continued after a resume from the newest
  stored batch of that worker), so workers never write the same id.
* **Replay ratio** = uses / rows stored, emerges from the two speeds. `loop.replay_cap`: the
  learner waits while a round would push it above the cap; `loop.replay_floor`: workers wait
  while the table holds at least one minibatch and the ratio is below the floor.
* **Stopping.** The learner writes `<run_dir>/async/STOP` when it ends (finished, failed or
  killed); a worker that missed it (the learner was SIGKILLed) stops at the stale heartbeat,
  so no worker outlives the run by more than `loop.heartbeat_timeout` plus one batch.
* **Compute and provenance.** Each worker keeps cumulative tokens, rollouts and generation
  seconds in its stats file (replaced atomically after each batch), plus where it ran
  (`engine`, `host`, `pid`; `ray_node`, `ray_actor`, `ray_restarts` on
  Ray); the learner folds the numbers into its ledger.

This module must not import the learner's side of the run (phases, build, loop).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from replay_pipeline.buffer import RolloutStore
from replay_pipeline.buffer.tables import RunTables
from replay_pipeline.buffer.usage import UsageStore
from replay_pipeline.config import TASK_DEFAULTS
from replay_pipeline.models.device import resolve_device
from replay_pipeline.models.loading import generator_from_pretrained
from replay_pipeline.system.process_exit import skip_final_collection
from replay_pipeline.run.batches import generate_batch, quiet_transformers, reward_terms, score_batch
from replay_pipeline.run.files import AsyncDir, LearnerWatch
from replay_pipeline.system.runs import RunPaths
from replay_pipeline.algo.scoring import set_reward_timeout
from replay_pipeline.tasks import task_from_config
from replay_pipeline.training.weights import WeightFollower, WeightStore


def _where(parent_pid: int | None, where: dict[str, Any] | None) -> dict[str, Any]:
    """Where this worker runs, for its stats: engine, host, pid; an engine that knows more
    says it in `where` (Ray: the engine, node and actor ids). Neither a child of the learner
    nor given `where`: called directly (tests, debugging)."""
    out: dict[str, Any] = {"engine": "local" if parent_pid is not None else "direct",
                           "host": socket.gethostname(), "pid": os.getpid()}
    return out if where is None else out | where


def generator_worker(cfg_container: dict[str, Any], run_id: str, worker: int, parent_pid: int | None = None,
                     session: str | None = None, where: dict[str, Any] | None = None) -> dict[str, Any]:
    """Generator worker `worker` (see `_generator_worker`); its generator is closed however the
    worker ends (a vLLM engine gives its GPU memory back)."""
    if parent_pid is not None:  # a child of the learner: Ctrl-C reaches the whole terminal's group,
        # but only the learner decides when to stop (it writes STOP; replay_pipeline/system/stopping.py)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        skip_final_collection()  # the learner waits for this process to end
    with ExitStack() as resources:
        return _generator_worker(resources, cfg_container, run_id, worker, parent_pid, session, where)


def _generator_worker(resources: ExitStack, cfg_container: dict[str, Any], run_id: str, worker: int,
                      parent_pid: int | None = None, session: str | None = None,
                      where: dict[str, Any] | None = None) -> dict[str, Any]:
    """Body of generator worker `worker`: a spawn target (loop.engine=local, `parent_pid` is
    the learner's pid) or a Ray actor's method (`parent_pid` None; Ray passes
    `where`, the actor's node and ids for the stats); everything is rebuilt here from the
    resolved configuration. `session` is the learner's heartbeat session. Returns the
    worker's final stats (with `stop_reason`)."""
    quiet_transformers()
    cfg = OmegaConf.create(cfg_container)
    torch.set_num_threads(max(int(cfg.loop.worker_threads), 1))
    set_reward_timeout(cfg.reward.timeout)
    paths = RunPaths.make(cfg.tracking.root_dir, run_id)
    control = AsyncDir.of(paths.run_dir)
    watch = LearnerWatch(control, session, cfg.loop.get("heartbeat_timeout", 180.0), parent_pid,
                         worker, control.claim(worker))
    weights = WeightStore(paths.run_dir / "weights")
    task = task_from_config(OmegaConf.to_container(cfg.task, resolve=True), TASK_DEFAULTS)
    terms, verifier_weight = reward_terms(OmegaConf.to_container(cfg.reward, resolve=True))
    # By generator.backend, on this machine's model.device; a vLLM engine builds from the base
    # directory (version 0) and every later version arrives through load_weights.
    generator = generator_from_pretrained(cfg.generator, weights.base, resolve_device(cfg.model.device))
    resources.callback(generator.close)
    generator.policy_version = -1
    uri = cfg.buffer.uri or str(paths.lancedb)
    store = RolloutStore.open(uri, run_id, storage_options=cfg.buffer.get("storage_options"))
    usage = UsageStore.open(uri, run_id, storage_options=cfg.buffer.get("storage_options"))
    step = store.max_step(worker=worker) + 1
    stats = {"gen_tokens": 0.0, "gen_seconds": 0.0, "gen_rollouts": 0.0, "batches": 0.0,
             "wait_seconds": 0.0, "other_seconds": 0.0, **control.read_stats(worker),
             **_where(parent_pid, where), "stop_reason": None}
    floor = cfg.loop.replay_floor
    minibatch = cfg.loop.minibatch_size
    tables = RunTables(store, usage, compact_every=0, shared=True,  # the learner compacts for every writer
                       write_behind=cfg.buffer.get("write_behind", True))
    writes = tables.writes
    resources.callback(writes.close)  # also when the loop fails: no writer thread left behind
    follower = WeightFollower(weights)  # newly published versions are read off the batch's path
    resources.callback(follower.close)

    def should_stop() -> bool:
        return watch.reason() is not None

    control.write_stats(worker, stats)
    control.mark_ready(worker)

    while not should_stop():
        t_wait = time.perf_counter()
        while floor is not None and not should_stop():
            rows = store.count()
            if rows < minibatch or usage.count() / rows >= floor:
                break
            time.sleep(0.02)
        stats["wait_seconds"] += time.perf_counter() - t_wait
        if should_stop():
            break
        t0 = time.perf_counter()
        newest = follower.newest(generator.policy_version)
        if newest is not None:
            generator.load_weights(newest[1], newest[0])
        stats["weights_seconds"] = stats.get("weights_seconds", 0.0) + time.perf_counter() - t0
        batch = generate_batch(task, generator, cfg, step, worker=worker)
        table, metrics = score_batch(task, batch, run_id, cfg.loop.group_size, worker=worker,
                                     max_flagged_fraction=cfg.reward.max_flagged_fraction, terms=terms,
                                     verifier_weight=verifier_weight)
        # Committed behind the next batch's generation (one write in flight; a failed write
        # raises here at the next batch). Idempotent, so a retry never duplicates rows.
        waited = writes.waited
        tables.append_behind(table)
        stats["write_wait_seconds"] = stats.get("write_wait_seconds", 0.0) + writes.waited - waited
        total = time.perf_counter() - t0
        tokens = float(np.sum(table.column("num_tokens").to_numpy()))
        stats["gen_tokens"] += tokens
        stats["gen_seconds"] += batch.seconds + metrics["score/reward_seconds"]
        stats["gen_rollouts"] += table.num_rows
        stats["batches"] += 1
        stats["other_seconds"] += total - batch.seconds - metrics["score/reward_seconds"]
        stats["reward_sum"] = stats.get("reward_sum", 0.0) + float(np.sum(table.column("reward").to_numpy()))
        stats["last_step"] = step
        stats["policy_version"] = generator.policy_version
        control.write_stats(worker, stats)
        step += 1
    writes.close()  # the last batch is stored before the worker reports its end
    stats["stop_reason"] = watch.reason()
    control.write_stats(worker, stats)
    return stats


def run_worker_process(cfg_container: dict[str, Any], run_id: str, worker: int, control: AsyncDir,
                       registry: dict[int, Any], session: str | None = None) -> dict[str, Any]:
    """loop.engine=local: start generator process `worker` (spawn), register it in `registry`
    (so the learner can tell whether any generator is alive) and wait for it to end; returns
    its stats. Raises if it died while the run was still going (a crash, not the STOP flag)."""
    proc = multiprocessing.get_context("spawn").Process(
        target=generator_worker, args=(cfg_container, run_id, worker, os.getpid(), session),
        name=f"generator-{worker}")
    proc.start()
    registry[worker] = proc
    proc.join()
    if proc.exitcode != 0 and not control.stopped():
        raise RuntimeError(f"generator worker {worker} of {run_id} exited with code {proc.exitcode}")
    return control.read_stats(worker)


def _describe(handle: Any) -> str:
    error = getattr(handle, "error", None)
    return error() if callable(error) else f"exit code {getattr(handle, 'exitcode', '?')}"


def wait_until_ready(control: AsyncDir, registry: dict[int, Any], workers: int, timeout: float = 600.0) -> float:
    """Block until every generator has built its model (so that all W generate from the first
    round on, not only the one that started first); returns the seconds waited."""
    start = time.perf_counter()
    while control.ready() < workers:
        if len(registry) == workers and not any(p.is_alive() for p in registry.values()):
            ended = "; ".join(f"generator {w}: {_describe(p)}" for w, p in sorted(registry.items()))
            raise RuntimeError(f"every generator exited before it was ready ({ended}); see their output above")
        if time.perf_counter() - start > timeout:
            raise RuntimeError(f"only {control.ready()} of {workers} generators ready after {timeout:.0f} s "
                               "(loop.engine=ray: their output is in /tmp/ray/session_*/logs)")
        time.sleep(0.05)
    return time.perf_counter() - start


def check_generators(control: AsyncDir, registry: dict[int, Any]) -> None:
    """Raise if a generator has ended while the learner is still going: before STOP a worker
    only ends by failing (or on a stale heartbeat), so the run would go on with fewer
    generators than configured, or on stale rollouts only."""
    for w, handle in sorted(registry.items()):
        if not handle.is_alive():
            reason = control.read_stats(w).get("stop_reason")
            raise RuntimeError(f"generator {w} ended while the learner was running ({_describe(handle)}"
                               + (f"; it stopped on: {reason}" if reason else "") + ")")


def any_alive(registry: dict[int, Any], expected: int) -> bool:
    """True while a generator may still produce: some registered process (or Ray actor) is
    alive, or not every worker has started yet."""
    return len(registry) < expected or any(p.is_alive() for p in registry.values())


def worker_config(settings: Any, paths: RunPaths) -> dict[str, Any]:
    """The resolved configuration the generators rebuild themselves from, with the run root
    (and a local buffer.uri) made absolute: a Ray actor's working directory is its own."""
    container = settings.container()
    container["tracking"]["root_dir"] = str(paths.root)
    uri = container["buffer"].get("uri")
    if uri and "://" not in str(uri):
        container["buffer"]["uri"] = str(Path(str(uri)).expanduser().resolve())
    return container
