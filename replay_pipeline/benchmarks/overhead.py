"""How much of a round the pipeline itself costs: orchestration (Prefect tasks), storage
(LanceDB appends, window reads, usage records), tracking (MLflow) and weight publication,
as a fraction of the round, for the sync and the async loop.

    python -m replay_pipeline.benchmarks.overhead                    # both loops, 60 rounds each
    python -m replay_pipeline.benchmarks.overhead --loops sync --steps 100 --root /tmp/bench

It runs the real flow (`flows.train.train` on the temporary Prefect server that `python -m
flows.train` uses, flows/prefect_server.py, with its idle services off, unless PREFECT_API_URL
names a server; MLflow on SQLite, LanceDB on disk) on the default model and task, with
evaluations and checkpoints only at the ends (they are scheduled extras, not per-round work),
then reads the run's ledger back from MLflow:

* sync: overhead = round seconds - generation - training (`compute/overhead_frac`);
* async: the learner's overhead = round seconds - training - waiting for rollouts, and each
  generator's = (batch seconds - generation) / batch seconds (`compute/generator_overhead_frac`).

The target is at most 5%. Measure on a quiet machine: any other CPU-heavy process slows the
torch phases and the figures with them. The warm start is cached under `<root>/cache`, so
only the first invocation pays for it.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

PHASES = ("buffer/append_seconds", "buffer/sample_seconds", "buffer/record_seconds", "learn/publish_seconds",
          "learn/wait_seconds", "generate/seconds", "learn/seconds", "score/seconds", "score/reward_seconds",
          "buffer/compact_seconds")

#: Where a sync round's time goes, in the round's order: (label, how it is computed from the
#: phase means). The rest of the round, after these, is the loop's own: Prefect's task (a
#: tenth of one a round), handing the metrics to MLflow's writer, the compute ledger.
SYNC_PARTS = (
    ("generation (sampling, decoding)", lambda m: m.get("generate/seconds", 0.0)),
    ("reward (the verifier)", lambda m: m.get("score/reward_seconds", 0.0)),
    ("scoring: advantages, the rows' table", lambda m: m.get("score/seconds", 0.0) - m.get("score/reward_seconds", 0.0)),
    ("append: validate, number, hand to the writer", lambda m: m.get("buffer/append_seconds", 0.0)),
    ("sample: the minibatch from the window", lambda m: m.get("buffer/sample_seconds", 0.0)),
    ("learner step (forward, backward, AdamW)", lambda m: m.get("learn/seconds", 0.0)),
    ("publish the weights", lambda m: m.get("learn/publish_seconds", 0.0)),
    ("usage records (after the commit's wait)", lambda m: m.get("buffer/record_seconds", 0.0)),
)


def run_loop(mode: str, steps: int, root: str, extra: list[str]) -> dict[str, Any]:
    # start-up cost: mlflow takes seconds to import; only this path talks to the store
    from mlflow.tracking import MlflowClient

    # start-up cost: the library (torch, lancedb, mlflow) loads after the command has parsed its arguments
    from flows.prefect_server import temporary_server
    from flows.train import train

    overrides = [f"tracking.root_dir={root}", f"loop.steps={steps}", "loop.eval_every=0", "loop.passk_every=0",
                 "loop.checkpoint_every=0", "tracking.progress=false", "tracking.experiment=overhead-benchmark"]
    if mode == "async":
        overrides += ["loop=async", "model.torch_threads=1"]
    # The trainer's own server, as `python -m flows.train` runs it: Prefect's in-process
    # temporary server would add the loop services that the trainer's has off.
    with temporary_server():
        summary = train(overrides + extra)
    client = MlflowClient(tracking_uri=summary["mlflow_uri"])
    metrics = client.get_run(summary["mlflow_run_id"]).data.metrics
    means = {}
    for key in PHASES:
        history = client.get_metric_history(summary["mlflow_run_id"], key)
        if history:
            means[key] = sum(m.value for m in history) / len(history)
    workers = []
    if mode == "async":  # each generator's cumulative stats (replay_pipeline/run/files.py)
        # start-up cost: the library (torch, lancedb, mlflow) loads after the command has parsed its arguments
        from replay_pipeline.run.files import AsyncDir
        from replay_pipeline.system.runs import RunPaths

        control = AsyncDir.of(RunPaths.make(root, summary["run_id"]).run_dir)
        workers = [control.read_stats(w) for w in range(len(list(control.path.glob("worker-*.json"))))]
    return {"mode": mode, "steps": steps, "run_id": summary["run_id"], "final": metrics, "means": means,
            "workers": workers}


def report(result: dict[str, Any]) -> str:
    m, means = result["final"], result["means"]
    rounds = m.get("compute/round_seconds", float("nan"))
    per_round = rounds / result["steps"]
    lines = [f"{result['mode']} loop, {result['steps']} rounds (run {result['run_id']}):",
             f"  round            {per_round * 1000:8.1f} ms",
             f"  overhead         {m.get('compute/overhead_seconds', float('nan')) / result['steps'] * 1000:8.1f} ms"
             f"  = {100 * m.get('compute/overhead_frac', float('nan')):.1f}% of a round"
             + ("" if result["mode"] == "sync" else " (learner, after waiting is removed)")]
    if "compute/generator_overhead_frac" in m:
        lines.append(f"  generators       {100 * m['compute/generator_overhead_frac']:.1f}% of their time outside generation")
    if result["mode"] == "sync":
        lines += breakdown(per_round, means)
    else:
        for key, value in means.items():
            lines.append(f"  {key:<24} {value * 1000:8.1f} ms / round")
    for w, stats in enumerate(result.get("workers", [])):
        batches = max(stats.get("batches", 0.0), 1.0)
        parts = ", ".join(f"{key.removesuffix('_seconds')} {1000 * stats.get(key, 0.0) / batches:.1f} ms"
                          for key in ("gen_seconds", "other_seconds", "weights_seconds", "write_wait_seconds"))
        lines.append(f"  generator {w}: {int(batches)} batches; per batch {parts}")
    return "\n".join(lines)


def breakdown(per_round: float, means: dict[str, float]) -> list[str]:
    """A sync round's milliseconds, part by part (SYNC_PARTS) and the rest, with their
    shares of the round: the table of where a default round goes (docs/performance.md,
    "Where a round's time goes")."""
    lines = [f"  {'where a round goes':<46} {'ms':>7} {'share':>7}"]
    accounted = 0.0
    for label, part in SYNC_PARTS:
        value = max(part(means), 0.0)
        accounted += value
        lines.append(f"  {label:<46} {value * 1000:7.1f} {100 * value / per_round:6.1f}%")
    rest = per_round - accounted
    lines.append(f"  {'the rest: Prefect task, MLflow hand-off, ledger':<46} {rest * 1000:7.1f} {100 * rest / per_round:6.1f}%")
    lines.append(f"  {'round':<46} {per_round * 1000:7.1f} {100.0:6.1f}%")
    if means.get("buffer/compact_seconds"):
        lines.append(f"  (compaction, behind the learner when due: {means['buffer/compact_seconds'] * 1000:.1f} ms "
                     "in the rounds that compacted)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replay_pipeline.benchmarks.overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--root", default=os.environ.get("REPLAY_PIPELINE_ROOT", "runs"))
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for both loops")
    args = parser.parse_args(argv)
    results = [run_loop(mode, args.steps, args.root, args.overrides) for mode in args.loops]
    print()
    for r in results:
        print(report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
