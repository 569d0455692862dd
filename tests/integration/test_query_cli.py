"""python -m flows.query against a real LanceDB database in tmp_path (the two runs of
test_analysis.build_replay_db: run-a with 32 rollouts and 22 usage records, run-b without a
usage table).

Each CLI process spends ~4 s importing lancedb, so the module fixture starts every
subprocess that reaches the database at once and the tests read their results; argument
errors answer before lancedb is imported and run one by one. A few more cases call
``flows.query.main`` in-process, where lancedb is already imported.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flows.query import main
from replay_pipeline.buffer.schema import ROLLOUT_SCHEMA
from tests.integration.test_analysis import REUSE, build_replay_db

REPO = Path(__file__).resolve().parents[2]
WIDTH = 100


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str


def _start(*args: str) -> subprocess.Popen:
    # PREFECT_HOME comes from tests/conftest.py, so flows/__init__ creates nothing in the repo.
    env = {**os.environ, "COLUMNS": str(WIDTH)}
    return subprocess.Popen([sys.executable, "-m", "flows.query", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> Result:
    out, err = proc.communicate(timeout=180)
    return Result(proc.returncode, out, err)


def run_cli(*args: str) -> Result:
    return _finish(_start(*args))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("query-cli")
    build_replay_db(root)
    (root / "out").mkdir()
    return root


@pytest.fixture(scope="module")
def cli(root) -> dict[str, Result]:
    r, db, out = str(root), str(root / "lancedb"), root / "out"
    cases = {
        "runs": ["runs", "--root", r],
        "runs_db": ["runs", "--uri", db],
        "table": ["rollouts", "run-a", "--uri", db, "--versions", "1:2", "--limit", "3"],
        "csv": ["rollouts", "run-a", "--root", r, "--versions", "1:2", "--correct",
                "--format", "csv", "--output", str(out / "r.csv")],
        "jsonl": ["rollouts", "run-a", "--root", r, "--min-reuse", "2", "--format", "jsonl",
                  "--columns", "seq,completion_ids,behaviour_logprobs,reuse_count"],
        "parquet": ["rollouts", "run-a", "--root", r, "--steps", "3:3", "--format", "parquet",
                    "--output", str(out / "r.parquet")],
        "unknown_run": ["rollouts", "nope", "--root", r],
        "no_match": ["rollouts", "run-a", "--root", r, "--versions", "7:9", "--correct"],
    }
    procs = {name: _start(*args) for name, args in cases.items()}
    return {name: _finish(proc) for name, proc in procs.items()}


# ------------------------------------------------------------------ tables
def test_runs_table(cli):
    res = cli["runs_db"]  # the database alone: its tables' figures
    assert res.rc == 0, res.stderr
    header, rule, a, b, *footer = res.stdout.splitlines()
    assert header.split()[0] == "run_id"  # the other headers are abbreviated to fit 100 columns
    assert all(len(line) <= WIDTH for line in res.stdout.splitlines())
    assert a.split()[:5] == ["run-a", "32", "22", "0", "3"] and "[step-000" in a  # tag, truncated
    assert b.split()[:3] == ["run-b", "8", "0"]
    assert footer == ["2 runs"]


def test_runs_under_a_root_show_status_columns_and_tables_without_a_run_directory(cli):
    res = cli["runs"]  # --root: these tables were written without run directories
    assert res.rc == 0, res.stderr
    header, rule, *rows, footer = res.stdout.splitlines()
    assert header.split() == ["run_id", "status", "pid", "steps", "accuracy", "started", "rollouts"]
    assert sorted(r.split() for r in rows) == [["run-a", "unknown", "?/?", "32"], ["run-b", "unknown", "?/?", "8"]]
    assert footer == "2 runs"


def test_rollouts_table_is_width_limited_and_says_how_many_matched(cli):
    res = cli["table"]
    assert res.rc == 0, res.stderr
    lines = res.stdout.splitlines()
    assert all(len(line) <= WIDTH for line in lines)
    assert lines[0].split()[0] == "seq" and "completion" in lines[0]
    rows = lines[2:5]
    assert [row.split()[0] for row in rows] == ["8", "9", "10"]
    assert "…" in rows[0]  # the 77-character completion is truncated
    assert "16 rollouts matched, the first 3 shown" in res.stdout


def test_no_match_is_not_an_error_but_says_so(cli):
    res = cli["no_match"]
    assert res.rc == 0 and res.stdout == ""
    assert "no rollouts of run run-a match --versions 7:9 --correct" in res.stderr
    assert "32 rollouts, policy versions 0..3" in res.stderr


# ------------------------------------------------------------------ files
def test_csv_output_reads_back(cli, root):
    res = cli["csv"]
    assert res.rc == 0, res.stderr
    assert "wrote 6 rollouts" in res.stderr
    df = pd.read_csv(root / "out" / "r.csv")
    assert list(df.columns) == [*ROLLOUT_SCHEMA.names, "reuse_count"]
    assert df["seq"].tolist() == [8, 12, 16, 17, 20, 21]
    assert df["correct"].tolist() == [True] * 6
    assert df["reuse_count"].tolist() == [REUSE.get(s, 0) for s in [8, 12, 16, 17, 20, 21]]
    # list columns are JSON lists; float32 log-probs at float32 precision
    assert [json.loads(v) for v in df["completion_ids"]] == [[10, 11], [10, 11], [10, 11, 12], [10], [10, 11, 12], [10]]
    assert json.loads(df["behaviour_logprobs"].iloc[0]) == [-0.1, -0.1]
    assert pd.to_datetime(df["created_at"]).iloc[0] == pd.Timestamp("2025-01-01 00:01", tz="UTC")


def test_jsonl_to_stdout(cli):
    res = cli["jsonl"]
    assert res.rc == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["seq"] for r in rows] == [0, 1, 8, 16]
    assert [r["reuse_count"] for r in rows] == [5, 2, 3, 2]
    assert rows[0] == {"seq": 0, "completion_ids": [10], "behaviour_logprobs": [-0.1], "reuse_count": 5}


def test_parquet_keeps_the_arrow_types(cli, root):
    res = cli["parquet"]
    assert res.rc == 0, res.stderr
    t = pq.read_table(root / "out" / "r.parquet")
    assert t.column("seq").to_pylist() == list(range(24, 32))
    assert t.schema.field("completion_ids").type == pa.list_(pa.int32())
    assert t.schema.field("reward").type == pa.float32()
    assert t.column("reuse_count").to_pylist() == [REUSE.get(s, 0) for s in range(24, 32)]


# ------------------------------------------------------------------ errors: exit 2, say how to fix
def test_unknown_run_lists_runs(cli):
    res = cli["unknown_run"]
    assert res.rc == 2 and res.stdout == ""
    assert "unknown run id 'nope'" in res.stderr and "['run-a', 'run-b']" in res.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["rollouts", "run-a", "--versions", "5"], "'5' is not a range: use LO:HI, e.g. 0:10"),
        (["rollouts", "run-a", "--versions", "5:2"], "--versions 5:2 is an empty range: LO must be <= HI, e.g. --versions 2:5"),
        (["usage", "run-a", "--learner-steps", "x:3"], "use LO:HI, e.g. 0:10"),
        (["rollouts", "run-a", "--format", "parquet"], "add --output FILE"),
        (["rollouts", "run-a", "--min-reuse", "3", "--max-reuse", "1"], "--min-reuse 3 > --max-reuse 1"),
        (["runs", "--root", "{missing}"], "no LanceDB database at {missing}/lancedb"),
    ],
)
def test_argument_errors(tmp_path, args, message):
    missing = str(tmp_path / "missing")
    res = run_cli(*[a.format(missing=missing) for a in args])
    assert res.rc == 2
    assert message.format(missing=missing) in res.stderr
    if "--root" in args:
        assert "A training run writes it" in res.stderr and "--uri" in res.stderr


def test_help_shows_examples():
    res = run_cli("--help")
    assert res.rc == 0
    assert "examples:" in res.stdout and "python -m flows.query rollouts RUN_ID --versions 10:20" in res.stdout


# ------------------------------------------------------------------ in-process (lancedb already imported)
def test_summaries_and_messages_in_process(root, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # the table's width (a pytest-xdist worker has no terminal)
    db = str(root / "lancedb")
    assert main(["summary", "run-a", "--uri", db, "--by", "staleness", "--format", "csv"]) == 0
    assert pd.read_csv(io.StringIO(capsys.readouterr().out)).to_dict("list") == {"staleness": [0, 1, 3], "uses": [17, 4, 1]}
    assert main(["summary", "run-a", "--uri", db, "--by", "reuse"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split() for line in out[2:7]] == [["0", "18"], ["1", "10"], ["2", "2"], ["3", "1"], ["5", "1"]]
    assert main(["rollouts", "run-a", "--uri", db]) == 0
    out = capsys.readouterr().out
    assert "32 rollouts matched, the first 20 shown" in out and len(out.splitlines()) == 2 + 20 + 1
    (root / "empty-db").mkdir()
    assert main(["runs", "--uri", str(root / "empty-db")]) == 0
    assert "no runs in" in capsys.readouterr().err
    assert main(["usage", "run-b", "--uri", db]) == 0
    assert "run run-b has no usage records" in capsys.readouterr().err
    assert main(["rollouts", "run-a", "--uri", db, "--columns", "seq,bogus"]) == 2
    err = capsys.readouterr().err
    assert "unknown rollout columns ['bogus']" in err and "'reuse_count'" in err
    assert main(["rollouts", "run-b", "--uri", db, "--columns", "seq,completion_ids,reuse_count",
                 "--format", "csv"]) == 0
    df = pd.read_csv(io.StringIO(capsys.readouterr().out))
    assert df["reuse_count"].tolist() == [0] * 8 and json.loads(df["completion_ids"][1]) == [10, 11]


def test_usage_csv_and_summary_in_process(root, capsys):
    db = str(root / "lancedb")
    assert main(["usage", "run-a", "--uri", db, "--learner-steps", "2:3", "--format", "csv"]) == 0
    df = pd.read_csv(io.StringIO(capsys.readouterr().out))
    assert df["learner_step"].tolist() == [2] * 4 + [3] * 4
    assert df["rollout_seq"].tolist() == [8, 9, 0, 1, 8, 10, 11, 12]
    assert df["staleness"].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert main(["summary", "run-a", "--uri", db, "--format", "jsonl"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["accuracy"] for r in rows] == [0.0, 0.25, 0.5, 0.75]
    assert [r["mean_length"] for r in rows] == [1.75, 2.0, 2.25, 1.75]
