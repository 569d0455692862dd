"""Minibatch draws from the window, checked on their statistics and on the rules they keep.

Statistical checks use fixed seeds and a chi-square bound at the 1e-4 tail, so they are
deterministic and a correct sampler is far inside them; expected frequencies are computed
here from the documented formulas, not from the module."""

from __future__ import annotations

import math

import numpy as np
import pytest

from replay_pipeline.buffer.sampling import (SAMPLERS, SamplingRules, WindowInfo, draw, round_budget,
                                             weighted_stream, window_for, within_budget)

WITH_REPLACEMENT = ["uniform", "recency", "prioritized"]
BUFFERED = WITH_REPLACEMENT + ["without_replacement"]


def chi2_bound(dof: int, z: float = 3.719) -> float:
    """Upper 1e-4 quantile of chi-square with `dof` degrees of freedom (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def lump_rare(counts: np.ndarray, probs: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray]:
    """Cells expected fewer than 5 times merged into one, as the chi-square test needs."""
    rare = probs * total < 5
    if not rare.any():
        return counts, probs
    return np.r_[counts[~rare], counts[rare].sum()], np.r_[probs[~rare], probs[rare].sum()]


def window(policy_version, advantage=None, reuse_count=None, current_version=None) -> WindowInfo:
    pv = np.asarray(policy_version)
    n = pv.size
    return WindowInfo(policy_version=pv, seq=np.arange(n), correct=np.zeros(n, bool),
                      advantage=np.zeros(n) if advantage is None else advantage,
                      reuse_count=np.zeros(n, np.int64) if reuse_count is None else reuse_count,
                      current_version=int(pv.max(initial=0)) if current_version is None else current_version)


def counts_of(picks: list[np.ndarray], n: int) -> np.ndarray:
    return np.bincount(np.concatenate(picks), minlength=n)


# ------------------------------------------------------------------ registry and validation

def test_registry_holds_one_documented_function_per_strategy():
    assert set(SAMPLERS) == {"uniform", "without_replacement", "fresh", "recency", "prioritized"}
    for name, fn in SAMPLERS.items():
        assert fn.__name__ == name and len(fn.__doc__ or "") > 100


def test_unknown_strategy_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown sampling strategy 'lifo'; known: fresh, prioritized"):
        draw("lifo", WindowInfo.uniform_only(8), 4, 1, np.random.default_rng(0))


@pytest.mark.parametrize("batch_size, updates, message", [
    (0, 1, "batch_size=0 must be an integer >= 1"),
    (-3, 1, "batch_size=-3"),
    (2.5, 1, "batch_size=2.5"),
    (4, 0, "updates=0 must be an integer >= 1"),
])
def test_bad_batch_sizes_raise(batch_size, updates, message):
    with pytest.raises(ValueError, match=message):
        draw("uniform", WindowInfo.uniform_only(8), batch_size, updates, np.random.default_rng(0))


@pytest.mark.parametrize("kwargs, message", [
    (dict(reuse_cap=-1), "reuse_cap=-1 must be an integer >= 1"),
    (dict(reuse_cap=0), "reuse_cap=0"),
    (dict(reuse_cap=1.5), "reuse_cap=1.5"),
    (dict(max_staleness=-1), "max_staleness=-1 must be an integer >= 0"),
    (dict(recency_half_life=0), "recency_half_life=0 must be a finite number > 0"),
    (dict(recency_half_life=float("nan")), "recency_half_life=nan"),
    (dict(recency_half_life=float("inf")), "recency_half_life=inf"),
    (dict(priority_alpha=-0.5), "priority_alpha=-0.5 must be a finite number >= 0"),
    (dict(priority_eps=0.0), "priority_eps=0.0 must be a finite number > 0"),
])
def test_invalid_rules_raise_on_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingRules(**kwargs)


def test_window_info_coerces_dtypes_and_rejects_bad_input():
    w = WindowInfo(policy_version=[0, 1], seq=[5, 9], correct=[1, 0], advantage=[0.5, -0.5],
                   reuse_count=[0, 2], current_version=np.int64(3))
    assert w.size == 2 and w.policy_version.dtype == np.int64 and w.correct.dtype == bool
    assert w.advantage.dtype == np.float32 and type(w.current_version) is int
    assert w.age.tolist() == [3, 2]
    u = WindowInfo.uniform_only(5, current_version=7)
    assert u.size == 5 and u.age.tolist() == [0] * 5 and u.seq.tolist() == list(range(5))
    with pytest.raises(ValueError, match="1-D with one entry per row"):
        WindowInfo(policy_version=[0, 1], seq=[0], correct=[1, 0], advantage=[0, 0],
                   reuse_count=[0, 0], current_version=1)
    with pytest.raises(ValueError, match="reuse_count must be >= 0"):
        window([0, 0], reuse_count=np.array([0, -1]))
    with pytest.raises(ValueError, match="advantage must be finite"):
        window([0, 0], advantage=np.array([0.0, np.nan]))


def test_window_for():
    assert window_for("uniform", 128, 64) == 128
    assert window_for("recency", 128, 64) == 128
    assert window_for("fresh", 128, 64) == 64


def test_round_budget_worked_by_hand():
    w = window([0, 1, 2, 3, 4], reuse_count=np.array([0, 1, 2, 5, 0]), current_version=4)
    # ages 4 3 2 1 0; cap 3 leaves 3 2 1 0(clipped) 3; staleness 2 zeroes ages 4 and 3
    assert round_budget(w, SamplingRules(reuse_cap=3, max_staleness=2), 10).tolist() == [0, 0, 1, 0, 3]
    assert round_budget(w, SamplingRules(), 10).tolist() == [10] * 5  # no cap: the round size
    assert round_budget(w, SamplingRules(reuse_cap=50), 4).tolist() == [4] * 5


# ------------------------------------------------------------------ each strategy's distribution

def test_uniform_is_uniform_with_replacement():
    n, b, k = 50, 64, 500
    picks = draw("uniform", WindowInfo.uniform_only(n), b, k, np.random.default_rng(0))
    assert len(picks) == k and all(len(p) == b and p.dtype == np.int64 for p in picks)
    counts = counts_of(picks, n)
    assert chi2(counts, np.full(n, 1 / n)) < chi2_bound(n - 1)
    assert any(len(np.unique(p)) < b for p in picks)  # with replacement: 64 from 50 must repeat


def test_without_replacement_never_repeats_within_a_round_and_covers_the_window():
    n, b, k = 48, 16, 3
    for seed in range(20):
        picks = draw("without_replacement", WindowInfo.uniform_only(n), b, k, np.random.default_rng(seed))
        assert [len(p) for p in picks] == [b] * k
        assert sorted(np.concatenate(picks).tolist()) == list(range(n))  # K*B == n: every row once


def test_without_replacement_subset_is_uniform():
    n, b, k, rounds = 40, 5, 2, 4000
    rng = np.random.default_rng(1)
    counts = np.zeros(n, np.int64)
    for _ in range(rounds):
        picks = np.concatenate(draw("without_replacement", WindowInfo.uniform_only(n), b, k, rng))
        assert len(np.unique(picks)) == b * k
        counts += np.bincount(picks, minlength=n)
    assert chi2(counts, np.full(n, 1 / n)) < chi2_bound(n - 1)


def test_without_replacement_runs_out_instead_of_repeating():
    # the early-run case: a window of 24 rows cannot feed 2 x 16 without a repeat
    picks = draw("without_replacement", WindowInfo.uniform_only(24), 16, 2, np.random.default_rng(0))
    assert [len(p) for p in picks] == [16, 8]
    assert sorted(np.concatenate(picks).tolist()) == list(range(24))
    picks = draw("without_replacement", WindowInfo.uniform_only(10), 4, 4, np.random.default_rng(0))
    assert [len(p) for p in picks] == [4, 4, 2, 0]


def test_fresh_uses_every_row_exactly_once():
    for seed in range(10):
        picks = draw("fresh", WindowInfo.uniform_only(64), 16, 4, np.random.default_rng(seed))
        assert [len(p) for p in picks] == [16] * 4
        assert sorted(np.concatenate(picks).tolist()) == list(range(64))


def test_fresh_keeps_its_error_when_the_window_is_too_small():
    with pytest.raises(ValueError, match="fresh window of 32 rollouts cannot feed 4 disjoint minibatches of 16"):
        draw("fresh", WindowInfo.uniform_only(32), 16, 4, np.random.default_rng(1))
    with pytest.raises(ValueError, match="cannot feed"):
        draw("fresh", WindowInfo.uniform_only(0), 1, 1, np.random.default_rng(1))
    spent = window([3] * 8, reuse_count=np.array([1, 0, 0, 0, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match=r"8 rollouts \(1 not eligible under the rules\)"):
        draw("fresh", spent, 4, 2, np.random.default_rng(1), SamplingRules(reuse_cap=1))


@pytest.mark.parametrize("half_life, young, old, ratio", [
    (2.0, 1, 3, 2.0),   # ages a and a + half_life: drawn twice as often
    (3.0, 0, 3, 2.0),
    (1.5, 2, 5, 4.0),   # two half-lives apart: four times
])
def test_recency_halves_the_draw_rate_every_half_life(half_life, young, old, ratio):
    w = window(np.r_[np.full(20, 10 - young), np.full(20, 10 - old)], current_version=10)
    rules = SamplingRules(recency_half_life=half_life)
    counts = counts_of(draw("recency", w, 100, 1000, np.random.default_rng(2), rules), 40)
    # 100k draws: the ratio's standard error is ~1% of it
    assert counts[:20].sum() / counts[20:].sum() == pytest.approx(ratio, rel=0.05)


def test_recency_matches_its_weights():
    ages = np.repeat(np.arange(7), 3)  # 21 rows, ages 0..6
    w = window(10 - ages, current_version=10)
    rules = SamplingRules(recency_half_life=2.0)
    counts = counts_of(draw("recency", w, 64, 1000, np.random.default_rng(3), rules), w.size)
    probs = 0.5 ** (ages / 2.0)
    probs /= probs.sum()
    assert chi2(counts, probs) < chi2_bound(w.size - 1)


@pytest.mark.parametrize("alpha", [1.0, 2.0, 0.5])
def test_prioritized_draws_in_proportion_to_weights(alpha):
    adv = np.array([-2.0, -1.0, -0.5, 0.0, 0.0, 0.25, 0.5, 1.0, 1.5, 2.0], np.float32)
    w = window(np.zeros(adv.size, int), advantage=adv)
    rules = SamplingRules(priority_alpha=alpha)
    draws = 200_000
    counts = counts_of(draw("prioritized", w, 200, draws // 200, np.random.default_rng(4), rules), adv.size)
    weights = (np.abs(adv.astype(np.float64)) + 1e-3) ** alpha
    probs = weights / weights.sum()
    cells, cell_probs = lump_rare(counts, probs, draws)
    assert chi2(cells, cell_probs) < chi2_bound(len(cells) - 1)
    zero = adv == 0
    expected_zero = probs[zero].sum() * draws  # eps-rare: ~17 in 200k at alpha 1, 0 at alpha 2
    assert counts[zero].sum() <= expected_zero + 5 * math.sqrt(expected_zero) + 5


def test_prioritized_with_alpha_zero_is_uniform():
    adv = np.linspace(-3, 3, 30)
    w = window(np.zeros(30, int), advantage=adv)
    counts = counts_of(draw("prioritized", w, 100, 300, np.random.default_rng(5),
                            SamplingRules(priority_alpha=0.0)), 30)
    assert chi2(counts, np.full(30, 1 / 30)) < chi2_bound(29)


def test_weights_that_would_underflow_still_draw():
    # rows ~2000 half-lives old: a naive 0.5 ** (age / 2) is 0.0 for all of them
    w = window([0, 0, 1], current_version=4000)
    counts = counts_of(draw("recency", w, 100, 100, np.random.default_rng(0)), 3)
    assert counts.sum() == 10_000
    assert counts[2] / counts[0] == pytest.approx(2 ** 0.5, rel=0.1)  # one version fresher


# ------------------------------------------------------------------ the rules

def simulate(strategy, rules, seed, steps=30, per_step=8, capacity=32, batch=8, updates=3):
    """A synchronous run in miniature: each step appends `per_step` rows of the current
    policy version, draws a round from the FIFO window and records the uses, as the trainer
    does through the usage table. Checks the rules after every round."""
    if strategy == "fresh":
        updates = per_step // batch  # the baseline uses each fresh rollout once
    rng = np.random.default_rng(seed)
    versions, uses = np.empty(0, np.int64), np.empty(0, np.int64)
    advantages = np.empty(0, np.float32)
    for step in range(steps):
        versions = np.r_[versions, np.full(per_step, step)]
        uses = np.r_[uses, np.zeros(per_step, np.int64)]
        advantages = np.r_[advantages, rng.normal(size=per_step).astype(np.float32) * (rng.random(per_step) < 0.6)]
        lo = max(0, versions.size - window_for(strategy, capacity, per_step))
        w = WindowInfo(policy_version=versions[lo:], seq=np.arange(lo, versions.size),
                       correct=advantages[lo:] > 0, advantage=advantages[lo:],
                       reuse_count=uses[lo:], current_version=step)
        budget = round_budget(w, rules, batch * updates)
        picks = draw(strategy, w, batch, updates, rng, rules)
        lengths = [len(p) for p in picks]
        # full minibatches, then at most one shorter, then empty ones
        assert lengths == sorted(lengths, reverse=True) and sum(0 < n < batch for n in lengths) <= 1
        drawn = np.concatenate(picks)
        # short only when eligibility ran out
        room = (budget > 0).sum() if strategy in ("without_replacement", "fresh") else budget.sum()
        assert drawn.size == min(batch * updates, room)
        if strategy in ("without_replacement", "fresh"):
            assert len(np.unique(drawn)) == drawn.size
        if rules.max_staleness is not None:
            assert (step - versions[lo + drawn] <= rules.max_staleness).all()
        np.add.at(uses, lo + drawn, 1)
        if rules.reuse_cap is not None:
            assert uses.max() <= rules.reuse_cap
    return uses


@pytest.mark.parametrize("strategy", BUFFERED)
@pytest.mark.parametrize("cap", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reuse_cap_is_never_exceeded_over_many_rounds(strategy, cap, seed):
    uses = simulate(strategy, SamplingRules(reuse_cap=cap), seed)
    assert uses.max() == cap  # the cap binds: 24 draws a step over a window of 32


@pytest.mark.parametrize("strategy", BUFFERED + ["fresh"])
@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_staleness_bound_is_never_violated(strategy, max_staleness):
    simulate(strategy, SamplingRules(max_staleness=max_staleness, reuse_cap=2), seed=max_staleness)
    simulate(strategy, SamplingRules(max_staleness=max_staleness), seed=10 + max_staleness)


@pytest.mark.parametrize("strategy", WITH_REPLACEMENT)
def test_with_replacement_respects_the_cap_inside_a_minibatch(strategy):
    w = window([0, 0, 0], advantage=np.array([0.0, 1.0, 3.0]))
    picks = draw(strategy, w, 8, 1, np.random.default_rng(0), SamplingRules(reuse_cap=2))
    assert len(picks[0]) == 6 and np.bincount(picks[0]).tolist() == [2, 2, 2]
    used = window([0, 0, 0], reuse_count=np.array([1, 0, 2]))
    picks = draw(strategy, used, 8, 1, np.random.default_rng(0), SamplingRules(reuse_cap=2))
    assert sorted(picks[0].tolist()) == [0, 1, 1]


@pytest.mark.parametrize("strategy", BUFFERED)
def test_shorter_minibatches_when_eligibility_runs_out(strategy):
    rng = np.random.default_rng(0)
    picks = draw(strategy, WindowInfo.uniform_only(10), 4, 4, rng, SamplingRules(reuse_cap=1))
    assert [len(p) for p in picks] == [4, 4, 2, 0]
    assert sorted(np.concatenate(picks).tolist()) == list(range(10))
    # the staleness bound excludes every row: all minibatches empty, no error
    old = window([0] * 6, current_version=5)
    assert [len(p) for p in draw(strategy, old, 4, 3, rng, SamplingRules(max_staleness=2))] == [0, 0, 0]
    # an empty window is the same case
    assert [len(p) for p in draw(strategy, WindowInfo.uniform_only(0), 4, 2, rng)] == [0, 0]


@pytest.mark.parametrize("strategy", list(SAMPLERS))
def test_deterministic_given_seed(strategy):
    w = window(np.repeat(np.arange(8), 8), advantage=np.random.default_rng(9).normal(size=64))
    rules = SamplingRules(reuse_cap=3, max_staleness=10)
    a = draw(strategy, w, 8, 4, np.random.default_rng(7), rules)
    b = draw(strategy, w, 8, 4, np.random.default_rng(7), rules)
    c = draw(strategy, w, 8, 4, np.random.default_rng(8), rules)
    assert all((x == y).all() for x, y in zip(a, b))
    assert any((x != y).any() for x, y in zip(a, c))


# ------------------------------------------------------------------ vectorised vs plain loop

def within_budget_loop(candidates, budget):
    used = {}
    keep = []
    for c in candidates:
        keep.append(used.get(c, 0) < budget[c])
        if keep[-1]:
            used[c] = used.get(c, 0) + 1
    return np.array(keep, bool)


def test_within_budget_matches_a_plain_loop():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 8))
        budget = rng.integers(0, 4, size=n)
        cand = rng.integers(0, n, size=int(rng.integers(0, 20)))
        assert within_budget(cand, budget).tolist() == within_budget_loop(cand, budget).tolist()


def sequence_probabilities_loop(weights, budget, size):
    """Exact probability of every draw sequence of the one-at-a-time process, by enumeration:
    each draw picks row i with probability weights[i] / (sum of weights of rows with budget
    left); the sequence stops early when every budget is spent."""
    n = len(weights)
    probs = {}
    stack = [((), 1.0)]
    while stack:
        seq, p = stack.pop()
        left = [budget[i] - seq.count(i) for i in range(n)]
        avail = [i for i in range(n) if left[i] > 0]
        if len(seq) == size or not avail:
            probs[seq] = probs.get(seq, 0.0) + p
            continue
        total = sum(weights[i] for i in avail)
        for i in avail:
            stack.append((seq + (i,), p * weights[i] / total))
    return probs


@pytest.mark.parametrize("budget, size", [([1, 2, 3], 4), ([1, 1, 2], 5), ([9, 9, 9], 3)])
def test_weighted_stream_matches_the_one_at_a_time_process(budget, size):
    weights = np.array([1.0, 2.0, 4.0])
    exact = sequence_probabilities_loop(weights, budget, size)
    assert sum(exact.values()) == pytest.approx(1.0)
    rng = np.random.default_rng(6)
    trials = 4_000
    seen: dict[tuple, int] = {}
    for _ in range(trials):
        s = tuple(weighted_stream(np.log(weights), np.array(budget), size, rng).tolist())
        seen[s] = seen.get(s, 0) + 1
    assert set(seen) <= set(exact)  # never a sequence the process cannot produce
    keys = sorted(exact)
    counts = np.array([seen.get(k, 0) for k in keys])
    probs = np.array([exact[k] for k in keys])
    cells, cell_probs = lump_rare(counts, probs, trials)
    assert chi2(cells, cell_probs) < chi2_bound(len(cells) - 1)


def test_prioritized_marginals_match_a_plain_loop_under_a_cap():
    # a plain loop (one rng.choice per draw over the rows with budget left) against the
    # vectorised sampler: the same mean uses per row, with the cap binding on the big rows
    adv = np.array([0.1, 0.5, 1.0, 2.0, 4.0])
    w = window(np.zeros(5, int), advantage=adv)
    rules = SamplingRules(reuse_cap=2)
    weights = np.abs(adv) + 1e-3
    rng = np.random.default_rng(11)
    loop_counts, vec_counts = np.zeros(5), np.zeros(5)
    rounds = 2000
    for _ in range(rounds):
        left = np.full(5, 2)
        for _ in range(6):  # 2 minibatches of 3
            avail = np.flatnonzero(left > 0)
            i = avail[rng.choice(avail.size, p=weights[avail] / weights[avail].sum())]
            left[i] -= 1
            loop_counts[i] += 1
        picks = draw("prioritized", w, 3, 2, rng, rules)
        assert np.bincount(np.concatenate(picks), minlength=5).max() <= 2
        vec_counts += np.bincount(np.concatenate(picks), minlength=5)
    # mean uses per round lie in [0, 2]; their standard errors are <= 0.02
    np.testing.assert_allclose(vec_counts / rounds, loop_counts / rounds, atol=0.08)
    assert loop_counts[4] / rounds > 1.9  # the cap binds on the heaviest row
