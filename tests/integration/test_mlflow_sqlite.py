"""The metric rows written straight into MLflow's SQLite store (replay_pipeline/tracking/mlflow_sqlite.py)
against MLflow's own log_batch, on a real store: the same history, the same latest values, the
same refusals, and the tracker using it."""

from __future__ import annotations

import json
import random
import sqlite3
import threading

import pytest
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from replay_pipeline.tracking.mlflow_sqlite import SqliteMetricWriter, open_writer, sqlite_path
from replay_pipeline.tracking.tracker import MlflowTracker


@pytest.fixture()
def store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("rows", artifact_location=(tmp_path / "artifacts").as_uri())
    return uri, client, experiment


def _batches(seed: int) -> list[list[tuple[str, float, int, int]]]:
    """Batches with what log_batch has rules for: a key several times in one batch, steps out
    of order, one step at two timestamps, one step and timestamp with two values, exact
    duplicates within and across batches, negative and large values."""
    rng = random.Random(seed)
    keys = ["learn/loss", "score/reward_mean", "eval/accuracy", "compute/gen_tokens", "a b-c.d_e/f"]
    batches, previous = [], []
    for b in range(12):
        rows = []
        for _ in range(rng.randint(1, 40)):
            key = rng.choice(keys)
            step = rng.choice([b, b, b + 1, max(0, b - 3), 0])
            ts = 1_700_000_000_000 + rng.choice([b * 1000, b * 1000, b * 1000 + 7, 5])
            value = rng.choice([rng.uniform(-5, 5), 0.0, 1e300, -1e300, float(step)])
            rows.append((key, value, ts, step))
        key, step, ts = rng.choice(keys), b + 2, 1_700_000_000_000 + b * 1000
        rows += [(key, 2.0, ts, step), (key, -1.0, ts, step)]  # a tie of step and time: the larger value wins
        rows += rng.sample(rows, k=min(3, len(rows)))  # duplicates within the batch
        if previous:
            rows += rng.sample(previous, k=min(2, len(previous)))  # and of an earlier batch
        previous = rows
        batches.append(rows)
    return batches


def _history(client, run_id, keys):
    return {k: sorted((m.value, m.timestamp, m.step) for m in client.get_metric_history(run_id, k)) for k in keys}


def _latest(uri, run_id):
    with sqlite3.connect(sqlite_path(uri)) as conn:
        return sorted(conn.execute("SELECT key, value, timestamp, step, is_nan FROM latest_metrics "
                                   "WHERE run_uuid = ?", (run_id,)).fetchall())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_match_log_batch(store, seed):
    uri, client, experiment = store
    fast, slow = client.create_run(experiment).info.run_id, client.create_run(experiment).info.run_id
    writer = open_writer(uri, fast)
    assert writer is not None, "a store MLflow just created must get the row writer"
    batches = _batches(seed)
    for rows in batches:
        writer.write(rows)
        client.log_batch(slow, metrics=[Metric(*row) for row in rows])
    writer.close()
    keys = {row[0] for rows in batches for row in rows}
    fast_history = _history(client, fast, keys)
    assert fast_history == _history(client, slow, keys)
    assert sum(map(len, fast_history.values())) > 50
    assert client.get_run(fast).data.metrics == client.get_run(slow).data.metrics
    assert _latest(uri, fast) == _latest(uri, slow)


def test_refusals_store_nothing(store):
    uri, client, experiment = store
    run = client.create_run(experiment).info.run_id
    writer = open_writer(uri, run)
    writer.write([("ok", 1.0, 1, 0)])
    with pytest.raises(MlflowException):  # MLflow's own name check, before anything is written
        writer.write([("fine", 2.0, 2, 1), ("../escape", 1.0, 2, 1)])
    client.delete_run(run)
    with pytest.raises(ValueError, match="deleted from the store"):
        writer.write([("ok", 3.0, 3, 2)])
    client.restore_run(run)
    assert [(m.value, m.step) for m in client.get_metric_history(run, "ok")] == [(1.0, 0)]
    assert client.get_metric_history(run, "fine") == []
    gone = SqliteMetricWriter(sqlite_path(uri), "0" * 32)
    with pytest.raises(ValueError, match="not in the store"):
        gone.write([("ok", 1.0, 1, 0)])


def test_only_known_sqlite_stores(tmp_path, store):
    uri, client, experiment = store
    run = client.create_run(experiment).info.run_id
    for other in ("http://127.0.0.1:5000", f"sqlite:///{tmp_path / 'mlflow.db'}?timeout=5",
                  f"sqlite:///{tmp_path / 'missing.db'}", "sqlite:///", f"postgresql://u@h/{tmp_path}"):
        assert open_writer(other, run) is None, other
    assert not (tmp_path / "missing.db").exists()
    changed = tmp_path / "changed.db"  # an MLflow whose metrics table gained a column
    with sqlite3.connect(changed) as conn:
        conn.execute("CREATE TABLE metrics (key, value, timestamp, run_uuid, step, is_nan, model_id)")
        conn.execute("CREATE TABLE latest_metrics (key, value, timestamp, step, is_nan, run_uuid)")
    assert open_writer(f"sqlite:///{changed}", run) is None


def test_beside_mlflows_own_writes(store):
    """The writer thread and MLflow's own connections write the same file: each waits for the
    other's lock instead of failing."""
    uri, client, experiment = store
    run = client.create_run(experiment).info.run_id
    writer = open_writer(uri, run)
    errors = []

    def write():
        try:
            for step in range(60):
                writer.write([(f"m{i}", float(step), 1000 + step, step) for i in range(95)])
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=write)
    thread.start()
    for i in range(60):
        client.set_tag(run, f"tag{i % 5}", str(i))
        client.log_param(run, f"p{i}", str(i))
    thread.join()
    assert errors == []
    data = client.get_run(run).data
    assert data.metrics == {f"m{i}": 59.0 for i in range(95)}
    assert len(client.get_metric_history(run, "m7")) == 60 and len(data.params) == 60


def test_tracker_writes_rows(store, tmp_path):
    uri, client, _ = store
    tracker = MlflowTracker(uri, "rows", tmp_path / "artifacts", "run-a")
    assert tracker._rows is not None
    for step in range(5):
        tracker.log_metrics({"learn/loss": 1.0 / (step + 1), "skipped": float("nan"), "none": None}, step)
    tracker.flush()
    assert [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, "learn/loss")] == \
        [(s, 1.0 / (s + 1)) for s in range(5)]
    assert client.get_metric_history(tracker.run_id, "skipped") == []
    tracker.finish()
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics == {"learn/loss": 0.2}


def test_benchmark_prints_both_paths(tmp_path, capsys):
    from replay_pipeline.benchmarks import metrics as bench

    out = tmp_path / "metrics.json"
    assert bench.main(["--batches", "3", "--rounds", "2", "--metrics", "10", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "log_batch / rows, CPU:" in printed and "20 metrics" in printed
    result = json.loads(out.read_text())
    assert result["metrics_per_batch"] == 20 and set(result["paths"]) == {"log_batch", "rows"}
    for path in result["paths"].values():
        assert path["cpu_ms_per_batch"] > 0 and path["wall_ms_per_batch"] > 0
    with pytest.raises(SystemExit) as exc:
        bench.main(["--batches", "0"])
    assert exc.value.code == 2 and "--batches must be >= 1" in capsys.readouterr().err
