"""The compute model's noise parameters, measured: alpha (how fast gradient noise grows with
staleness) and rho (the correlation between samples), from per-sample gradients.

The planner (replay_pipeline/algo/planner.py) models the variance of a minibatch gradient as
s(x) (rho + 1/y + 1/x) in units of one step's R rollouts, with the per-sample noise variance
s(x) = (x / tau)^(2 alpha) at staleness x (learner updates). Both are estimated here from
gradient vectors, one per rollout, all taken at one policy (replay_pipeline/run/measure.py
computes them from a run's stored rollouts and checkpoint; any projection that keeps inner
products in expectation, such as its count sketch, leaves the estimates unbiased):

* **s(x)**: the trace of the unbiased sample covariance of the gradients of rollouts that were
  generated x learner updates before the policy they are taken at (:func:`noise_variance`).
* **alpha** (:func:`fit_alpha`): least squares of log s(x) on log x over the staleness levels
  with x >= 1 (the power law has no value at x = 0); the slope is 2 alpha. Assumes the power
  law holds over the measured range, and that the rollouts at each level are exchangeable
  draws (each level is one or a few generation steps: their prompts differ, their policy is
  one). tau cancels from the planner's optimum and is not reported.
* **rho** (:func:`fit_rho`): rollouts come in batches (one generation step: one policy, one
  draw of prompts). The model says a mean of b rollouts of one batch has variance
  rho s + (1 - rho) s / b: a part rho s shared by the batch (its prompts, its policy) that no
  larger minibatch averages away, and the rest independent. The variance across batches of
  b-rollout means is fitted against 1/b by least squares over b = 1, 2, 4, ... up to the
  batch size; its intercept is rho s, and the pooled within-batch variance (1 - rho) s (the
  shared part cancels inside a batch), so rho = intercept / (intercept + within), clipped at 0.
  Assumes batches are independent of each other and their rollouts exchangeable within a
  batch; the shared part includes differences between the batches' policies, so batches of
  one staleness (or few) should be used.

Intervals: a bootstrap over the units that are independent under each model (rollouts within
each staleness level for alpha, whole batches for rho), 2.5 and 97.5 percentiles. Tested on
synthetic gradients with known alpha and rho (tests/unit/test_noise.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["Estimate", "fit_alpha", "fit_rho", "noise_variance"]


@dataclass(frozen=True)
class Estimate:
    """A measured parameter: the point estimate, its bootstrap interval and what it was fitted on."""
    value: float
    low: float
    high: float
    points: dict[str, float]
    """alpha: staleness -> s(x); rho: minibatch size b -> variance of b-means across batches, over s."""

    def as_dict(self) -> dict:
        return asdict(self)


def noise_variance(grads: np.ndarray) -> float:
    """Trace of the unbiased sample covariance of gradient vectors (rows): the mean squared
    distance from their mean, times n / (n - 1)."""
    g = np.asarray(grads, dtype=np.float64)
    if g.ndim != 2 or g.shape[0] < 2:
        raise ValueError(f"need at least two gradient vectors (rows), got an array of shape {g.shape}")
    return float(((g - g.mean(axis=0)) ** 2).sum() / (g.shape[0] - 1))


def _slope(x: np.ndarray, y: np.ndarray) -> float:
    x = x - x.mean()
    return float((x * (y - y.mean())).sum() / (x ** 2).sum())


def fit_alpha(levels: Mapping[float, np.ndarray], draws: int = 200, seed: int = 0) -> Estimate:
    """alpha from gradients grouped by staleness (learner updates -> rows of gradient vectors):
    half the slope of log s(x) on log x over the levels with x >= 1 (at least two)."""
    usable = {float(x): np.asarray(g, dtype=np.float64) for x, g in levels.items() if float(x) >= 1 and len(g) >= 2}
    if len(usable) < 2:
        raise ValueError(f"alpha needs gradients at two or more staleness levels >= 1 (got {sorted(levels)}); "
                         "measure a run with more steps stored, or more of them")
    xs = np.log(np.asarray(sorted(usable)))

    def estimate(groups: dict[float, np.ndarray]) -> float:
        s = np.asarray([noise_variance(groups[x]) for x in sorted(groups)])
        return _slope(xs, np.log(np.maximum(s, 1e-300))) / 2

    rng = np.random.default_rng(seed)
    boot = [estimate({x: g[rng.integers(0, len(g), len(g))] for x, g in usable.items()}) for _ in range(draws)]
    return Estimate(value=estimate(usable), low=float(np.percentile(boot, 2.5)), high=float(np.percentile(boot, 97.5)),
                    points={f"{x:g}": noise_variance(g) for x, g in sorted(usable.items())})


def _rho(batches: Sequence[np.ndarray], sizes: Sequence[int], rng: np.random.Generator) -> tuple[float, dict]:
    within = float(np.mean([noise_variance(b) for b in batches]))  # (1 - rho) s: the shared part cancels
    between = {}
    for b in sizes:
        means = np.stack([batch[rng.permutation(len(batch))[:b]].mean(axis=0) for batch in batches])
        between[b] = noise_variance(means)  # rho s + (1 - rho) s / b
    inv = np.asarray([1.0 / b for b in sizes])
    v = np.asarray([between[b] for b in sizes])
    shared = float(v.mean() - _slope(inv, v) * inv.mean())  # the intercept: rho s
    shared = max(shared, 0.0)
    return shared / (shared + within), {f"{b}": between[b] / (shared + within) for b in sizes}


def fit_rho(batches: Sequence[np.ndarray], draws: int = 200, seed: int = 0) -> Estimate:
    """rho from batches of gradient vectors (each batch: the rollouts of one generation step):
    the intercept of var(b-means across batches) / s against 1/b."""
    batches = [np.asarray(b, dtype=np.float64) for b in batches if len(b) >= 2]
    if len(batches) < 3:
        raise ValueError(f"rho needs three or more batches of two or more gradients (got {len(batches)}); "
                         "measure a run with more steps stored")
    smallest = min(len(b) for b in batches)
    sizes = [b for b in (2 ** k for k in range(smallest.bit_length())) if b <= smallest]
    if len(sizes) < 2:
        raise ValueError("rho needs batches of at least two rollouts")
    rng = np.random.default_rng(seed)
    value, points = _rho(batches, sizes, rng)
    boot = [_rho([batches[i] for i in rng.integers(0, len(batches), len(batches))], sizes, rng)[0]
            for _ in range(draws)]
    return Estimate(value=value, low=float(np.percentile(boot, 2.5)), high=float(np.percentile(boot, 97.5)),
                    points=points)
