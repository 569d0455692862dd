"""The asynchronous loop (`loop=async`): generator workers and the learner run at the same
time and meet only at the rollout table and the weight store (replay_pipeline/weights.py).

    generator worker w (own process)                   learner (the flow's process)
    ───────────────────────────────                    ────────────────────────────
    newest published weights ──────────────────────────  publish v+1 every K learner steps
    generate R rollouts, score, append  ──► rollout table ──► sample B from the window
    (stats → <run_dir>/async/worker-w.json)                  learn, record usage
    stop: STOP flag, stale heartbeat  ◄── <run_dir>/async/ ◄── heartbeat every few seconds

Decisions:
* **Two engines, one body.** `loop.engine=local` (default) starts each worker as a
  `multiprocessing` process with spawn (fork can hang LanceDB and torch); `loop.engine=dask`
  runs the same `generator_worker` as a task on a Dask cluster: a `distributed.LocalCluster`
  the flow starts (`loop.workers` worker processes, one thread each, closed at the end) or
  the existing scheduler at `loop.dask_address`. Either way the worker builds its own task,
  model and table handles from the run's resolved configuration, with `loop.worker_threads`
  torch threads (keep workers x threads + the learner's within the cores).
* **Dask without a Dask task runner.** The flow keeps Prefect's default (thread) task runner,
  and each `generator-W` Prefect task submits `generator_worker` to a `distributed.Client`
  and waits on its future. prefect-dask's `DaskTaskRunner` would send *every* task of the
  flow to the cluster, but the learner's tasks share one in-process `TrainingRun` (model,
  optimizer, table and MLflow handles) that must not move; and a Prefect task run on a Dask
  worker reports its state from that machine, which cannot reach the flow's embedded
  (ephemeral) Prefect server. Supervising from the flow keeps every generator a task run in
  the UI, works with the embedded server and with a real one, and needs only
  `dask[distributed]` (not prefect-dask).
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
  id claimed `owner-W` (Dask restarted it elsewhere), or, with the local engine, when its
  parent process is gone. It records why in its stats (`stop_reason`). The learner sees a
  dead worker through `is_alive()` of the process or of the Dask future (`any_alive`,
  `wait_until_ready`), and a worker that failed fails the flow with its own error.
* **Weights.** The learner publishes after every round of `loop.updates_per_step` learner
  steps (one policy version); a worker checks LATEST before every batch and loads a newer
  version, so it is at most one batch behind. Each worker builds its generator with
  `generation.build_generator` (`generator.backend`): a transformers model on the worker's
  `model.device`, or (loop.engine=local only) a vLLM engine of its own, built from
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
  (`engine`, `host`, `pid`, and `dask_worker` on Dask); the learner folds the numbers into
  its ledger.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

STOP = "STOP"
HEARTBEAT = "HEARTBEAT"
#: Seconds to reach a Dask scheduler (TCP connect, then the Dask handshake).
DASK_CONNECT_TIMEOUT = 10.0
DASK_INSTALL = "pip install 'dask[distributed]' (CPU machines: pip install -c infra/constraints-cpu.txt 'dask[distributed]')"


@dataclass(frozen=True)
class AsyncDir:
    """<run_dir>/async/: the STOP flag, the learner's heartbeat, ready markers and one stats
    file (and log) per worker."""

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
        (self.path / f"ready-{worker}").write_text(f"{socket.gethostname()} {os.getpid()}")

    def ready(self) -> int:
        """Workers that have built their model and are about to generate."""
        return len(list(self.path.glob("ready-*")))

    def stop(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / STOP).write_text(str(time.time()))

    def stopped(self) -> bool:
        return (self.path / STOP).exists()

    def beat(self, session: str, count: int) -> None:
        """Replace the heartbeat file (atomically): the learner `session` is alive."""
        tmp = self.path / f".{HEARTBEAT}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"session": session, "beat": count, "time": time.time()}))
        os.replace(tmp, self.path / HEARTBEAT)

    def heartbeat(self) -> dict[str, Any] | None:
        """The newest heartbeat, or None if there is none (or it is being replaced)."""
        try:
            return json.loads((self.path / HEARTBEAT).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def claim(self, worker: int) -> str:
        """Make the calling generator the owner of worker id `worker`; returns its token. A copy
        that Dask restarted elsewhere claims the id, and the old copy (on a machine the
        scheduler lost but that still runs) sees it and stops."""
        token = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        tmp = self.path / f".owner-{worker}.{os.getpid()}.tmp"
        tmp.write_text(token)
        os.replace(tmp, self.path / f"owner-{worker}")
        return token

    def owner(self, worker: int) -> str | None:
        try:
            return (self.path / f"owner-{worker}").read_text()
        except FileNotFoundError:
            return None

    def stats_path(self, worker: int) -> Path:
        return self.path / f"worker-{worker}.json"

    def read_stats(self, worker: int) -> dict[str, Any]:
        try:
            return json.loads(self.stats_path(worker).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def write_stats(self, worker: int, stats: dict[str, Any]) -> None:
        tmp = self.path / f".worker-{worker}.json.tmp"
        tmp.write_text(json.dumps(stats))
        os.replace(tmp, self.stats_path(worker))

    def totals(self, workers: int) -> dict[str, float]:
        """Sum of every worker's cumulative numeric stats (`engine`, `host`, ... are skipped)."""
        out: dict[str, float] = {}
        for w in range(workers):
            for k, v in self.read_stats(w).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[k] = out.get(k, 0.0) + float(v)
        return out


