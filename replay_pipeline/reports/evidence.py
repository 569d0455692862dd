"""The evidence a sweep's headline rests on, as pure functions over per-seed curves: where each
seed's accuracy curve first reaches a target (interpolated between evaluations), the median
and inter-quartile range of those crossings, the ratio of a configuration's median crossing to
the baseline's with a seed-bootstrap interval, the grid's resolution, and whether two
configurations are apart by more than it. No I/O, no pandas; replay_pipeline/reports/report.py reads
the runs and calls these.

Decisions:
* **Crossing.** A seed reaches the target at its first evaluation whose accuracy is >= the
  target (1e-9 tolerance); the compute there is interpolated linearly between that evaluation
  and the one before it (accuracy against compute), so a ratio is not forced onto multiples
  of the evaluation interval. A seed that reaches it at its first evaluation crosses at that
  evaluation's compute; one that never does has crossing None (infinite, in the medians).
* **Ratio and interval.** ratio = median(config crossings) / median(baseline crossings). The
  95% interval resamples seeds with replacement, each group on its own (the runs of two
  configurations are independent), `n_boot` times with a fixed seed, and takes the 2.5th and
  97.5th percentiles of the resampled ratios; a resample whose median is infinite (half the
  seeds never reached) gives an infinite ratio, so an upper bound can be `inf`.
* **Resolution.** The median compute between consecutive evaluations of a configuration: two
  configurations whose median crossings differ by less than one interval of the coarser of
  them are a tie.
* **Gamma** of a design: compute per learner update relative to on-policy at the same mu,
  (1 + mu / y) / (1 + mu) with y the replay ratio K x B / R (the paper's (1 + W/T) / (1 + mu)
  with W/T = mu / y).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

TOLERANCE = 1e-9


def crossing(compute: Sequence[float], accuracy: Sequence[float], target: float) -> float | None:
    """Compute at which one seed's accuracy curve (evaluations in order) first reaches
    `target`, linear between the evaluation before and the first one at or above it."""
    c = np.asarray(compute, dtype=float)
    a = np.asarray(accuracy, dtype=float)
    if c.shape != a.shape:
        raise ValueError(f"compute ({c.shape}) and accuracy ({a.shape}) must be the same length")
    keep = np.isfinite(c) & np.isfinite(a)
    c, a = c[keep], a[keep]
    hit = np.flatnonzero(a >= target - TOLERANCE)
    if len(hit) == 0:
        return None
    i = int(hit[0])
    if i == 0 or a[i] <= a[i - 1]:
        return float(c[i])
    frac = (target - a[i - 1]) / (a[i] - a[i - 1])
    return float(c[i - 1] + min(max(frac, 0.0), 1.0) * (c[i] - c[i - 1]))


def _values(crossings: Sequence[float | None]) -> np.ndarray:
    return np.asarray([math.inf if v is None else float(v) for v in crossings], dtype=float)


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def spread(crossings: Sequence[float | None]) -> dict[str, float | int | None]:
    """Median and quartiles of per-seed crossings (None: never reached, counted as infinite);
    None where the statistic is infinite. `reached` counts the seeds that reached."""
    v = _values(crossings)
    if len(v) == 0:
        return {"median": None, "q25": None, "q75": None, "reached": 0, "seeds": 0}
    q25, med, q75 = (_inf_quantile(v, q) for q in (0.25, 0.5, 0.75))
    return {"median": _finite(med), "q25": _finite(q25), "q75": _finite(q75),
            "reached": int(np.isfinite(v).sum()), "seeds": int(len(v))}


def _inf_quantile(v: np.ndarray, q: float) -> float:
    """np.quantile's linear rule (numpy's default), defined for infinite values too: a
    quantile that falls between a finite value and an infinite one is infinite."""
    s = np.sort(v)
    pos = q * (len(s) - 1)
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    if lo == hi or s[lo] == s[hi]:
        return float(s[lo])
    if not math.isfinite(s[hi]):
        return math.inf
    return float(s[lo] + (pos - lo) * (s[hi] - s[lo]))


def _median(v: np.ndarray) -> float:
    return _inf_quantile(v, 0.5)


def ratio_interval(config: Sequence[float | None], baseline: Sequence[float | None], *, n_boot: int = 10_000,
                   seed: int = 0, level: float = 0.95) -> dict[str, float | int | None]:
    """median(config) / median(baseline) and its seed-bootstrap interval (module docstring).

    `ratio` is None when the configuration's median is infinite (fewer than half its seeds
    reached); everything is None when the baseline's is (its own seeds did not reach the
    target: no ratio exists). Resamples whose baseline median is infinite have no ratio and
    are left out of the interval (counted in `undefined`)."""
    c, b = _values(config), _values(baseline)
    if len(c) == 0 or len(b) == 0:
        raise ValueError("a ratio needs at least one seed on each side")
    base = _median(b)
    out = {"ratio": None, "low": None, "high": None, "level": level, "n_boot": n_boot, "seed": seed,
           "undefined": 0}
    if not math.isfinite(base) or base <= 0:
        return out
    rng = np.random.default_rng(seed)
    ci = rng.integers(0, len(c), size=(n_boot, len(c)))
    bi = rng.integers(0, len(b), size=(n_boot, len(b)))
    bases = np.asarray([_median(b[j]) for j in bi])
    tops = np.asarray([_median(c[i]) for i in ci])
    defined = np.isfinite(bases) & (bases > 0)
    ratios = tops[defined] / bases[defined]
    tail = (1.0 - level) / 2
    point = _median(c) / base
    out |= {"ratio": _finite(point), "undefined": int((~defined).sum())}
    if len(ratios):
        out |= {"low": float(_inf_quantile(ratios, tail)), "high": float(_inf_quantile(ratios, 1.0 - tail))}
    return out


def resolution(compute_at_evaluations: Sequence[float]) -> float | None:
    """The median compute between consecutive evaluations (None with fewer than two)."""
    c = np.asarray([x for x in compute_at_evaluations if x is not None and math.isfinite(x)], dtype=float)
    if len(c) < 2:
        return None
    return float(np.median(np.diff(np.sort(c))))


def apart(a: float | None, b: float | None, step: float | None) -> bool:
    """True when crossings `a` and `b` differ by at least one evaluation interval `step`
    (a reached target beats one never reached; two never reached are a tie)."""
    if a is None or b is None:
        return (a is None) != (b is None)
    return step is None or abs(a - b) >= step - TOLERANCE


def gamma(mu: float, replay_ratio: float) -> float:
    """Compute per learner update relative to on-policy at `mu` (module docstring)."""
    if not (math.isfinite(mu) and mu > 0 and math.isfinite(replay_ratio) and replay_ratio > 0):
        raise ValueError(f"mu={mu} and replay_ratio={replay_ratio} must be finite numbers > 0")
    return (1.0 + mu / replay_ratio) / (1.0 + mu)
