"""The temporary Prefect API server of a local `python -m flows.train` (when no
PREFECT_API_URL is set), started by us instead of by Prefect so that a stop behaves.

Prefect's own temporary server is a child in the trainer's process group: Ctrl-C in the
terminal reaches it too, it dies first, and the trainer then retried the dead server for
about 75 s before exiting with a traceback; after `kill <pid>` it outlived the trainer. This
one is the same server (Prefect's uvicorn app, same settings, UI off) with two differences:

* it runs in a session of its own (`start_new_session`), so a terminal's Ctrl-C reaches only
  the trainer, which then reports the flow run's end to a server that is still there;
* it watches its parent and exits when the parent is gone, however the parent ended
  (kill -9 included), so no server process is left behind.

`temporary_server()` starts it (reusing one per process), points Prefect's settings at it
and stops it at exit. `python -m flows.prefect_server --port N --parent PID` is the server
process itself.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator

import flows  # noqa: F401  (Prefect's environment before prefect is imported)
import httpx
from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

_server: subprocess.Popen | None = None
_url: str | None = None


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _configured_url() -> str | None:
    return get_current_settings().api.url


def _start(timeout: float) -> str:
    global _server, _url
    port = _free_port()
    env = {**os.environ, **get_current_settings().to_environment_variables(exclude_unset=True),
           "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    _server = subprocess.Popen([sys.executable, "-m", "flows.prefect_server", "--port", str(port),
                                "--parent", str(os.getpid())], env=env, start_new_session=True,
                               stdin=subprocess.DEVNULL)
    atexit.register(stop)
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + timeout
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            if _server.poll() is not None:
                raise RuntimeError(f"the temporary Prefect server exited with code {_server.returncode} "
                                   "before it was ready; set PREFECT_API_URL to use a running server")
            try:
                if client.get(f"{url}/health", timeout=2).status_code == 200:
                    _url = url
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    stop()
    raise RuntimeError(f"the temporary Prefect server was not ready within {timeout:.0f} s "
                       "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)")


def stop() -> None:
    """Stop the temporary server (SIGTERM, then SIGKILL after 5 s)."""
    global _server, _url
    if _server is None:
        return
    proc, _server, _url = _server, None, None
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def temporary_server(log: Callable[[str], Any] | None = None) -> Iterator[str | None]:
    """Prefect's API for the body of the `with`: PREFECT_API_URL when set (yields it), else
    this process's temporary server (started once, stopped at exit)."""
    configured = _configured_url()
    if configured:
        yield configured
        return
    url = _url or _start(float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", 120)))
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield url


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)  # the trainer is gone: so is its server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    if os.getppid() != args.parent:
        return 0
    threading.Thread(target=_watch_parent, args=(args.parent,), daemon=True).start()
    import uvicorn  # start-up cost: only the server process needs it
    uvicorn.run("prefect.server.api.server:create_app", factory=True, host="127.0.0.1", port=args.port,
                log_level="error", lifespan="on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
