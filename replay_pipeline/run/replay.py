"""Replay sampling: which stored rollouts a round's learner steps train on, and the reuse
metrics derived from the usage records.

`ReplaySampler` is handed what it needs (the run's tables, the buffer and loop settings, the
seed) and reads nothing else of the run: a round calls `sample` with the learner's step, the
policy version and the buffer's end, and `usage_metrics` with the round's usage records. It
reads the window (from the in-memory mirror when it can, else LanceDB), lets the strategy of
replay_pipeline/buffer/sampling.py choose, then reads only the chosen rows' token data. It
writes only the usage records, through the tables' door (replay_pipeline/buffer/tables.py).

Reads are "as of" the current learner step: on a resume, records that the stopped process
wrote ahead (learner steps >= `used_through`) are left out (`before=`), so a resumed run
draws exactly what the run that never stopped drew.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa

from replay_pipeline.buffer.sampling import SamplingRules, WindowInfo, draw
from replay_pipeline.buffer.store import META_COLUMNS
from replay_pipeline.buffer.tables import RunTables
from replay_pipeline.run.batches import LEARN_COLUMNS, SEED_SAMPLER, step_seed


class ReplaySampler:
    """Draws a round's minibatches from the window and derives its reuse metrics."""

    def __init__(self, tables: RunTables, buffer: Any, loop: Any, seed: int, window_size: int,
                 rules: SamplingRules, used_through: int = -1, updates: int | None = None):
        self.tables = tables
        self.updates = int(loop.updates_per_step if updates is None else updates)
        """Minibatches a round draws (reuse.max_updates with adaptive reuse)."""
        self.buffer = buffer
        self.loop = loop
        self.seed = seed
        self.window_size = window_size
        self.rules = rules
        self.used_through = used_through
        """Newest learner step whose usage records were already stored when this process started."""
        self._window_usage: tuple | None = None
        """(learner step, reuse counts, last uses, total uses) read by sample() for usage_metrics."""

    def usage_bound(self, learner_step: int) -> int | None:
        """`before=` for usage reads at `learner_step`: None (read everything, the fast path)
        unless records of this or later learner steps were stored by a stopped process."""
        return learner_step if learner_step <= self.used_through else None

    def sample(self, step: int, learner_step: int, policy_version: int, window_end: int
               ) -> tuple[list[dict[str, list]], dict[str, float]]:
        """Read the window's light columns and the usage counts, let the strategy choose,
        then read only the chosen rows' token data. Returns the minibatches and the window's
        metrics (`buffer/...`)."""
        start = time.perf_counter()
        b, loop, t = self.buffer, self.loop, self.tables
        before = self.usage_bound(learner_step)
        mirrored = self._mirrored_window(window_end) if before is None and b.positive_bias == 0 else None
        if mirrored is not None:
            meta, counts, last, total = mirrored
        else:
            t.wait()  # the table must hold this round's rows before it is read
            if b.positive_bias > 0:  # validation keeps it off the fresh baseline
                meta = t.store.positive_bias_window(self.window_size, b.positive_bias,
                                                    columns=list(META_COLUMNS), end=window_end)
            else:
                meta = t.store.window_meta(self.window_size, end=window_end)
            seqs = meta.column("seq").to_numpy()
            # One read of the window's usage records gives the sampler its reuse counts and the
            # learner's metrics their last uses (usage_metrics), both as of this learner step.
            counts, last = t.usage.uses(int(seqs.min()), int(seqs.max()), before=before) if len(seqs) else ({}, {})
            total = t.usage.count() if before is None else t.usage.count_before(before)
        seqs = meta.column("seq").to_numpy()
        self._window_usage = (learner_step, counts, last, total)
        info = WindowInfo(
            policy_version=meta.column("policy_version").to_numpy(), seq=seqs,
            correct=meta.column("correct").to_numpy(zero_copy_only=False),
            advantage=meta.column("advantage").to_numpy(),
            reuse_count=np.asarray([counts.get(int(q), 0) for q in seqs], dtype=np.int64),
            current_version=policy_version)
        rng = np.random.default_rng(step_seed(self.seed, step, SEED_SAMPLER))
        picks = draw(b.strategy, info, loop.minibatch_size, self.updates, rng, self.rules)
        picks = [p for p in picks if len(p)]  # eligibility ran out: skip, and say so below
        minibatches = []
        if picks:
            chosen = seqs[np.concatenate(picks)]
            rows = t.cache.take(chosen, LEARN_COLUMNS) if mirrored is not None else None
            if rows is None:
                t.wait()
                rows = t.store.take_seqs(chosen, columns=LEARN_COLUMNS)
            offset = 0
            for p in picks:
                minibatches.append(rows.slice(offset, len(p)).to_pydict())
                offset += len(p)
        return minibatches, {
            "buffer/window_rows": float(info.size),
            "buffer/window_correct_frac": float(info.correct.mean()) if info.size else 0.0,
            "buffer/window_staleness_mean": float((policy_version - info.policy_version).mean())
            if info.size else 0.0,
            "buffer/skipped_updates": float(self.updates - len(picks)),
            "buffer/sample_seconds": time.perf_counter() - start,
        }

    def _mirrored_window(self, window_end: int) -> tuple[pa.Table, dict, dict, int] | None:
        """The live window from the in-memory mirror (filled from the tables on a miss);
        None without a mirror, or if it cannot hold the window (the caller reads LanceDB)."""
        cache = self.tables.cache
        if cache is None:
            return None
        if cache.shared:
            cache.refresh()
        got = cache.window(self.window_size, window_end)
        if got is None:
            self.tables.wait()  # the table must hold this round's rows before it is read
            cache.fill(window_end)
            got = cache.window(self.window_size, window_end)
        return got

    def usage_metrics(self, used: pa.Table, window_end: int) -> dict[str, float]:
        """Record this round's uses, then derive reuse, staleness and steps-since-last-use
        from the usage table (durable records, not counters kept in memory): the records
        before this round, read once by sample() (or here), plus this round's own."""
        used_seq = used.column("rollout_seq").to_pylist()
        used_step = used.column("learner_step").to_pylist()
        seqs = sorted(set(used_seq))
        first = min(used_step)
        cached = self._window_usage
        if cached is not None and cached[0] == first:  # read by sample() for this learner step
            _, counts, previous, total = cached
            previous = {q: previous[q] for q in seqs if q in previous}
        else:
            before = self.usage_bound(first)
            counts, previous = self.tables.usage.uses(seqs[0], seqs[-1], before=before)
            total = self.tables.usage.count() if before is None else self.tables.usage.count_before(before)
        self._window_usage = None
        # Validated here and committed behind the next round's work; a replayed round's records
        # are already stored: the idempotent append, at once.
        self.tables.record_usage(used, fresh=first > self.used_through)
        since, last = [], dict(previous)
        for q, ls in zip(used_seq, used_step):  # rows are in learner-step order
            if q in last:  # a repeat within one learner step counts 0, as the paper counts it
                since.append(ls - last[q])
            last[q] = ls
        staleness = used.column("staleness").to_numpy().astype(np.float64)
        # In learner updates (the paper's unit): the updates since the generating policy was
        # published, K per round (exact in the sync loop while no update is skipped).
        updates = (used.column("learner_step").to_numpy()
                   - self.loop.updates_per_step * used.column("rollout_policy_version").to_numpy()).astype(np.float64)
        this_round = Counter(used_seq)
        uses_of_used = np.asarray([counts.get(q, 0) + this_round[q] for q in seqs], dtype=np.float64)
        total_uses = total + used.num_rows
        return {
            "buffer/staleness_mean": float(staleness.mean()),
            "buffer/staleness_max": float(staleness.max()),
            "buffer/staleness_updates_mean": float(updates.mean()),
            "buffer/staleness_updates_max": float(updates.max()),
            "buffer/unique_frac": len(seqs) / len(used),
            "buffer/reuse_mean": float(uses_of_used.mean()),
            "buffer/reuse_max": float(uses_of_used.max()),
            "buffer/first_use_frac": float(np.mean([q not in previous for q in seqs])),
            "buffer/steps_since_last_use_mean": float(np.mean(since)) if since else 0.0,
            "buffer/replay_ratio": total_uses / max(window_end, 1),
            "buffer/usage_records": float(total_uses),
        }
