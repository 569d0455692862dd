"""Replay planner: the paper's optimal staleness horizon x* = N/R and replay ratio y* = B/R.

The model (PAPER.md, "Compute model"). Each synchronous step adds R fresh rollouts, the
FIFO window holds the newest N, and the learner trains on B rollouts drawn uniformly from
it. Costs are in units of training on one rollout, so a step costs B + mu R, where mu is
the generation/training cost ratio (replay_pipeline.algo.compute.ComputeLedger.mu). The paper's
step is one learner update; this project's round takes K = loop.updates_per_step updates of
B = loop.minibatch_size on R fresh rollouts, i.e. R / K fresh rollouts an update. In the
paper's units, then, the replay ratio is y = B / (R / K) = K B / R (DESIGN.md) and the
staleness horizon, counted in learner updates, is x = N / (R / K) = K N / R: `plan` sizes the
window N = x* R / K (not x* R, which would keep rollouts K times too long for K > 1).

Compute to reach a target is proportional to (cost per step) x (gradient-noise variance):

    F(x, y) = s(x) (y + mu) (1/y + rho + 1/x) / mu

with s(x) the noise variance at staleness horizon x and rho the correlation between
samples. With c = rho + 1/x, (y + mu)(1/y + c) = 1 + c y + mu / y + mu c, whose y-derivative
c - mu / y^2 vanishes at

    y*(x) = sqrt(mu / (rho + 1/x)),   where   (y + mu)(1/y + c) / mu = (1 + sqrt(mu c))^2 / mu,

so min_y F(x, y) = G(x) = s(x) (1/sqrt(mu) + sqrt(rho + 1/x))^2, the paper's objective, and
x* = argmin_x G(x), y* = y*(x*). (tests/unit/test_planner.py checks this numerically.)

Power law (the paper's Theorem 4.5). d/dx log G = 0 with beta the exponent of s and
u = sqrt(rho + 1/x) reads beta x u (u + 1/sqrt(mu)) = 1; since x = 1 / (u^2 - rho) this is
the quadratic (1 - beta) u^2 - (beta / sqrt(mu)) u - rho = 0, and in y = sqrt(mu) / u

    rho y^2 + beta y - (1 - beta) mu = 0,        x* = y*^2 / (beta (mu + y*)).

For beta < 1 it has exactly one positive root and G -> infinity at both ends (x -> 0 and
x -> infinity), so that root is the unique global minimum.

Differences from the paper's statement, and why:
1. alpha is the exponent of the noise's standard deviation, sigma(x) = (x/tau)^alpha, so
   the variance is s(x) = sigma(x)^2 = (x/tau)^(2 alpha): beta = 2 alpha. The paper's
   closed forms are the roots above for that s and match a brute-force minimiser; read with
   s(x) = (x/tau)^alpha they do not (at mu 6.84, alpha 0.25, rho 0.05 the true x* is then
   17.0, not 3.78). alpha < 1/2 is then exactly "s grows sublinearly", the condition for a
   finite optimum: for 2 alpha >= 1, G has no stationary point and falls as x -> 0.
   power_law_noise(alpha) is that s; tau cancels from x* and y*.
2. As transcribed, x* = [-(alpha/mu + rho(1 - 2 alpha)) + sqrt(alpha^2/mu^2 + rho(1 - 2 alpha)/mu)]
   / [2 alpha rho (1/mu - rho)] is right for every rho > 0 except rho = 1/mu, where it is
   0/0 (mu 20 with rho 0.05 evaluates to -inf), and it loses digits to cancellation near
   rho = 1/mu and as rho -> 0; y* = [-alpha + sqrt(alpha^2 + mu rho (1 - 2 alpha))] / rho is
   0/0 at rho = 0. Multiplying by the conjugates gives the same values without the
   removable singularities, which is what this module computes:
       x* = (1 - 2 alpha)^2 / [2 alpha (P + sqrt(Q))],   P = alpha/mu + rho (1 - 2 alpha),
                                                       Q = alpha^2/mu^2 + rho (1 - 2 alpha)/mu
       y* = (1 - 2 alpha) mu / [alpha + sqrt(alpha^2 + mu rho (1 - 2 alpha))]
   (numerator of x*: Q - P^2 = rho (1 - 2 alpha)^2 (1/mu - rho), cancelling the denominator).
3. rho = 0 is an ordinary case here: y* = (1 - 2 alpha) mu / (2 alpha), x* = y*^2 / mu.
4. alpha = 0 (noise that does not grow with staleness) has no finite optimum: G falls
   for ever, so power_law_optimum returns x* = inf (keep everything the memory allows) and
   y* = sqrt(mu / rho) (inf when rho = 0 too) rather than a number from a 0/0.

x* and y* grow with mu and shrink as alpha or rho grow (checked over a grid in the tests).
The optimum is unconstrained: x* < 1 (N < R) is possible when generation is cheap (mu
below ~1, as on a CPU); plan() then keeps the window at least one batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

NoiseGrowth = Callable[[float], float]

DEFAULT_ALPHA = 0.25
"""Illustrative noise-growth exponent (of sigma(x)); measure it for a real setting."""
DEFAULT_RHO = 0.05
"""Illustrative correlation between samples; measure it for a real setting."""

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


# ------------------------------------------------------------------ validation
def _check_mu(mu: float) -> float:
    mu = float(mu)
    if not (math.isfinite(mu) and mu > 0):
        raise ValueError(f"mu={mu} must be a finite number > 0: it is the seconds to generate a "
                         "rollout over the seconds to train on one (the run's compute/mu metric)")
    return mu


def _check_rho(rho: float) -> float:
    rho = float(rho)
    if not (math.isfinite(rho) and rho >= 0):
        raise ValueError(f"rho={rho} must be a finite number >= 0: it is the correlation between "
                         "samples (0: independent)")
    return rho


def _check_alpha(alpha: float) -> float:
    alpha = float(alpha)
    if not math.isfinite(alpha) or alpha < 0:
        raise ValueError(f"alpha={alpha} must be in [0, 1/2): the exponent of the noise's growth "
                         "with staleness, sigma(x) = (x/tau)^alpha")
    if alpha >= 0.5:
        raise ValueError(f"alpha={alpha} must be below 1/2: the noise variance s(x) = x^(2 alpha) then "
                         "grows at least linearly with staleness, the objective has no interior minimum "
                         "and the model says stay on-policy; use a smaller alpha (or numerical_optimum "
                         "over a bounded domain for such a noise model)")
    return alpha


def _check_positive(name: str, value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value} must be a finite number > 0")
    return value


def _evaluate_noise(s: NoiseGrowth, x: np.ndarray) -> np.ndarray:
    """s at every x; s may be vectorised (numpy) or scalar-only (math)."""
    try:
        values = np.asarray(s(x), dtype=float)
    except (TypeError, ValueError):
        values = None
    if values is None or values.shape != x.shape:
        values = np.array([float(s(float(t))) for t in x.ravel()]).reshape(x.shape)
    bad = ~(np.isfinite(values) & (values > 0))
    if bad.any():
        where = float(x.ravel()[np.argmax(bad.ravel())])
        raise ValueError(f"s(x) must be finite and > 0 (it is a noise variance); s({where:g}) = "
                         f"{values.ravel()[np.argmax(bad.ravel())]}")
    return values


# ------------------------------------------------------------------ the model
def power_law_noise(alpha: float, tau: float = 1.0) -> NoiseGrowth:
    """s(x) = sigma(x)^2 = (x/tau)^(2 alpha): the variance under the paper's power law."""
    alpha, tau = _check_alpha(alpha), _check_positive("tau", tau)
    return lambda x: (np.asarray(x, dtype=float) / tau) ** (2.0 * alpha)


