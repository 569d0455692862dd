"""The temporary Prefect API server of a local `python -m flows.train` or `python -m
flows.evaluate` (when no PREFECT_API_URL is set), started by us instead of by Prefect so that
a stop behaves. (`python -m flows.sweep`'s own flow still runs on Prefect's; its children are
`flows.train` commands, each with a server of its own.)

Prefect's own temporary server is a child in the trainer's process group: Ctrl-C in the terminal
reaches it too, it dies first, and the trainer then retries the dead server for more than a
minute before exiting with a traceback; after `kill <pid>` it outlives the trainer. This one is
the same server (Prefect's uvicorn app, same settings, UI off) with two differences:

* it runs in a session of its own (`start_new_session`), so a terminal's Ctrl-C reaches only
  the trainer, which then reports the flow run's end to a server that is still there;
* it watches its parent and stops when the parent is gone, however the parent ended
  (kill -9 included), writing what its services hold first, so no server process is left
  behind and what the trainer sent it is written.

`temporary_server()` starts it (reusing one per process), points Prefect's settings at it
and stops it at exit. `launch()` starts its process without waiting: `python -m flows.train`
calls it first thing (unless asked for --help or --cfg), so the server boots (about 3 s of CPU)
on one core while the trainer checks its configuration, imports and builds its run on the
other, and `temporary_server()` then only waits for whatever is left of the boot; a command
line refused meanwhile stops it at exit (atexit, and its watchdog).
`python -m flows.prefect_server --port N --parent PID` is the server process itself; `spawn()`
starts one and `wait_ready()` waits for it (the tests share one a run root this way,
tests/servers.py).

A new PREFECT_HOME's database starts as a copy of an empty, migrated one (`_seed_database`,
through `replay_pipeline.tracking.sqlite_templates`): Prefect migrates a new SQLite database on its first
start, about 14 s of CPU here, and registers its block types, about 2.4 s more; every new run
root has a new home. The first server to make one keeps a copy, migrated and registered and
before it serves, as `<cache>/prefect-db-<prefect version>-<key>/prefect.db` (`<key>`: a hash
of the block types this environment has, so that a collection installed later makes a new
template); later new homes link a copy into place only while none exists. Either way the seed
then writes the home's memo of the registration (Prefect's own `memo_store.toml`, a hash that
includes this home's database URL), so the server's start finds the schema at head and the
block types registered and does neither again. Any failure here leaves the home to Prefect's
own migration and registration. What it saves a new run root: docs/performance.md, "Start-up".

The server's loop services that a trainer's private server has no work for are off
(`IDLE_SERVICES`: deployment schedules, late scheduled runs, workers' heartbeats, pause
expirations, concurrency leases, automations; nothing of a local run uses them, and a setting
in the environment or profile wins). They wake every 5-60 s: on an 80-step run at one thread
they took 0.2-0.4 s of the server's 5.3 s of CPU. The task-run recorder and the event
persister stay: they are what records the run's task runs and events in PREFECT_HOME's
database for `prefect server start` to show afterwards (the recorder is the server's biggest
cost after its boot: about 1 s of CPU for the 130 task-run state events of that run).

The private server runs without Prefect's background worker (docket's `Worker`, which runs
the server's perpetual services and a few tasks its API enqueues). Every perpetual service
that would give it work here is off, yet idle it polls its queues, its scheduler and its
cancellation channel: 14-15 ms of the server's CPU a second and about 90 of its 120 wake-ups a
second (per-thread /proc readings and py-spy), each one taken from a core torch is
spinning on; without it, 3-4 ms and about 30 (`python -m replay_pipeline.benchmarks.orchestration`
prints each side's idle rate). What its API still enqueues (a deleted flow run's logs, the
check of a run left CANCELLING, an event vacuum an hour in) then waits in the server's memory
and ends with it: a per-run server that ends with its trainer has no use for them, and
`prefect server start` on the same home runs its worker as usual. `spawn(...,
background_worker=True)` keeps it (the orchestration benchmark's Prefect-defaults side).

The task-run recorder writes in batches on the private server (`RECORDER_BATCH`: up to 200
events, at least every 2 s; Prefect's default writes each event in a transaction of its own,
and the event persister already batches, 20 events or 5 s). Its work lands on the cores torch
is using, mostly in the round after each evaluation (the evaluation task's end, the next rounds
task's start). In the peer benchmark the batches take a few per cent off ours against the
bare loop, most of it in the round after each evaluation. A batch is held in the server's memory
until it is written: the server writes it when it stops, whether the trainer stops it (SIGTERM
at exit) or its watchdog finds the trainer gone (even after kill -9: the watchdog then stops the
server the same way, and ends it hard only if that takes over STOP_GRACE_S). Meanwhile a task's
state reaches PREFECT_HOME's database up to 2 s late; the run's own records (rollouts, MLflow)
do not go through the server. What one task run costs this server and the trainer, with and
without the batches, is measured by `python -m replay_pipeline.benchmarks.orchestration`
(docs/performance.md, "Prefect's cost per task run"). Larger batches for the event persister too
were measured there and not adopted: no difference the repeats could see.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import flows  # noqa: F401  (Prefect's environment before prefect is imported)
from replay_pipeline.tracking import sqlite_templates

#: Prefect server services off on the trainer's private server (see the module's docstring).
IDLE_SERVICES = ("SCHEDULER", "LATE_RUNS", "FOREMAN", "PAUSE_EXPIRATIONS", "REPOSSESSOR", "TRIGGERS")
#: The trainer's private server writes task-run states in batches (Prefect's default is one
#: transaction per event); see the module's docstring. A setting in the environment wins.
RECORDER_BATCH = {"PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "200",
                  "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "2"}
#: Seconds a stopping server gets to write what it holds before it is killed (SIGKILL from the
#: trainer's `stop`, `os._exit` from its own watchdog).
STOP_GRACE_S = 10.0

_server: subprocess.Popen | None = None
_url: str | None = None  # the server's API once it answered
_launched: str | None = None  # the API it will answer at, from launch() until then


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _configured_url() -> str | None:
    # start-up cost: prefect, once a flow is about to run
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def spawn(parent: int, settings_env: dict[str, str] | None = None, defaults: dict[str, str] | None = None,
          background_worker: bool = False) -> tuple[subprocess.Popen, str]:
    """Start a server process watching `parent` on a free port, without waiting for it; returns
    the process and the API it will answer at. Its environment is this process's with the
    idle services off and `defaults` (a setting in the environment wins over both), and
    `settings_env` on top; it runs Prefect's background worker only with `background_worker`
    (see the module's docstring)."""
    port = _free_port()
    env = {**{f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false" for name in IDLE_SERVICES}, **(defaults or {}),
           **os.environ, **(settings_env or {}),
           "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "flows.prefect_server", "--port", str(port),
                             "--parent", str(parent), *(["--background-worker"] if background_worker else [])],
                            env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}/api"


def wait_ready(proc: subprocess.Popen, url: str, timeout: float) -> None:
    """Wait until the server `proc` answers at `url`; RuntimeError (the server left running)
    if it exits first or does not answer within `timeout` seconds."""
    # start-up cost: httpx, once a flow is about to run
    import httpx

    deadline = time.monotonic() + timeout
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the temporary Prefect server exited with code {proc.returncode} "
                                   "before it was ready; set PREFECT_API_URL to use a running server")
            try:
                if client.get(f"{url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    raise RuntimeError(f"the temporary Prefect server was not ready within {timeout:.0f} s "
                       "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)")


