"""The Dask engine of the async loop's generators (`loop.engine=dask`, needs
`dask[distributed]`, imported only here and only when used): the same
`generator_worker` (replay_pipeline/run/workers.py) as a task on a Dask cluster, a
`distributed.LocalCluster` the flow starts (`loop.workers` worker processes, one thread each,
closed at the end) or the existing scheduler at `loop.dask_address`.

**Dask without a Dask task runner.** The flow keeps Prefect's default (thread) task runner,
and each `generator-W` Prefect task submits `generator_worker` to a `distributed.Client` and
waits on its future. prefect-dask's `DaskTaskRunner` would send *every* task of the flow to
the cluster, but the learner's tasks share one in-process `TrainingRun` (model, optimizer,
table and MLflow handles) that must not move; and a Prefect task run on a Dask worker reports
its state from that machine, which cannot reach the flow's embedded (ephemeral) Prefect
server. Supervising from the flow keeps every generator a task run in the UI, works with the
embedded server and with a real one, and needs only `dask[distributed]` (not prefect-dask).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from concurrent.futures import CancelledError
from contextlib import contextmanager
from typing import Any, Iterator

from replay_pipeline.config import DASK_INSTALL, ConfigError
from replay_pipeline.run.files import AsyncDir
from replay_pipeline.run.workers import generator_worker

#: Seconds to reach a Dask scheduler (TCP connect, then the Dask handshake).
DASK_CONNECT_TIMEOUT = 10.0


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


def check_dask_scheduler(address: str, timeout: float = DASK_CONNECT_TIMEOUT) -> int:
    """Prove a Dask scheduler answers at `address` before any work starts; returns its worker
    threads. Raises ConfigError saying how to fix it. A plain TCP probe first (a refused or
    unroutable address fails in moments), then Dask's `identity` call under one deadline (a
    `distributed.Client` would wait forever on a listener that never answers)."""
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
        from distributed.comm import connect  # optional dependency (the dask extra)
    except ImportError as exc:
        raise ConfigError(f"loop.engine=dask needs dask.distributed: {DASK_INSTALL}") from exc

    from distributed.security import Security  # optional dependency (the dask extra)

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
    import dask  # optional dependency (the dask extra), as below
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
    from distributed import Client  # optional dependency (the dask extra)

    with Client(address, timeout=DASK_CONNECT_TIMEOUT) as client:
        threads = client.nthreads()
        log(f"Dask scheduler at {address}: {len(threads)} worker(s), {sum(threads.values())} thread(s)")
        if sum(threads.values()) < workers:
            log(f"warning: the Dask cluster at {address} has {sum(threads.values())} worker thread(s) for "
                f"loop.workers={workers} generators; the rest wait until workers join "
                f"(`dask worker {address} --nthreads 1` on each generator machine)")
        yield client
