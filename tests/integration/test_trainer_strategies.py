"""The training loop's phases without Prefect (the library works on its own), for every
sampling strategy and rule, checked against the durable usage records."""

from __future__ import annotations

import numpy as np
import pytest

from replay_pipeline.reports.analysis import reuse_histogram
from replay_pipeline.config import load_config
from replay_pipeline.run.build import build_run
from replay_pipeline.tracking.tracker import NullTracker
from tests.conftest import TINY_OVERRIDES

STEPS = 4


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("strategies")


def run_steps(root, run_id, *overrides, steps=STEPS):
    cfg = load_config([f"tracking.root_dir={root}", *TINY_OVERRIDES, f"run_id={run_id}",
                       f"loop.steps={steps}", *overrides])
    run = build_run(cfg, log=lambda _: None, tracker=NullTracker())
    metrics = []
    for step in range(steps):
        table, m = run.score(run.generate(step))
        m |= run.append(table, step)
        minibatches, bm = run.sample(step)
        m |= bm | run.learn(minibatches, step)
        metrics.append(m)
    run.flush_writes()  # the tables are read below
    return run, metrics


@pytest.mark.parametrize("strategy", ["uniform", "without_replacement", "recency", "prioritized"])
def test_every_strategy_records_every_use(root, strategy):
    run, metrics = run_steps(root, f"s-{strategy.replace('_', '-')}", f"buffer.strategy={strategy}")
    usage = run.usage.rows()
    drawn = sum(16 * 2 - 16 * m["buffer/skipped_updates"] for m in metrics)  # B=16, K=2
    assert usage.num_rows == drawn == run.usage.count()
    assert set(usage.column("rollout_id").to_pylist()) <= set(run.store.window(10_000).column("rollout_id").to_pylist())
    st = usage.to_pydict()
    assert all(s == v - rv for s, v, rv in zip(st["staleness"], st["policy_version"], st["rollout_policy_version"]))
    assert sorted(set(st["learner_step"])) == list(range(run.learner.steps))
    if strategy == "without_replacement":
        for ls in set(st["step"]):
            used = [q for q, s in zip(st["rollout_seq"], st["step"]) if s == ls]
            assert len(used) == len(set(used))  # no rollout twice within a round


def test_reuse_cap_and_staleness_bound_hold(root):
    run, metrics = run_steps(root, "s-capped", "buffer.reuse_cap=1", "buffer.max_staleness=1",
                             "buffer.capacity=64", steps=5)
    st = run.usage.rows().to_pydict()
    counts = np.bincount(st["rollout_seq"])
    assert counts.max() <= 1
    assert max(st["staleness"]) <= 1
    hist = reuse_histogram(run.store.uri, run.run_id).to_pydict()
    assert max(hist["reuse_count"]) <= 1


def test_positive_bias_window_keeps_old_correct_rollouts(root):
    run, metrics = run_steps(root, "s-posbias", "buffer=positive_bias", "buffer.capacity=32", steps=5)
    # window = newest 16 + newest 16 correct rollouts older than those
    assert all(m["buffer/window_rows"] <= 32 for m in metrics)
    late = metrics[-1]
    fresh_only = run.store.window(16).column("correct").to_numpy(zero_copy_only=False).mean()
    assert late["buffer/window_correct_frac"] >= fresh_only


def test_fresh_baseline_uses_each_rollout_once(root):
    run, metrics = run_steps(root, "s-fresh", "buffer=none")
    st = run.usage.rows().to_pydict()
    assert len(st["rollout_seq"]) == len(set(st["rollout_seq"])) == STEPS * 16
    assert all(m["buffer/replay_ratio"] == pytest.approx(1.0) for m in metrics)
    assert max(st["staleness"]) == 0


@pytest.mark.parametrize("algo", ["asymre", "tis", "topr"])
def test_every_objective_trains_from_the_stored_rollouts(root, algo):
    run, metrics = run_steps(root, f"o-{algo}", f"algo={algo}", steps=2)
    assert run.learner.steps == 4
    for key in ["learn/loss", "learn/entropy", "learn/truncated_frac", "learn/kl_behaviour",
                "learn/grad_norm", "learn/staleness_mean"]:
        assert all(np.isfinite(m[key]) for m in metrics), key


def test_the_sampled_evaluation_is_the_papers(root):
    """pass@k at temperature 1 with loop.eval_top_p (the paper's 0.95 by default), pass@1 at
    temperature 0.1, top_p 0.95 over loop.pass1_samples a prompt: the real generator's calls,
    as the run's evaluate phase makes them."""
    cfg = load_config([f"tracking.root_dir={root}", *TINY_OVERRIDES, "run_id=paper-eval", "loop.steps=1",
                       "loop.eval_samples=4", "loop.pass1_samples=3"])
    assert (load_config([]).loop.eval_top_p, load_config([]).loop.pass1_samples) == (0.95, 4)
    run = build_run(cfg, log=lambda _: None, tracker=NullTracker())
    calls, generate = [], run.generator.generate

    def recorded(prompts, n, **kw):
        calls.append((n, kw.get("temperature"), kw.get("top_p")))
        return generate(prompts, n=n, **kw)

    run.generator.generate = recorded
    metrics = run.evaluate(0, sampled=True)
    run.generator.generate = generate
    assert (3, 0.1, 0.95) in calls and (4, 1.0, 0.95) in calls
    assert 0 <= metrics["eval/pass_at_1_t01"] <= 1 and {"eval/pass_at_4", "eval/pass_at_2"} <= set(metrics)
