"""The overhead benchmark (replay_pipeline/benchmarks/overhead.py) end to end on the tiny test
model: a real sync run on the trainer's own Prefect server, its ledger read back from MLflow,
and the report's breakdown of a round."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from replay_pipeline.benchmarks.overhead import SYNC_PARTS, report
from tests.conftest import TINY_OVERRIDES

STEPS = 3


# In a process of its own: a flow run in the test process would leave Prefect's event client
# bound to this server, and a later test's fresh server would never hear its task runs.
CHILD = """
import json, sys
from flows import prefect_server
from replay_pipeline.benchmarks.overhead import run_loop
out = run_loop("sync", int(sys.argv[1]), sys.argv[2], sys.argv[3:])
out["server_url"] = prefect_server._url  # set only if flows/prefect_server.py started the server
print("RESULT " + json.dumps(out, default=str))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("overhead")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    done = subprocess.run([sys.executable, "-c", CHILD, str(STEPS), str(root), *TINY_OVERRIDES], env=env,
                          capture_output=True, text=True, timeout=900, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line.removeprefix("RESULT "))
    return out, out.pop("server_url")


@pytest.fixture(scope="module")
def result(run):
    return run[0]


def test_it_runs_on_the_trainers_own_prefect_server(run):
    # flows/prefect_server.py started the server the flow ran on, as for `python -m flows.train`
    # (idle services off); with Prefect's own in-process temporary server this stays None
    result, url = run
    assert url is not None
    assert result["final"]["compute/overhead_frac"] >= 0.0


def test_every_phase_of_a_round_was_read_back(result):
    means = result["means"]
    for key in ("generate/seconds", "learn/seconds", "buffer/append_seconds", "buffer/sample_seconds",
                "buffer/record_seconds", "score/seconds"):
        assert means[key] >= 0.0, key
    assert means["generate/seconds"] > 0.0 and means["learn/seconds"] > 0.0


def test_the_report_breaks_a_round_down(result):
    text = report(result)
    assert f"sync loop, {STEPS} rounds" in text
    for label, _ in SYNC_PARTS:
        assert label in text
