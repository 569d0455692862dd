"""The reuse rules (replay_pipeline/algo/reuse.py), worked by hand."""

import pytest

from replay_pipeline.algo.reuse import ReusePolicy, clip_budget, grad_spike, kl_budget, stop_reason


def test_grad_spike_compares_the_candidate_with_the_rounds_mean():
    assert grad_spike([], 100.0, 2.0) is None  # nothing to compare with: the first update goes
    assert grad_spike([1.0, 3.0], 4.0, 2.0) is None  # mean 2: 4 is not above 2 x 2
    reason = grad_spike([1.0, 3.0], 4.01, 2.0)
    assert reason == "grad_spike: gradient norm 4.01 > 2 x the round's mean 2"


def test_the_budgets_stop_only_above_them():
    assert kl_budget(0.02, 0.02) is None and kl_budget(0.0201, 0.02).startswith("kl_budget: KL")
    assert clip_budget(0.2, 0.2) is None and clip_budget(0.25, 0.2) == "clip_budget: clipped token fraction 0.25 > 0.2"


@pytest.mark.parametrize("rule, key, values, stops_at", [
    ("grad_spike", "group_grad_norm", [1.0, 1.2, 0.9, 2.5, 1.0], 3),  # mean of 1.0, 1.2, 0.9 = 1.033; 2.5 > 2.07
    ("kl_budget", "kl_behaviour_k3", [0.0, 0.01, 0.019, 0.03], 3),
    ("clip_budget", "clip_frac", [0.0, 0.1, 0.3], 2),
    ("fixed", "clip_frac", [0.0, 0.9, 0.9, 0.9], None),  # never stops: the cap does
])
def test_stop_reason_applies_updates_until_the_rule_refuses_one(rule, key, values, stops_at):
    policy = ReusePolicy(rule=rule, max_updates=8, min_updates=1)
    applied = []
    for k, v in enumerate(values):
        reason = stop_reason(policy, applied, {key: v})
        if reason is not None:
            assert k == stops_at and reason.startswith(rule)
            return
        applied.append({key: v})
    assert stops_at is None


def test_min_updates_are_taken_whatever_the_signal():
    policy = ReusePolicy(rule="clip_budget", min_updates=2, clip_budget=0.1)
    assert stop_reason(policy, [], {"clip_frac": 0.9}) is None
    assert stop_reason(policy, [{"clip_frac": 0.9}], {"clip_frac": 0.9}) is None
    assert stop_reason(policy, [{"clip_frac": 0.9}] * 2, {"clip_frac": 0.9}) is not None
