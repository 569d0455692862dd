"""replay_pipeline.reports.evidence against hand-worked numbers: interpolated crossings, their spread
with seeds that never reach, the bootstrap ratio interval, resolution, ties and gamma.

The bootstrap interval is checked against the exact bootstrap distribution of tiny seed groups:
every resample of a group of n seeds (n^n equally likely index tuples) enumerated here, the
median of each taken with np.median, and the two groups combined as independent draws. The
function's empirical percentiles from n_boot resamples land on the exact distribution's
quantile when the quantile level is far (here >= 5 standard errors of an empirical CDF at
n_boot) from every jump of the exact CDF; `exact_quantile` checks that margin before using it."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest

from replay_pipeline.reports import evidence


def test_crossing_interpolates_between_the_evaluation_before_and_the_first_at_or_above():
    compute, acc = [0, 100, 200, 300], [0.30, 0.40, 0.50, 0.60]
    # 0.45 is half way from 0.40 (at 100) to 0.50 (at 200)
    assert evidence.crossing(compute, acc, 0.45) == pytest.approx(150.0)
    assert evidence.crossing(compute, acc, 0.50) == pytest.approx(200.0)  # exactly at an evaluation
    assert evidence.crossing(compute, acc, 0.25) == 0.0  # reached at the first evaluation
    assert evidence.crossing(compute, acc, 0.61) is None  # never
    # The first crossing counts, not a later one; a dip before it is skipped over.
    assert evidence.crossing([0, 10, 20, 30], [0.2, 0.6, 0.1, 0.9], 0.5) == pytest.approx(10 * 0.3 / 0.4)
    # Missing evaluations (NaN) are left out.
    assert evidence.crossing([0, 10, float("nan"), 30], [0.2, 0.3, 0.9, 0.5], 0.4) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="same length"):
        evidence.crossing([0, 1], [0.1], 0.5)


def test_spread_counts_never_reached_as_infinite():
    assert evidence.spread([10, 20, 30, 40]) == {"median": 25.0, "q25": 17.5, "q75": 32.5, "reached": 4, "seeds": 4}
    # Sorted [10, 20, inf, inf]: median between 20 and inf is inf -> None; q25 = 17.5 still finite.
    assert evidence.spread([10, None, 20, None]) == {"median": None, "q25": 17.5, "q75": None, "reached": 2,
                                                     "seeds": 4}
    s = evidence.spread([10, 20, 30, None, 50])  # sorted 10 20 30 50 inf: median 30, q75 50
    assert (s["median"], s["q25"], s["q75"], s["reached"]) == (30.0, 20.0, 50.0, 4)


def test_ratio_interval_is_the_median_ratio_with_a_seed_bootstrap_interval():
    config, baseline = [50.0] * 5, [100.0] * 5  # no spread: every resample gives 0.5
    r = evidence.ratio_interval(config, baseline, n_boot=500)
    assert (r["ratio"], r["low"], r["high"], r["undefined"]) == (0.5, 0.5, 0.5, 0)
    rng = np.random.default_rng(3)
    config = list(rng.normal(60, 5, 10))
    baseline = list(rng.normal(100, 5, 10))
    r = evidence.ratio_interval(config, baseline, n_boot=2000, seed=1)
    assert r["ratio"] == pytest.approx(np.median(config) / np.median(baseline))
    assert r["low"] < r["ratio"] < r["high"] and 0.45 < r["low"] and r["high"] < 0.75
    assert evidence.ratio_interval(config, baseline, n_boot=2000, seed=1) == r  # repeatable under its seed


def median_distribution(values):
    """{median of a resample: probability}, over all len(values)^len(values) index tuples."""
    n = len(values)
    counts = Counter(float(np.median([values[i] for i in idx])) for idx in itertools.product(range(n), repeat=n))
    return {m: c / n ** n for m, c in counts.items()}


def ratio_distribution(config, baseline):
    """The exact bootstrap distribution of median(config resample) / median(baseline resample),
    the two groups resampled independently: sorted [(ratio, probability)]."""
    out = Counter()
    for top, p in median_distribution(config).items():
        for base, q in median_distribution(baseline).items():
            out[top / base] += p * q
    return sorted(out.items())


def exact_quantile(dist, q, n_boot):
    """The smallest ratio whose exact CDF reaches q, after checking that q is at least 5
    standard errors (of an empirical CDF from n_boot draws) from the CDF's values on either side."""
    se = math.sqrt(q * (1 - q) / n_boot)
    below = 0.0
    for x, p in dist:
        if below + p >= q:
            assert q - below > 5 * se and below + p - q > 5 * se, "q is too close to a jump: choose other inputs"
            return x
        below += p
    raise AssertionError("unreachable")


