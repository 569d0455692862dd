"""replay_pipeline.algo.planner against the algebra, the paper's closed form and brute force.

The brute-force minimisers here are independent of the module: a zooming grid over
(log x, log y) for F(x, y) itself, and a dense log grid over x for G(x).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from replay_pipeline.algo import planner
from replay_pipeline.algo.planner import (
    best_replay_ratio, compute_to_target, gamma_from_ratio, horizon_objective, numerical_optimum,
    plan, power_law_noise, power_law_optimum, predicted_gamma,
)

PAPER_MUS = (6.84, 5.28)  # Qwen3-0.6B, Qwen2.5-7B
CPU_MU = 0.5
MUS = (CPU_MU, 1.0, 5.0, 5.28, 6.84, 20.0)
ALPHAS = (0.05, 0.25, 0.45)
RHOS = (0.0, 0.05, 0.2, 1.0)  # 0.05 = 1/20 and 0.2 = 1/5: where the paper's x* is 0/0


def F(mu, x, y, beta, rho):
    """The paper's objective with s(x) = x^beta, written out again (not the module's)."""
    return x ** beta * (y + mu) * (1.0 / y + rho + 1.0 / x) / mu


def brute_force_xy(mu, beta, rho, lo=1e-4, hi=1e6, points=201):
    """argmin over (x, y) of F by a grid in log space, zooming on the best cell."""
    tx = ty = np.linspace(math.log(lo), math.log(hi), points)
    first = True
    while tx[1] - tx[0] > 1e-9 or ty[1] - ty[0] > 1e-9:
        X, Y = np.exp(tx)[:, None], np.exp(ty)[None, :]
        i, j = np.unravel_index(np.argmin(F(mu, X, Y, beta, rho)), (points, points))
        edge = i in (0, points - 1) or j in (0, points - 1)
        assert not (first and edge), "minimum on the edge of the whole domain"
        # a valley can put the best point of a zoomed grid on its edge: move, don't shrink
        half = points // 2 if edge else 10
        dx, dy = tx[1] - tx[0], ty[1] - ty[0]
        tx = np.linspace(tx[i] - half * dx, tx[i] + half * dx, points)
        ty = np.linspace(ty[j] - half * dy, ty[j] + half * dy, points)
        first = False
    return math.exp(tx[points // 2]), math.exp(ty[points // 2])


def brute_force_x(mu, s, rho, lo, hi, points=400_001):
    """argmin over x of min_y F, on a dense log grid (the grid step bounds the error)."""
    xs = np.geomspace(lo, hi, points)
    g = np.asarray(s(xs), dtype=float) * (1 / math.sqrt(mu) + np.sqrt(rho + 1 / xs)) ** 2
    return float(xs[np.argmin(g)]), float(np.log(hi / lo) / (points - 1))


def paper_closed_form(mu, alpha, rho):
    """Theorem 4.5 exactly as transcribed in PAPER.md."""
    x = ((-(alpha / mu + rho * (1 - 2 * alpha)) + math.sqrt(alpha ** 2 / mu ** 2 + rho * (1 - 2 * alpha) / mu))
         / (2 * alpha * rho * (1 / mu - rho)))
    y = (-alpha + math.sqrt(alpha ** 2 + mu * rho * (1 - 2 * alpha))) / rho
    return x, y


# ------------------------------------------------------------------ the algebra
@pytest.mark.parametrize("mu,x,rho,beta", [(6.84, 3.0, 0.05, 0.5), (5.28, 1.0, 0.0, 0.2),
                                           (CPU_MU, 0.3, 1.0, 0.9), (20.0, 50.0, 0.2, 0.1)])
def test_minimum_over_y_is_the_papers_objective(mu, x, rho, beta):
    # min_y s(x)(y + mu)(1/y + rho + 1/x)/mu = s(x)(1/sqrt(mu) + sqrt(rho + 1/x))^2 at y*(x)
    ys = np.geomspace(1e-4, 1e6, 2_000_001)
    values = F(mu, x, ys, beta, rho)
    k = int(np.argmin(values))
    s = power_law_noise(beta / 2)
    assert best_replay_ratio(mu, x, rho) == pytest.approx(ys[k], rel=2e-5)
    assert best_replay_ratio(mu, x, rho) == pytest.approx(math.sqrt(mu / (rho + 1 / x)))
    assert float(horizon_objective(mu, x, s, rho)) == pytest.approx(values[k], rel=1e-9)
    assert float(horizon_objective(mu, x, s, rho)) == pytest.approx(
        x ** beta * (1 / math.sqrt(mu) + math.sqrt(rho + 1 / x)) ** 2)
    assert compute_to_target(mu, x, ys[k], s, rho) == pytest.approx(values[k])


def test_compute_to_target_by_hand():
    # s = 1, mu = 1, rho = 0, x = 2, y = 1: (1 + 1)(1 + 0 + 1/2) / 1 = 3
    assert compute_to_target(1.0, 2.0, 1.0, lambda x: 1.0, 0.0) == pytest.approx(3.0)
    # s = x^(2 * 0.25) = sqrt(4) = 2, mu = 2, rho = 0.5, x = 4, y = 2: 2 (4)(0.5 + 0.5 + 0.25) / 2 = 5
    assert compute_to_target(2.0, 4.0, 2.0, power_law_noise(0.25), 0.5) == pytest.approx(5.0)


# ------------------------------------------------------------------ the closed form
@pytest.mark.parametrize("mu,alpha,rho", list(itertools.product(MUS, ALPHAS, RHOS)))
def test_closed_form_matches_brute_force(mu, alpha, rho):
    x_star, y_star = power_law_optimum(mu, alpha, rho)
    x_bf, y_bf = brute_force_xy(mu, 2 * alpha, rho)
    assert x_star == pytest.approx(x_bf, rel=1e-5)
    assert y_star == pytest.approx(y_bf, rel=1e-5)


@pytest.mark.parametrize("mu,alpha,rho", list(itertools.product(MUS, ALPHAS, RHOS)))
def test_y_star_is_y_of_x_star(mu, alpha, rho):
    x_star, y_star = power_law_optimum(mu, alpha, rho)
    assert best_replay_ratio(mu, x_star, rho) == pytest.approx(y_star, rel=1e-12)
    # the root of rho y^2 + 2 alpha y - (1 - 2 alpha) mu = 0 and x* = y*^2 / (2 alpha (mu + y*))
    assert rho * y_star ** 2 + 2 * alpha * y_star - (1 - 2 * alpha) * mu == pytest.approx(0, abs=1e-9 * mu)
    assert x_star == pytest.approx(y_star ** 2 / (2 * alpha * (mu + y_star)), rel=1e-12)


@pytest.mark.parametrize("mu,alpha,rho", [(6.84, 0.25, 0.05), (5.28, 0.25, 0.05), (5.28, 0.1, 0.3),
                                          (CPU_MU, 0.25, 0.05), (20.0, 0.3, 0.2), (2.0, 0.4, 1.0),
                                          (10.0, 0.05, 0.5)])
def test_papers_formula_as_written_agrees_where_defined(mu, alpha, rho):
    assert paper_closed_form(mu, alpha, rho) == pytest.approx(power_law_optimum(mu, alpha, rho), rel=1e-9)


def test_papers_formula_is_singular_where_ours_is_not():
    # rho = 1/mu: the transcribed x* is 0/0 (here -inf); the rationalised one matches brute force
    with np.errstate(all="ignore"):
        x_paper, _ = paper_closed_form(20.0, 0.25, np.float64(0.05))
    assert not math.isfinite(x_paper) or abs(x_paper - 20 / 3) > 1
    assert power_law_optimum(20.0, 0.25, 0.05) == pytest.approx((20 / 3, 10.0), rel=1e-12)
    # rho = 0: the transcribed y* is 0/0; the limit is y* = (1 - 2a) mu / (2a), x* = y*^2 / mu
    with pytest.raises(ZeroDivisionError):
        paper_closed_form(6.84, 0.25, 0.0)
    x0, y0 = power_law_optimum(6.84, 0.25, 0.0)
    assert y0 == pytest.approx(6.84)
    assert x0 == pytest.approx(6.84)
    assert (x0, y0) == pytest.approx(power_law_optimum(6.84, 0.25, 1e-12), rel=1e-9)


def test_alpha_is_the_exponent_of_sigma_not_of_the_variance():
    # the closed form minimises s = x^(2 alpha); read as s = x^alpha it is far off
    x_star, _ = power_law_optimum(6.84, 0.25, 0.05)
    x_sigma2, _ = brute_force_x(6.84, lambda x: x ** 0.5, 0.05, 1e-3, 1e4)
    x_var, _ = brute_force_x(6.84, lambda x: x ** 0.25, 0.05, 1e-3, 1e4)
    assert x_star == pytest.approx(x_sigma2, rel=1e-4)
    assert x_var > 4 * x_star  # 17.0 against 3.78


def test_hand_worked_optimum():
    # mu 20, alpha 1/4, rho 1/20: 0.05 y^2 + 0.5 y - 10 = 0 -> y* = 10; x* = 100 / (0.5 * 30) = 20/3
    assert power_law_optimum(20.0, 0.25, 0.05) == pytest.approx((20 / 3, 10.0))


# ------------------------------------------------------------------ the paper's claims
def test_optimum_grows_with_mu_and_shrinks_with_alpha_and_rho():
    mus, alphas, rhos = np.geomspace(0.1, 100, 25), np.linspace(0.01, 0.49, 25), np.geomspace(1e-3, 10, 25)
    for alpha, rho in itertools.product(alphas, rhos):
        xs, ys = zip(*(power_law_optimum(mu, alpha, rho) for mu in mus))
        assert np.all(np.diff(xs) > 0) and np.all(np.diff(ys) > 0), (alpha, rho)
    for mu, rho in itertools.product(mus, rhos):
        xs, ys = zip(*(power_law_optimum(mu, alpha, rho) for alpha in alphas))
        assert np.all(np.diff(xs) < 0) and np.all(np.diff(ys) < 0), (mu, rho)
    for mu, alpha in itertools.product(mus, alphas):
        xs, ys = zip(*(power_law_optimum(mu, alpha, rho) for rho in rhos))
        assert np.all(np.diff(xs) < 0) and np.all(np.diff(ys) < 0), (mu, alpha)


def test_cheap_generation_means_little_replay():
    x_cpu, y_cpu = power_law_optimum(CPU_MU, 0.25, 0.05)
    assert x_cpu < 1 and y_cpu < 1
    for mu in PAPER_MUS:
        x, y = power_law_optimum(mu, 0.25, 0.05)
        assert x > 3 and y > 3


# ------------------------------------------------------------------ edge cases
@pytest.mark.parametrize("mu", [0.0, -1.0, math.nan, math.inf])
def test_bad_mu(mu):
    with pytest.raises(ValueError, match="mu=.* must be a finite number > 0"):
        power_law_optimum(mu, 0.25, 0.05)


@pytest.mark.parametrize("alpha,match", [(-0.1, r"must be in \[0, 1/2\)"), (math.nan, r"must be in \[0, 1/2\)"),
                                         (0.5, "must be below 1/2"), (0.7, "must be below 1/2")])
def test_bad_alpha(alpha, match):
    with pytest.raises(ValueError, match=match):
        power_law_optimum(6.84, alpha, 0.05)


@pytest.mark.parametrize("rho", [-0.01, math.nan, math.inf])
def test_bad_rho(rho):
    with pytest.raises(ValueError, match="rho=.* must be a finite number >= 0"):
        power_law_optimum(6.84, 0.25, rho)


def test_no_growth_has_no_finite_optimum():
    assert power_law_optimum(6.84, 0.0, 0.05) == (math.inf, pytest.approx(math.sqrt(6.84 / 0.05)))
    assert power_law_optimum(6.84, 0.0, 0.0) == (math.inf, math.inf)
    assert numerical_optimum(6.84, lambda x: 1.0, 0.05) == (math.inf, pytest.approx(math.sqrt(6.84 / 0.05)))
    with pytest.raises(ValueError, match="no finite optimal horizon"):
        plan(6.84, 64, 64, alpha=0.0)
    with pytest.raises(ValueError, match="no finite optimal horizon"):
        plan(6.84, 64, 64, s=lambda x: np.ones_like(x))


@pytest.mark.parametrize("R,B", [(0, 64), (64, 0), (64.5, 64), (True, 64), (-8, 64)])
def test_plan_rejects_bad_sizes(R, B):
    with pytest.raises(ValueError, match="must be a positive integer"):
        plan(6.84, R, B)


def test_plan_takes_alpha_or_s_not_both():
    with pytest.raises(ValueError, match="not both"):
        plan(6.84, 64, 64, alpha=0.25, s=power_law_noise(0.25))


def test_noise_must_be_positive():
    with pytest.raises(ValueError, match="s\\(x\\) must be finite and > 0"):
        numerical_optimum(6.84, lambda x: 1.0 - 0.5 * x, 0.05)
    with pytest.raises(ValueError, match="x_min < x_max"):
        numerical_optimum(6.84, power_law_noise(0.25), 0.05, x_min=10, x_max=1)


# ------------------------------------------------------------------ gamma
@pytest.mark.parametrize("mu,rho,alpha", [(6.84, 0.05, 0.25), (CPU_MU, 1.0, 0.1), (20.0, 0.0, 0.45)])
def test_predicted_gamma_of_on_policy_is_one(mu, rho, alpha):
    assert predicted_gamma(mu, 1.0, 1.0, power_law_noise(alpha), rho) == pytest.approx(1.0)


def test_predicted_gamma_by_hand():
    # s = 1, mu = 1, rho = 0: F(2, 1) = 3, F(1, 1) = 2 * 2 = 4
    assert predicted_gamma(1.0, 2.0, 1.0, lambda x: 1.0, 0.0) == pytest.approx(0.75)


def test_optimum_beats_on_policy_when_generation_is_costly():
    for mu in PAPER_MUS:
        x, y = power_law_optimum(mu, 0.25, 0.05)
        assert predicted_gamma(mu, x, y, power_law_noise(0.25), 0.05) < 0.8


def test_gamma_from_ratio():
    # the paper's ledger: (1 + W/T) / (1 + mu); (W, T) = (6, 2) at mu 6.84: 4 / 7.84
    assert gamma_from_ratio(6.84, 3.0) == pytest.approx(4 / 7.84)
    assert gamma_from_ratio(6.84, 6.84) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="w_over_t"):
        gamma_from_ratio(6.84, -1.0)
    with pytest.raises(ValueError, match="mu="):
        gamma_from_ratio(0.0, 1.0)


# ------------------------------------------------------------------ numerical optimum
@pytest.mark.parametrize("mu,alpha,rho", list(itertools.product(MUS, ALPHAS, RHOS)))
def test_numerical_power_law_equals_closed_form(mu, alpha, rho):
    x_star, y_star = power_law_optimum(mu, alpha, rho)
    x_num, y_num = numerical_optimum(mu, power_law_noise(alpha), rho, x_min=1e-4, x_max=1e6)
    assert x_num == pytest.approx(x_star, rel=1e-6)
    assert y_num == pytest.approx(y_star, rel=1e-6)


def test_numerical_default_domain_starts_at_one():
    # x* = 0.466 at mu 0.5: constrained to N >= R, the optimum is the boundary x = 1
    x, y = numerical_optimum(CPU_MU, power_law_noise(0.25), 0.05)
    assert x == 1.0 and y == pytest.approx(best_replay_ratio(CPU_MU, 1.0, 0.05))
    x, y = numerical_optimum(6.84, power_law_noise(0.25), 0.05)  # interior: unchanged
    assert (x, y) == pytest.approx(power_law_optimum(6.84, 0.25, 0.05), rel=1e-6)


@pytest.mark.parametrize("mu,rho", [(6.84, 0.05), (5.28, 0.0), (CPU_MU, 0.05), (20.0, 1.0)])
def test_numerical_linear_noise_matches_brute_force(mu, rho):
    s = lambda x: 1.0 + 0.1 * x  # noqa: E731  (not a power law: no closed form)
    x_num, y_num = numerical_optimum(mu, s, rho, x_min=1e-3, x_max=1e4)
    x_bf, step = brute_force_x(mu, s, rho, 1e-3, 1e4)
    assert math.log(x_num / x_bf) == pytest.approx(0, abs=2 * step)
    assert y_num == pytest.approx(math.sqrt(mu / (rho + 1 / x_num)))
    g = lambda x: float(horizon_objective(mu, x, s, rho))  # noqa: E731
    assert g(x_num) <= g(x_bf) * (1 + 1e-12)


def test_numerical_accepts_scalar_only_noise():
    s = lambda x: math.exp(0.01 * x)  # noqa: E731  (math, not numpy: called point by point)
    x_num, _ = numerical_optimum(6.84, s, 0.05, x_min=1e-3, x_max=1e3)
    x_bf, step = brute_force_x(6.84, np.vectorize(s), 0.05, 1e-3, 1e3, points=100_001)
    assert math.log(x_num / x_bf) == pytest.approx(0, abs=2 * step)


# ------------------------------------------------------------------ the plan
@pytest.mark.parametrize("mu,R,B", [(6.84, 64, 64), (5.28, 64, 64), (CPU_MU, 64, 64), (6.84, 128, 32),
                                    (20.0, 16, 64), (1.5, 64, 16)])
def test_plan_is_a_rounded_optimum(mu, R, B):
    p = plan(mu, R, B, alpha=0.25, rho=0.05)
    s = power_law_noise(0.25)
    assert (p.x_star, p.y_star) == power_law_optimum(mu, 0.25, 0.05)
    assert p.method == "closed form" and p.mu == mu and p.alpha == 0.25 and p.rho == 0.05
    K = p.updates_per_step
    assert K >= 1 and p.capacity == max(round(p.x_star * R / K), R, B)  # x* counts learner updates
    assert p.x == K * p.capacity / R and p.y == K * B / R

    def cost(k):  # the design with k updates a round, by brute force
        n = max(round(p.x_star * R / k), R, B)
        return compute_to_target(mu, k * n / R, k * B / R, s, 0.05)

    assert p.updates_per_step == min(range(1, 200), key=cost)
    assert p.gamma == pytest.approx(predicted_gamma(mu, p.x, p.y, s, 0.05))
    assert p.gamma_star <= p.gamma * (1 + 1e-12)


def test_plan_by_hand():
    # mu 6.84: x* = 3.782 updates, y* = 4.664. K = 5 updates a round share its 64 rollouts, so a
    # rollout kept x* updates needs N = 3.782 x 64 / 5 = 48, raised to one batch (64): x = 5
    # updates, y = 5. (x* R = 242 would keep each rollout 19 updates.)
    p = plan(6.84, 64, 64)
    assert (p.capacity, p.updates_per_step, p.alpha, p.rho) == (64, 5, planner.DEFAULT_ALPHA, planner.DEFAULT_RHO)
    assert (p.x, p.y) == (5.0, 5.0)
    # R = 128, B = 32: K = 16 updates of 32 a round, N = 3.782 x 128 / 16 = 30 -> one batch
    p = plan(6.84, 128, 32)
    assert (p.capacity, p.updates_per_step, p.x, p.y) == (128, 16, 16.0, 4.0)
    # CPU mu 0.5: x* = 0.47 < 1, so N is raised to one batch; K = 1: on-policy
    p = plan(CPU_MU, 64, 64)
    assert (p.capacity, p.updates_per_step, p.x, p.y, p.gamma) == (64, 1, 1.0, 1.0, pytest.approx(1.0))


def test_plan_with_custom_noise_is_numerical():
    s = lambda x: 1.0 + 0.1 * x  # noqa: E731
    p = plan(6.84, 64, 64, s=s)
    x_num, y_num = numerical_optimum(6.84, s, planner.DEFAULT_RHO)
    assert (p.method, p.alpha, p.x_star, p.y_star) == ("numerical", None, x_num, y_num)
    assert p.capacity == max(round(x_num * 64 / p.updates_per_step), 64)