def heartbeat_interval(timeout: float) -> float:
    """How often the learner beats: six beats per timeout, between 0.2 and 10 seconds."""
    return min(max(float(timeout) / 6.0, 0.2), 10.0)


class Heartbeat:
    """The learner's heartbeat: a daemon thread replacing <run_dir>/async/HEARTBEAT every
    `heartbeat_interval(timeout)` seconds while the context is open. It beats as long as the
    learner's process lives (a long evaluation or checkpoint does not stop it); a SIGKILL does."""

    def __init__(self, control: AsyncDir, timeout: float):
        self.control = control
        self.interval = heartbeat_interval(timeout)
        self.session = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="learner-heartbeat", daemon=True)
        self._count = 0

    def _beat(self) -> None:
        self._count += 1
        self.control.beat(self.session, self._count)

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            try:
                self._beat()
            except OSError:  # a full or flaky filesystem: try again next time
                pass

    def __enter__(self) -> "Heartbeat":
        self.control.path.mkdir(parents=True, exist_ok=True)
        self._beat()  # before any worker starts
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join()


class LearnerWatch:
    """A worker's view of its learner: `reason()` is None while the worker should go on, else
    why it should stop. The heartbeat counts as stale when its content has not changed for
    `timeout` seconds measured on this machine's monotonic clock (so the machines' clocks need
    not agree); it (and the owner of the worker id, when `worker` and `token` are given) is
    read at most every `min(1, timeout / 4)` seconds."""

    def __init__(self, control: AsyncDir, session: str | None, timeout: float, parent_pid: int | None = None,
                 worker: int | None = None, token: str | None = None):
        self.control, self.session, self.timeout, self.parent_pid = control, session, float(timeout), parent_pid
        self.worker, self.token = worker, token
        self._every = min(1.0, self.timeout / 4)
        self._last: dict[str, Any] | None = control.heartbeat()
        self._changed = self._checked = time.monotonic()
        self._reason: str | None = None

    def reason(self) -> str | None:
        if self._reason is None:
            self._reason = self._check()
        return self._reason

    def _check(self) -> str | None:
        if self.control.stopped():
            return "stop flag"
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            return "learner process gone"
        now = time.monotonic()
        if now - self._checked < self._every:
            return None
        self._checked = now
        beat = self.control.heartbeat()
        if beat is not None and beat != self._last:
            self._last, self._changed = beat, now
        if beat is not None and self.session is not None and beat.get("session") != self.session:
            return f"another learner took over (session {beat.get('session')})"
        if self.token is not None and self.control.owner(self.worker) != self.token:
            return f"another copy of generator {self.worker} took over ({self.control.owner(self.worker)})"
        if now - self._changed > self.timeout:
            return f"no learner heartbeat for {now - self._changed:.0f} s (loop.heartbeat_timeout={self.timeout:g})"
        return None


def _where(parent_pid: int | None) -> dict[str, Any]:
    """Where this worker runs, for its stats: engine, host, pid (and the Dask worker)."""
    out: dict[str, Any] = {"engine": "local" if parent_pid is not None else "dask",
                           "host": socket.gethostname(), "pid": os.getpid()}
    if parent_pid is None:
        try:
            from distributed import get_worker

            out["dask_worker"] = get_worker().address
        except (ImportError, ValueError):  # called outside a Dask worker (tests, debugging)
            out["engine"] = "direct"
    return out


def generator_worker(cfg_container: dict[str, Any], run_id: str, worker: int, parent_pid: int | None = None,
                     session: str | None = None) -> dict[str, Any]:
    """Generator worker `worker` (see `_generator_worker`); its generator is closed however the
    worker ends (a vLLM engine gives its GPU memory back)."""
    with ExitStack() as resources:
        return _generator_worker(resources, cfg_container, run_id, worker, parent_pid, session)


