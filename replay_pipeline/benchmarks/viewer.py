"""Viewer benchmark: how long the rollout viewer's pages take on a large rollout table.

    python -m replay_pipeline.benchmarks.viewer [--rows 1000000] [--repeats 5]

In a temporary root (deleted afterwards) it fills `<root>/lancedb` with synthetic rollouts
(replay_pipeline/benchmarks/buffer.py's, 100 completion tokens each, compacted as a run
compacts) and a usage table of one record per rollout, then requests each page of the viewer
(flows/view.py) in-process, through its HTTP handlers, `--repeats` times, and prints the
median milliseconds a page, its size, and one JSON line: the run page (its series read three
light columns of every row and the usage table's step, staleness and rollout_seq; its charts
draw a point a step) from the start and from the middle of its step table, two runs compared,
a step's groups, one rollout with its uses, and two filtered pages of 50 rollouts. Filling is
not timed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa

from replay_pipeline.benchmarks.buffer import RUN, SyntheticRollouts, fill
from replay_pipeline.buffer import RolloutStore
from replay_pipeline.buffer.usage import USAGE_SCHEMA, UsageStore


def _usage(store: RolloutStore, usage: UsageStore, batch: int = 200_000) -> None:
    """One usage record a rollout, at the learner step of its generation step."""
    rows = store.read_at(store.version, ["seq", "rollout_id", "step", "policy_version"])
    now = datetime.now(timezone.utc)
    for start in range(0, rows.num_rows, batch):
        part = rows.slice(start, batch)
        n = part.num_rows
        usage.record(pa.Table.from_pydict({
            "usage_id": [f"{RUN}/l{s:08d}/p{i:05d}" for i, s in zip(range(start, start + n), part["step"].to_pylist())],
            "run_id": [RUN] * n, "learner_step": part["step"], "step": part["step"],
            "position": list(range(start, start + n)), "rollout_id": part["rollout_id"],
            "rollout_seq": part["seq"], "rollout_step": part["step"],
            "rollout_policy_version": part["policy_version"], "policy_version": part["policy_version"],
            "staleness": [0] * n, "created_at": [now] * n}, schema=USAGE_SCHEMA))


def run(rows: int, repeats: int) -> dict[str, float]:
    # start-up cost: the web app and its test client, only for this benchmark
    from fastapi.testclient import TestClient

    from flows.view import create_app

    root = Path(tempfile.mkdtemp(prefix="rp-bench-viewer-"))
    try:
        store = RolloutStore.create(root / "lancedb", RUN)
        fill(store, SyntheticRollouts(100), rows, 2048, 50, root / "lancedb")
        store.compact()
        usage = UsageStore.create(root / "lancedb", RUN)
        _usage(store, usage)
        usage.compact()
        client = TestClient(create_app(root))
        step = store.max_step() // 2
        rollout_id = store.rows_for_step(step, ["rollout_id"]).column("rollout_id")[0].as_py()
        pages = {"run page (series, charts)": f"/run/{RUN}", "run page, step table from the middle": f"/run/{RUN}?from={step}",
                 "two runs compared (the same run twice)": f"/compare?runs={RUN},{RUN}",
                 "a step's groups": f"/run/{RUN}/step/{step}",
                 "one rollout and its uses": f"/run/{RUN}/rollout/{rollout_id}",
                 "50 rollouts, correct, versions 100:200": f"/run/{RUN}/rollouts?correct=1&versions=100:200",
                 "50 rollouts used at least once, from the middle": f"/run/{RUN}/rollouts?min_reuse=1&start={rows // 2}"}
        out: dict[str, float] = {"rows": rows, "steps": store.max_step() + 1, "usage_records": usage.count()}
        for name, url in pages.items():
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                response = client.get(url)
                times.append(time.perf_counter() - start)
                assert response.status_code == 200, (url, response.text[-500:])
            out[name] = 1000 * statistics.median(times)
            out[f"{name}: kB"] = len(response.content) / 1000
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replay_pipeline.benchmarks.viewer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    result = run(args.rows, args.repeats)
    for key, value in result.items():
        unit = "" if key in ("rows", "steps", "usage_records") else " kB" if key.endswith(": kB") else " ms (median)"
        print(f"{key.removesuffix(': kB'):<50} {value:>10.1f}{unit}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