def launch(settings_env: dict[str, str] | None = None) -> None:
    """Start this process's server without waiting for it (nothing when PREFECT_API_URL is in
    the environment or one is started already). Prefect is not imported here: the server
    process reads the same environment and profile as this one would (`settings_env` adds
    settings made in this process, as `_start` passes them)."""
    global _server, _launched
    if _server is not None or os.environ.get("PREFECT_API_URL"):
        return
    _server, _launched = spawn(os.getpid(), settings_env, RECORDER_BATCH)
    atexit.register(stop)


def _start(timeout: float) -> str:
    """The launched server's API once it answers (launched here if it was not)."""
    global _url
    # start-up cost: prefect, once a flow is about to run
    from prefect.settings import get_current_settings

    if _server is None:
        launch(get_current_settings().to_environment_variables(exclude_unset=True))
    try:
        wait_ready(_server, _launched, timeout)
    except RuntimeError:
        stop()
        raise
    _url = _launched
    return _url


def stop() -> None:
    """Stop the temporary server (SIGTERM: it writes what its services hold; SIGKILL after
    STOP_GRACE_S)."""
    global _server, _url, _launched
    if _server is None:
        return
    proc, _server, _url, _launched = _server, None, None, None
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def temporary_server(log: Callable[[str], Any] | None = None) -> Iterator[str | None]:
    """Prefect's API for the body of the `with`: PREFECT_API_URL when set (yields it), else
    this process's temporary server (started once, stopped at exit)."""
    # start-up cost: prefect, once a flow is about to run
    from prefect.settings import PREFECT_API_URL, temporary_settings

    configured = _configured_url()
    if configured:
        if configured not in (_url, _launched):
            stop()  # launched early for nothing: a profile names a server
        yield configured
        return
    url = _url or _start(float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", 120)))
    (log or _say)(ui_hint())
    flow_runs = logging.getLogger("prefect.flow_runs")
    flow_runs.addFilter(_no_dead_link)
    try:
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url
    finally:
        flow_runs.removeFilter(_no_dead_link)


def ui_hint() -> str:
    """What a run on the private server prints instead of Prefect's "View at <url>" link: that
    server has no UI and ends with the run, so the link would lead nowhere. Its records stay in
    PREFECT_HOME's database, which `prefect server start` on the same home shows."""
    home = os.environ.get("PREFECT_HOME", "<root>/.prefect")
    return (f"Prefect: this run's flow and task runs go to a private server without a UI that ends "
            f"with it. To browse them afterwards: PREFECT_HOME={home} prefect server start "
            f"(then http://127.0.0.1:4200); to watch runs live, start that server first and set "
            f"PREFECT_API_URL=http://127.0.0.1:4200/api")


def _no_dead_link(record: logging.LogRecord) -> bool:
    """Prefect's flow-run logger announces `View at <api url without /api>/runs/...` for every
    flow run; on the private server that page does not exist."""
    return not str(record.msg).startswith("View at ")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # where Prefect's console logs, and its link, go


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    # The trainer is gone: so is its server, once it has written what its services hold (the
    # task-run recorder's and the event persister's batches): uvicorn's own SIGTERM handling
    # stops the app, whose services flush as they stop. A shutdown that hangs is cut short.
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(STOP_GRACE_S)
    os._exit(0)


def _sqlite_path() -> Path | None:
    """The file of Prefect's database when it is the usual SQLite file, else None."""
    # start-up cost: prefect, in the server process only
    from prefect.settings import get_current_settings

    url = get_current_settings().server.database.connection_url
    url = url.get_secret_value() if url is not None else ""
    prefix = "sqlite+aiosqlite:///"
    return Path(url[len(prefix):]) if url.startswith(prefix) and url[len(prefix):].startswith("/") else None


async def _blocks_key() -> str:
    """What Prefect's block auto-registration hashes, less the database's URL: the template is
    kept per Prefect version and per this key, so that its block types are this environment's."""
    # start-up cost: prefect's server, in the server process only (its start loads them anyway)
    from hashlib import sha256

    import prefect.plugins
    from prefect.blocks.core import Block
    from prefect.server.models.block_registration import _load_collection_blocks_data
    from prefect.utilities.dispatch import get_registry_for_type
    from prefect.utilities.hashing import hash_objects

    prefect.plugins.load_prefect_collections()
    return hash_objects(get_registry_for_type(Block), await _load_collection_blocks_data(), hash_algo=sha256)


async def _migrate_and_register() -> None:
    """What the server's start does to a new database: migrate it, register the block types."""
    # start-up cost: prefect's server, in the server process only
    from prefect.server.database import provide_database_interface
    from prefect.server.models.block_registration import run_block_auto_registration

    db = provide_database_interface()
    await db.create_db()
    async with await db.session() as session:
        await run_block_auto_registration(session=session)


async def _blocks_registered() -> None:
    """Nothing: the seeded database's block types are registered already."""


def _seed_database() -> None:
    """A new home's database from the migrated template, or migrated here and kept as the
    template (see the module's docstring); then the home's memo that its block types are
    registered, so that the server's start does not register them again (about 2.4 s). Nothing
    when the database exists already."""
    path = _sqlite_path()  # importing Prefect's settings has created the home where it could
    if path is None or path.exists():
        return
    import prefect  # start-up cost: prefect, in the server process only
    # start-up cost: prefect's server, in the server process only (uvicorn imports it next)
    from prefect.server.api.server import _memoize_block_auto_registration

    try:
        key = asyncio.run(_blocks_key())[:16]
    except Exception:  # noqa: BLE001  (any failure: Prefect migrates and registers itself, as before)
        return
    name = f"prefect-db-{prefect.__version__}-{key}/prefect.db"
    if sqlite_templates.seed(path, name, lambda _: asyncio.run(_migrate_and_register())):
        with contextlib.suppress(Exception):
            # Prefect's own memo (hash of the block types and this home's database URL): its
            # start then finds them registered, as on any later start of this home.
            asyncio.run(_memoize_block_auto_registration(_blocks_registered)())


@contextlib.asynccontextmanager
async def _no_background_worker(docket: Any, ephemeral: bool = False, webserver_only: bool = False):
    """Stands in for Prefect's `background_worker(docket, ...)` in the server's lifespan: the
    docket stays (the API enqueues into it), no worker polls it."""
    yield


def _without_background_worker() -> None:
    """The server's lifespan starts no background worker (see the module's docstring). A
    Prefect without `prefect.server.api.server.background_worker` is left as it is."""
    # start-up cost: prefect's server, in the server process only (uvicorn imports it next)
    import prefect.server.api.server as server

    if hasattr(server, "background_worker"):
        server.background_worker = _no_background_worker


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flows.prefect_server", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--background-worker", action="store_true",
                        help="run Prefect's background worker (docket), as Prefect's own server does")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if os.getppid() != args.parent:
        return 0
    threading.Thread(target=_watch_parent, args=(args.parent,), daemon=True).start()
    _seed_database()
    if not args.background_worker:
        _without_background_worker()
    import uvicorn  # start-up cost: only the server process needs it
    uvicorn.run("prefect.server.api.server:create_app", factory=True, host="127.0.0.1", port=args.port,
                log_level="error", lifespan="on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
