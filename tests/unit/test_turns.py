"""Processes in turns (replay_pipeline/benchmarks/turns.py), on real processes: only one side's
process tree runs at a time, the pauses recorded cover every moment a side did not run, a failed
side leaves no stopped or living process behind; and the arithmetic of what pauses do to a
side's steps, start-up and evaluations (peers.apply_turns)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from replay_pipeline.benchmarks.peers import apply_turns, repeat_figures
from replay_pipeline.benchmarks.turns import (Turned, in_window, kept_steps, overlap, process_tree, shared_window,
                                              take_turns)

# Busy for RUN_S seconds of its own running time (wall time it was stopped does not count),
# stamping time.time() every ~2 ms into argv[1]; with argv[2] == "child", a child process
# stamps into argv[1] + ".child" alongside it.
STAMPER = """
import os, subprocess, sys, time
path, mode, run_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
child = None
if mode == "child":
    child = subprocess.Popen([sys.executable, sys.argv[4], path + ".child", "plain", str(run_s), sys.argv[4]])
with open(path, "w") as out:
    own, last = 0.0, time.perf_counter()
    while own < run_s:
        now = time.perf_counter()
        own += min(now - last, 0.01)  # a gap of more than 10 ms was a stop: not our running time
        last = now
        out.write(f"{time.time()}\\n")
        out.flush()
        t = time.perf_counter()
        while time.perf_counter() - t < 0.002:
            pass
if child is not None:
    child.wait()
if mode == "fail":
    sys.exit(3)
