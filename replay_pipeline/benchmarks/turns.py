"""Processes in turns: several commands run one at a time in slices of wall time, each stopped
(SIGSTOP on its whole process tree) while another has the turn, and what the stops did to each
one's own timings.

    turns = take_turns([("ours", cmd_a, log_a), ("trl", cmd_b, log_b)], slice_seconds=2.0)
    turns["ours"].pauses      # [(stopped_at, resumed_at), ...] in epoch seconds

Why (the peer benchmark, replay_pipeline/benchmarks/peers.py): run one after another, its sides
are fresh processes of 15-30 s each, and a 2-core VM's speed drifts by 10-15% over tens of
seconds, so two processes of the same code a minute apart differ by as much as the effect
measured. In turns of a few seconds every side's steps are spread over the same minute, so a
slow or fast spell falls on all of them alike, while each side still runs alone on the cores, in
a fresh process of its own.

Rules:
- A side's whole process tree is stopped: `python -m flows.train` and its Prefect server (a
  child in a session of its own), so nothing of a side runs while another has the turn. The
  tree is read with psutil (already the project's dependency): the root is stopped first, and
  each process is read for its children only once it has stopped, so none can start a child
  that escapes the stop (a process inside fork() stops when the fork returns: seen once in the
  tests before the wait).
- A side that is the last one running is not stopped again; it runs to its end.
- Pause windows are recorded inside the real stop: from the moment every process of the tree
  is seen stopped to just before the SIGCONT (`time.time()`, the clock the sides stamp their
  steps with), so no stamp a side makes can fall inside one, however late a signal lands. A
  step that ran across a stop still overlaps its window, so `kept_steps` drops it.
- A side that fails, or runs longer than `timeout` seconds of its own (pauses not counted),
  fails the whole run; every other side's tree is continued and killed first, so no stopped
  process is left behind (also on Ctrl-C and SIGTERM, which raises `Terminated` meanwhile; a
  SIGKILL of this process leaves the stopped sides stopped: `kill -CONT`, then kill them).

The machine's load beside the sides is measured, not assumed: over every turn that ends in a
stop, the CPU the whole machine spent (psutil.cpu_times: /proc/stat on Linux) less what the
running command's tree and this process spent (`Turned.other_cores`: the cores other processes
kept busy meanwhile). A turn that ends with its command's exit is left out (the tree's last CPU
is gone with it).

What the pauses do to a side's figures (`overlap`, `kept_steps`) is for the caller: a step is
kept only when no pause touched it or the step before it (the step that resumes a turn runs on
caches the other sides evicted); a window's seconds (start-up, an evaluation, the whole
process) are counted without the pauses inside it.

Turns spread the sides over the same minute only while all of them are taking steps. A side
with a longer start-up begins its steps later, one with more to do between steps (evaluations)
ends them later, and after the others have ended it runs on its own, cycle after cycle: its
first and last steps have no counterpart on the other sides, and the machine's speed drifts
over such spans (every process's steps can go from ~130 to ~166 ms within a few seconds and stay
there). `shared_window` is the stretch of wall time in which every command was taking steps
(from the latest first step's start to the earliest last step's end) and `in_window` the steps
inside it: the caller compares the sides over it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import psutil

Pause = tuple[float, float]


@dataclass
class Turned:
    """One command's run in turns: wall seconds from launch to exit (pauses included), its
    pauses (epoch seconds, from the stop confirmed to the SIGCONT: inside the real stop), how
    many turns it had, and over the turns that ended in a stop the machine's CPU time
    (core-seconds) and the part of it spent by processes other than this command's tree and the
    caller (`other_cpu`: the machine's load beside it)."""
    seconds: float = 0.0
    pauses: list[Pause] = field(default_factory=list)
    turns: int = 0
    machine_cpu: float = 0.0
    other_cpu: float = 0.0

    @property
    def paused_seconds(self) -> float:
        return sum(b - a for a, b in self.pauses)

    @property
    def other_cores(self) -> float | None:
        """Cores other processes kept busy during this command's measured turns (None: none
        measured)."""
        return self.other_cpu / self.machine_cpu * CORES if self.machine_cpu else None


CORES = os.cpu_count() or 1


def _machine_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of all cores so far (busy: all but idle and iowait)."""
    t = psutil.cpu_times()
    total = t.user + t.nice + t.system + t.idle + t.iowait + t.irq + t.softirq + t.steal  # guest is in user
    return total - t.idle - t.iowait, total


def cpu_seconds(pid: int, children: bool = True) -> float:
    """user + system seconds of `pid`, and of its children it has reaped (`children`); 0 once gone."""
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system + (t.children_user + t.children_system if children else 0.0)


def _sample(pid: int) -> tuple[float, float, float]:
    """(machine busy, machine total, this command's tree + the caller) CPU seconds."""
    busy, total = _machine_seconds()
    return busy, total, sum(cpu_seconds(p) for p in process_tree(pid)) + cpu_seconds(os.getpid(), children=False)


def process_tree(pid: int) -> list[int]:
    """`pid` and its living descendants, parents first."""
    try:
        return [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:  # gone meanwhile
        return [pid]


def _signal_all(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


_HELD = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def _held(pid: int) -> bool:
    """Whether `pid` is stopped, or will not run again (a zombie, or gone)."""
    try:
        return psutil.Process(pid).status() in _HELD
    except psutil.Error:
        return True


def _wait_stopped(pid: int, timeout: float = 1.0) -> None:
    """Until `pid` is stopped (or gone): a process that was inside fork() when SIGSTOP came
    stops only once the fork is done, and its new child must be visible before the tree is read."""
    deadline = time.monotonic() + timeout
    while not _held(pid) and time.monotonic() < deadline:
        time.sleep(0.0002)


def stop_tree(pid: int) -> list[int]:
    """SIGSTOP `pid`, then every descendant, each once it has stopped (so none is mid-fork and
    every child it made is seen); the pids stopped, for `continue_tree`."""
    stopped: list[int] = []
    new = [pid]
    while new:
        _signal_all(new, signal.SIGSTOP)
        for p in new:
            _wait_stopped(p)
        stopped += new
        new = [p for p in process_tree(pid) if p not in stopped]
    return stopped


def continue_tree(pids: Sequence[int]) -> None:
    """SIGCONT the processes `stop_tree` stopped, children first."""
    _signal_all(list(reversed(pids)), signal.SIGCONT)


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and its descendants (stopped ones included: a stopped process dies on SIGKILL)."""
    _signal_all(process_tree(pid), signal.SIGKILL)


def take_turns(jobs: Sequence[tuple[str, list[str], Path]], slice_seconds: float,
               timeout: float = 3600.0) -> dict[str, Turned]:
    """Run `jobs` (name, command, log file) in turns of `slice_seconds` in the order given,
    each launched at its first turn and stopped between its turns, until all have ended.
    Raises RuntimeError (with the log's last lines) when one fails or overruns `timeout`
    seconds of its own; the others are killed first."""
    if slice_seconds <= 0:
        raise ValueError(f"slice_seconds={slice_seconds}: must be > 0")
    restore = _terminate_as_exception()
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Any] = {}
    stopped: dict[str, list[int]] = {}
    began: dict[str, float] = {}
    out = {name: Turned() for name, _, _ in jobs}
    ended: set[str] = set()
    try:
        while len(ended) < len(jobs):
            for name, command, log_path in jobs:
                if name in ended:
                    continue
                turned = out[name]
                if name not in procs:
                    log_path.parent.mkdir(parents=True, exist_ok=True)
                    logs[name] = log_path.open("w")
                    began[name] = time.perf_counter()
                    procs[name] = subprocess.Popen(command, stdout=logs[name], stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL)
                else:
                    # a pause is stamped inside the stop: from its confirmation to the SIGCONT
                    # (a stopped process cannot stamp anything inside it, however late signals land)
                    turned.pauses[-1] = (turned.pauses[-1][0], time.time())
                    continue_tree(stopped.pop(name))
                turned.turns += 1
                before = _sample(procs[name].pid)
                alone = len(jobs) - len(ended) == 1
                own = time.perf_counter() - began[name] - turned.paused_seconds
                try:
                    code = procs[name].wait(timeout=max(timeout - own, 0.0) if alone
                                            else min(slice_seconds, max(timeout - own, 0.0)))
                except subprocess.TimeoutExpired:
                    if alone or time.perf_counter() - began[name] - turned.paused_seconds >= timeout:
                        _fail(name, "timeout", log_path, began[name])
                    busy, total, theirs = (b - a for a, b in zip(before, _sample(procs[name].pid)))
                    stopped[name] = stop_tree(procs[name].pid)
                    turned.pauses.append((time.time(), float("nan")))
                    turned.machine_cpu += total
                    turned.other_cpu += max(busy - theirs, 0.0)
                    continue
                turned.seconds = time.perf_counter() - began[name]
                ended.add(name)
                logs.pop(name).close()
                if code != 0:
                    _fail(name, code, log_path, began[name])
        return out
    finally:
        for name, proc in procs.items():
            if name not in ended:
                continue_tree(stopped.pop(name, []))
                kill_tree(proc.pid)
                proc.wait()
        for f in logs.values():
            f.close()
        restore()


class Terminated(Exception):
    """SIGTERM reached `take_turns`: raised so that its cleanup runs (continue and kill every
    side); Python's default for SIGTERM ends the process at once and left the stopped sides
    stopped, for good."""


def _terminate_as_exception() -> Callable[[], None]:
    """SIGTERM raises Terminated while `take_turns` runs (main thread only); returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def raise_terminated(signum, frame):
        raise Terminated(f"signal {signum} while the sides took turns: every side was killed")

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    return lambda: signal.signal(signal.SIGTERM, previous)


def _fail(name: str, code: Any, log_path: Path, began: float) -> None:
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
    raise RuntimeError(f"{name} ended with {code} after {time.perf_counter() - began:.0f} s; "
                       f"its log is {log_path}:\n{tail}")


# ------------------------------------------------------------------ what the pauses did
def overlap(start: float, end: float, pauses: Sequence[Pause]) -> float:
    """Seconds of `pauses` inside [start, end]."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in pauses)


def shared_window(sides: Sequence[tuple[Sequence[float], Sequence[float]]]) -> Pause | None:
    """For commands whose steps ended at `ends` after `seconds` each ((ends, seconds) per
    command): the stretch of wall time in which every one of them was taking steps, from the
    latest first step's start to the earliest last step's end; None when one has no step or
    the stretch is empty."""
    if not sides or any(not ends for ends, _ in sides):
        return None
    start = max(min(e - s for e, s in zip(ends, seconds)) for ends, seconds in sides)
    end = min(max(ends) for ends, _ in sides)
    return (start, end) if start < end else None


def in_window(ends: Sequence[float], seconds: Sequence[float], window: Pause | None) -> list[bool]:
    """For steps that ended at `ends` after `seconds` each: True where the whole step lies in
    `window` (all False when there is none)."""
    if window is None:
        return [False] * len(ends)
    start, end = window
    return [e - s >= start and e <= end for e, s in zip(ends, seconds)]


def kept_steps(ends: Sequence[float], seconds: Sequence[float], pauses: Sequence[Pause]) -> list[bool]:
    """For steps that ended at `ends` after `seconds` each: True where no pause touched the step
    or the one before it (the first step after a turn's start runs on cold caches)."""
    starts = [e - s for e, s in zip(ends, seconds)]
    return [not any(a <= ends[k] and b >= starts[max(k - 1, 0)] for a, b in pauses) for k in range(len(ends))]
