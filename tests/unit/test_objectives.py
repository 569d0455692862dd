"""Objectives (grpo_clip, asymre, tis, topr), the KL penalty and aggregation, with
values and gradients worked by hand."""

import math

import pytest
import torch

from replay_pipeline.algo.objectives import (OBJECTIVES, LossInputs, aggregate, asymre, get_objective,
                                        grpo_clip, kl_penalty, objective_param_names, tis, topr)


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


# --- the off-policy objectives: asymre, tis, topr; the KL penalty; the registry ----------


def _asym_inputs(logp, rewards, group_mean, old=None):
    inp, leaf = _inputs(logp, logp if old is None else old, [0.0] * len(logp))
    inp.rewards = torch.tensor(rewards, dtype=torch.float32)
    inp.group_reward_mean = torch.tensor(group_mean, dtype=torch.float32)
    return inp, leaf


def test_tis_ratio_below_cap_weights_reinforce_by_the_ratio():
    # ratio = e^(-1 - -1.5) = e^0.5 = 1.6487 < c = 2; A = 1
    # loss = -1.6487 * 1 * (-1) = 1.6487; d loss / d logp = -1.6487 (weight is detached)
    inp, logp = _inputs([[-1.0]], [[-1.5]], [1.0])
    out = tis(inp, tis_cap=2.0)
    loss = aggregate(out.per_token, inp.mask)
    assert loss.item() == pytest.approx(math.exp(0.5), rel=1e-6)
    loss.backward()
    assert logp.grad.item() == pytest.approx(-math.exp(0.5), rel=1e-6)
    assert not out.clipped.any()


@pytest.mark.parametrize("adv", [1.5, -1.5])
def test_tis_ratio_above_cap_is_truncated_to_c_and_keeps_gradient(adv):
    # ratio = e^(0 - -1) = e = 2.718 > c = 2 -> weight 2; logp = 0 so loss = -2 * A * 0 = 0
    # d loss / d logp = -c * A = -3 for A = 1.5, +3 for A = -1.5 (still a gradient, unlike grpo_clip)
    inp, logp = _inputs([[0.0]], [[-1.0]], [adv])
    out = tis(inp, tis_cap=2.0)
    loss = aggregate(out.per_token, inp.mask)
    assert loss.item() == pytest.approx(0.0, abs=1e-7)
    loss.backward()
    assert logp.grad.item() == pytest.approx(-2.0 * adv)
    assert out.clipped.all()
    assert out.ratio.item() == pytest.approx(math.e)  # the reported ratio is not truncated


def test_topr_positive_is_unweighted_even_with_ratio_above_one():
    # A = +1, ratio = e: weight 1 -> loss = -1 * 1 * logp; logp = [-0.5] -> loss 0.5, grad -1
    inp, logp = _inputs([[-0.5]], [[-1.5]], [1.0])
    out = topr(inp)
    loss = aggregate(out.per_token, inp.mask)
    assert loss.item() == pytest.approx(0.5)
    loss.backward()
    assert logp.grad.item() == pytest.approx(-1.0)
    assert not out.clipped.any()


def test_topr_negative_with_ratio_above_one_has_weight_one():
    # A = -2, ratio = e > 1 -> weight clip(e, 0, 1) = 1 (truncated)
    # loss = -1 * (-2) * (-0.5) = -1; d loss / d logp = -w * A = +2 (pushes the token down)
    inp, logp = _inputs([[-0.5]], [[-1.5]], [-2.0])
    out = topr(inp)
    loss = aggregate(out.per_token, inp.mask)
    assert loss.item() == pytest.approx(-1.0)
    loss.backward()
    assert logp.grad.item() == pytest.approx(2.0)
    assert out.clipped.all()


def test_topr_negative_with_ratio_below_one_is_weighted_by_the_ratio():
    # A = -2, ratio = e^(-2 - -1) = e^-1 = 0.3679 -> weight 0.3679
    # loss = -0.3679 * (-2) * (-2) = -1.4715; d loss / d logp = -0.3679 * -2 = +0.7358
    inp, logp = _inputs([[-2.0]], [[-1.0]], [-2.0])
    out = topr(inp)
    loss = aggregate(out.per_token, inp.mask)
    assert loss.item() == pytest.approx(-4 * math.exp(-1), rel=1e-6)
    loss.backward()
    assert logp.grad.item() == pytest.approx(2 * math.exp(-1), rel=1e-6)
    assert not out.clipped.any()


def test_asymre_all_correct_group_still_gets_a_positive_push():
    # r = 1, V_hat = 1, dV = -0.1 -> coefficient r - (V + dV) = 0.1
    # per token -0.1 * logp = [0.05, 0.15]; token mean 0.1; grad -0.1 / 2 tokens = -0.05 each
    inp, logp = _asym_inputs([[-0.5, -1.5]], [1.0], [1.0])
    out = asymre(inp, delta_v=-0.1)
    loss = aggregate(out.per_token, inp.mask)
    assert loss.item() == pytest.approx(0.1)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.05, -0.05]]))
    assert not out.clipped.any()


