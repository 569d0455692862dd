"""The in-memory window mirror (replay_pipeline/buffer/cache.py) gives exactly what LanceDB
gives: a training run with the mirror equals one without it, step for step and weight for
weight, and a mirror fed by other processes' appends (the async loop) matches the table's
own window after every refresh, across a compaction. Also: the generator in the learner's
process shares the learner's weights instead of copying them."""

from __future__ import annotations

import multiprocessing
import time

import pyarrow as pa
import pytest
import torch

from replay_pipeline.buffer import RolloutStore, UsageStore
from replay_pipeline.buffer.usage import USAGE_SCHEMA
from replay_pipeline.buffer.cache import WindowCache
from replay_pipeline.buffer.store import META_COLUMNS
from replay_pipeline.config import load_config
from replay_pipeline.run.batches import LEARN_COLUMNS
from replay_pipeline.run.build import build_run
from replay_pipeline.run.loop import sync_round
from replay_pipeline.tracking.tracker import NullTracker
from tests.conftest import TINY_OVERRIDES
from tests.integration.test_store import make_rows


def run_steps(root, run_id, steps, *overrides):
    cfg = load_config([f"tracking.root_dir={root}", *TINY_OVERRIDES, f"run_id={run_id}",
                       f"loop.steps={steps}", "buffer.compact_every=3", *overrides])
    run = build_run(cfg, log=lambda _: None, tracker=NullTracker())
    history = []
    for step in range(steps):
        m = sync_round(run, step)
        history.append({k: v for k, v in m.items() if "second" not in k})  # timings differ
    run.flush_writes()  # the tables are read below
    return run, history


@pytest.mark.parametrize("overrides", [
    ["buffer.strategy=uniform"],
    ["buffer.strategy=prioritized", "buffer.reuse_cap=2", "buffer.max_staleness=3", "algo.kl_coef=0.05"],
], ids=["uniform", "prioritized-capped"])
def test_a_run_with_the_mirror_equals_one_reading_lancedb(tmp_path, overrides):
    steps = 7  # past two compactions (every 3 steps) and beyond the window (capacity 32, 16 a step)
    cached, with_cache = run_steps(tmp_path, "mirror-on", steps, *overrides)
    plain, without = run_steps(tmp_path, "mirror-off", steps, "buffer.read_cache=false", *overrides)
    assert plain.cache is None and cached.cache is not None
    assert cached.cache.hits >= steps - 1  # it served the reads (one fill at the start)
    assert with_cache == without  # every metric of every step, exactly
    for a, b in zip(cached.learner.model.state_dict().values(), plain.learner.model.state_dict().values()):
        assert torch.equal(a, b)
    assert cached.usage.rows(columns=["rollout_seq", "learner_step"]).equals(
        plain.usage.rows(columns=["rollout_seq", "learner_step"]))


def test_the_mirror_holds_only_the_newest_rows(tmp_path):
    run, _ = run_steps(tmp_path, "mirror-bounded", 6)
    cache = run.cache
    assert cache.rows.num_rows <= cache.keep
    newest = run.store.window(cache.rows.num_rows, columns=cache.columns)
    assert cache.rows.equals(newest.select(cache.columns))
    assert cache.total == run.usage.count()


def test_generator_shares_the_learners_weights(tmp_path):
    run, _ = run_steps(tmp_path, "shared-weights", 2)
    gen = dict(run.generator.model.named_parameters())
    for name, p in run.learner.model.named_parameters():
        assert gen[name].data_ptr() == p.data_ptr()
        assert not gen[name].requires_grad and p.requires_grad
    assert run.generator.policy_version == run.policy_version == 2
    assert not run.generator.model.training and run.learner.model.training


def _writer(uri: str, run_id: str, worker: int, batches: int) -> None:
    store = RolloutStore.open(uri, run_id)
    for b in range(batches):
        store.append(make_rows(1000 * (worker + 1) + b, run_id=run_id))


