"""The run lease: at most one process drives a run at a time.

A run is driven by one process: the sync learner, or the async learner with its generators
(the generators are the learner's children or Ray actors and never take the lease; they stop
when the learner's heartbeat does). Two drivers on one run would both append the same steps
and both train, so a second `python -m flows.train resume=<id>` (or `run_id=<id>`) on a live
run is refused before any work, naming the holder, and the CLI exits with code 2.

How (files in the run directory):

* `<run_dir>/.lease.lock` is locked with `flock` for as long as the driver lives. The kernel
  releases the lock when the process ends, however it ends (kill -9 included), so on one
  machine a stale lease can never block a run and two racing processes cannot both win.
* `<run_dir>/lease.json` says who holds it: host, PID, the PID's start time (so a reused PID
  is not mistaken for the holder), since when, the command, and a heartbeat refreshed every
  `timeout / 4` seconds by a daemon thread. It is what the refusal and `flows.query runs`
  show. A lease.json left by a process that is gone (killed) is taken over with a warning.
* On a root shared between machines (NFS and the like, where `flock` may not reach the
  other host), a lease.json of another host is honoured while its heartbeat is younger than
  the timeout (REPLAY_PIPELINE_LEASE_TIMEOUT seconds, default 60), and taken over with a
  warning once it has expired.

Of the project it imports only replay_pipeline/system/threadnames.py (its heartbeat thread's name).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import socket
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from replay_pipeline.system.threadnames import os_named

LEASE = "lease.json"
LOCK = ".lease.lock"
TIMEOUT_ENV = "REPLAY_PIPELINE_LEASE_TIMEOUT"
DEFAULT_TIMEOUT = 60.0


class LeaseHeld(RuntimeError):
    """Another live process drives this run."""

    def __init__(self, run_dir: Path, holder: dict[str, Any]):
        self.holder = holder
        since = holder.get("since", "?")
        beat = holder.get("heartbeat")
        age = f", heartbeat {time.time() - float(beat):.0f} s ago" if beat else ""
        super().__init__(
            f"run {run_dir.name} is being driven by another process: PID {holder.get('pid')} on "
            f"{holder.get('host')}, since {since}{age} ({holder.get('command', '?')}). One process "
            f"drives a run at a time: wait for it to end, or stop it (Ctrl-C or kill {holder.get('pid')}) "
            f"and resume then. If that process is gone, its lease expires {lease_timeout():.0f} s after "
            f"its last heartbeat ({run_dir / LEASE}).")


def lease_timeout() -> float:
    try:
        return max(float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT)), 1.0)
    except ValueError:
        return DEFAULT_TIMEOUT


def _pid_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused PID apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return start is None or _pid_start(pid) in (None, start)


def read_lease(run_dir: str | Path) -> dict[str, Any] | None:
    """The lease.json of a run (None: none, or unreadable)."""
    try:
        return json.loads((Path(run_dir) / LEASE).read_text())
    except (OSError, ValueError):
        return None


def holder(run_dir: str | Path) -> dict[str, Any] | None:
    """The live holder of a run's lease, or None when nobody drives it (no lease, or one left
    by a process that is gone or whose heartbeat expired)."""
    info = read_lease(run_dir)
    if info is None:
        return None
    return info if _live(Path(run_dir), info) else None


def _live(run_dir: Path, info: dict[str, Any], locked_by_me: bool = False) -> bool:
    if info.get("host") == socket.gethostname():
        if locked_by_me:  # we hold the flock, so the writer of this file no longer does
            return False
        return _alive(int(info.get("pid", -1)), info.get("pid_start"))
    beat = info.get("heartbeat")
    return beat is not None and time.time() - float(beat) < lease_timeout()


@dataclass
class Lease:
    """A held lease; `release()` (or the process's end) gives it back."""

    run_dir: Path
    info: dict[str, Any]
    fd: int
    holds: int = 1
    _done: threading.Event = field(default_factory=threading.Event)

    def _write(self) -> None:
        self.info["heartbeat"] = time.time()
        path = self.run_dir / LEASE
        tmp = path.with_name(f".{LEASE}.{self.info['token']}")
        tmp.write_text(json.dumps(self.info, indent=2, sort_keys=True))
        tmp.replace(path)

    def _beat(self) -> None:
        while not self._done.wait(lease_timeout() / 4):
            try:
                if (read_lease(self.run_dir) or {}).get("token") != self.info["token"]:
                    return  # taken over (another host decided we were gone): stop writing
                self._write()
            except OSError:
                pass

    def release(self) -> None:
        self.holds -= 1
        if self.holds > 0:
            return
        self._done.set()
        _HELD.pop(self.run_dir, None)
        try:
            if (read_lease(self.run_dir) or {}).get("token") == self.info["token"]:
                (self.run_dir / LEASE).unlink(missing_ok=True)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)


_HELD: dict[Path, Lease] = {}


def acquire(run_dir: str | Path, command: str | None = None) -> Lease:
    """Take the lease of `run_dir` (created if missing) for this process, or raise LeaseHeld.
    Re-entrant: a process that holds it gets the same lease back (release once per acquire)."""
    run_dir = Path(run_dir).resolve()
    held = _HELD.get(run_dir)
    if held is not None:
        held.holds += 1
        return held
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        raise LeaseHeld(run_dir, read_lease(run_dir) or {"pid": "?", "host": socket.gethostname(),
                                                         "since": "just now"}) from None
    try:
        previous = read_lease(run_dir)
        if previous is not None:
            if _live(run_dir, previous, locked_by_me=True):
                raise LeaseHeld(run_dir, previous)
            warnings.warn(f"run {run_dir.name}: taking over the lease of PID {previous.get('pid')} on "
                          f"{previous.get('host')} (since {previous.get('since')}): that process is gone",
                          stacklevel=2)
    except BaseException:
        os.close(fd)
        raise
    pid = os.getpid()
    info = {"host": socket.gethostname(), "pid": pid, "pid_start": _pid_start(pid),
            "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": command or " ".join([os.path.basename(sys.executable), *sys.argv])[:300],
            "token": secrets.token_hex(8)}
    lease = Lease(run_dir, info, fd)
    lease._write()
    threading.Thread(target=os_named(lease._beat), name="run-lease", daemon=True).start()
    _HELD[run_dir] = lease
    return lease
