"""What one Prefect task run costs a trainer on this machine: the CPU of the trainer's own
process (Prefect's task engine, its events and logs) and of its private Prefect server
(receiving the events, recording the task run, persisting the events, storing the logs),
as the trainer's server runs them (its task-run recorder in batches: flows/prefect_server.py
`RECORDER_BATCH`, no background worker), with the event persister's batches larger too (not
adopted: docs/performance.md, "Prefect's cost per task run"), and with Prefect's defaults (its
background worker on); and each server's idle CPU a second.

    python -m replay_pipeline.benchmarks.orchestration                 # 3 repeats of 200 task runs a side
    python -m replay_pipeline.benchmarks.orchestration --tasks 400 --repeats 5 --out orchestration.json

Why it matters: in a sync run every rounds task is a task run, and both processes' work lands
on the cores generation and training are using (docs/performance.md, "Prefect's cost per task
run"). A side is one server, started as the trainer starts its own (the idle services off, a
fresh PREFECT_HOME) with its side's settings, and one flow run of `--tasks` trivial task runs
against it from this process, `--gap` seconds apart (a trainer's tasks never come back to
back). The sides take turns, in reverse order every other repeat.

What is measured, per side and repeat (medians over repeats are printed):
* server CPU per task run: the server's whole CPU from the flow's start to its exit (its exit
  writes what the batches still hold, so a side with batches pays for all of its writes, read
  from the exited process's rusage), less its idle CPU over that time (its rate measured over
  `--idle` quiet seconds before the flow), over the task runs. The flow run's own work (its
  creation, a few states) is amortised over them.
* client CPU per task run: this process's CPU over the flow, all threads (the task engine on
  this thread, the events and logs workers on theirs), less its idle rate, over the task runs;
* the wall time of one task call on this thread;
* the server's idle CPU a second (the rate above): what it takes from the cores between tasks;
* what the server wrote: task runs and task-run events in its database after its exit (every
  side must have them all: a batch must never lose what it holds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

from flows.prefect_server import RECORDER_BATCH
from replay_pipeline.benchmarks.peers import spread
from replay_pipeline.benchmarks.turns import cpu_seconds

#: Prefect settings of each side's server (a setting in the environment wins over them).
SIDES = {"trainer": RECORDER_BATCH,
         "larger-events": {**RECORDER_BATCH, "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE": "1000",
                           "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "10"},
         "prefect-defaults": {}}
#: The sides whose server runs Prefect's background worker, as Prefect's own server does (the
#: trainer's private server runs without it: flows/prefect_server.py).
WITH_BACKGROUND_WORKER = ("prefect-defaults",)


def _written(home: Path) -> tuple[int, int]:
    """(task runs, task-run events) in the database of the server that used `home`."""
    with contextlib.closing(sqlite3.connect(home / "prefect.db")) as db:
        runs = db.execute("SELECT count(*) FROM task_run").fetchone()[0]
        events = db.execute("SELECT count(*) FROM events WHERE event LIKE 'prefect.task-run.%'").fetchone()[0]
    return runs, events


def _wait_written(home: Path, tasks: int, seconds: float) -> None:
    """Until the server that uses `home` has written `tasks` task runs and their 3 events each,
    or `seconds` have passed."""
    deadline = time.monotonic() + seconds
    while _written(home) != (tasks, 3 * tasks) and time.monotonic() < deadline:
        time.sleep(0.1)


def cpu(server: int) -> tuple[float, float]:
    """CPU seconds (user + system, all threads, children left out) of the live process `server`
    and of this process, so far."""
    return cpu_seconds(server, children=False), cpu_seconds(os.getpid(), children=False)


def run_side(side: str, tasks: int, gap: float, idle: float, root: Path) -> dict:
    """One server with the `side`'s settings (SIDES) and one flow run of `tasks` task runs
    against it; the figures of the module's docstring."""
    # start-up cost: prefect loads in the benchmark only
    from flows.prefect_server import spawn, wait_ready
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = Path(tempfile.mkdtemp(prefix=f"{side}-", dir=root))
    proc, url = spawn(os.getpid(), {"PREFECT_HOME": str(home)}, SIDES[side], side in WITH_BACKGROUND_WORKER)
    try:
        wait_ready(proc, url, 120)
        time.sleep(2.0)  # the boot's last writes
        server_0, own_0 = cpu(proc.pid)
        time.sleep(idle)
        server_1, own_1 = cpu(proc.pid)
        server_idle, own_idle = (server_1 - server_0) / idle, (own_1 - own_0) / idle

        @task(name="unit", cache_policy=NO_CACHE, persist_result=False)
        def unit(i: int) -> int:
            return i

        calls: list[float] = []

        @flow(name="orchestration-benchmark")
        def many() -> None:
            for i in range(tasks):
                began = time.perf_counter()
                unit(i)
                calls.append(time.perf_counter() - began)
                time.sleep(gap)

        with temporary_settings(updates={PREFECT_API_URL: url}):
            began, (server_began, own_began) = time.monotonic(), cpu(proc.pid)
            many()
            EventsWorker.drain_all(timeout=60)  # every event and log line of the flow sent
            APILogWorker.drain_all(timeout=60)
            own = cpu(proc.pid)[1] - own_began - own_idle * (time.monotonic() - began)
            if not SIDES[side]:
                # Prefect's defaults write each event as it comes, with no batch that a stop
                # flushes: wait for the writes to land (the idle rate is subtracted for the wait)
                # rather than count what a SIGTERM cut short
                _wait_written(home, tasks, seconds=15.0)
            os.kill(proc.pid, signal.SIGTERM)  # the server writes what its batches hold, and exits
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            ended = time.monotonic()
        server = usage.ru_utime + usage.ru_stime - server_began - server_idle * (ended - began)
        runs, events = _written(home)
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.wait()
    return {"side": side, "tasks": tasks, "server_cpu_ms_per_task": 1000 * server / tasks,
            "client_cpu_ms_per_task": 1000 * own / tasks, "call_ms": 1000 * statistics.median(calls),
            "server_idle_ms_per_s": 1000 * server_idle, "client_idle_ms_per_s": 1000 * own_idle,
            "task_runs_written": runs, "task_run_events_written": events}


