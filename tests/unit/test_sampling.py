"""Minibatch draws from the window, checked on their statistics."""

import numpy as np
import pytest

from replay_pipeline.buffer.sampling import SAMPLERS, fresh, uniform, window_for


def test_uniform_is_uniform_with_replacement():
    rng = np.random.default_rng(0)
    n, b, k = 50, 64, 500
    draws = np.concatenate(uniform(n, b, k, rng))
    assert draws.min() >= 0 and draws.max() < n
    counts = np.bincount(draws, minlength=n)
    expected = b * k / n
    # chi-square with 49 dof: 99.9% quantile ~ 85
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 85, chi2
    # with replacement: some minibatch of 64 from 50 must repeat an index
    assert any(len(np.unique(mb)) < b for mb in uniform(n, b, 10, rng))


def test_uniform_is_deterministic_given_seed():
    a = uniform(100, 8, 3, np.random.default_rng(7))
    b = uniform(100, 8, 3, np.random.default_rng(7))
    assert all((x == y).all() for x, y in zip(a, b))


def test_fresh_uses_every_rollout_exactly_once():
    mbs = fresh(64, 16, 4, np.random.default_rng(1))
    assert len(mbs) == 4 and all(len(m) == 16 for m in mbs)
    assert sorted(np.concatenate(mbs).tolist()) == list(range(64))


def test_fresh_rejects_too_small_window():
    with pytest.raises(ValueError, match="disjoint minibatches"):
        fresh(32, 16, 4, np.random.default_rng(1))


def test_empty_window_raises():
    with pytest.raises(ValueError, match="empty window"):
        uniform(0, 4, 1, np.random.default_rng(0))


def test_registry_and_window_size():
    assert set(SAMPLERS) >= {"uniform", "fresh"}
    assert window_for("uniform", 128, 64) == 128
    assert window_for("fresh", 128, 64) == 64
