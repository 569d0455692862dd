"""How our processes end: without the interpreter's final garbage collection.

When Python exits it clears its modules and collects what is left; with torch, transformers,
Prefect, MLflow and LanceDB loaded, that collection alone took 2.3-2.6 s of CPU per process
here (py-spy: `gc_collect_main` after the last exit handler had run), seconds in which the work
is done and the user, a test or a parent process only waits. `skip_final_collection()` makes
`gc.freeze` an exit handler: the objects alive then are never collected again, so the process
frees them by reference counts only and ends at once. Exit handlers still all run (the ones
registered after it, first; the ones registered before it, after it, with the cycle collector
still working for what they make).

What is given up: `__del__` of objects in reference cycles still alive at exit, which Python
does not promise to run anyway. Nothing here relies on it: tables, checkpoints, MLflow runs and
Prefect states are written and closed explicitly before a process ends.

Called by `flows/__init__.py` (every command and the temporary Prefect server) and by the
async loop's generator processes.
"""

from __future__ import annotations

import atexit
import gc

_registered = False


def skip_final_collection() -> None:
    """Register `gc.freeze` as an exit handler (once per process)."""
    global _registered
    if not _registered:
        atexit.register(gc.freeze)
        _registered = True
