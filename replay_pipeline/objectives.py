"""Policy objectives on replayed rollouts: pure functions over tensors, in a registry.

Each objective takes a ``LossInputs`` and returns the per-token loss (to be minimised)
before aggregation, plus diagnostics. Aggregation (token mean or sequence mean) is a
separate function so that every objective shares it.

Conventions, as in the paper: behaviour log-probs (pi_old) and advantages are computed
once, at generation, stored with the rollout, and never recomputed when it is replayed.
"""

from __future__ import annotations

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


@dataclass
class LossOutput:
    per_token: Tensor           # (B, T) loss per token (masked positions are ignored later)
    clipped: Tensor             # (B, T) bool, the token's gradient was cut by the clip
    ratio: Tensor               # (B, T) pi_theta / pi_old (detached)


def grpo_clip(inputs: LossInputs, eps_low: float = 0.2, eps_high: float = 0.2) -> LossOutput:
    """GRPO clipped-ratio surrogate (PPO-clip with group-normalised advantages), no KL.

    per-token loss = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A),
    r = exp(logprob - behaviour_logprob), A the rollout's frozen advantage.

    Departure from GRPO as first published: no KL term to a reference (the paper's setting,
    eps_low = eps_high = 0.2), and pi_old is the *behaviour* policy stored with the rollout,
    which can be many versions old under replay, not the policy of the previous step.
    """
    log_ratio = inputs.logprobs - inputs.behaviour_logprobs          # (B, T)
    ratio = torch.exp(log_ratio)                                      # (B, T)
    adv = inputs.advantages.unsqueeze(-1)                             # (B, 1)
    unclipped = ratio * adv
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    clipped = clipped_ratio * adv
    per_token = -torch.minimum(unclipped, clipped)
    # The gradient is zero where the clipped branch is the smaller one and actually clipped.
    was_clipped = (clipped < unclipped) & (clipped_ratio != ratio)
    return LossOutput(per_token=per_token, clipped=was_clipped, ratio=ratio.detach())


OBJECTIVES: dict[str, Callable[..., LossOutput]] = {
    "grpo_clip": grpo_clip,
}


def aggregate(per_token: Tensor, mask: Tensor, mode: str = "token_mean") -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar.

    token_mean: sum over all completion tokens of the minibatch / their count (DAPO-style;
    every token weighs the same, long completions weigh more).
    seq_mean: mean over tokens within each sequence, then mean over sequences (GRPO-style).
    """
    mask = mask.to(per_token.dtype)
    if mode == "token_mean":
        return (per_token * mask).sum() / mask.sum().clamp_min(1.0)
    if mode == "seq_mean":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
        return per_seq.mean()
    raise ValueError(f"unknown loss aggregation {mode!r}; use 'token_mean' or 'seq_mean'")
