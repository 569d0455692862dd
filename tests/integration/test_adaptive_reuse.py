"""Adaptive reuse (reuse.rule, replay_pipeline/algo/reuse.py) through the library: a rule decides,
before each drawn update, whether to apply it; a refused update changes nothing; each round
logs how many updates it took and whether the rule stopped it; the usage table records only
the applied updates; and a stopped-and-resumed run decides exactly as the unstopped one."""

from __future__ import annotations

import copy

import pytest
import torch

from replay_pipeline.run.resume import resolve_config
from replay_pipeline.run.build import build_run
from tests.integration.test_resume import EXACT, drive, overrides

REUSE = ["reuse.max_updates=4", "buffer.strategy=uniform", "buffer.reuse_cap=null"]


def setup(root, *extra):
    return build_run(resolve_config(overrides(root, *REUSE, *extra)), log=lambda _: None)


@pytest.mark.parametrize("budget, updates, by_rule", [("1e-12", 1, 1.0), ("1e9", 4, 0.0)], ids=["tight", "loose"])
def test_a_kl_budget_takes_one_update_when_tight_and_the_cap_when_loose(tmp_path, budget, updates, by_rule):
    run = setup(tmp_path, f"run_id=kl-{budget}", "reuse.rule=kl_budget", f"reuse.kl_budget={budget}")
    metrics = drive(run)
    assert [m["reuse/updates"] for m in metrics.values()] == [updates] * len(metrics)
    assert {m["reuse/stopped_by_rule"] for m in metrics.values()} == {by_rule}
    assert run.learner.steps == updates * len(metrics)
    used = run.usage.rows(columns=["learner_step", "position"]).to_pydict()
    assert sorted(set(used["learner_step"])) == list(range(run.learner.steps))  # one record set per applied update
    assert len(used["position"]) == run.learner.steps * run.settings.loop.minibatch_size
    if by_rule:
        assert run.last_stop_reason.startswith("kl_budget: KL(behaviour || current)")
        assert all(m["reuse/refused_tokens"] > 0 for m in metrics.values())
    else:
        assert run.last_stop_reason == "cap"
    run.finish()


def test_a_refused_update_leaves_weights_optimizer_and_step_count_alone(tmp_path):
    run = setup(tmp_path, "run_id=refuse", "reuse.rule=grad_spike")
    drive(run)  # some optimizer state to keep
    minibatches, _ = run.sample(run.settings.loop.steps)
    learner = run.learner
    weights = copy.deepcopy(learner.model.state_dict())
    moments = copy.deepcopy(learner.optimizer.state_dict())
    steps = learner.steps
    m = learner.step(minibatches[0], accept=lambda candidate: "refused by the test")
    assert m["applied"] == 0.0 and learner.refused == "refused by the test" and m["group_grad_norm"] > 0
    assert learner.steps == steps
    assert all(torch.equal(weights[k], v) for k, v in learner.model.state_dict().items())
    assert str(learner.optimizer.state_dict()) == str(moments)
    assert all(p.grad is None for p in learner.model.parameters())
    run.finish()


def test_grad_spike_rounds_vary_and_resume_bit_for_bit(tmp_path):
    spike = ["reuse.rule=grad_spike", "reuse.spike_factor=1.05"]
    straight = setup(tmp_path, "run_id=spike-straight", *spike)
    ref = drive(straight)
    counts = [m["reuse/updates"] for m in ref.values()]
    assert min(counts) >= 1 and max(counts) <= 4 and len(set(counts)) > 1, counts  # the rule decides
    stopped = setup(tmp_path, "run_id=spike-stopped", *spike)
    before = drive(stopped, stop_after_append=3)
    resumed = setup(tmp_path, "resume=spike-stopped", *spike)
    after = drive(resumed)
    got = {**before, **after}
    for step in ref:
        for key in (*EXACT, "reuse/updates", "reuse/stopped_by_rule", "reuse/refused_tokens"):
            assert got[step][key] == ref[step][key], (step, key)
    for a, b in zip(straight.learner.model.state_dict().values(), resumed.learner.model.state_dict().values()):
        assert torch.equal(a, b)
    assert resumed.usage.rows(columns=["learner_step", "rollout_seq"]).equals(
        straight.usage.rows(columns=["learner_step", "rollout_seq"]))
    straight.finish()
    resumed.finish()