def run_benchmark(tasks: int, repeats: int, gap: float, idle: float, root: str | Path) -> dict:
    root = Path(root)
    records = []
    for r in range(repeats):
        for side in (list(SIDES) if r % 2 == 0 else list(SIDES)[::-1]):
            records.append(run_side(side, tasks, gap, idle, root) | {"repeat": r})
    summary = {}
    for side in SIDES:
        mine = [rec for rec in records if rec["side"] == side]
        summary[side] = {key: spread([rec[key] for rec in mine])
                         for key in ("server_cpu_ms_per_task", "client_cpu_ms_per_task", "call_ms",
                                     "server_idle_ms_per_s")}
        summary[side]["all_written"] = all(rec["task_runs_written"] == tasks and
                                           rec["task_run_events_written"] == 3 * tasks for rec in mine)
    return {"tasks": tasks, "repeats": repeats, "gap_s": gap, "records": records, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replay_pipeline.benchmarks.orchestration", description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200, help="task runs per side and repeat (default 200)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats; the sides take turns in each (default 3)")
    parser.add_argument("--gap", type=float, default=0.05, help="seconds between two task runs (default 0.05)")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds to measure each process's idle CPU (default 5)")
    parser.add_argument("--out", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    for flag in ("tasks", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1")
    if args.gap < 0 or args.idle <= 0:
        parser.error("--gap must be >= 0 and --idle > 0")
    with tempfile.TemporaryDirectory(prefix="orchestration-benchmark-") as root:
        result = run_benchmark(args.tasks, args.repeats, args.gap, args.idle, root)
    print(f"{args.repeats} repeats of {args.tasks} task runs a side, {args.gap} s apart, the sides taking turns; "
          "medians over repeats [server min-max]:")
    print(f"{'side':17s} {'server CPU ms/task':>19s} {'client CPU ms/task':>19s} {'call ms':>8s}"
          f" {'server idle ms/s':>17s}  all written")
    for side, s in result["summary"].items():
        server = s["server_cpu_ms_per_task"]
        print(f"{side:17s} {server['median']:8.2f} [{server['min']:.2f}-{server['max']:.2f}]"
              f" {s['client_cpu_ms_per_task']['median']:12.2f} {s['call_ms']['median']:14.2f}"
              f" {s['server_idle_ms_per_s']['median']:12.1f}      {'yes' if s['all_written'] else 'NO'}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0 if all(s["all_written"] for s in result["summary"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
