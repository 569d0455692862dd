"""flows.prefect_server: the trainer's private temporary Prefect server, a real server process.

Its idle loop services are off (IDLE_SERVICES), read back from the server's own settings
(`GET /api/admin/settings`); the services that record a run stay on, so a flow's task run is
in the server's database and its state is Completed; a setting in the environment wins; a new
PREFECT_HOME starts from the migrated template database and an existing database is kept. The
task-run recorder writes in batches (RECORDER_BATCH), and what it and the event persister hold
is written when the server stops: stopped by its trainer, or by its watchdog after the trainer
was killed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from flows import prefect_server


@pytest.fixture
def no_api_url(monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    prefect_server.stop()
    yield monkeypatch
    prefect_server.stop()


def services(url: str) -> dict[str, object]:
    settings = httpx.get(f"{url}/admin/settings", timeout=10).json()
    return {name: value.get("enabled") for name, value in settings["server"]["services"].items()}


def test_the_private_server_runs_without_idle_services_and_records_task_runs(no_api_url):
    from prefect import flow, get_client, task

    @task
    def double(x: int) -> int:
        return 2 * x

    @flow
    def tiny() -> int:
        return double(21)

    with prefect_server.temporary_server() as url:
        enabled = services(url)
        assert {name.lower(): False for name in prefect_server.IDLE_SERVICES}.items() <= enabled.items()
        assert enabled["task_run_recorder"] is True and enabled["event_persister"] is True
        state = tiny(return_state=True)
        assert state.is_completed() and state.result() == 42

        async def task_runs():
            from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

            async with get_client() as client:
                return await client.read_task_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))

        deadline = time.monotonic() + 30  # the recorder writes task runs from their events, in batches
        while not (runs := asyncio.run(task_runs())) or runs[0].state_type.value != "COMPLETED":
            assert time.monotonic() < deadline, f"task run not recorded as completed: {runs}"
            time.sleep(0.5)
        assert [r.name.split("-")[0] for r in runs] == ["double"]


def test_a_service_setting_in_the_environment_wins(no_api_url):
    no_api_url.setenv("PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED", "true")
    with prefect_server.temporary_server() as url:
        enabled = services(url)
    assert enabled["scheduler"] is True and enabled["late_runs"] is False


def test_a_new_home_starts_from_the_migrated_template_and_an_existing_database_is_kept(no_api_url, tmp_path):
    """A new PREFECT_HOME's database is a copy of the template the first new home left (Prefect
    migrates nothing then); the template holds no run of that home; a home that has a database
    keeps it."""
    no_api_url.setenv("REPLAY_PIPELINE_CACHE_DIR", str(tmp_path / "cache"))

    def serve(home) -> list[dict]:
        no_api_url.setenv("PREFECT_HOME", str(home))
        prefect_server.launch()
        url = prefect_server._start(120)
        try:
            assert httpx.post(f"{url}/flows/", json={"name": f"flow-{home.name}"}, timeout=30).is_success
            return httpx.post(f"{url}/flows/filter", json={}, timeout=30).json()
        finally:
            prefect_server.stop()

    first = serve(tmp_path / "a")
    (template,) = (tmp_path / "cache").glob("prefect-db-*/prefect.db")
    with contextlib.closing(sqlite3.connect(template)) as db:
        assert db.execute("SELECT count(*) FROM flow").fetchone() == (0,)  # migrated, nothing served
        assert db.execute("SELECT count(*) FROM alembic_version").fetchone() == (1,)
        db.execute("CREATE TABLE template_marker (x)")  # to tell a copy from Prefect's own migration
    assert [f["name"] for f in serve(tmp_path / "b")] == ["flow-b"]
    with contextlib.closing(sqlite3.connect(tmp_path / "b" / "prefect.db")) as db:
        assert db.execute("SELECT name FROM sqlite_master WHERE name = 'template_marker'").fetchall()
        registered = db.execute("SELECT slug, block_type.updated, block_schema.updated FROM block_schema JOIN block_type"
                                " ON block_type.id = block_type_id ORDER BY slug").fetchall()
    with contextlib.closing(sqlite3.connect(template)) as db:
        # b's start registered nothing again (the memo the seed left matched): its block types
        # and schemas are the template's, down to their update times
        assert registered == db.execute("SELECT slug, block_type.updated, block_schema.updated FROM block_schema JOIN block_type"
                                        " ON block_type.id = block_type_id ORDER BY slug").fetchall()
    assert len(registered) > 10 and (tmp_path / "b" / "memo_store.toml").is_file()
    again = serve(tmp_path / "a")  # its own database, kept: the same flow, not a copy of the template
    assert [(f["name"], f["id"]) for f in again] == [(f["name"], f["id"]) for f in first]
    with contextlib.closing(sqlite3.connect(tmp_path / "a" / "prefect.db")) as db:
        assert not db.execute("SELECT name FROM sqlite_master WHERE name = 'template_marker'").fetchall()


def _recorded(home: Path) -> list[tuple[str, str]]:
    """(task name, state type) of every task run in the server's database at `home`."""
    with contextlib.closing(sqlite3.connect(home / "prefect.db")) as db:
        return [(name.split("-")[0], state) for name, state in db.execute("SELECT name, state_type FROM task_run")]


