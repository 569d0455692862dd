"""GRPO clipped objective and aggregation, with numbers worked by hand."""

import math

import pytest
import torch

from replay_pipeline.objectives import LossInputs, aggregate, grpo_clip


def _inputs(logp, old, adv, mask=None):
    logp = torch.tensor(logp, dtype=torch.float32, requires_grad=True)
    old = torch.tensor(old, dtype=torch.float32)
    mask = torch.ones_like(old) if mask is None else torch.tensor(mask, dtype=torch.float32)
    return LossInputs(logp, old, torch.tensor(adv, dtype=torch.float32), mask), logp


def test_on_policy_ratio_one_gives_minus_advantage_and_reinforce_gradient():
    # ratio = 1 everywhere; loss per token = -A; d loss / d logp = -A (REINFORCE)
    inp, logp = _inputs([[-1.0, -2.0]], [[-1.0, -2.0]], [0.5])
    out = grpo_clip(inp)
    loss = aggregate(out.per_token, inp.mask)
    assert loss.item() == pytest.approx(-0.5)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, -0.25]]))  # -A / 2 tokens
    assert not out.clipped.any()


def test_positive_advantage_ratio_above_upper_clip_is_clipped_with_zero_gradient():
    # ratio = e (logp - old = 1) > 1.2; A = +1: min(e*1, 1.2*1) = 1.2 -> loss -1.2, no gradient
    inp, logp = _inputs([[0.0]], [[-1.0]], [1.0])
    out = grpo_clip(inp, eps_low=0.2, eps_high=0.2)
    loss = aggregate(out.per_token, inp.mask)
    assert loss.item() == pytest.approx(-1.2)
    loss.backward()
    assert logp.grad.item() == 0.0
    assert out.clipped.all()
    assert out.ratio.item() == pytest.approx(math.e)


def test_negative_advantage_ratio_above_clip_keeps_gradient():
    # ratio = e, A = -1: min(-e, -1.2) = -e -> loss = e, gradient d(e^x)/dx = e (pessimistic branch)
    inp, logp = _inputs([[0.0]], [[-1.0]], [-1.0])
    out = grpo_clip(inp)
    loss = aggregate(out.per_token, inp.mask)
    assert loss.item() == pytest.approx(math.e, rel=1e-6)
    loss.backward()
    assert logp.grad.item() == pytest.approx(math.e, rel=1e-6)
    assert not out.clipped.any()


def test_negative_advantage_ratio_below_lower_clip_is_clipped():
    # ratio = e^-1 = 0.368 < 0.8, A = -2: min(-0.736, -1.6) = -1.6 -> loss 1.6, no gradient
    inp, logp = _inputs([[-2.0]], [[-1.0]], [-2.0])
    out = grpo_clip(inp)
    loss = aggregate(out.per_token, inp.mask)
    assert loss.item() == pytest.approx(1.6)
    loss.backward()
    assert logp.grad.item() == 0.0
    assert out.clipped.all()


def test_asymmetric_eps():
    # ratio = e^0.25 = 1.284; eps_high = 0.3 -> not clipped, loss = -1.284
    inp, _ = _inputs([[0.25]], [[0.0]], [1.0])
    out = grpo_clip(inp, eps_low=0.2, eps_high=0.3)
    assert out.per_token.item() == pytest.approx(-math.exp(0.25))
    assert not out.clipped.any()


def test_token_mean_vs_seq_mean_and_mask():
    per_token = torch.tensor([[1.0, 3.0, 100.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # token mean: (1 + 3 + 2) / 3 = 2 (the masked 100 is ignored)
    assert aggregate(per_token, mask, "token_mean").item() == pytest.approx(2.0)
    per_token2 = torch.tensor([[1.0, 5.0, 100.0], [2.0, 0.0, 0.0]])
    # token mean (1+5+2)/3 = 2.667; seq mean ((1+5)/2 + 2)/2 = 2.5
    assert aggregate(per_token2, mask, "token_mean").item() == pytest.approx(8 / 3)
    assert aggregate(per_token2, mask, "seq_mean").item() == pytest.approx(2.5)
    with pytest.raises(ValueError, match="token_mean"):
        aggregate(per_token, mask, "bogus")