def compute_to_target(mu: float, x: float, y: float, s: NoiseGrowth, rho: float) -> float:
    """F(x, y) = s(x) (y + mu) (1/y + rho + 1/x) / mu, up to a constant factor."""
    mu, rho = _check_mu(mu), _check_rho(rho)
    x, y = _check_positive("x", x), _check_positive("y", y)
    noise = float(_evaluate_noise(s, np.array([x]))[0])
    return noise * (y + mu) * (1.0 / y + rho + 1.0 / x) / mu


def best_replay_ratio(mu: float, x: float, rho: float) -> float:
    """y*(x) = sqrt(mu / (rho + 1/x)): the replay ratio minimising F at horizon x."""
    mu, rho = _check_mu(mu), _check_rho(rho)
    x = float(x)
    if x == math.inf:
        return math.sqrt(mu / rho) if rho > 0 else math.inf
    x = _check_positive("x", x)
    return math.sqrt(mu / (rho + 1.0 / x))


def horizon_objective(mu: float, x, s: NoiseGrowth, rho: float):
    """G(x) = min_y F(x, y) = s(x) (1/sqrt(mu) + sqrt(rho + 1/x))^2 (array in, array out)."""
    mu, rho = _check_mu(mu), _check_rho(rho)
    x = np.asarray(x, dtype=float)
    return _evaluate_noise(s, x) * (1.0 / math.sqrt(mu) + np.sqrt(rho + 1.0 / x)) ** 2


def predicted_gamma(mu: float, x: float, y: float, s: NoiseGrowth, rho: float) -> float:
    """The model's predicted compute-to-target of design (x, y) over on-policy (x = y = 1).

    F(x, y) / F(1, 1): below 1 means the design should reach a target with that fraction of
    the on-policy compute. It is the model's prediction under the assumed s and rho, not a
    measurement; compare gamma_from_ratio, the paper's ledger ratio of cost per update.
    """
    return compute_to_target(mu, x, y, s, rho) / compute_to_target(mu, 1.0, 1.0, s, rho)


