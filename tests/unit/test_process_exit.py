"""Our processes end without the interpreter's final garbage collection (2.3-2.6 s of CPU per
command here, replay_pipeline/system/process_exit.py): importing `flows`, as every command and the
temporary Prefect server do, registers it; other exit handlers still run."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

# A reference cycle whose __del__ writes a line: only a collection at exit can run it.
CYCLE = """
import atexit, sys
class Node:
    def __del__(self):
        sys.stdout.write("collected\\n"); sys.stdout.flush()
a, b = Node(), Node()
a.other, b.other = b, a
del a, b
import gc; gc.disable()  # nothing before the exit collects it
atexit.register(lambda: print("exit handler ran", flush=True))
"""


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_usual_end_collects_a_cycle_left_at_exit():
    # The control: without our exit handler the interpreter's final collection runs __del__.
    assert run(CYCLE).splitlines() == ["exit handler ran", "collected", "collected"]


def test_importing_flows_skips_the_final_collection_and_keeps_the_exit_handlers():
    assert run("import flows\n" + CYCLE).splitlines() == ["exit handler ran"]
    # Registered once however often it is asked for.
    assert run("import flows, atexit, gc\nfrom replay_pipeline.system.process_exit import skip_final_collection\n"
               "skip_final_collection(); atexit.unregister(gc.freeze)\n" + CYCLE).splitlines()[-1] == "collected"
