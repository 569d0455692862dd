"""alpha and rho recovered from synthetic gradients with known values (replay_pipeline/algo/noise.py)."""

import numpy as np
import pytest

from replay_pipeline.algo.noise import fit_alpha, fit_rho, noise_variance


def test_noise_variance_is_the_trace_of_the_unbiased_covariance():
    g = np.asarray([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0], [2.0, 2.0]])  # each coordinate: var 4/3
    assert noise_variance(g) == pytest.approx(8 / 3)
    with pytest.raises(ValueError, match="at least two"):
        noise_variance(g[:1])


@pytest.mark.parametrize("alpha", [0.1, 0.25, 0.4])
def test_alpha_is_half_the_log_log_slope_of_the_variance(alpha):
    rng = np.random.default_rng(1)
    d, n, tau = 64, 400, 2.0
    levels = {x: rng.normal(size=(n, d)) * np.sqrt((x / tau) ** (2 * alpha) / d) + 5.0 for x in (1, 2, 4, 8, 16)}
    levels[0] = rng.normal(size=(n, d))  # x = 0 has no power-law value: left out of the fit
    est = fit_alpha(levels)
    assert est.value == pytest.approx(alpha, abs=0.03)
    assert est.low < alpha < est.high and est.high - est.low < 0.1
    assert set(est.points) == {"1", "2", "4", "8", "16"}


@pytest.mark.parametrize("rho", [0.0, 0.05, 0.2])
def test_rho_is_the_share_of_the_variance_a_batch_has_in_common(rho):
    rng = np.random.default_rng(2)
    d, batches, size, s = 32, 300, 16, 1.0
    shared = rng.normal(size=(batches, 1, d)) * np.sqrt(rho * s / d)
    own = rng.normal(size=(batches, size, d)) * np.sqrt((1 - rho) * s / d)
    est = fit_rho(list(shared + own + 3.0))
    assert est.value == pytest.approx(rho, abs=0.03)
    assert est.low - 0.01 <= rho <= est.high + 0.01


def test_too_little_data_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="two or more staleness levels"):
        fit_alpha({1: np.zeros((4, 3))})
    with pytest.raises(ValueError, match="three or more batches"):
        fit_rho([np.zeros((4, 3))] * 2)
