"""Group-normalised advantages, worked by hand."""

import math

import numpy as np
import pytest

from replay_pipeline.scoring import group_advantages, safe_reward


def test_group_advantages_by_hand():
    # group [1, 0, 0, 0]: mean 0.25, population std sqrt(0.1875) = 0.4330
    adv = group_advantages([1, 0, 0, 0, 0, 1, 1, 0], group_size=4)
    s = math.sqrt(0.1875)
    np.testing.assert_allclose(adv[:4], [0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s], rtol=1e-5)
    # group [0, 1, 1, 0]: mean 0.5, std 0.5 -> [-1, 1, 1, -1]
    np.testing.assert_allclose(adv[4:], [-1, 1, 1, -1], rtol=1e-5)


def test_equal_rewards_give_zero_advantage():
    adv = group_advantages([1, 1, 1, 0, 0, 0], group_size=3)
    assert np.all(adv == 0.0)


def test_advantages_sum_to_zero_per_group():
    rng = np.random.default_rng(0)
    r = rng.random(64)
    adv = group_advantages(r, 8).reshape(8, 8)
    np.testing.assert_allclose(adv.sum(1), 0.0, atol=1e-5)
    np.testing.assert_allclose(adv.std(1), 1.0, atol=1e-4)


def test_bad_layout_raises():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages([1, 0, 1], 4)


def test_safe_reward_flags_raise_and_nan():
    assert safe_reward(lambda: 1.0) == (1.0, True)
    assert safe_reward(lambda: float("nan")) == (0.0, False)
    assert safe_reward(lambda: float("inf")) == (0.0, False)

    def boom():
        raise RuntimeError("verifier crashed")

    assert safe_reward(boom) == (0.0, False)