"""


def _stamper(tmp_path: Path) -> Path:
    script = tmp_path / "stamper.py"
    script.write_text(STAMPER)
    return script


def _job(tmp_path: Path, name: str, mode: str = "plain", run_s: float = 0.9):
    script = _stamper(tmp_path)
    return (name, [sys.executable, str(script), str(tmp_path / f"{name}.stamps"), mode, str(run_s), str(script)],
            tmp_path / f"{name}.log")


def _stamps(path: Path) -> list[float]:
    return [float(x) for x in path.read_text().split()]


def test_sides_take_turns_and_never_run_together(tmp_path):
    turns = take_turns([_job(tmp_path, "a"), _job(tmp_path, "b")], slice_seconds=0.25)
    a, b = _stamps(tmp_path / "a.stamps"), _stamps(tmp_path / "b.stamps")
    assert turns["a"].turns >= 3 and turns["b"].turns >= 2
    assert turns["a"].pauses and all(t1 > t0 for t0, t1 in turns["a"].pauses)
    # nothing of a ran inside one of its pauses, and b ran in each of them
    for t0, t1 in turns["a"].pauses:
        assert not [t for t in a if t0 + 0.005 < t < t1 - 0.005]
        assert [t for t in b if t0 < t < t1]
    # the owners of the merged stamps change at turns only: never interleaved stamp by stamp
    owners = [o for _, o in sorted([(t, "a") for t in a] + [(t, "b") for t in b])]
    changes = sum(x != y for x, y in zip(owners, owners[1:]))
    assert changes <= turns["a"].turns + turns["b"].turns
    # a side's wall seconds hold its pauses; without them, about its own running time
    for name in ("a", "b"):
        own = turns[name].seconds - turns[name].paused_seconds
        assert 0.8 < own < turns[name].seconds


def test_a_sides_children_are_stopped_with_it(tmp_path):
    turns = take_turns([_job(tmp_path, "parent", "child"), _job(tmp_path, "other")], slice_seconds=0.25)
    child, other = _stamps(tmp_path / "parent.stamps.child"), _stamps(tmp_path / "other.stamps")
    assert child and turns["parent"].pauses
    for t0, t1 in turns["parent"].pauses:  # while the other side ran, the child did not
        ran = [t for t in other if t0 < t < t1]
        assert ran and not [t for t in child if ran[0] < t < ran[-1]]


def test_a_failing_side_fails_the_run_and_leaves_no_process(tmp_path):
    jobs = [_job(tmp_path, "long", run_s=30.0), _job(tmp_path, "bad", "fail", run_s=0.3)]
    with pytest.raises(RuntimeError, match=r"bad ended with 3 .*bad\.log"):
        take_turns(jobs, slice_seconds=0.2)
    time.sleep(0.2)
    # the long side was stopped at the failure's turn: it was killed, not left stopped
    mine = [p for p in process_tree(os.getpid()) if p != os.getpid()]
    assert not [p for p in mine if "stamper" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]


def test_a_side_over_its_own_time_is_killed(tmp_path):
    with pytest.raises(RuntimeError, match="timeout"):
        take_turns([_job(tmp_path, "slow", run_s=30.0), _job(tmp_path, "quick", run_s=0.1)],
                   slice_seconds=0.2, timeout=1.0)


def test_a_bad_slice_is_refused():
    with pytest.raises(ValueError, match="slice_seconds"):
        take_turns([], slice_seconds=0)


def test_overlap_and_kept_steps():
    pauses = [(10.0, 12.0), (20.0, 21.0)]
    assert overlap(9.0, 11.0, pauses) == pytest.approx(1.0)
    assert overlap(0.0, 30.0, pauses) == pytest.approx(3.0)
    assert overlap(12.0, 20.0, pauses) == 0.0
    # steps of 1 s ending at 9, 10.5 (cut), 13.5, 14.5 (the one after the cut one), 15.5
    ends, seconds = [9.0, 13.0, 14.0, 15.0, 16.0], [1.0, 3.5, 1.0, 1.0, 1.0]
    assert kept_steps(ends, seconds, pauses) == [True, False, False, True, True]


def test_the_shared_window_is_where_every_side_was_taking_steps():
    # side a steps from 1 to 10, side b from 3 to 14 (it started later and ended later)
    a = ([2.0, 4.0, 6.0, 8.0, 10.0], [1.0] * 5)
    b = ([4.0, 6.0, 9.0, 12.0, 14.0], [1.0, 2.0, 1.0, 1.0, 2.0])
    assert shared_window([a, b]) == (3.0, 10.0)
    assert shared_window([b, a]) == (3.0, 10.0)
    assert in_window(*a, (3.0, 10.0)) == [False, True, True, True, True]  # step 1 began at 1.0
    assert in_window(*b, (3.0, 10.0)) == [True, True, True, False, False]  # the last two end after 10
    # one side ended before the other began; a side without steps; no side
    assert shared_window([([2.0, 3.0], [1.0, 1.0]), ([5.0, 6.0], [1.0, 1.0])]) is None
    assert shared_window([a, ([], [])]) is None and shared_window([]) is None
    assert in_window(*a, None) == [False] * 5


def _record():
    """Created at 0.3 s; a 0.2-s start evaluation ending at 1.0 (startup_at); five steps from
    1.0 to 1.65 (the third 0.2 s, the others 0.1 s); an end evaluation of 0.1 s logged at 1.8."""
    ends = [1.1, 1.2, 1.25 + 0.2, 1.55, 1.65]
    return {"name": "x", "step_seconds": [0.1, 0.1, 0.2, 0.1, 0.1], "gen_seconds": [0.05] * 5,
            "train_seconds": [0.04] * 5, "step_ended_at": ends, "gen_tokens": 50.0,
            "startup_seconds": 0.5, "startup_at": 1.0, "startup_eval_seconds": 0.2,
            "eval_seconds": 0.3, "eval_tokens": 30.0,
            "evals": [{"step": 0, "accuracy": 0.1, "gen_tokens": 0.0, "seconds": 0.0, "eval_seconds": 0.2,
                       "eval_tokens": 20.0, "ended_at": 1.0},
                      {"step": 5, "accuracy": 0.2, "gen_tokens": 50.0, "seconds": 0.6, "eval_seconds": 0.1,
                       "eval_tokens": 10.0, "ended_at": 1.8}]}


def test_apply_turns_drops_cut_steps_and_takes_pauses_out_of_windows():
    record = _record()
    # created at 0.3; a pause in start-up (0.35-0.4), one in the start evaluation (0.85-0.9),
    # one inside step 3 (1.3-1.35), none in the end evaluation
    turned = Turned(seconds=2.0, pauses=[(0.35, 0.4), (0.85, 0.9), (1.3, 1.35)], turns=4)
    apply_turns(record, turned)
    assert record["step_kept"] == [True, True, False, False, True]
    assert record["step_unpaused_seconds"] == pytest.approx([0.1, 0.1, 0.15, 0.1, 0.1])
    # 0.5 s measured, less the start-up pause; the evaluation's pause was in its own seconds
    assert record["startup_seconds"] == pytest.approx(0.45)
    assert record["process_seconds"] == pytest.approx(2.0 - 0.15)
    start, end = record["evals"]
    assert not start["clean"] and end["clean"]
    assert end["seconds"] == pytest.approx(0.55)  # unpaused step seconds before it
    f = repeat_figures(record)
    assert f["steps_kept"] == 3 and f["step_s"] == pytest.approx(0.1)
    assert f["steps_total_s"] == pytest.approx(0.55)
    assert f["eval_ms_per_token"] == pytest.approx(1000 * 0.1 / 10)  # the clean evaluation only


def test_a_side_whose_every_step_was_cut_is_refused():
    record = _record()
    apply_turns(record, Turned(seconds=3.0, pauses=[(1.0, 2.0)], turns=2))
    with pytest.raises(ValueError, match="slice-seconds"):
        repeat_figures(record)


def test_sigterm_to_the_caller_leaves_no_side_behind(tmp_path):
    # a caller of take_turns, terminated while one side runs and the other is stopped
    caller = tmp_path / "caller.py"
    caller.write_text(
        "import sys\nfrom pathlib import Path\nfrom replay_pipeline.benchmarks.turns import take_turns\n"
        f"script = {str(_stamper(tmp_path))!r}\n"
        "jobs = [(n, [sys.executable, script, str(Path(sys.argv[1]) / (n + '.stamps')), 'plain', '60', script],"
        " Path(sys.argv[1]) / (n + '.log')) for n in ('a', 'b')]\n"
        "take_turns(jobs, slice_seconds=0.3)\n")
    proc = subprocess.Popen([sys.executable, str(caller), str(tmp_path)], cwd=Path(__file__).parents[2],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not ((tmp_path / "a.stamps").exists() and (tmp_path / "b.stamps").exists()):  # both launched
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) != 0
    assert "Terminated" in proc.stderr.read()
    time.sleep(0.2)
    left = [p for p in os.listdir("/proc") if p.isdigit()
            and str(tmp_path) in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
    assert not left
