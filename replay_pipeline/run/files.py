"""The async loop's file protocol, one floor up from the ground: what the learner and its
generator workers tell each other through <run_dir>/async/ (no torch, no tables; of the project
it imports only replay_pipeline/system/threadnames.py, to name its heartbeat thread).

    STOP                 the learner ended (finished, failed or killed): workers stop
    HEARTBEAT            the learner's session and a counter, replaced every few seconds
    owner-W              which copy of worker W claimed it (a replacement Ray actor takes over)
    ready-W              worker W built its model and is about to generate
    worker-W.json        worker W's cumulative stats (tokens, rollouts, seconds, why it stopped)

A worker stops (`LearnerWatch`) on STOP, on a heartbeat unchanged for loop.heartbeat_timeout
seconds of its own clock, on a heartbeat naming another session, on a lost claim, or, for a
child process, when its parent is gone. replay_pipeline/run/workers.py runs the workers;
this module must not import it or anything above it.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay_pipeline.system.threadnames import os_named

STOP = "STOP"
HEARTBEAT = "HEARTBEAT"


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
        that Ray's supervisor started in place of a lost one claims the id, and the old copy (on
        a machine the cluster lost but that still runs) sees it and stops."""
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
        self._thread = threading.Thread(target=os_named(self._run), name="learner-heartbeat", daemon=True)
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