def _compare(cache: WindowCache, store: RolloutStore, usage: UsageStore, size: int) -> None:
    end = store.count()
    deadline = time.monotonic() + 30
    while cache.stored() < end:  # the read-ahead thread has not looked since the last commit
        assert time.monotonic() < deadline, f"read-ahead stuck at {cache.stored()} of {end} rows"
        time.sleep(0.01)
    cache.refresh()
    got = cache.window(size, end)
    assert got is not None
    rows, counts, last, total = got
    expected = store.window(size, columns=cache.columns, end=end)
    assert rows.select(cache.columns).equals(expected.select(cache.columns))
    seqs = expected.column("seq").to_numpy()
    want_counts, want_last = usage.uses(int(seqs.min()), int(seqs.max()))
    assert (counts, last, total) == (want_counts, want_last, usage.count())
    picks = seqs[[0, len(seqs) - 1, len(seqs) // 2, 0]]
    assert cache.take(picks, LEARN_COLUMNS).equals(store.take_seqs(picks, columns=LEARN_COLUMNS))


@pytest.mark.parametrize("prefetch", [False, True], ids=["on-refresh", "read-ahead"])
def test_a_shared_mirror_follows_other_processes_appends_and_a_compaction(tmp_path, prefetch):
    uri, run_id = str(tmp_path / "db"), "mirror-shared"
    store, usage = RolloutStore.create(uri, run_id), UsageStore.create(uri, run_id)
    store.append(make_rows(0, n_groups=6, run_id=run_id))
    cache = WindowCache(store, usage, [*META_COLUMNS, *LEARN_COLUMNS], keep=40, shared=True, prefetch=prefetch)
    cache.fill(store.count())
    used = [{"usage_id": f"{run_id}/l{k:08d}/p00000", "run_id": run_id, "learner_step": k, "step": 0,
             "position": 0, "rollout_id": f"x{k}", "rollout_seq": q, "rollout_step": 0,
             "rollout_policy_version": 0, "policy_version": 0, "staleness": 0,
             "created_at": pa.scalar(0, pa.timestamp("us", tz="UTC")).as_py()}
            for k, q in enumerate([20, 21, 21, 23])]
    usage.record(used)
    cache.used(pa.Table.from_pylist(used, schema=USAGE_SCHEMA))
    _compare(cache, store, usage, 16)
    ctx = multiprocessing.get_context("spawn")  # fork can hang LanceDB
    procs = [ctx.Process(target=_writer, args=(uri, run_id, w, 5)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    _compare(cache, store, usage, 16)
    store.compact()  # rewrites every fragment: the mirror must not count a row twice
    store.append(make_rows(7, run_id=run_id))
    _compare(cache, store, usage, 32)
    assert cache.rows.num_rows == len(set(cache.rows.column("rollout_id").to_pylist())) <= 40 + 8
    assert cache.window(16, 10) is None  # not mirrored: the caller reads LanceDB
    cache.close()
    if prefetch:
        assert not cache._prefetch.thread.is_alive() and cache._prefetch.error is None


@pytest.mark.parametrize("prefetch", [False, True], ids=["on-refresh", "read-ahead"])
def test_a_shared_mirror_serves_the_window_when_racing_writers_shared_seq_values(tmp_path, prefetch):
    """Two writers that number their rows from the same count store duplicate ``seq`` values,
    so the table holds more rows than seqs: a window ending at the row count is still served
    from the mirror, and equals the table's (this raced in the test above, now and then)."""
    uri, run_id = str(tmp_path / "db"), "mirror-dups"
    store, usage = RolloutStore.create(uri, run_id), UsageStore.create(uri, run_id)
    store.append(make_rows(0, n_groups=4, run_id=run_id))
    cache = WindowCache(store, usage, [*META_COLUMNS, *LEARN_COLUMNS], keep=40, shared=True, prefetch=prefetch)
    cache.fill(store.count())
    racer = RolloutStore.open(uri, run_id)
    numbered = racer.prepare(make_rows(1, run_id=run_id))  # seq 16..23, from the count now
    store.append(make_rows(2, run_id=run_id))  # seq 16..23 as well
    racer.insert(numbered)  # no expect_count: the race the async loop's generators can run
    seqs = store.window(64, columns=["seq"]).column("seq").to_pylist()
    assert store.count() == 32 and max(seqs) == 23  # the race happened: 32 rows, 24 seqs
    _compare(cache, store, usage, 16)
    assert cache.hits == 1 and cache.misses == 0
    cache.close()
