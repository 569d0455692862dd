"""Adaptive reuse: how many learner updates a round takes, decided from measured signals.

The paper fixes the replay ratio for a whole run (K = loop.updates_per_step updates of B
rollouts per round). With `reuse.rule` other than `fixed`, a round instead draws up to
`reuse.max_updates` minibatches and takes them one by one; before each candidate update is
applied, the rule looks at that update's own diagnostics (computed by the learner's forward and
backward pass, replay_pipeline/training/learner.py) against those of the updates already applied in the
round, and either lets it through or ends the round. A refused update is not applied (no
optimizer step, no usage record); its forward and backward pass still counts as training
compute. The first `reuse.min_updates` updates are always applied.

Rules (each a pure function of the round's diagnostics, hand-worked in tests/unit/test_reuse.py):

* ``grad_spike`` (after DGG, "When to Stop Reusing", arXiv 2605.19425): the gradient norm of a
  watched parameter group (`reuse.group`, default the output embedding, DGG's output layer)
  jumps above `reuse.spike_factor` x the mean of the applied updates' norms in this round. A
  spike says the minibatch's gradient no longer agrees with the ones the round started from:
  the policy has moved far enough from the data's behaviour policy that more reuse adds noise.
  The baseline is the round's own (its first update is always on the freshest data), so the
  rule carries no state across rounds and a resumed run decides exactly as the stopped one.
* ``kl_budget``: the candidate minibatch's KL(behaviour || current) (the k3 estimator, averaged
  over completion tokens) is above `reuse.kl_budget`: its rollouts are too far off-policy.
* ``clip_budget``: the candidate's clipped (or truncated) token fraction is above
  `reuse.clip_budget`: most of its tokens would no longer move the policy.
* ``fixed``: every drawn update is applied (the paper's fixed K; the default).

Each round logs how many updates it took (`reuse/updates`), whether the rule stopped it
(`reuse/stopped_by_rule`: 1) or it took every drawn update (0: the cap), and the tokens of the
refused update (`reuse/refused_tokens`, counted as training compute); the rule's reason, with
the value and the threshold, is kept on the run (`TrainingRun.last_stop_reason`). The usage
table stays the record of which rollout each applied update used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: The rules `reuse.rule` may name.
RULES = ("fixed", "grad_spike", "kl_budget", "clip_budget")
#: The diagnostic each rule reads (a key of the learner's per-update metrics).
SIGNALS = {"grad_spike": "group_grad_norm", "kl_budget": "kl_behaviour_k3", "clip_budget": "clip_frac"}


@dataclass(frozen=True)
class ReusePolicy:
    """The `reuse` section as the rules read it."""
    rule: str = "fixed"
    max_updates: int = 8
    min_updates: int = 1
    spike_factor: float = 2.0
    kl_budget: float = 0.02
    clip_budget: float = 0.2

    @property
    def adaptive(self) -> bool:
        return self.rule != "fixed"


def grad_spike(applied: Sequence[float], candidate: float, factor: float) -> str | None:
    """Stop if the candidate's watched-group gradient norm exceeds `factor` x the mean norm of
    the updates applied so far in the round (None: apply it)."""
    if not applied:
        return None
    baseline = sum(applied) / len(applied)
    if candidate > factor * baseline:
        return f"grad_spike: gradient norm {candidate:.4g} > {factor:g} x the round's mean {baseline:.4g}"
    return None


def kl_budget(candidate: float, budget: float) -> str | None:
    """Stop if the candidate minibatch's KL(behaviour || current) exceeds `budget`."""
    if candidate > budget:
        return f"kl_budget: KL(behaviour || current) {candidate:.4g} > {budget:g}"
    return None


def clip_budget(candidate: float, budget: float) -> str | None:
    """Stop if the candidate's clipped token fraction exceeds `budget`."""
    if candidate > budget:
        return f"clip_budget: clipped token fraction {candidate:.4g} > {budget:g}"
    return None


def stop_reason(policy: ReusePolicy, applied: Sequence[Mapping[str, float]],
                candidate: Mapping[str, float]) -> str | None:
    """Why the candidate update (its diagnostics) must not be applied after the round's
    `applied` ones, or None to apply it."""
    if not policy.adaptive or len(applied) < policy.min_updates:
        return None
    signal = SIGNALS[policy.rule]
    value = float(candidate[signal])
    if policy.rule == "grad_spike":
        return grad_spike([float(m[signal]) for m in applied], value, policy.spike_factor)
    if policy.rule == "kl_budget":
        return kl_budget(value, policy.kl_budget)
    return clip_budget(value, policy.clip_budget)


def apply_updates(learner: Any, minibatches: Sequence[Any], policy: ReusePolicy
                  ) -> tuple[list[dict[str, float]], dict[str, float] | None]:
    """Apply a round's minibatches in order with `learner.step`: all of them (fixed reuse), or
    until the policy's rule refuses one; the applied updates' diagnostics, and the refused
    one's (None if every drawn update was applied)."""
    if not policy.adaptive:
        return [learner.step(mb) for mb in minibatches], None
    applied: list[dict[str, float]] = []
    for mb in minibatches:
        m = learner.step(mb, accept=lambda candidate: stop_reason(policy, applied, candidate))
        if not m["applied"]:
            return applied, m
        applied.append(m)
    return applied, None
