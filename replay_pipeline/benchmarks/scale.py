"""Rounds per second with more processes: 1 and 2 learner ranks (the sync loop,
learner.world_size; replay_pipeline/run/ranks.py) and 1 and 2 generator actors (the async loop
on Ray, loop.engine=ray loop.workers), each process at one torch thread.

    python -m replay_pipeline.benchmarks.scale                       # 4 sides x 3 repeats, 30 rounds each
    python -m replay_pipeline.benchmarks.scale --sides ranks1,ranks2 --steps 20 --repeats 2

Each measurement is the real flow in a fresh process (replay_pipeline/benchmarks/overhead.py's
`run_loop`: `flows.train.train` on the trainer's own Prefect server, MLflow on SQLite, the
default model and task from the cached warm start, evaluations and checkpoints only at the
ends), read back from the run's ledger: rounds per second = rounds / `compute/round_seconds`
(the rounds' own time: start-up, the ranks' join and the evaluations are outside it), with the
mean seconds of a round's learner steps and generation, and for the async sides each
generator's rollouts per second of generation. Sides are interleaved, `--repeats` times, so a
noisy machine hits each alike; figures are medians. Run it with nothing else on the machine:
on a machine with C cores, sides whose processes outnumber C measure contention, not scaling
(docs/guides/scale-out.md reads them so).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: Each side: (loop, overrides). Every process at one torch thread, so a side's process count
#: is its core count.
SIDES = {
    "ranks1": ("sync", ["model.torch_threads=1"]),
    "ranks2": ("sync", ["model.torch_threads=1", "learner.world_size=2"]),
    "actors1": ("async", ["loop.engine=ray", "loop.workers=1", "loop.worker_threads=1"]),
    "actors2": ("async", ["loop.engine=ray", "loop.workers=2", "loop.worker_threads=1"]),
}
LABELS = {"ranks1": "sync, 1 learner rank", "ranks2": "sync, 2 learner ranks",
          "actors1": "async on Ray, 1 generator actor", "actors2": "async on Ray, 2 generator actors"}


def child(side: str, steps: int, root: str) -> dict[str, Any]:
    """One measurement, in this process."""
    from replay_pipeline.benchmarks.overhead import run_loop  # start-up cost: the library

    mode, extra = SIDES[side]
    result = run_loop(mode, steps, root, [*extra, "tracking.experiment=scale-benchmark"])
    final, means = result["final"], result["means"]
    out = {"side": side, "rounds_per_second": steps / final["compute/round_seconds"],
           "learn_seconds": means.get("learn/seconds"), "generate_seconds": means.get("generate/seconds"),
           "wait_seconds": means.get("learn/wait_seconds")}
    if result["workers"]:
        out["generator_rollouts_per_second"] = [w["gen_rollouts"] / w["gen_seconds"] for w in result["workers"]
                                                if w.get("gen_seconds")]
    return out


def run_benchmark(sides: list[str], steps: int, repeats: int, root: str | Path) -> dict[str, Any]:
    records: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for repeat in range(repeats):
        for side in sides:  # interleaved: each repeat runs every side once
            proc = subprocess.run([sys.executable, "-m", "replay_pipeline.benchmarks.scale", "--child", side,
                                   "--steps", str(steps), "--root", str(root)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"side {side} failed (repeat {repeat}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
            record = json.loads(proc.stdout.strip().splitlines()[-1])
            records[side].append(record)
            print(f"repeat {repeat} {side}: {record['rounds_per_second']:.3f} rounds/s", flush=True)
    return {"steps": steps, "repeats": repeats, "records": records}


def median_of(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def report(result: dict[str, Any]) -> str:
    lines = [f"rounds of the default run, {result['steps']} a measurement, medians of {result['repeats']}",
             "", "| side | rounds/s | learner s/round | generation s/round | learner wait s/round | "
             "rollouts/s per generator |", "|---|---|---|---|---|---|"]
    for side, records in result["records"].items():
        per_gen = [v for r in records for v in r.get("generator_rollouts_per_second", [])]
        cells = [median_of(records, k) for k in ("rounds_per_second", "learn_seconds", "generate_seconds",
                                                 "wait_seconds")]
        text = ["-" if v is None else f"{v:.3f}" for v in cells]
        lines.append(f"| {LABELS[side]} | " + " | ".join(text) + " | "
                     + (f"{statistics.median(per_gen):.1f}" if per_gen else "-") + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replay_pipeline.benchmarks.scale", description=__doc__.split("\n")[0])
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    parser.add_argument("--steps", type=int, default=30, help="rounds a measurement (default 30)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    parser.add_argument("--root", default=None, help="run root (default: a temporary directory; the warm start "
                                                     "is cached under it)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sides = [s for s in args.sides.split(",") if s]
    unknown = [s for s in sides if s not in SIDES]
    if unknown or not sides or args.steps < 1 or args.repeats < 1:
        parser.error(f"--sides takes some of {', '.join(SIDES)} (got {args.sides!r}); --steps and --repeats >= 1")
    root = args.root or tempfile.mkdtemp(prefix="scale-bench-")
    if args.child:
        print(json.dumps(child(args.child, args.steps, root)))
        return 0
    result = run_benchmark(sides, args.steps, args.repeats, root)
    print(report(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
