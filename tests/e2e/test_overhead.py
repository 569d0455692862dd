"""The overhead benchmark (replay_pipeline/benchmarks/overhead.py) end to end on the tiny test
model: a real sync run on the trainer's own Prefect server, its ledger read back from MLflow,
and the report's breakdown of a round."""

from __future__ import annotations

import os

import pytest

from flows import prefect_server
from replay_pipeline.benchmarks.overhead import SYNC_PARTS, report, run_loop
from tests.conftest import TINY_OVERRIDES

STEPS = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    prefect_server.stop()  # a server an earlier test started would hide whether run_loop starts one
    root = tmp_path_factory.mktemp("overhead")
    out = run_loop("sync", STEPS, str(root), list(TINY_OVERRIDES))
    return out, prefect_server._url


@pytest.fixture(scope="module")
def result(run):
    return run[0]


def test_it_runs_on_the_trainers_own_prefect_server(run):
    # flows/prefect_server.py started the server the flow ran on, as for `python -m flows.train`
    # (idle services off); with Prefect's own in-process temporary server this stays None
    if os.environ.get("PREFECT_API_URL"):
        pytest.skip("PREFECT_API_URL names a server: the benchmark runs on it")
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
