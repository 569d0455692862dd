"""Policy objectives on replayed rollouts: pure functions over tensors, in a registry.

Each objective is ``fn(inputs: LossInputs, **params) -> LossOutput``: the per-token loss (to
be minimised) before aggregation, which tokens had their weight clipped or truncated, and the
importance ratio pi_theta / pi_behaviour. Its hyper-parameters are its own named keyword
arguments (``objective_param_names`` reads them off the signature), so the learner passes each
objective only what it declares and adding an objective is a function, a registry entry and a
test. Aggregation (token mean or sequence mean) and the KL penalty to a reference are separate
functions shared by every objective.

Conventions, as in the paper: behaviour log-probs (pi_old) and advantages are computed
once, at generation, stored with the rollout, and never recomputed when it is replayed.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


@dataclass
class LossInputs:
    logprobs: Tensor            # (B, T) log pi_theta(token) under the current policy
    behaviour_logprobs: Tensor  # (B, T) stored with the rollout (policy that generated it)
    advantages: Tensor          # (B,)   frozen at generation
    mask: Tensor                # (B, T) 1.0 on completion tokens, 0.0 on padding
    rewards: Tensor | None = None            # (B,) reward of each rollout (asymre)
    group_reward_mean: Tensor | None = None  # (B,) mean reward of its group, stored at generation


@dataclass
class LossOutput:
    per_token: Tensor           # (B, T) loss per token (masked positions are ignored later)
    clipped: Tensor             # (B, T) bool, the token's weight was clipped / truncated
    ratio: Tensor               # (B, T) pi_theta / pi_old (detached)


# A weight counts as truncated only when truncation cuts it by more than this (relative).
# On-policy ratios sit at 1 up to float noise from re-scoring (~1e-6), exactly where topr's
# cap is; without a tolerance that noise would read as "half the negatives truncated".
TRUNCATION_TOL = 1e-4


def _ratio(inputs: LossInputs) -> Tensor:
    return torch.exp(inputs.logprobs - inputs.behaviour_logprobs)   # (B, T)


def grpo_clip(inputs: LossInputs, eps_low: float = 0.2, eps_high: float = 0.2) -> LossOutput:
    """GRPO clipped-ratio surrogate (PPO-clip with group-normalised advantages), no KL.

    per-token loss = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A),
    r = exp(logprob - behaviour_logprob), A the rollout's frozen advantage.
    `clipped`: the clipped branch is the smaller one and actually clips (zero gradient).

    Departure from GRPO as first published: no KL term to a reference (the paper's setting,
    eps_low = eps_high = 0.2; the learner's optional `kl_coef` adds one), and pi_old is the
    *behaviour* policy stored with the rollout, which can be many versions old under replay,
    not the policy of the previous step.
    """
    ratio = _ratio(inputs)                                            # (B, T)
    adv = inputs.advantages.unsqueeze(-1)                             # (B, 1)
    unclipped = ratio * adv
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    clipped = clipped_ratio * adv
    per_token = -torch.minimum(unclipped, clipped)
    # The gradient is zero where the clipped branch is the smaller one and actually clipped.
    was_clipped = (clipped < unclipped) & (clipped_ratio != ratio)
    return LossOutput(per_token=per_token, clipped=was_clipped, ratio=ratio.detach())


def asymre(inputs: LossInputs, delta_v: float = -0.1) -> LossOutput:
    """Asymmetric REINFORCE (AsymRE): REINFORCE with a baseline shifted below the group mean.

    per-token loss = -(r - (V_hat + delta_v)) * logprob,
    r the rollout's reward, V_hat its group's mean reward (stored at generation), delta_v < 0.
    No importance ratio: `clipped` is all False; `ratio` is reported for diagnostics only.
    With delta_v = -0.1 a group whose rollouts are all correct (r = V_hat = 1) still gets a
    push of +0.1 on each, which keeps off-policy REINFORCE from collapsing.

    Departures from the paper's J = E[(1/G) sum_i (r_i - (V_hat + dV)) log pi(z_i | q)]:
    1. V_hat is the mean over the whole group as generated, stored with the rollout, so a
       replayed rollout keeps its group's baseline even when the minibatch holds only part
       of the group.
    2. log pi(z_i | q) is a sum over tokens; here the loss is per token and `aggregate`
       reduces it (token_mean divides by the minibatch's token count, seq_mean by each
       completion's length), which rescales the gradient as the learning rate would.
    """
    if inputs.rewards is None or inputs.group_reward_mean is None:
        raise ValueError("asymre needs LossInputs.rewards and LossInputs.group_reward_mean; "
                         "pass the rollouts' `reward` and `group_reward_mean` columns")
    coef = inputs.rewards - (inputs.group_reward_mean + delta_v)     # (B,)
    per_token = -coef.unsqueeze(-1) * inputs.logprobs                # (B, T)
    clipped = torch.zeros_like(inputs.logprobs, dtype=torch.bool)
    return LossOutput(per_token=per_token, clipped=clipped, ratio=_ratio(inputs).detach())


def tis(inputs: LossInputs, tis_cap: float = 2.0) -> LossOutput:
    """Truncated importance sampling (TIS): REINFORCE weighted by the truncated ratio.

    per-token loss = -sg(min(r, c)) * A * logprob,   r = exp(logprob - behaviour_logprob),
    c = tis_cap, sg = stop-gradient. Gradient per token: -min(r, c) * A * d logprob.
    `clipped`: r > c (the weight was truncated to c; beyond TRUNCATION_TOL).

    As in the TIS literature, the truncation is on the detached weight: the weight scales
    the REINFORCE gradient but is not itself differentiated (unlike grpo_clip, whose ratio
    carries the gradient), so a truncated token still gets a gradient, c * A. Here r is the
    per-token ratio to the stored behaviour policy, so it covers replay staleness as well as
    any generator / learner numerical mismatch.
    """
    ratio = _ratio(inputs).detach()                                   # (B, T)
    weight = torch.clamp(ratio, max=tis_cap)
    adv = inputs.advantages.unsqueeze(-1)                             # (B, 1)
    per_token = -weight * adv * inputs.logprobs
    return LossOutput(per_token=per_token, clipped=ratio > tis_cap * (1 + TRUNCATION_TOL),
                      ratio=ratio)


def topr(inputs: LossInputs) -> LossOutput:
    """Tapered off-policy REINFORCE (TOPR).

    per-token loss = -w * A * logprob, w = 1 if A > 0, else sg(clip(r, 0, 1)),
    r = exp(logprob - behaviour_logprob). Positives get an unweighted (SFT-like) REINFORCE
    push; negatives are down-weighted by the truncated ratio, so tokens the current policy
    already makes less likely than the behaviour policy did are pushed down less.
    `clipped`: a negative token with r > 1 (its weight was truncated to 1; beyond
    TRUNCATION_TOL, so float noise on-policy does not count).

    Departure from the TOPR paper: positive / negative is the sign of the stored
    group-normalised advantage A (A = 0 contributes nothing either way), not of the raw
    reward, and the update is scaled by A rather than by the reward.
    """
    ratio = _ratio(inputs).detach()                                   # (B, T)
    adv = inputs.advantages.unsqueeze(-1)                             # (B, 1)
    negative = (adv < 0).expand_as(ratio)
    weight = torch.where(negative, torch.clamp(ratio, 0.0, 1.0), torch.ones_like(ratio))
    per_token = -weight * adv * inputs.logprobs
    truncated = negative & (ratio > 1.0 + TRUNCATION_TOL)
    return LossOutput(per_token=per_token, clipped=truncated, ratio=ratio)


OBJECTIVES: dict[str, Callable[..., LossOutput]] = {
    "grpo_clip": grpo_clip,
    "asymre": asymre,
    "tis": tis,
    "topr": topr,
}


def get_objective(name: str) -> Callable[..., LossOutput]:
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; known: {sorted(OBJECTIVES)}")
    return OBJECTIVES[name]


def objective_param_names(fn: Callable[..., LossOutput]) -> tuple[str, ...]:
    """The hyper-parameters an objective declares: its arguments after `inputs`."""
    return tuple(list(inspect.signature(fn).parameters)[1:])


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref), (B, T):

    exp(ref - logp) - (ref - logp) - 1, >= 0 and 0 where logp == ref.
    Gradient d/d logp = 1 - exp(ref - logp): positive where logp > ref, so minimising it
    pulls logp back towards the reference. The tokens come from the behaviour policy, not
    pi_theta, so under replay this is GRPO's (biased) estimator, as in GRPO itself.
    """
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def aggregate(per_token: Tensor, mask: Tensor, mode: str = "token_mean") -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar.

    token_mean: sum over all completion tokens of the minibatch / their count (DAPO-style;
    every token weighs the same, long completions weigh more).
    seq_mean: mean over tokens within each sequence, then mean over sequences (GRPO-style).

    Empty completions (a row whose mask is all 0) have no tokens to learn from: they add
    nothing to either sum and seq_mean leaves them out of its count of sequences (counting
    them would shrink the step by the fraction of empty rows). A minibatch with no completion
    token at all gives 0 (with a zero gradient), never 0/0. Masked positions are selected
    out, not multiplied by 0, so a non-finite value there (e.g. a KL term on a padding
    position) cannot leak into the loss value (the learner also keeps such values out of
    the gradient by zeroing its log-probs at masked positions).
    """
    mask = mask.to(per_token.dtype)
    kept = torch.where(mask > 0, per_token * mask, torch.zeros_like(per_token))
    if mode == "token_mean":
        return kept.sum() / mask.sum().clamp_min(1.0)
    if mode == "seq_mean":
        lengths = mask.sum(-1)
        per_seq = kept.sum(-1) / lengths.clamp_min(1.0)
        return per_seq.sum() / (lengths > 0).sum().clamp_min(1).to(per_token.dtype)
    raise ValueError(f"unknown loss aggregation {mode!r}; use 'token_mean' or 'seq_mean'")