def _generator_worker(resources: ExitStack, cfg_container: dict[str, Any], run_id: str, worker: int,
                      parent_pid: int | None = None, session: str | None = None) -> dict[str, Any]:
    """Body of generator worker `worker`: a spawn target (loop.engine=local, `parent_pid` is
    the learner's pid) or a Dask task (loop.engine=dask, `parent_pid` None); everything is
    rebuilt here from the resolved configuration. `session` is the learner's heartbeat
    session. Returns the worker's final stats (with `stop_reason`)."""
    import numpy as np
    import torch
    from omegaconf import OmegaConf

    from replay_pipeline.buffer import RolloutStore
    from replay_pipeline.buffer.usage import UsageStore
    from replay_pipeline.buffer.writer import WriteBehind
    from replay_pipeline.generation import generator_from_pretrained
    from replay_pipeline.models.device import resolve_device
    from replay_pipeline.runs import RunPaths
    from replay_pipeline.tasks import task_from_config
    from replay_pipeline.trainer import generate_batch, retry_storage, score_batch
    from replay_pipeline.weights import WeightFollower, WeightStore

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cfg = OmegaConf.create(cfg_container)
    torch.set_num_threads(max(int(cfg.loop.worker_threads), 1))
    paths = RunPaths.make(cfg.tracking.root_dir, run_id)
    control = AsyncDir.of(paths.run_dir)
    watch = LearnerWatch(control, session, cfg.loop.get("heartbeat_timeout", 180.0), parent_pid,
                         worker, control.claim(worker))
    weights = WeightStore(paths.run_dir / "weights")
    task = task_from_config(OmegaConf.to_container(cfg.task, resolve=True))
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
             **_where(parent_pid), "stop_reason": None}
    floor = cfg.loop.replay_floor
    minibatch = cfg.loop.minibatch_size
    writes = WriteBehind(enabled=cfg.buffer.get("write_behind", True))
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
        table, metrics = score_batch(task, batch, run_id, cfg.loop.group_size, worker=worker)
        # Committed behind the next batch's generation (one write in flight; a failed write
        # raises here at the next batch). Idempotent, so a retry never duplicates rows.
        waited = writes.waited
        writes.submit(lambda table=table: retry_storage(lambda attempt: store.append(table)))
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
    import multiprocessing

    proc = multiprocessing.get_context("spawn").Process(
        target=generator_worker, args=(cfg_container, run_id, worker, os.getpid(), session),
        name=f"generator-{worker}")
    proc.start()
    registry[worker] = proc
    proc.join()
    if proc.exitcode != 0 and not control.stopped():
        raise RuntimeError(f"generator worker {worker} of {run_id} exited with code {proc.exitcode}")
    return control.read_stats(worker)


class DaskGenerator:
    """A generator running as a Dask task, as the learner sees it: `is_alive()` and `kill()`
    like a multiprocessing.Process, `error()` once it has failed."""

    def __init__(self, future: Any):
        self.future = future

    def is_alive(self) -> bool:
        return not self.future.done()

    def kill(self) -> None:
        # Releases the task; a task already running on a worker ends at its next STOP or
        # heartbeat check (a Python thread cannot be interrupted), and with the flow's own
        # LocalCluster when the cluster closes.
        self.future.cancel()

    def error(self) -> str:
        if self.future.status == "error":
            return repr(self.future.exception())
        return self.future.status


def run_dask_worker(client: Any, cfg_container: dict[str, Any], run_id: str, worker: int, control: AsyncDir,
                    registry: dict[int, Any], session: str | None = None) -> dict[str, Any]:
    """loop.engine=dask: submit generator worker `worker` to the Dask cluster of `client`,
    register it in `registry` and wait for it to end; returns its stats. Raises with the
    worker's own error if it failed (an exception, or KilledWorker when its Dask worker
    process died) or was lost while the run was still going."""
    from concurrent.futures import CancelledError

    future = client.submit(generator_worker, cfg_container, run_id, worker, None, session,
                           key=f"generator-{worker}-{run_id}-{secrets.token_hex(4)}", pure=False, retries=0)
    registry[worker] = DaskGenerator(future)
    try:
        return future.result()
    except CancelledError as exc:
        if control.stopped():  # cancelled by the learner at the end of the run
            return control.read_stats(worker)
        raise RuntimeError(f"generator worker {worker} of {run_id} was cancelled on the Dask cluster "
                           f"({exc or 'the scheduler connection was lost'})") from exc
    except Exception as exc:
        where = control.read_stats(worker).get("dask_worker", "a Dask worker")
        raise RuntimeError(f"generator worker {worker} of {run_id} failed on {where}: {exc!r}") from exc