def test_ratio_interval_is_the_2_5th_to_97_5th_percentile_hand_worked():
    """Pins the 95% level: a 50% (or any other) interval fails. Baseline one seed (100): every
    resample's base is 100. Config seeds 10..50: a resample's median (3rd of 5 draws) is <= the
    j-th value with P = sum_{i>=3} C(5,i) p^i (1-p)^(5-i), p = j/5: 0.05792, 0.31744, 0.68256,
    0.94208, 1. So the 2.5th percentile is 10 (0.025 < 0.058) and the 97.5th is 50 (0.975 >
    0.942): [0.1, 0.5]; the 25th and 75th are 20 and 40: a 50% interval would be [0.2, 0.4]."""
    config = [10.0, 20.0, 30.0, 40.0, 50.0]
    assert median_distribution(config) == pytest.approx({10.0: 0.05792, 20.0: 0.25952, 30.0: 0.36512,
                                                         40.0: 0.25952, 50.0: 0.05792})
    r = evidence.ratio_interval(config, [100.0], n_boot=4000)
    assert (r["ratio"], r["low"], r["high"], r["level"]) == (pytest.approx(0.3), pytest.approx(0.1),
                                                             pytest.approx(0.5), 0.95)
    half = evidence.ratio_interval(config, [100.0], n_boot=4000, level=0.5)
    assert (half["low"], half["high"]) == (pytest.approx(0.2), pytest.approx(0.4))


def test_ratio_interval_matches_the_exact_bootstrap_distribution_of_both_groups():
    """Pins the interval to the exact 2.5th and 97.5th percentiles of the bootstrap distribution
    when both groups vary (config 4 seeds, baseline 3: 256 x 27 resamples enumerated): 4/11 and
    16/11, where a 50% interval is [2/3, 12/11]; also `level` picks the percentiles. A bootstrap
    that resamples only one group, or takes other percentiles, gives other bounds."""
    config, baseline, n_boot = [400.0, 800.0, 1200.0, 1600.0], [1000.0, 1100.0, 1500.0], 20_000
    dist = ratio_distribution(config, baseline)
    low, high = (exact_quantile(dist, q, n_boot) for q in (0.025, 0.975))
    assert (low, high) == (pytest.approx(4 / 11), pytest.approx(16 / 11))  # the exhaustive count, by hand
    r = evidence.ratio_interval(config, baseline, n_boot=n_boot)
    assert r["ratio"] == pytest.approx(1000 / 1100)
    assert (r["low"], r["high"]) == (pytest.approx(low), pytest.approx(high))
    half = evidence.ratio_interval(config, baseline, n_boot=n_boot, level=0.5)
    q25, q75 = (exact_quantile(dist, q, n_boot) for q in (0.25, 0.75))
    assert (q25, q75) == (pytest.approx(2 / 3), pytest.approx(12 / 11))
    assert (half["low"], half["high"]) == (pytest.approx(q25), pytest.approx(q75))


def test_ratio_interval_resamples_the_two_groups_independently():
    """Pins independent resampling (the two configurations' runs are independent): the config's
    seeds are exactly twice the baseline's, seed by seed, so drawing the same seed indices for
    both groups would give the ratio 2 in every resample and the interval [2, 2]. Drawn
    independently, the exact bootstrap distribution's 2.5th and 97.5th percentiles are
    200/300 and 600/100: [2/3, 6]."""
    baseline = [100.0, 200.0, 300.0, 400.0, 500.0]
    config = [2 * b for b in baseline]
    n_boot = 20_000
    dist = ratio_distribution(config, baseline)
    low, high = (exact_quantile(dist, q, n_boot) for q in (0.025, 0.975))
    assert (low, high) == (pytest.approx(2 / 3), pytest.approx(6.0))
    r = evidence.ratio_interval(config, baseline, n_boot=n_boot)
    assert r["ratio"] == pytest.approx(2.0)
    assert (r["low"], r["high"]) == (pytest.approx(low), pytest.approx(high))
    assert r["high"] - r["low"] > 5


def test_ratio_interval_with_seeds_that_never_reach():
    # Most of the configuration's seeds never reach: no ratio, an infinite upper bound.
    r = evidence.ratio_interval([40.0, None, None], [100.0, 100.0, 100.0], n_boot=300)
    assert r["ratio"] is None and math.isinf(r["high"])
    # The baseline's own median never reaches: no ratio exists at all.
    r = evidence.ratio_interval([40.0, 50.0], [100.0, None, None], n_boot=300)
    assert r["ratio"] is r["low"] is r["high"] is None
    with pytest.raises(ValueError, match="at least one seed"):
        evidence.ratio_interval([], [1.0])


def test_resolution_and_ties():
    assert evidence.resolution([0, 640, 1280, 1920]) == 640.0
    assert evidence.resolution([5]) is None
    assert not evidence.apart(1000, 1500, 640) and evidence.apart(1000, 1700, 640)
    assert evidence.apart(1000, None, 640) and not evidence.apart(None, None, 640)


def test_gamma_is_the_papers_ledger_ratio():
    assert evidence.gamma(5.28, 1.0) == pytest.approx(1.0)  # one update per rollout generated
    assert evidence.gamma(5.28, 2.0) == pytest.approx((1 + 2.64) / 6.28)
    assert evidence.gamma(1.0, 4.0) == pytest.approx(1.25 / 2)
    with pytest.raises(ValueError):
        evidence.gamma(0.0, 1.0)
