"""Start and stop real servers on loopback for integration tests (no mocks).

Small functions meant to be combined in a test's fixture:

    port = free_port()
    proc = start_process([...server command..., "--port", str(port)], tmp_path / "server.log")
    try:
        wait_for_http(f"http://127.0.0.1:{port}/", timeout=30, proc=proc)
        ...
    finally:
        stop_process(proc)

Each server runs in its own session (process group), so ``stop_process`` ends it and anything
it started, by process id, and nothing else. Its output goes to a log file, which the errors
quote when it does not come up.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

LOOPBACK = "127.0.0.1"


class ServerError(RuntimeError):
    """A test server did not start; the message quotes the end of its log."""


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nothing listens on right now (the OS picks it; a server started right after
    may still lose it to another process, which then shows as a start failure)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def log_tail(log_path: str | Path | None, chars: int = 2000) -> str:
    """The last ``chars`` characters of a server's log ('' if there is none)."""
    if log_path is None or not Path(log_path).is_file():
        return ""
    return Path(log_path).read_text(errors="replace")[-chars:]


def start_process(cmd: Sequence[str], log_path: str | Path, env: Mapping[str, str] | None = None,
                  cwd: str | Path | None = None) -> subprocess.Popen:
    """Start ``cmd`` in a new session with stdout and stderr appended to ``log_path``; the
    environment is this process's plus ``env``."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True,
        )
    proc.log_path = log_path  # type: ignore[attr-defined]
    return proc


def wait_for_http(url: str, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Return once ``url`` answers an HTTP request (any status counts: the server is up).

    Raises :class:`ServerError` after ``timeout`` seconds, or at once if ``proc`` (the
    server's process) has exited, quoting the end of its log.
    """
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerError(f"the server for {url} exited with status {proc.returncode} before "
                              f"answering; its log:\n{log_tail(getattr(proc, 'log_path', None))}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answered, with an error status
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        time.sleep(0.1)
    raise ServerError(f"nothing answered at {url} within {timeout:.0f} s (last error: {last}); "
                      f"the server's log:\n{log_tail(getattr(proc, 'log_path', None))}")


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Stop a process started by :func:`start_process` and its process group: SIGTERM, then
    SIGKILL after ``timeout`` seconds. Safe to call twice. A process that already exited (and
    was reaped) is left alone: its id may belong to someone else by now."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # start_new_session: the group id is its pid
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=timeout)


_prefect: dict[Path, tuple[subprocess.Popen, str]] = {}


def prefect_env(home: Path) -> dict[str, str]:
    """`PREFECT_HOME` and `PREFECT_API_URL` of a Prefect server on `home` shared by the
    processes a test module starts there, instead of a temporary server each (its boot is 5-9 s
    of CPU here, a quarter of a tiny run's). It is the server a trainer starts for itself
    (flows/prefect_server.py, the same settings), watching this test process; started on the
    first ask, ready when this returns, stopped at the module's end (tests/conftest.py). Tests
    of the temporary server itself (a stop's behaviour, nothing left behind) leave it out."""
    from flows.prefect_server import spawn, wait_ready  # the test process's Prefect settings first

    home = Path(home).resolve()
    if home not in _prefect or _prefect[home][0].poll() is not None:
        home.mkdir(parents=True, exist_ok=True)
        proc, url = spawn(os.getpid(), {"PREFECT_HOME": str(home)})
        _prefect[home] = (proc, url)
        try:
            wait_ready(proc, url, 120)
        except RuntimeError:
            stop_process(proc)
            raise
    return {"PREFECT_HOME": str(home), "PREFECT_API_URL": _prefect[home][1]}


def stop_prefect_servers() -> None:
    """Stop the servers `prefect_env` started."""
    while _prefect:
        stop_process(_prefect.popitem()[1][0])