_ADDRESS = re.compile(r"((tcp|tls|ws|wss|ucx)://)?(\[[0-9A-Fa-f:.]+\]|[^\s/:\[\]]+):[0-9]{1,5}")


def valid_dask_address(address: str) -> bool:
    """`[scheme://]host:port`, e.g. tcp://10.0.0.5:8786 (what `dask scheduler` prints)."""
    return _ADDRESS.fullmatch(str(address)) is not None


def check_dask_scheduler(address: str, timeout: float = DASK_CONNECT_TIMEOUT) -> int:
    """Prove a Dask scheduler answers at `address` before any work starts; returns its worker
    threads. Raises ConfigError saying how to fix it. A plain TCP probe first (a refused or
    unroutable address fails in moments), then Dask's `identity` call under one deadline (a
    `distributed.Client` would wait forever on a listener that never answers)."""
    import asyncio

    from replay_pipeline.config import ConfigError

    fix = (f"start one with `dask scheduler --host HOST --port PORT` and generator workers with "
           f"`dask worker {address} --nthreads 1`, fix loop.dask_address, or drop loop.dask_address "
           "to start a local cluster")
    host_port = str(address).split("://", 1)[-1]
    host, _, port = host_port.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"loop.dask_address={address}: cannot connect ({exc}); {fix}") from exc
    try:
        from distributed.comm import connect
    except ImportError as exc:
        raise ConfigError(f"loop.engine=dask needs dask.distributed: {DASK_INSTALL}") from exc

    from distributed.security import Security

    async def identity() -> dict[str, Any]:  # tls:// takes its certificates from Dask's config
        comm = await connect(address, timeout=timeout, **Security().get_connection_args("client"))
        try:
            await comm.write({"op": "identity", "reply": True})
            return await comm.read()
        finally:
            comm.abort()

    try:
        reply = asyncio.run(asyncio.wait_for(identity(), timeout))
    except Exception as exc:  # TimeoutError, OSError, or a peer speaking another protocol
        raise ConfigError(f"loop.dask_address={address}: no Dask scheduler answered within {timeout:g} s "
                          f"({type(exc).__name__}: {exc}); {fix}") from exc
    if not isinstance(reply, dict) or reply.get("type") != "Scheduler":
        raise ConfigError(f"loop.dask_address={address} answered as {reply!r:.80}, not as a Dask scheduler; {fix}")
    return sum(int(w.get("nthreads", 0)) for w in reply.get("workers", {}).values())


@contextmanager
def dask_client(workers: int, address: str | None, log=print) -> Iterator[Any]:
    """A `distributed.Client` for loop.engine=dask: on a LocalCluster started here (`workers`
    worker processes with one thread each, on loopback, closed when the context ends) when
    `address` is None, else on the existing scheduler at `address` (left running)."""
    import logging

    import dask
    from distributed import Client, LocalCluster

    quiet = logging.getLogger("distributed")  # the scheduler's and nannies' INFO chatter in this process
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        if address is None:
            # Worker processes set up logging when they import distributed: tell them before.
            with dask.config.set({"distributed.nanny.pre-spawn-environ.DASK_LOGGING__DISTRIBUTED": "warning"}):
                cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                                       dashboard_address=None, memory_limit=0, silence_logs=logging.WARNING)
            with cluster, Client(cluster) as client:
                log(f"Dask LocalCluster at {cluster.scheduler_address}: {workers} generator worker process(es)")
                yield client
        else:
            with _remote_client(address, workers, log) as client:
                yield client
    finally:
        quiet.setLevel(level)


@contextmanager
def _remote_client(address: str, workers: int, log) -> Iterator[Any]:
    from distributed import Client

    with Client(address, timeout=DASK_CONNECT_TIMEOUT) as client:
        threads = client.nthreads()
        log(f"Dask scheduler at {address}: {len(threads)} worker(s), {sum(threads.values())} thread(s)")
        if sum(threads.values()) < workers:
            log(f"warning: the Dask cluster at {address} has {sum(threads.values())} worker thread(s) for "
                f"loop.workers={workers} generators; the rest wait until workers join "
                f"(`dask worker {address} --nthreads 1` on each generator machine)")
        yield client


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
                               "(loop.engine=dask: does the cluster have a free worker thread for each?)")
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
    """True while a generator may still produce: some registered process (or Dask task) is
    alive, or not every worker has started yet."""
    return len(registry) < expected or any(p.is_alive() for p in registry.values())
