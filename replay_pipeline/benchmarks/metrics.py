"""What one second of a run's metrics costs to store in MLflow's SQLite store: MLflow's own
`log_batch` against the row writer the tracker uses (replay_pipeline/tracking/mlflow_sqlite.py).

    python -m replay_pipeline.benchmarks.metrics                     # 40 batches of 6 rounds x 95 metrics
    python -m replay_pipeline.benchmarks.metrics --batches 100 --out metrics.json

A batch is what the tracker's writer gathers in one second of the default run (about 6 rounds
of 95 metrics). Both paths write the same batches into two runs of one fresh store, taking
turns batch by batch (which goes first alternates), so a noisy machine hits both alike. Per
path it prints the median CPU time of the writing thread per batch and per metric (what is
taken from generation and training, whose threads share the cores and, for the Python part,
the interpreter lock) and the median wall time per batch (it includes SQLite's fsync).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def run_benchmark(batches: int, rounds: int, metrics: int, root: str | Path) -> dict:
    # start-up cost: mlflow loads in the benchmark only (tracking first: it quiets MLflow's logs)
    from replay_pipeline.tracking.mlflow_sqlite import open_writer
    from replay_pipeline.tracking.tracker import seed_sqlite_store

    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{Path(root).resolve() / 'mlflow.db'}"
    seed_sqlite_store(uri)  # a copy of an empty migrated store, as every run's
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("metrics-benchmark", artifact_location=(Path(root) / "artifacts").resolve().as_uri())
    runs = {name: client.create_run(experiment, run_name=name).info.run_id for name in ("log_batch", "rows")}
    writer = open_writer(uri, runs["rows"])
    if writer is None:
        raise RuntimeError(f"the store at {uri} has metric tables the row writer does not know")
    keys = [f"group{i % 5}/metric_{i}" for i in range(metrics)]
    write = {"log_batch": lambda rows: client.log_batch(runs["log_batch"], metrics=[Metric(*r) for r in rows]),
             "rows": writer.write}
    seconds: dict[str, dict[str, list[float]]] = {name: {"cpu": [], "wall": []} for name in write}
    for b in range(batches + 1):  # batch 0 warms both paths up and is not counted
        now = int(time.time() * 1000)
        rows = [(k, float(b * rounds + s) / (i + 1), now, b * rounds + s) for s in range(rounds) for i, k in enumerate(keys)]
        for name in (("log_batch", "rows") if b % 2 else ("rows", "log_batch")):
            cpu, wall = time.thread_time(), time.perf_counter()
            write[name](rows)
            if b:
                seconds[name]["cpu"].append(time.thread_time() - cpu)
                seconds[name]["wall"].append(time.perf_counter() - wall)
    writer.close()
    per_batch = rounds * len(keys)
    out = {"batches": batches, "metrics_per_batch": per_batch, "paths": {}}
    for name, s in seconds.items():
        cpu = statistics.median(s["cpu"])
        out["paths"][name] = {"cpu_ms_per_batch": 1000 * cpu, "cpu_us_per_metric": 1e6 * cpu / per_batch,
                              "wall_ms_per_batch": 1000 * statistics.median(s["wall"])}
    out["cpu_ratio"] = out["paths"]["log_batch"]["cpu_ms_per_batch"] / out["paths"]["rows"]["cpu_ms_per_batch"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replay_pipeline.benchmarks.metrics", description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=40, help="batches per path (default 40)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per batch (default 6: one second of the default run)")
    parser.add_argument("--metrics", type=int, default=95, help="metrics per round (default 95, as the default run)")
    parser.add_argument("--out", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    for flag in ("batches", "rounds", "metrics"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1")
    with tempfile.TemporaryDirectory(prefix="metrics-benchmark-") as root:
        result = run_benchmark(args.batches, args.rounds, args.metrics, root)
    print(f"{args.batches} batches of {result['metrics_per_batch']} metrics ({args.rounds} rounds x {args.metrics}), "
          "the two paths taking turns; medians:")
    print(f"{'path':12s} {'CPU ms/batch':>13s} {'CPU us/metric':>14s} {'wall ms/batch':>14s}")
    for name, p in result["paths"].items():
        print(f"{name:12s} {p['cpu_ms_per_batch']:13.1f} {p['cpu_us_per_metric']:14.1f} {p['wall_ms_per_batch']:14.1f}")
    print(f"log_batch / rows, CPU: {result['cpu_ratio']:.1f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