def gamma_from_ratio(mu: float, w_over_t: float) -> float:
    """The paper's ledger compute ratio gamma = (1 + W/T) / (1 + mu).

    Per learner update a no-buffer run costs C(1 + mu) and a buffered one C(1 + W/T), W/T
    being inference over trainer resources (the paper's GPU split, W + T = 8).
    """
    mu = _check_mu(mu)
    w_over_t = float(w_over_t)
    if not (math.isfinite(w_over_t) and w_over_t >= 0):
        raise ValueError(f"w_over_t={w_over_t} must be a finite number >= 0 (inference over trainer resources)")
    return (1.0 + w_over_t) / (1.0 + mu)


# ------------------------------------------------------------------ optima
def power_law_optimum(mu: float, alpha: float, rho: float) -> tuple[float, float]:
    """(x*, y*) in closed form for s(x) = (x/tau)^(2 alpha), 0 <= alpha < 1/2 (see module doc).

    x* = (1 - 2a)^2 / [2a (P + sqrt(Q))], P = a/mu + rho (1 - 2a), Q = a^2/mu^2 + rho (1 - 2a)/mu
    y* = (1 - 2a) mu / [a + sqrt(a^2 + mu rho (1 - 2a))]
    Equal to the paper's Theorem 4.5 where that is defined (rho > 0, rho != 1/mu); also
    y* = y*(x*) = sqrt(mu / (rho + 1/x*)) and x* = y*^2 / (2a (mu + y*)).
    alpha = 0: no finite optimum, returns (inf, sqrt(mu / rho)) (inf, inf if rho = 0).
    """
    mu, alpha, rho = _check_mu(mu), _check_alpha(alpha), _check_rho(rho)
    if alpha == 0.0:
        return math.inf, (math.sqrt(mu / rho) if rho > 0 else math.inf)
    q = 1.0 - 2.0 * alpha
    p_term = alpha / mu + rho * q
    q_term = alpha * alpha / (mu * mu) + rho * q / mu
    x_star = q * q / (2.0 * alpha * (p_term + math.sqrt(q_term)))
    y_star = q * mu / (alpha + math.sqrt(alpha * alpha + mu * rho * q))
    return x_star, y_star


def _golden_section(f: Callable[[float], float], lo: float, hi: float, tol: float) -> float:
    """Minimiser of a unimodal f on [lo, hi] to within tol (scipy is not a dependency)."""
    c, d = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
    fc, fd = f(c), f(d)
    while hi - lo > tol:
        if fc < fd:
            hi, d, fd = d, c, fc
            c = hi - _GOLDEN * (hi - lo)
            fc = f(c)
        else:
            lo, c, fc = c, d, fd
            d = lo + _GOLDEN * (hi - lo)
            fd = f(d)
    return 0.5 * (lo + hi)


def numerical_optimum(mu: float, s: NoiseGrowth, rho: float, x_min: float = 1.0,
                      x_max: float = 1e4, grid: int = 2001) -> tuple[float, float]:
    """(x*, y*) for any positive noise variance s(x): argmin of G over [x_min, x_max].

    G is evaluated on `grid` log-spaced points, then golden-section search in log x refines
    the best bracket to ~1e-10 relative (G is flat at its minimum, so x* itself is good to
    ~1e-8). y* = sqrt(mu / (rho + 1/x*)).
    x_min defaults to 1: N >= R, the window holds at least the newest batch; pass a smaller
    x_min for the unconstrained model optimum (the power law's can be below 1).
    At the boundaries: a minimum at x_min is the constrained optimum and is returned; if G
    still falls at x_max there is no minimum in the domain (e.g. s constant: more history is
    always better), and the result is (inf, sqrt(mu / rho)) rather than the arbitrary x_max:
    raise x_max if the optimum may be beyond it, or cap the buffer by memory.
    """
    mu, rho = _check_mu(mu), _check_rho(rho)
    x_min, x_max = _check_positive("x_min", x_min), _check_positive("x_max", x_max)
    if not x_min < x_max or x_max == math.inf:
        raise ValueError(f"the domain [x_min, x_max] = [{x_min}, {x_max}] must be finite with x_min < x_max")
    if grid < 3:
        raise ValueError(f"grid={grid} must be at least 3 points")
    xs = np.geomspace(x_min, x_max, int(grid))
    values = horizon_objective(mu, xs, s, rho)
    i = int(np.argmin(values))
    if i == len(xs) - 1:
        return math.inf, best_replay_ratio(mu, math.inf, rho)
    if i == 0:
        return x_min, best_replay_ratio(mu, x_min, rho)

    def g(t: float) -> float:
        return float(horizon_objective(mu, np.array([math.exp(t)]), s, rho)[0])

    t_star = _golden_section(g, math.log(xs[i - 1]), math.log(xs[i + 1]), tol=1e-10)
    x_star = math.exp(t_star)
    return x_star, best_replay_ratio(mu, x_star, rho)


