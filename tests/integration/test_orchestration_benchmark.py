"""replay_pipeline.benchmarks.orchestration: real private Prefect servers, one for each side's
service batches (SIDES), each given a flow run of task runs; every side writes every task run
and task-run event (what a server's batches hold, at its exit), and the figures are CPU a task run costs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from replay_pipeline.benchmarks.orchestration import SIDES, main

ROOT = Path(__file__).resolve().parents[2]


def test_both_sides_write_every_task_run_and_report_their_cpu(tmp_path):
    out = tmp_path / "orchestration.json"
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    done = subprocess.run([sys.executable, "-m", "replay_pipeline.benchmarks.orchestration", "--tasks", "20",
                           "--repeats", "2", "--gap", "0.02", "--idle", "2", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    sides = list(SIDES)
    assert [(r["repeat"], r["side"]) for r in result["records"]] == [(0, side) for side in sides] + \
        [(1, side) for side in reversed(sides)]
    for record in result["records"]:
        # a server's batches held some of these until its exit, which wrote them
        assert (record["task_runs_written"], record["task_run_events_written"]) == (20, 60), record
        assert record["server_cpu_ms_per_task"] > 0 and record["client_cpu_ms_per_task"] > 0, record
        assert 0 < record["call_ms"] < 1000, record
    assert all(result["summary"][side]["all_written"] for side in SIDES)
    lines = done.stdout.splitlines()
    for side in sides:
        assert any(line.startswith(f"{side} ") and line.endswith("yes") for line in lines), done.stdout


@pytest.mark.parametrize("args, message", [
    (["--tasks", "0"], "--tasks must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--gap", "-1"], "--gap must be >= 0"),
    (["--idle", "0"], "--idle > 0"),
])
def test_bad_input_is_refused_before_any_server_starts(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