def _task_run_events(home: Path) -> list[str]:
    """The task-run events in the server's database at `home`, in order."""
    with contextlib.closing(sqlite3.connect(home / "prefect.db")) as db:
        return [name for (name,) in db.execute("SELECT event FROM events WHERE event LIKE 'prefect.task-run.%' "
                                                "ORDER BY occurred")]


#: Only the server's stop writes what the recorder and the persister hold (a setting in the
#: environment wins).
_HOLD = {"PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "600",
         "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "600",
         "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE": "1000"}
_TASK_RUN_EVENTS = ["prefect.task-run.Pending", "prefect.task-run.Running", "prefect.task-run.Completed"]

#: A trainer in a process of its own (one server per process, as `python -m flows.train`): runs
#: a flow of one task on its private server, says the server's pid and API, and waits for a line
#: on stdin, then exits (its server is stopped at exit), unless the test kills it first.
_TRAINER = """
import sys, time
from flows import prefect_server
from prefect import flow, task
from prefect.events.worker import EventsWorker

@task
def double(x):
    return 2 * x

@flow
def tiny():
    return double(21)

prefect_server.launch()
with prefect_server.temporary_server() as url:
    assert tiny(return_state=True).is_completed()
    EventsWorker.drain_all(timeout=60)  # the client has sent the task run's events
    time.sleep(3)  # one at a time, they would be written by now
    print(prefect_server._server.pid, url, flush=True)
    sys.stdin.readline()
"""


def _trainer(tmp_path: Path) -> tuple[subprocess.Popen, int, str, Path]:
    """The trainer started and its flow run: (process, its server's pid, API, PREFECT_HOME)."""
    home = tmp_path / "home"
    env = {**os.environ, "PREFECT_HOME": str(home), **_HOLD}
    env.pop("PREFECT_API_URL", None)
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               env=env, cwd=Path(__file__).resolve().parents[2], text=True)
    pid, url = trainer.stdout.readline().split()
    return trainer, int(pid), url, home


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pid: int, since: float) -> float:
    """Seconds from `since` until the server `pid` has exited (fails past STOP_GRACE_S + 10)."""
    while not _gone(pid):
        assert time.monotonic() - since < prefect_server.STOP_GRACE_S + 10, "the server outlived its trainer"
        time.sleep(0.1)
    return time.monotonic() - since


def test_task_run_states_are_batched_and_written_when_the_trainer_stops_its_server(tmp_path):
    trainer, server, url, home = _trainer(tmp_path)
    try:
        services = httpx.get(f"{url}/admin/settings", timeout=10).json()["server"]["services"]
        batch = int(prefect_server.RECORDER_BATCH["PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE"])
        recorder, persister = services["task_run_recorder"], services["event_persister"]
        assert (recorder["batch_size"], recorder["flush_interval"]) == (batch, 600)  # the environment's wins
        assert (persister["batch_size"], persister["flush_interval"]) == (1000, 600)
        assert _recorded(home) == [] and _task_run_events(home) == []  # held in the services' batches
        trainer.communicate("exit\n", timeout=60)  # its exit stops the server (SIGTERM)
        assert trainer.returncode == 0
        assert _wait_gone(server, time.monotonic()) < prefect_server.STOP_GRACE_S
    finally:
        trainer.kill()
    assert _recorded(home) == [("double", "COMPLETED")]
    assert _task_run_events(home) == _TASK_RUN_EVENTS


def test_a_killed_trainers_server_writes_what_it_holds_and_exits(tmp_path):
    trainer, server, _, home = _trainer(tmp_path)
    try:
        assert _recorded(home) == [] and _task_run_events(home) == []  # held in the services' batches
        trainer.kill()
        trainer.wait()
        # it stopped itself (the watchdog polls every 0.5 s), well before the hard exit
        assert _wait_gone(server, time.monotonic()) < prefect_server.STOP_GRACE_S
    finally:
        trainer.kill()
    assert _recorded(home) == [("double", "COMPLETED")]
    assert _task_run_events(home) == _TASK_RUN_EVENTS


def _wake_ups(pid: int) -> int:
    """Voluntary context switches of all of `pid`'s threads so far: a thread that sleeps on a
    timer and wakes adds one each time."""
    total = 0
    for thread in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):
            status = Path(f"/proc/{pid}/task/{thread}/status").read_text()
            total += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    return total


def _idle_wake_ups_per_second(home: Path, background_worker: bool) -> float:
    proc, url = prefect_server.spawn(os.getpid(), {"PREFECT_HOME": str(home)}, prefect_server.RECORDER_BATCH,
                                     background_worker=background_worker)
    try:
        prefect_server.wait_ready(proc, url, 120)
        time.sleep(3)  # the lifespan's start-up work done
        before = _wake_ups(proc.pid)
        time.sleep(4)
        return (_wake_ups(proc.pid) - before) / 4
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_the_private_server_runs_no_background_worker_and_wakes_a_quarter_as_often(tmp_path, no_api_url):
    # Prefect's background worker (docket) polls its queues and channels on timers even with
    # nothing to do: about 120 wake-ups a second against about 30 here (flows/prefect_server.py).
    # Timer wake-ups, not CPU time: a slow machine wakes as often.
    without = _idle_wake_ups_per_second(tmp_path / "without", background_worker=False)
    with_worker = _idle_wake_ups_per_second(tmp_path / "with", background_worker=True)
    assert without < 0.5 * with_worker, (without, with_worker)