# ------------------------------------------------------------------ a design to run
@dataclass(frozen=True)
class Plan:
    """A recommended buffer design for R rollouts per step and minibatches of B."""

    mu: float
    """Generation/training cost ratio the plan is for."""
    alpha: Optional[float]
    """Noise-growth exponent (None when a custom s was given)."""
    rho: float
    """Correlation between samples."""
    method: str
    """`closed form` (power law) or `numerical` (custom s)."""
    rollouts_per_step: int
    """R = loop.prompts_per_step x loop.group_size."""
    minibatch_size: int
    """B = loop.minibatch_size."""
    x_star: float
    """Optimal staleness horizon in learner updates (unconstrained, continuous): the paper's
    x = N/R with one update per R fresh rollouts; here K updates share a round's R, so a
    window of N holds a rollout for K N / R updates."""
    y_star: float
    """Optimal replay ratio K B / R (continuous)."""
    capacity: int
    """buffer.capacity N = round(x* R / K), at least R (the window holds the newest batch, so
    no generated rollout goes untrained) and at least B."""
    updates_per_step: int
    """loop.updates_per_step K >= 1: the integer whose design (N, K) has the lowest F."""
    x: float
    """Realised horizon in learner updates, K N / R."""
    y: float
    """Realised replay ratio K B / R."""
    gamma: float
    """Predicted compute-to-target of the realised design over on-policy (model's prediction)."""
    gamma_star: float
    """The same at the continuous optimum (x*, y*); gamma >= gamma_star up to rounding."""


def plan(mu: float, R: int, B: int, alpha: Optional[float] = None, rho: float = DEFAULT_RHO,
         s: Optional[NoiseGrowth] = None) -> Plan:
    """Recommend buffer.capacity N and loop.updates_per_step K for R rollouts per step.

    With s, x* comes from numerical_optimum (domain x >= 1); otherwise from the power law
    with alpha (DEFAULT_ALPHA when None) in closed form. x counts learner updates, as in the
    paper: with K updates a round, each update's share of fresh rollouts is R / K, so the
    window that keeps a rollout x* updates is N = x* R / K (folding the K updates into one of
    K B would make the window K times too large). For each K, N = round(x* R / K), raised to
    at least R (the window holds the newest batch) and B (a minibatch fits); the K whose
    realised design (x = K N / R, y = K B / R) has the lowest F is chosen.
    """
    mu, rho = _check_mu(mu), _check_rho(rho)
    for name, value in (("R", R), ("B", B)):
        if isinstance(value, bool) or int(value) != value or value < 1:
            raise ValueError(f"{name}={value} must be a positive integer (R: rollouts per step, "
                             "B: minibatch size)")
    R, B = int(R), int(B)
    if s is not None and alpha is not None:
        raise ValueError("give alpha (power-law noise, closed form) or s (any noise, numerical), not both")
    if s is None:
        alpha = DEFAULT_ALPHA if alpha is None else _check_alpha(alpha)
        x_star, y_star = power_law_optimum(mu, alpha, rho)
        s, method = power_law_noise(alpha), "closed form"
    else:
        x_star, y_star = numerical_optimum(mu, s, rho)
        method = "numerical"
    if x_star == math.inf:
        raise ValueError(f"no finite optimal horizon for mu={mu}, rho={rho}"
                         + (f", alpha={alpha}" if alpha is not None else "")
                         + ": the noise does not grow with staleness, so the model says keep every "
                         "rollout; set buffer.capacity by memory instead")
    def design(k: int) -> tuple[int, float, float]:
        """(N, x, y) with K = k updates a round: N = x* R / k so that a rollout stays x* learner
        updates, at least one batch (R) and one minibatch (B)."""
        n = max(round(x_star * R / k), R, B)
        return n, k * n / R, k * B / R

    # Every K up to twice the unconstrained optimum's (the N >= R floor can move the best K).
    top = max(2, math.ceil(2 * y_star * R / B)) if math.isfinite(y_star) else 64
    updates = min(range(1, top + 1), key=lambda k: compute_to_target(mu, *design(k)[1:], s, rho))
    capacity, x, y = design(updates)
    return Plan(mu=mu, alpha=alpha, rho=rho, method=method, rollouts_per_step=R, minibatch_size=B,
                x_star=x_star, y_star=y_star, capacity=capacity, updates_per_step=updates, x=x, y=y,
                gamma=predicted_gamma(mu, x, y, s, rho),
                gamma_star=predicted_gamma(mu, x_star, y_star, s, rho))
