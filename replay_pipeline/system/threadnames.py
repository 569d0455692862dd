"""Operating-system names for the project's threads: `top -H`, `ps -L`, py-spy's native
view and `/proc/<pid>/task/*/comm` then tell the table writer from the MLflow writer.

Python 3.11 names a thread only inside Python; to the operating system every thread of a
run is called after the process ("python"), so measuring which thread spends the CPU (from
`/proc/<pid>/task/*/stat`, py-spy or `top -H`) would mean guessing from thread ids.

* `name_os_thread()` gives the calling thread its Python name, cut to Linux's 15 bytes
  (prctl(PR_SET_NAME)); a ThreadPoolExecutor's `initializer`.
* `os_named(fn)` wraps a thread's target so that the thread names itself first.

Where the C library has no prctl (not Linux) both do nothing; a name is a diagnostic, never a
reason for a thread to fail. Ground floor: imports nothing of the project.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any, Callable

__all__ = ["name_os_thread", "os_named"]

PR_SET_NAME = 15
NAME_BYTES = 15  # Linux's TASK_COMM_LEN, less the terminating zero


@functools.cache
def _prctl() -> Callable[..., int] | None:
    try:
        # the process itself (dlopen(NULL)), which has libc loaded: find_library("c") would run
        # ldconfig in a subprocess, a fork from whichever thread names itself first
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def name_os_thread() -> None:
    """Name the calling thread, for the operating system, after its Python name."""
    prctl = _prctl()
    if prctl is not None:
        prctl(PR_SET_NAME, threading.current_thread().name.encode("utf-8", "replace")[:NAME_BYTES], 0, 0, 0)


def os_named(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` for a thread's target: the thread names itself (name_os_thread) and runs `fn`."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        name_os_thread()
        return fn(*args, **kwargs)
    return run
