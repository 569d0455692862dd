"""Replay-buffer benchmark: what the rollout table costs the training loop at scale.

    python -m replay_pipeline.benchmarks.buffer [--rows 1000000] [--quick]

In a temporary LanceDB directory (deleted afterwards) it appends synthetic rollouts of
``--tokens`` completion tokens (default 100) in batches of ``--batch`` (2,048) until the table
holds ``--rows``, compacting every ``--compact-every`` appends as the training loop does
(``buffer.compact_every``), and times only the ``append`` calls. Then, after one more
compaction, it times the reads the loop and the analysis make on the large table:

* a uniform minibatch draw: 256 ``seq`` values chosen uniformly in the newest-N window, then
  ``take_seqs`` with the learner's columns (N = 10k and 100k; median of 50 draws);
* ``window_meta`` of those windows (what a weighted sampler reads first);
* a policy-version range query returning about 1% of the rows, all columns (median of 10);
* ``positive_bias_window`` of 10k rollouts, delta 0.5, light columns (median of 10);
* retrying a committed batch (the idempotent no-op).

It prints a table with the targets (>= 50k rows/s appended, <= 20 ms per draw from a 100k
window, <= 200 ms per version-range query on 1M rows) and one JSON line with every figure.
``--quick`` is ``--rows 100000``, about a minute.

The rows are synthetic but shaped like the real ones (random token ids and log-probs, so
they compress no better than real data); generating them is not timed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from replay_pipeline.buffer.schema import ROLLOUT_SCHEMA
from replay_pipeline.buffer.store import META_COLUMNS, RolloutStore

RUN = "bench"
# The columns the trainer's learner reads for a minibatch (replay_pipeline.run.batches.LEARN_COLUMNS).
LEARN_COLUMNS = ["rollout_id", "seq", "policy_version", "step", "prompt_ids", "completion_ids",
                 "behaviour_logprobs", "advantage"]
GROUP_SIZE = 8
PROMPT_TOKENS = 8
TARGETS = {"append_rows_per_s_end": (">=", 50_000.0), "draw_ms_100k": ("<=", 20.0),
           "versions_query_ms": ("<=", 200.0)}


class SyntheticRollouts:
    """Batches of rollouts in ROLLOUT_SCHEMA, one generation step (= policy version) each.

    Token ids and log-probs are slices of large random pools at random offsets, so a batch
    costs about a millisecond to build and every batch differs.
    """

    def __init__(self, tokens: int, seed: int = 0):
        self.tokens = tokens
        self.rng = np.random.default_rng(seed)
        pool = 1 << 22
        self.token_pool = self.rng.integers(0, 32_000, pool, dtype=np.int32)
        self.logprob_pool = np.log(self.rng.random(pool, dtype=np.float32) + 1e-6)

    def _lists(self, pool: np.ndarray, n: int, width: int, typ: pa.DataType) -> pa.Array:
        start = int(self.rng.integers(0, len(pool) - n * width))
        offsets = pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32))
        return pa.ListArray.from_arrays(offsets, pa.array(pool[start : start + n * width], typ))

    def batch(self, step: int, n: int) -> pa.Table:
        group, sample = np.divmod(np.arange(n), GROUP_SIZE)
        group_ids = [f"{RUN}/s{step:06d}/g{g:04d}" for g in range(group[-1] + 1)]
        reward = (self.rng.random(n) < 0.5).astype(np.float32)
        text = self.tokens * "7"
        cols = {
            "rollout_id": pa.array([f"{group_ids[g]}/i{i:03d}" for g, i in zip(group, sample)]),
            "seq": pa.nulls(n, pa.int64()),
            "run_id": pa.array([RUN] * n),
            "policy_version": pa.array(np.full(n, step, np.int64)),
            "step": pa.array(np.full(n, step, np.int64)),
            "worker": pa.nulls(n, pa.int32()),
            "prompt_id": pa.array([f"p{step * 997 + g}" for g in group]),
            "group_id": pa.array([group_ids[g] for g in group]),
            "sample_index": pa.array(sample.astype(np.int32)),
            "prompt": pa.array(["123+456="] * n),
            "completion": pa.array([text] * n),
            "prompt_ids": self._lists(self.token_pool, n, PROMPT_TOKENS, pa.int32()),
            "completion_ids": self._lists(self.token_pool, n, self.tokens, pa.int32()),
            "behaviour_logprobs": self._lists(self.logprob_pool, n, self.tokens, pa.float32()),
            "reward": pa.array(reward),
            "reward_error": pa.nulls(n, pa.string()),
            "correct": pa.array(reward > 0),
            "advantage": pa.array(self.rng.standard_normal(n).astype(np.float32)),
            "group_reward_mean": pa.array(np.full(n, reward.mean(), np.float32)),
            "finish_reason": pa.array(["stop"] * n),
            "num_tokens": pa.array(np.full(n, self.tokens, np.int32)),
            "seed": pa.array(np.full(n, step, np.int64)),
            "created_at": pa.array(np.full(n, np.datetime64("2026-01-01", "us")), pa.timestamp("us", tz="UTC")),
            "temperature": pa.array(np.full(n, 1.0), ROLLOUT_SCHEMA.field("temperature").type),
            "top_p": pa.array(np.full(n, 1.0), ROLLOUT_SCHEMA.field("top_p").type),
        }
        return pa.Table.from_pydict(cols, schema=ROLLOUT_SCHEMA)


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def fill(store: RolloutStore, gen: SyntheticRollouts, rows: int, batch: int, compact_every: int) -> dict[str, float]:
    """Append until ``rows`` are stored; time each append and each compaction."""
    append_s: list[float] = []
    sizes: list[int] = []
    compact_s: list[float] = []
    step = 0
    while store.count() < rows:
        data = gen.batch(step, min(batch, rows - store.count()))
        start = time.perf_counter()
        inserted = store.append(data)
        append_s.append(time.perf_counter() - start)
        sizes.append(inserted)
        step += 1
        if compact_every and step % compact_every == 0:
            start = time.perf_counter()
            store.compact()
            compact_s.append(time.perf_counter() - start)
    tail = max(1, min(len(append_s), compact_every or 50))  # the last compaction cycle
    retry = gen.batch(step - 1, sizes[-1])  # the same ids as the last append
    return {
        "appends": len(append_s),
        "append_rows_per_s": sum(sizes) / sum(append_s),
        "append_rows_per_s_end": sum(sizes[-tail:]) / sum(append_s[-tail:]),
        "append_end_batches": tail,
        "append_end_from_rows": sum(sizes[:-tail]),
        "append_ms_median": 1000 * statistics.median(append_s),
        "append_ms_max_end": 1000 * max(append_s[-tail:]),
        "compactions": len(compact_s),
        "compact_s_mean": statistics.fmean(compact_s) if compact_s else 0.0,
        "compact_s_max": max(compact_s, default=0.0),
        "retry_ms": _median_ms(lambda: store.append(retry), 5),
    }


def reads(store: RolloutStore, rows: int, batch: int, rng: np.random.Generator) -> dict[str, float]:
    """The loop's and the analysis's reads on the (compacted) table."""
    out: dict[str, float] = {}
    for window in (10_000, 100_000):
        label = f"{window // 1000}k"

        def draw() -> pa.Table:
            n = store.count()
            seqs = rng.integers(max(n - window, 0), n, size=256)
            return store.take_seqs(seqs, columns=LEARN_COLUMNS)

        assert draw().num_rows == 256
        out[f"draw_ms_{label}"] = _median_ms(draw, 50)
        out[f"window_meta_ms_{label}"] = _median_ms(lambda: store.window_meta(window), 10)
    versions = max(1, round(0.01 * rows / batch))  # one version per batch: ~1% of the rows
    top = max(rows // batch - versions, 1)
    out["versions_query_rows"] = store.rows_for_versions(0, versions - 1).num_rows

    def versions_query() -> pa.Table:
        lo = int(rng.integers(0, top))
        return store.rows_for_versions(lo, lo + versions - 1)

    out["versions_query_ms"] = _median_ms(versions_query, 10)
    out["positive_bias_ms_10k"] = _median_ms(
        lambda: store.positive_bias_window(10_000, 0.5, columns=META_COLUMNS), 10)
    return out


def run(rows: int, batch: int, tokens: int, compact_every: int, seed: int = 0) -> dict[str, float]:
    root = tempfile.mkdtemp(prefix="rp-bench-buffer-")
    try:
        store = RolloutStore.create(root, RUN)
        gen = SyntheticRollouts(tokens, seed)
        results: dict[str, float] = {"rows": rows, "batch": batch, "tokens": tokens,
                                     "compact_every": compact_every}
        start = time.perf_counter()
        results.update(fill(store, gen, rows, batch, compact_every))
        results["fill_s"] = time.perf_counter() - start
        start = time.perf_counter()
        store.compact()  # the loop compacts every compact_every steps; reads see a compacted table
        results["final_compact_s"] = time.perf_counter() - start
        results.update(reads(store, rows, batch, np.random.default_rng(seed)))
        return results
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _verdict(key: str, value: float) -> str:
    if key not in TARGETS:
        return ""
    op, target = TARGETS[key]
    ok = value >= target if op == ">=" else value <= target
    return f"{op} {target:,.0f}  {'ok' if ok else 'MISSED'}"


def report(r: dict[str, float]) -> str:
    rows = int(r["rows"])
    lines = [
        ("append, whole fill", f"{r['append_rows_per_s']:,.0f} rows/s", "append_rows_per_s"),
        (f"append, last {int(r['append_end_batches'])} batches (rows {int(r['append_end_from_rows']):,}..{rows:,})",
         f"{r['append_rows_per_s_end']:,.0f} rows/s", "append_rows_per_s_end"),
        ("append, one batch (median / max at the end)",
         f"{r['append_ms_median']:.1f} / {r['append_ms_max_end']:.1f} ms", ""),
        ("retry of a committed batch (no-op)", f"{r['retry_ms']:.1f} ms", ""),
        (f"compaction every {int(r['compact_every'])} appends (mean / max)",
         f"{r['compact_s_mean']:.2f} / {r['compact_s_max']:.2f} s", ""),
        ("draw 256 from a 10k window (take_seqs)", f"{r['draw_ms_10k']:.1f} ms", "draw_ms_10k"),
        ("draw 256 from a 100k window (take_seqs)", f"{r['draw_ms_100k']:.1f} ms", "draw_ms_100k"),
        ("window_meta, 10k / 100k", f"{r['window_meta_ms_10k']:.1f} / {r['window_meta_ms_100k']:.1f} ms", ""),
        (f"policy-version range, {int(r['versions_query_rows']):,} rows of {rows:,}",
         f"{r['versions_query_ms']:.1f} ms", "versions_query_ms"),
        ("positive_bias_window 10k, delta 0.5", f"{r['positive_bias_ms_10k']:.1f} ms", ""),
    ]
    width = max(len(name) for name, _, _ in lines)
    out = [f"replay buffer benchmark: {rows:,} rollouts of {int(r['tokens'])} completion tokens, "
           f"batches of {int(r['batch']):,} ({r['fill_s']:.0f} s to fill)"]
    out += [f"  {name:<{width}}  {value:>18}  {_verdict(key, r[key]) if key else ''}".rstrip()
            for name, value, key in lines]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replay_pipeline.benchmarks.buffer",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rollouts to append (default 1,000,000)")
    parser.add_argument("--quick", action="store_true", help="100,000 rollouts (about a minute)")
    parser.add_argument("--batch", type=int, default=2048, help="rollouts per append (default 2,048)")
    parser.add_argument("--tokens", type=int, default=100, help="completion tokens per rollout (default 100)")
    parser.add_argument("--compact-every", type=int, default=50,
                        help="appends between compactions, as buffer.compact_every (default 50)")
    args = parser.parse_args(argv)
    rows = 100_000 if args.quick else args.rows
    if rows < 10_000 or args.batch < 1:
        parser.error("--rows must be at least 10,000 (the smallest window measured) and --batch positive")
    results = run(rows, args.batch, args.tokens, args.compact_every)
    print(report(results))
    print(json.dumps({"benchmark": "buffer", **{k: round(v, 3) for k, v in results.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
