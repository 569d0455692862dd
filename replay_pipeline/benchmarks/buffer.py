"""Replay-buffer benchmark: what the rollout table costs the training loop at scale.

    python -m replay_pipeline.benchmarks.buffer [--rows 1000000] [--quick] [--dir PATH] [--keep]

In a new directory under ``--dir`` (default: the system's temporary directory; the directory
is deleted afterwards unless ``--keep`` is given, and then its path is printed) it appends
synthetic rollouts of ``--tokens`` completion tokens (default 100) in batches of ``--batch``
(2,048) until the table holds ``--rows``, compacting every ``--compact-every`` appends as the
training loop does (``buffer.compact_every``), and times only the ``append`` calls and, apart,
each compaction. Then, after one more compaction, it times the reads the loop and the
analysis make on the large table:

* a uniform minibatch draw: 256 ``seq`` values chosen uniformly in the newest-N window, then
  ``take_seqs`` with the learner's columns, for N = 10k, 100k and 1M, each only where the
  table holds at least N rows (the 1M window needs ``--rows`` >= 1,000,000; a smaller table
  has no ``draw_ms_1m`` in its figures); median of 50 draws;
* ``window_meta`` of those windows (what a weighted sampler reads first; median of 10);
* policy-version range queries, all columns: one returning about 1% of the rows (the target's
  query: 10k rows at 1M, 100k at 10M) and one of about 10,240 rows whatever the size (five
  versions of 2,048), so that tables of different sizes compare (median of 10 each);
* ``positive_bias_window`` of 10k rollouts, delta 0.5, light columns (median of 10);
* retrying a committed batch (the idempotent no-op).

Where it degrades shows in three series: the append rate in each tenth of the fill (by the
rows stored when the append began), every compaction of the fill as ``[rows, seconds, disk
bytes after it]`` with the mean compaction time per tenth, and the size of the table's
directory after each compaction and after the final one. The last is the peak too: nothing is
deleted during a benchmark (below). Measured at 20k-200k rows, a compaction's cost grows with
the table, not with the rows it merges: Lance remaps every btree index in full when it
rewrites indexed fragments, and ``optimize_indices`` rewrites each index whole to add the new
rows (docs/performance.md, "At 10M rows", has a 10M-row fill's compactions).

It prints a table with the targets (>= 50k rows/s appended in the last compaction cycle,
<= 20 ms per draw from a 100k window, <= 200 ms per 1% version-range query; the same targets
at 1M and 10M rows; the 1M-window draw is printed without one) and one JSON line with every
figure (lists for the series). ``--quick`` is ``--rows 100000``, a few seconds; 1M rows take
under a minute; 10M rows about ten minutes on a quiet 2-core machine, most of it compacting.

Disk space, checked before the fill starts. The estimate is measured, not taken from the
schema: a sample of :data:`SAMPLE_APPENDS` batches (of ``--batch`` rows, at most 2,048) is
written to a scratch table beside the benchmark's directory (and deleted), giving the bytes
per row of the data files (~660 at 100 tokens); one compaction of it gives the bytes per row
of one copy of the four btree indexes on ``rollout_id``, ``seq``, ``step`` and
``policy_version`` (~35). :func:`fill_model` replays the fill's compactions as Lance plans
them (runs of adjacent fragments under ``COMPACT_TARGET_ROWS``, indexed ones apart from new
ones) and counts what is written, and :func:`estimate_disk` multiplies:

* data: every row is written by its append, by the compaction that merges its cycle of
  appends (102,400 rows, under the 128k target) and, once the table is large, by the next one,
  which merges two such fragments into a full one: 2.0 copies at 100k rows, 2.8 at 1M, 3.0 at
  10M (a small table with frequent compactions, more: its fragments stay under the target);
* indexes: written whole when created, whole again by every compaction's ``optimize_indices``
  (it adds the new rows) and, when indexed fragments were merged (every other compaction),
  whole once more by the remap: about 1.5 copies of the table's index per compaction, so the
  index bytes grow with the square of the table.

Nothing is reclaimed while the benchmark runs: ``RolloutStore.compact`` ends with
``cleanup_old_versions(older_than=7 days)``, so every file of a version younger than a week
stays (a training run keeps them as long). The model matched the tables measured at 20k-200k
rows to within 2% on data and 0-50% over on indexes. At the defaults: about 2.1 GB at 1M rows;
about 45 GB at 10M (20 GB data, 25 GB indexes), peaking at the end. :func:`check_disk` asks
for the estimate plus :data:`DISK_HEADROOM` (20%: manifests, transaction files, compression
unlike the sample's) free in the directory ``--dir`` names; it prints "needs about X GB, Y GB
free" and, when there is less, exits with code 2 before the fill, saying to free space, point
``--dir`` at a larger disk or ask for fewer ``--rows``.

The rows are synthetic but shaped like the real ones (random token ids and log-probs, so
they compress no better than real data); generating them is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from replay_pipeline.buffer.lance_table import COMPACT_TARGET_ROWS
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
#: The newest-N windows drawn from, each where the table holds at least N rows.
WINDOWS = (10_000, 100_000, 1_000_000)
#: Rows of the fixed-size version-range query (whole versions of ``--batch`` rows).
FIXED_QUERY_ROWS = 10_240
#: The disk estimate's sample: this many appends of ``min(--batch, SAMPLE_BATCH)`` rows.
SAMPLE_APPENDS, SAMPLE_BATCH = 4, 2048
#: Free space asked for beyond the estimate, as a fraction of it.
DISK_HEADROOM = 0.2
GB = 1e9
DECILES = 10
#: Every synthetic row's created_at: one fixed instant (the Unix epoch), so that the rows a run
#: of the benchmark writes do not depend on when it ran.
CREATED_AT = np.datetime64(0, "us")


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
            "created_at": pa.array(np.full(n, CREATED_AT), pa.timestamp("us", tz="UTC")),
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


def disk_bytes(root: str | Path, part: str | None = None) -> int:
    """Bytes of the files under ``root``; with ``part``, only those below a directory of that
    name (``_indices``, ``data``)."""
    total = 0
    for folder, _, files in os.walk(root):
        if part is None or part in Path(folder).relative_to(root).parts:
            total += sum(os.path.getsize(os.path.join(folder, name)) for name in files)
    return total


def sample_bytes_per_row(parent: str | Path, tokens: int, batch: int, seed: int = 0) -> dict[str, float]:
    """Bytes per row of the data files and of one copy of the indexes, measured on a scratch
    table of :data:`SAMPLE_APPENDS` batches in ``parent`` (deleted afterwards)."""
    scratch = tempfile.mkdtemp(prefix="rp-bench-buffer-sample-", dir=parent)
    try:
        store = RolloutStore.create(scratch, RUN)
        gen = SyntheticRollouts(tokens, seed)
        n = min(batch, SAMPLE_BATCH)
        for step in range(SAMPLE_APPENDS):
            store.append(gen.batch(step, n), known_new=True)
        rows = n * SAMPLE_APPENDS
        data = disk_bytes(scratch) / rows  # manifests and transaction files included
        store.compact()  # creates the indexes over the sample's rows
        return {"data_bytes_per_row": data, "index_bytes_per_row": disk_bytes(scratch, "_indices") / rows}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _merge(frags: list[tuple[int, bool]], target: int) -> tuple[list[int], int, bool]:
    """One compaction of fragments ``(rows, indexed)``, as Lance plans it: each run of two or
    more adjacent fragments under ``target`` rows, all indexed or all not, is merged into one
    (a run of twice ``target`` or more into parts of at least ``target``). Returns the row
    counts after, the rows rewritten and whether indexed fragments were among them."""
    out: list[int] = []
    rewritten, indexed = 0, False
    for start, end in _runs(frags, target):
        run = [rows for rows, _ in frags[start:end]]
        indexed = indexed or (len(run) > 1 and frags[start][1])
        while len(run) > 1:  # Lance's split_for_size
            take, total = 0, 0
            while total < target and take < len(run):
                total, take = total + run[take], take + 1
            if sum(run[take:]) < target:
                take, total = len(run), sum(run)
            out.append(total)
            rewritten += total
            run = run[take:]
        out += run
    return out, rewritten, indexed


def _runs(frags: list[tuple[int, bool]], target: int) -> list[tuple[int, int]]:
    """``(start, end)`` of the runs of :func:`_merge`, a full fragment being a run of its own."""
    runs: list[tuple[int, int]] = []
    for i, (rows, indexed) in enumerate(frags):
        if runs and rows < target and frags[i - 1][0] < target and frags[i - 1][1] == indexed:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def fill_model(rows: int, batch: int, compact_every: int) -> dict[str, Any]:
    """What a fill writes and keeps (nothing is cleaned up, see the module docstring):
    ``data_rows``, the rows of every append and of every rewrite of a compaction;
    ``index_rows``, the rows of every whole write of the indexes (created at the first
    compaction; at each compaction ``optimize_indices`` adds the new rows, and the remap
    rewrites them when indexed fragments were merged); ``compactions``, the table's row count
    at each compaction, the final one included."""
    appends = -(-rows // batch)
    frags: list[int] = []
    new: list[int] = []  # the appends since the last compaction (not indexed yet)
    data, index, sizes = 0, 0, []
    for step in range(1, appends + 2):  # step appends + 1: the final compaction
        if step <= appends:
            new.append(min(batch, rows - (step - 1) * batch))
            data += new[-1]
            if not (compact_every and step % compact_every == 0):
                continue
        indexed_rows = sum(frags)
        frags, rewritten, remapped = _merge([(n, True) for n in frags] + [(n, False) for n in new],
                                            COMPACT_TARGET_ROWS)
        stored = indexed_rows + sum(new)
        index += (stored if new else 0) + (indexed_rows if remapped else 0) + (0 if sizes else stored)
        data, new = data + rewritten, []
        sizes.append(stored)
    return {"data_rows": data, "index_rows": index, "compactions": sizes}


def estimate_disk(rows: int, batch: int, compact_every: int, data_bytes_per_row: float,
                  index_bytes_per_row: float) -> float:
    """Bytes the table's directory will take after the final compaction: :func:`fill_model`'s
    rows times the bytes per row measured by :func:`sample_bytes_per_row`."""
    model = fill_model(rows, batch, compact_every)
    return model["data_rows"] * data_bytes_per_row + model["index_rows"] * index_bytes_per_row


def check_disk(estimated_bytes: float, free_bytes: float, where: str | Path | None = None,
               rows_fit: int | None = None) -> str | None:
    """Why a table of ``estimated_bytes`` does not fit in ``free_bytes`` (the estimate plus
    :data:`DISK_HEADROOM`), or None when it does; ``rows_fit``, if given, is said too."""
    needed = estimated_bytes * (1 + DISK_HEADROOM)
    if free_bytes >= needed:
        return None
    fits = "" if rows_fit is None else f" (about {rows_fit:,} rows fit there)"
    return (f"not enough disk space{'' if where is None else f' in {str(where)!r}'}: the table "
            f"needs about {needed / GB:.1f} GB (estimate {estimated_bytes / GB:.1f} GB plus "
            f"{DISK_HEADROOM:.0%} headroom), {free_bytes / GB:.1f} GB are free. Free some space, "
            f"point --dir at a larger disk, or ask for fewer --rows{fits}.")


def rows_that_fit(free_bytes: float, batch: int, compact_every: int, **per_row: float) -> int:
    """The most rows (to a batch) whose :func:`estimate_disk` plus headroom fits in ``free_bytes``."""
    lo, hi = 0, batch
    while estimate_disk(hi, batch, compact_every, **per_row) * (1 + DISK_HEADROOM) <= free_bytes:
        lo, hi = hi, 2 * hi
    while hi - lo > batch:
        mid = (lo + hi) // 2
        fits = estimate_disk(mid, batch, compact_every, **per_row) * (1 + DISK_HEADROOM) <= free_bytes
        lo, hi = (mid, hi) if fits else (lo, mid)
    return lo


def _by_decile(positions: Sequence[int], rows: int) -> list[list[int]]:
    """The indices of ``positions`` (rows stored, 0..rows) in each tenth of the fill."""
    out: list[list[int]] = [[] for _ in range(DECILES)]
    for i, pos in enumerate(positions):
        out[min(DECILES - 1, max(pos, 0) * DECILES // rows)].append(i)
    return out


def fill(store: RolloutStore, gen: SyntheticRollouts, rows: int, batch: int, compact_every: int,
         root: str | Path) -> dict[str, Any]:
    """Append until ``rows`` are stored; time each append and each compaction, and measure the
    table's directory after each compaction."""
    append_s: list[float] = []
    sizes: list[int] = []
    before: list[int] = []  # rows stored when each append began
    series: list[list[float]] = []  # [rows, seconds, disk bytes] per compaction
    step = 0
    while (stored := store.count()) < rows:
        data = gen.batch(step, min(batch, rows - stored))
        start = time.perf_counter()
        inserted = store.append(data)
        append_s.append(time.perf_counter() - start)
        sizes.append(inserted)
        before.append(stored)
        step += 1
        if compact_every and step % compact_every == 0:
            start = time.perf_counter()
            store.compact()
            series.append([stored + inserted, time.perf_counter() - start, disk_bytes(root)])
    tail = max(1, min(len(append_s), compact_every or 50))  # the last compaction cycle
    retry = gen.batch(step - 1, sizes[-1])  # the same ids as the last append
    compact_s = [s for _, s, _ in series]
    append_tenths = [(sum(sizes[i] for i in part) / sum(append_s[i] for i in part)) if part else None
                     for part in _by_decile(before, rows)]
    compact_tenths = [statistics.fmean(compact_s[i] for i in part) if part else None
                      for part in _by_decile([int(n) - 1 for n, _, _ in series], rows)]
    return {
        "appends": len(append_s),
        "append_rows_per_s": sum(sizes) / sum(append_s),
        "append_rows_per_s_end": sum(sizes[-tail:]) / sum(append_s[-tail:]),
        "append_end_batches": tail,
        "append_end_from_rows": sum(sizes[:-tail]),
        "append_ms_median": 1000 * statistics.median(append_s),
        "append_ms_max_end": 1000 * max(append_s[-tail:]),
        "append_rows_per_s_decile": append_tenths,
        "compactions": len(compact_s),
        "compact_s_mean": statistics.fmean(compact_s) if compact_s else 0.0,
        "compact_s_max": max(compact_s, default=0.0),
        "compact_s_decile": compact_tenths,
        "compact_series": series,
        "retry_ms": _median_ms(lambda: store.append(retry), 5),
    }


