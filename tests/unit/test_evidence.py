"""replay_pipeline.reports.evidence against hand-worked numbers: interpolated crossings, their spread
with seeds that never reach, the bootstrap ratio interval, resolution, ties and gamma."""

from __future__ import annotations

import math

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
