"""The learner: one optimizer step of a registered objective on a minibatch of stored
rollouts.

It re-scores each rollout (prompt + completion tokens, as stored) under the current
weights at the generation temperature, and compares with the behaviour log-probs and the
frozen advantages stored with the rollout (LossInputs). AdamW with a constant learning
rate and global-norm gradient clipping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from replay_pipeline.objectives import OBJECTIVES, LossInputs, aggregate


@dataclass
class Batch:
    """A minibatch as tensors, right-padded; logits column t predicts token t + 1."""

    input_ids: torch.Tensor           # (B, L) prompt + completion, right-padded
    attention_mask: torch.Tensor      # (B, L)
    completion_mask: torch.Tensor     # (B, L-1) 1 where target token t+1 is a completion token
    behaviour_logprobs: torch.Tensor  # (B, L-1) aligned with completion_mask, 0 elsewhere
    advantages: torch.Tensor          # (B,)


def collate(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
            behaviour_logprobs: Sequence[Sequence[float]], advantages: Sequence[float],
            pad_id: int) -> Batch:
    rows = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
    width = max(len(r) for r in rows)
    b = len(rows)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width - 1), dtype=torch.float32)
    old = torch.zeros((b, width - 1), dtype=torch.float32)
    for i, (p, c, lp) in enumerate(zip(prompt_ids, completion_ids, behaviour_logprobs)):
        if len(lp) != len(c):
            raise ValueError(f"row {i}: {len(c)} completion tokens but {len(lp)} behaviour log-probs")
        n = len(p) + len(c)
        input_ids[i, :n] = torch.tensor(rows[i], dtype=torch.long)
        attention[i, :n] = 1
        # completion token k sits at column len(p)+k and is predicted by column len(p)+k-1
        mask[i, len(p) - 1:n - 1] = 1.0
        old[i, len(p) - 1:n - 1] = torch.tensor(list(lp), dtype=torch.float32)
    return Batch(input_ids, attention, mask, old, torch.tensor(list(advantages), dtype=torch.float32))


def token_logprobs_and_entropy(model, batch: Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L-1) log-probs of each next token and entropy of each next-token distribution."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logits = logits[:, :-1].float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    targets = batch.input_ids[:, 1:].unsqueeze(-1)
    logp = logp_all.gather(-1, targets).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


class Learner:
    def __init__(self, model, *, objective: str = "grpo_clip", lr: float = 3e-5,
                 eps_low: float = 0.2, eps_high: float = 0.2, loss_agg: str = "token_mean",
                 max_grad_norm: float = 1.0, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), temperature: float = 1.0,
                 pad_id: int = 0):
        if objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {objective!r}; known: {sorted(OBJECTIVES)}")
        self.model = model
        self.model.train()
        self.objective = OBJECTIVES[objective]
        self.objective_kwargs = dict(eps_low=eps_low, eps_high=eps_high)
        self.loss_agg = loss_agg
        self.max_grad_norm = max_grad_norm
        self.temperature = temperature
        self.pad_id = pad_id
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas,
                                           weight_decay=weight_decay)
        self.steps = 0

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def step(self, rows: Mapping[str, Sequence[Any]]) -> dict[str, float]:
        """One optimizer step on a minibatch given as columns of stored rollouts."""
        batch = collate(rows["prompt_ids"], rows["completion_ids"], rows["behaviour_logprobs"],
                        rows["advantage"], self.pad_id)
        logp, entropy = token_logprobs_and_entropy(self.model, batch, self.temperature)
        out = self.objective(LossInputs(logp, batch.behaviour_logprobs, batch.advantages,
                                        batch.completion_mask), **self.objective_kwargs)
        loss = aggregate(out.per_token, batch.completion_mask, self.loss_agg)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm_cap = self.max_grad_norm if self.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), norm_cap)
        self.optimizer.step()
        self.steps += 1
        m = batch.completion_mask
        tokens = m.sum().clamp_min(1.0)
        ratio = out.ratio
        return {
            "loss": float(loss.detach()),
            "clip_frac": float((out.clipped.float() * m).sum() / tokens),
            "entropy": float((entropy * m).sum() / tokens),
            "ratio_mean": float((ratio * m).sum() / tokens),
            "ratio_max": float((ratio * m + (m - 1) * 1e9).max()),
            "grad_norm": float(grad_norm),
            "tokens": float(m.sum()),
            "advantage_abs_mean": float(batch.advantages.abs().mean()),
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Weights to publish to the generator (detached copies, safe to load elsewhere)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
