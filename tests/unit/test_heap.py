"""replay_pipeline/system/heap.py: no full collection while a command starts, the start-up heap
frozen at the first round, and a process that never deferred left as it was. Each case runs
in a fresh interpreter, so that pytest's own collector is not the one changed."""

from __future__ import annotations

import json
import subprocess
import sys

# Grows the heap the way loading libraries does (long-lived objects, in reference cycles so
# that the collector tracks them), counting full collections, then ends start-up.
SCRIPT = """
import gc, json, sys
from replay_pipeline.system import heap
full = []
gc.callbacks.append(lambda phase, info: full.append(1) if phase == "start" and info["generation"] == 2 else None)
before = gc.get_threshold()
if sys.argv[1] == "defer":
    heap.defer_full_collections()
    heap.defer_full_collections()  # idempotent: the saved thresholds stay the real ones
deferring = heap.deferring()
keep = []
for i in range(300_000):
    node = {"i": i}
    node["self"] = node
    keep.append(node)
during = len(full)
frozen = heap.freeze_startup_heap()
print(json.dumps({"full_during_startup": during, "deferring": deferring, "frozen": frozen,
                  "freeze_count": gc.get_freeze_count(), "restored": gc.get_threshold() == before,
                  "again": heap.freeze_startup_heap(), "deferring_after": heap.deferring()}))
"""


def _run(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_deferred_start_up_runs_no_full_collection_and_freezes_its_heap():
    out = _run("defer")
    assert out["deferring"] and out["full_during_startup"] == 0
    assert out["frozen"] == out["freeze_count"] >= 300_000  # every node, and what was there before
    assert out["restored"] and not out["deferring_after"]  # the collector as it was, from then on
    assert out["again"] == 0  # a second call (a second train() in the process) freezes nothing more


def test_the_control_without_deferral_collects_in_full_and_freezes_nothing():
    out = _run("plain")  # what every start-up did before: the heap walked again as it grew
    assert not out["deferring"] and out["full_during_startup"] >= 2
    assert out["frozen"] == out["freeze_count"] == 0 and out["restored"]


def test_only_the_training_command_defers():
    """`python -m flows.train` defers from its first line; importing flows.train (a test, a
    sweep, a deployment) does not, so a longer-lived process keeps its collector."""
    probe = ("import gc, runpy, sys; sys.argv = ['flows.train', '--help']\n"
             "try:\n    runpy.run_module('flows.train', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "from replay_pipeline.system import heap; print('CLI', heap.deferring(), gc.get_threshold()[2])")
    cli = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert cli.stdout.strip().splitlines()[-1] == f"CLI True {1 << 30}"
    imported = subprocess.run([sys.executable, "-c", "import flows.train, gc; from replay_pipeline.system import heap; "
                               "print(heap.deferring(), gc.get_threshold()[2])"],
                              capture_output=True, text=True, timeout=300)
    assert imported.returncode == 0, imported.stderr[-2000:]
    assert imported.stdout.split() == ["False", "10"]  # Python's own generation-2 threshold