def _label(window: int) -> str:
    return f"{window // 1_000_000}m" if window >= 1_000_000 else f"{window // 1000}k"


def reads(store: RolloutStore, rows: int, batch: int, rng: np.random.Generator) -> dict[str, float]:
    """The loop's and the analysis's reads on the (compacted) table."""
    out: dict[str, float] = {}
    for window in (w for w in WINDOWS if w <= rows):
        label = _label(window)

        def draw() -> pa.Table:
            n = store.count()
            seqs = rng.integers(max(n - window, 0), n, size=256)
            return store.take_seqs(seqs, columns=LEARN_COLUMNS)

        assert draw().num_rows == 256
        out[f"draw_ms_{label}"] = _median_ms(draw, 50)
        out[f"window_meta_ms_{label}"] = _median_ms(lambda: store.window_meta(window), 10)
    # One version per batch: ~1% of the rows, then a fixed ~10k rows.
    for key, versions in (("", round(0.01 * rows / batch)), ("_10k", round(FIXED_QUERY_ROWS / batch))):
        versions = max(1, versions)
        top = max(rows // batch - versions, 1)
        out[f"versions_query_rows{key}"] = store.rows_for_versions(0, versions - 1).num_rows

        def versions_query() -> pa.Table:
            lo = int(rng.integers(0, top))
            return store.rows_for_versions(lo, lo + versions - 1)

        out[f"versions_query_ms{key}"] = _median_ms(versions_query, 10)
    out["positive_bias_ms_10k"] = _median_ms(
        lambda: store.positive_bias_window(10_000, 0.5, columns=META_COLUMNS), 10)
    return out


def run(rows: int, batch: int, tokens: int, compact_every: int, seed: int = 0,
        root: str | Path | None = None, keep: bool = False) -> dict[str, Any]:
    """Fill and read a table in ``root`` (a new directory; default a temporary one), removed
    afterwards unless ``keep``."""
    root = root if root is not None else tempfile.mkdtemp(prefix="rp-bench-buffer-")
    try:
        store = RolloutStore.create(root, RUN)
        gen = SyntheticRollouts(tokens, seed)
        results: dict[str, Any] = {"rows": rows, "batch": batch, "tokens": tokens,
                                   "compact_every": compact_every}
        start = time.perf_counter()
        results.update(fill(store, gen, rows, batch, compact_every, root))
        results["fill_s"] = time.perf_counter() - start
        start = time.perf_counter()
        store.compact()  # the loop compacts every compact_every steps; reads see a compacted table
        results["final_compact_s"] = time.perf_counter() - start
        results["disk_bytes_final"] = disk_bytes(root)
        results["disk_bytes_peak"] = max([results["disk_bytes_final"]] + [b for *_, b in results["compact_series"]])
        results.update(reads(store, rows, batch, np.random.default_rng(seed)))
        if keep:
            results["kept_dir"] = str(root)
        return results
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def _verdict(key: str, value: float) -> str:
    if key not in TARGETS:
        return ""
    op, target = TARGETS[key]
    ok = value >= target if op == ">=" else value <= target
    return f"{op} {target:,.0f}  {'ok' if ok else 'MISSED'}"


def _tenths(values: Sequence[float | None], fmt: str) -> str:
    return " ".join("-" if v is None else format(v, fmt) for v in values)


def report(r: dict[str, Any]) -> str:
    rows = int(r["rows"])
    windows = [_label(w) for w in WINDOWS if f"draw_ms_{_label(w)}" in r]
    tenths = [v for v in r["compact_s_decile"] if v is not None]
    lines = [
        ("append, whole fill", f"{r['append_rows_per_s']:,.0f} rows/s", "append_rows_per_s"),
        (f"append, last {int(r['append_end_batches'])} batches (rows {int(r['append_end_from_rows']):,}..{rows:,})",
         f"{r['append_rows_per_s_end']:,.0f} rows/s", "append_rows_per_s_end"),
        ("append by tenth of the fill, k rows/s",
         _tenths([None if v is None else v / 1000 for v in r["append_rows_per_s_decile"]], ".0f"), ""),
        ("append, one batch (median / max at the end)",
         f"{r['append_ms_median']:.1f} / {r['append_ms_max_end']:.1f} ms", ""),
        ("retry of a committed batch (no-op)", f"{r['retry_ms']:.1f} ms", ""),
        (f"compaction every {int(r['compact_every'])} appends (mean / max)",
         f"{r['compact_s_mean']:.2f} / {r['compact_s_max']:.2f} s", ""),
        ("compaction, first / last tenth of the fill (mean)",
         f"{tenths[0]:.2f} / {tenths[-1]:.2f} s" if tenths else "none during the fill", ""),
        ("compaction by tenth of the fill, s", _tenths(r["compact_s_decile"], ".2f"), ""),
        ("final compaction", f"{r['final_compact_s']:.2f} s", ""),
        ("disk, after the final compaction (= peak) / estimate",
         f"{r['disk_bytes_final'] / GB:.2f} / {r['disk_estimate_bytes'] / GB:.2f} GB"
         if "disk_estimate_bytes" in r else f"{r['disk_bytes_final'] / GB:.2f} GB", ""),
    ]
    lines += [(f"draw 256 from a {w} window (take_seqs)", f"{r[f'draw_ms_{w}']:.1f} ms", f"draw_ms_{w}")
              for w in windows]
    lines += [
        (f"window_meta, {' / '.join(windows)}", " / ".join(f"{r[f'window_meta_ms_{w}']:.1f}" for w in windows) + " ms", ""),
        (f"policy-version range, {int(r['versions_query_rows']):,} rows of {rows:,} (~1%)",
         f"{r['versions_query_ms']:.1f} ms", "versions_query_ms"),
        (f"policy-version range, {int(r['versions_query_rows_10k']):,} rows of {rows:,}",
         f"{r['versions_query_ms_10k']:.1f} ms", ""),
        ("positive_bias_window 10k, delta 0.5", f"{r['positive_bias_ms_10k']:.1f} ms", ""),
    ]
    width = max(len(name) for name, _, _ in lines)
    out = [f"replay buffer benchmark: {rows:,} rollouts of {int(r['tokens'])} completion tokens, "
           f"batches of {int(r['batch']):,} ({r['fill_s']:.0f} s to fill)"]
    out += [f"  {name:<{width}}  {value:>18}  {_verdict(key, r[key]) if key else ''}".rstrip()
            for name, value, key in lines]
    if "kept_dir" in r:
        out.append(f"  the table is kept in {r['kept_dir']}")
    return "\n".join(out)


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replay_pipeline.benchmarks.buffer",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rollouts to append (default 1,000,000)")
    parser.add_argument("--quick", action="store_true", help="100,000 rollouts (seconds)")
    parser.add_argument("--batch", type=int, default=2048, help="rollouts per append (default 2,048)")
    parser.add_argument("--tokens", type=int, default=100, help="completion tokens per rollout (default 100)")
    parser.add_argument("--compact-every", type=int, default=50,
                        help="appends between compactions, as buffer.compact_every (default 50)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to create the benchmark's directory (default: the system's temporary "
                             "directory); its free space is checked before the fill")
    parser.add_argument("--keep", action="store_true", help="keep the table's directory (its path is printed)")
    args = parser.parse_args(argv)
    rows = 100_000 if args.quick else args.rows
    if rows < 10_000 or args.batch < 1:
        parser.error("--rows must be at least 10,000 (the smallest window measured) and --batch positive")
    parent = Path(args.dir if args.dir is not None else tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    sample = sample_bytes_per_row(parent, args.tokens, args.batch)
    estimate = estimate_disk(rows, args.batch, args.compact_every, **sample)
    free = shutil.disk_usage(parent).free
    print(f"disk: the table needs about {estimate * (1 + DISK_HEADROOM) / GB:.1f} GB (estimate "
          f"{estimate / GB:.1f} GB + {DISK_HEADROOM:.0%}), {free / GB:.1f} GB free in {str(parent)!r}", flush=True)
    if check_disk(estimate, free):
        print(f"error: {check_disk(estimate, free, parent, rows_that_fit(free, args.batch, args.compact_every, **sample))}",
              file=sys.stderr)
        return 2
    root = tempfile.mkdtemp(prefix="rp-bench-buffer-", dir=parent)
    results = run(rows, args.batch, args.tokens, args.compact_every, root=root, keep=args.keep)
    results.update({"disk_estimate_bytes": estimate, "disk_free_bytes": free, **sample})
    print(report(results))
    print(json.dumps({"benchmark": "buffer", **{k: _rounded(v) for k, v in results.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
