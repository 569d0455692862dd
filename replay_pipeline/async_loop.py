"""The asynchronous loop (`loop=async`): generator processes and the learner run at the same
time and meet only at the rollout table and the weight store (replay_pipeline/weights.py).

    generator worker w (own process)                   learner (the flow's process)
    ───────────────────────────────                    ────────────────────────────
    newest published weights ──────────────────────────  publish v+1 every K learner steps
    generate R rollouts, score, append  ──► rollout table ──► sample B from the window
    (stats → <run_dir>/async/worker-w.json)                  learn, record usage

Decisions:
* **Separate processes, spawn start method.** Each worker is a `multiprocessing` process
  started with spawn (fork can hang LanceDB and torch); it builds its own task, model and
  table handles from the run's resolved configuration. `loop.worker_threads` torch threads
  each (keep workers x threads + the learner's within the cores).
* **Weights.** The learner publishes after every round of `loop.updates_per_step` learner
  steps (one policy version); a worker checks LATEST before every batch and loads a newer
  version, so it is at most one batch behind.
* **Ids.** Worker w's rollouts carry `worker = w` and ids `{run}/w{w:02d}/s{step:06d}/...`,
  where `step` is the worker's own batch counter (continued after a resume from the newest
  stored batch of that worker), so workers never write the same id.
* **Replay ratio** = uses / rows stored, emerges from the two speeds. `loop.replay_cap`: the
  learner waits while a round would push it above the cap; `loop.replay_floor`: workers wait
  while the table holds at least one minibatch and the ratio is below the floor.
* **Stopping.** The learner writes `<run_dir>/async/STOP` when it ends (finished, failed or
  killed); workers check it before every batch and also stop when their parent process is
  gone, so no worker outlives the run.
* **Compute.** Each worker keeps cumulative tokens, rollouts and generation seconds in its
  stats file (replaced atomically after each batch); the learner folds them into its ledger.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STOP = "STOP"


@dataclass(frozen=True)
class AsyncDir:
    """<run_dir>/async/: the STOP flag and one stats file (and log) per worker."""

    path: Path

    @classmethod
    def of(cls, run_dir: Path) -> "AsyncDir":
        return cls(Path(run_dir) / "async")

    def reset(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / STOP).unlink(missing_ok=True)
        for marker in self.path.glob("ready-*"):
            marker.unlink()

    def mark_ready(self, worker: int) -> None:
        (self.path / f"ready-{worker}").write_text(str(os.getpid()))

    def ready(self) -> int:
        """Workers that have built their model and are about to generate."""
        return len(list(self.path.glob("ready-*")))

    def stop(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / STOP).write_text(str(time.time()))

    def stopped(self) -> bool:
        return (self.path / STOP).exists()

    def stats_path(self, worker: int) -> Path:
        return self.path / f"worker-{worker}.json"

    def read_stats(self, worker: int) -> dict[str, float]:
        try:
            return json.loads(self.stats_path(worker).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def write_stats(self, worker: int, stats: dict[str, float]) -> None:
        tmp = self.path / f".worker-{worker}.json.tmp"
        tmp.write_text(json.dumps(stats))
        os.replace(tmp, self.stats_path(worker))

    def totals(self, workers: int) -> dict[str, float]:
        """Sum of every worker's cumulative stats."""
        out: dict[str, float] = {}
        for w in range(workers):
            for k, v in self.read_stats(w).items():
                out[k] = out.get(k, 0.0) + float(v)
        return out


def generator_worker(cfg_container: dict[str, Any], run_id: str, worker: int, parent_pid: int) -> None:
    """Body of generator process `worker` (a spawn target: everything is rebuilt here)."""
    import numpy as np
    import torch
    from omegaconf import OmegaConf

    from replay_pipeline.buffer import RolloutStore
    from replay_pipeline.buffer.usage import UsageStore
    from replay_pipeline.generation import TransformersGenerator
    from replay_pipeline.models.loading import load_pretrained
    from replay_pipeline.runs import RunPaths
    from replay_pipeline.tasks import task_from_config
    from replay_pipeline.trainer import generate_batch, score_batch
    from replay_pipeline.weights import WeightStore

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cfg = OmegaConf.create(cfg_container)
    torch.set_num_threads(max(int(cfg.loop.worker_threads), 1))
    paths = RunPaths.make(cfg.tracking.root_dir, run_id)
    control = AsyncDir.of(paths.run_dir)
    weights = WeightStore(paths.run_dir / "weights")
    task = task_from_config(OmegaConf.to_container(cfg.task, resolve=True))
    model, tokenizer = load_pretrained(weights.base)
    generator = TransformersGenerator.from_config(model, tokenizer, cfg.generator, copy_model=False)
    generator.policy_version = -1
    uri = cfg.buffer.uri or str(paths.lancedb)
    store, usage = RolloutStore.open(uri, run_id), UsageStore.open(uri, run_id)
    step = store.max_step(worker=worker) + 1
    stats = {"gen_tokens": 0.0, "gen_seconds": 0.0, "gen_rollouts": 0.0, "batches": 0.0,
             "wait_seconds": 0.0, "other_seconds": 0.0, **control.read_stats(worker)}
    floor = cfg.loop.replay_floor
    minibatch = cfg.loop.minibatch_size

    def should_stop() -> bool:
        return control.stopped() or os.getppid() != parent_pid

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
        latest = weights.latest_version()
        if latest is not None and latest != generator.policy_version:
            version, state = weights.load_latest()
            generator.load_weights(state, version)
        batch = generate_batch(task, generator, cfg, step, worker=worker)
        table, metrics = score_batch(task, batch, run_id, cfg.loop.group_size, worker=worker)
        store.append(table)
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


def run_worker_process(cfg_container: dict[str, Any], run_id: str, worker: int, control: AsyncDir,
                       registry: dict[int, Any]) -> dict[str, float]:
    """Start generator process `worker` (spawn), register it in `registry` (so the learner
    can tell whether any generator is alive) and wait for it to end; returns its stats.
    Raises if it died while the run was still going (a crash, not the STOP flag)."""
    import multiprocessing

    proc = multiprocessing.get_context("spawn").Process(
        target=generator_worker, args=(cfg_container, run_id, worker, os.getpid()), name=f"generator-{worker}")
    proc.start()
    registry[worker] = proc
    proc.join()
    if proc.exitcode != 0 and not control.stopped():
        raise RuntimeError(f"generator worker {worker} of {run_id} exited with code {proc.exitcode}")
    return control.read_stats(worker)


def wait_until_ready(control: AsyncDir, registry: dict[int, Any], workers: int, timeout: float = 600.0) -> float:
    """Block until every generator process has built its model (so that all W generate from
    the first round on, not only the one that started first); returns the seconds waited."""
    start = time.perf_counter()
    while control.ready() < workers:
        if len(registry) == workers and not any(p.is_alive() for p in registry.values()):
            raise RuntimeError(f"every generator process exited before it was ready; see their output above")
        if time.perf_counter() - start > timeout:
            raise RuntimeError(f"only {control.ready()} of {workers} generator processes ready after {timeout:.0f} s")
        time.sleep(0.05)
    return time.perf_counter() - start


def any_alive(registry: dict[int, Any], expected: int) -> bool:
    """True while a generator may still produce: some registered process is alive, or not
    every worker has started yet."""
    return len(registry) < expected or any(p.is_alive() for p in registry.values())