def test_asymre_delta_v_shifts_the_baseline():
    # rollout 0 wrong: r = 0, V = 0.5 -> coef 0 - 0.4 = -0.4, grad +0.4 / 2 rollouts = +0.2
    # rollout 1 right: r = 1, V = 0.5 -> coef 1 - 0.4 = +0.6, grad -0.6 / 2 = -0.3
    inp, logp = _asym_inputs([[-1.0], [-1.0]], [0.0, 1.0], [0.5, 0.5])
    aggregate(asymre(inp, delta_v=-0.1).per_token, inp.mask).backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.2], [-0.3]]))
    # delta_v = 0: the plain group-mean baseline; an all-correct group gets no gradient
    inp, logp = _asym_inputs([[-1.0]], [1.0], [1.0])
    aggregate(asymre(inp, delta_v=0.0).per_token, inp.mask).backward()
    assert logp.grad.item() == 0.0


def test_asymre_ignores_the_ratio_and_needs_rewards():
    # no importance ratio: the same loss on-policy and with a behaviour log-prob far away
    on, _ = _asym_inputs([[-1.0]], [1.0], [0.25])
    off, _ = _asym_inputs([[-1.0]], [1.0], [0.25], old=[[-3.0]])
    assert asymre(on).per_token.item() == pytest.approx(asymre(off).per_token.item())
    assert asymre(off).ratio.item() == pytest.approx(math.exp(2.0))
    inp, _ = _inputs([[-1.0]], [[-1.0]], [1.0])
    with pytest.raises(ValueError, match="group_reward_mean"):
        asymre(inp)


@pytest.mark.parametrize("name", ["grpo_clip", "tis", "topr"])
def test_ratio_objectives_on_policy_are_reinforce(name):
    # ratio = 1: every ratio-based objective's gradient is -A / tokens per token
    inp, logp = _inputs([[-1.0, -2.0], [-0.5, -0.1]], [[-1.0, -2.0], [-0.5, -0.1]], [0.8, -0.4])
    out = OBJECTIVES[name](inp)
    aggregate(out.per_token, inp.mask).backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.2, -0.2], [0.1, 0.1]]))
    assert not out.clipped.any()


def test_empty_completions_add_nothing_and_an_all_empty_minibatch_is_zero_not_nan():
    # row 0 has 2 tokens, row 1 none (an empty completion), row 2 one token
    per_token = torch.tensor([[1.0, 5.0, 7.0], [9.0, 9.0, 9.0], [2.0, 4.0, 4.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    # token mean (1 + 5 + 2) / 3; seq mean over the two non-empty rows ((1 + 5) / 2 + 2) / 2
    assert aggregate(per_token, mask, "token_mean").item() == pytest.approx(8 / 3)
    assert aggregate(per_token, mask, "seq_mean").item() == pytest.approx(2.5)
    # a non-finite value at a masked position does not reach the loss value
    poisoned = per_token.detach().clone()
    poisoned[1] = float("inf")
    poisoned[0, 2] = float("nan")
    for mode in ("token_mean", "seq_mean"):
        assert aggregate(poisoned, mask, mode).item() == pytest.approx(8 / 3 if mode == "token_mean" else 2.5)
        loss = aggregate(per_token, torch.zeros_like(mask), mode)
        assert loss.item() == 0.0
        loss.backward()
        assert torch.equal(per_token.grad, torch.zeros_like(per_token))
        per_token.grad = None


def test_token_mean_and_seq_mean_weigh_long_completions_differently():
    # two completions, 3 tokens and 1 token, A = 1, on-policy tis (REINFORCE):
    # token_mean: each of 4 tokens gets -1/4; seq_mean: -1/(2*3) on the long one, -1/2 on the short
    mask = [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    for mode, expected in [("token_mean", [[-0.25] * 3, [-0.25, 0, 0]]),
                           ("seq_mean", [[-1 / 6] * 3, [-0.5, 0, 0]])]:
        inp, logp = _inputs([[-1.0] * 3] * 2, [[-1.0] * 3] * 2, [1.0, 1.0], mask)
        aggregate(tis(inp).per_token, inp.mask, mode).backward()
        assert torch.allclose(logp.grad, torch.tensor(expected)), mode


def test_kl_penalty_zero_when_equal_positive_otherwise_and_pulls_towards_reference():
    logp = torch.tensor([[-1.0, 0.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0, 0.0]])
    kl = kl_penalty(logp, ref)
    # d = ref - logp = [0, -1, 1]; k3 = e^d - d - 1 = [0, e^-1 = 0.3679, e - 2 = 0.7183]
    assert torch.allclose(kl.detach(), torch.tensor([[0.0, math.exp(-1), math.e - 2]]))
    kl.sum().backward()
    # d k3 / d logp = 1 - e^d = [0, 0.632 (> 0: logp above ref is pushed down), 1 - e (< 0)]
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 1 - math.exp(-1), 1 - math.e]]))


def test_registry_objectives_document_themselves_and_declare_params():
    assert set(OBJECTIVES) == {"grpo_clip", "asymre", "tis", "topr"}
    assert {n: objective_param_names(fn) for n, fn in OBJECTIVES.items()} == {
        "grpo_clip": ("eps_low", "eps_high"), "asymre": ("delta_v",), "tis": ("tis_cap",),
        "topr": ()}
    for name, fn in OBJECTIVES.items():
        assert fn.__doc__ and "per-token loss =" in fn.__doc__, name  # the formula is stated
    with pytest.raises(ValueError, match=r"unknown objective 'ppo'.*asymre.*grpo_clip.*tis.*topr"):
        get_objective("ppo")
