"""The compute ledger against hand-worked numbers (mu, gamma, FLOPs, overhead split)."""

from __future__ import annotations

import math

import pytest

from replay_pipeline.algo.compute import ComputeLedger


def ledger() -> ComputeLedger:
    led = ComputeLedger(parameters=1000)
    # 2 generation batches of 64 rollouts, 320 tokens in 0.2 s each (0.4 s, 640 tokens);
    # 4 learner steps on 64 rollouts each (replay ratio 2), 1280 tokens in 1.6 s.
    led.add(gen_tokens=640, gen_seconds=0.4, gen_rollouts=128)
    led.add(train_tokens=1280, train_seconds=1.6, train_rollouts=256, other_seconds=0.1)
    return led


def test_mu_is_generation_over_training_cost_per_rollout():
    # (0.4 / 128) / (1.6 / 256) = 0.003125 / 0.00625 = 0.5
    assert ledger().mu() == pytest.approx(0.5)


def test_flops_and_mu_from_flops():
    led = ledger()
    assert led.gen_flops() == 2 * 1000 * 640
    assert led.train_flops() == 6 * 1000 * 1280
    # (2*1000*640/128) / (6*1000*1280/256) = 10000 / 30000
    assert led.mu_flops() == pytest.approx(1 / 3)


def test_gamma_is_one_plus_w_over_t_over_one_plus_mu():
    led = ledger()
    assert led.gen_train_ratio() == pytest.approx(0.25)  # 0.4 s generating per 1.6 s training
    # (1 + 0.25) / (1 + 0.5): replay ratio 2 halves generation per update, so gamma < 1
    assert led.gamma() == pytest.approx(1.25 / 1.5)
    # On-policy (each rollout trained on once) gives W/T = mu and gamma = 1.
    on = ComputeLedger(parameters=1)
    on.add(gen_seconds=1.0, gen_rollouts=64, train_seconds=2.0, train_rollouts=64)
    assert on.gamma() == pytest.approx(1.0)


def test_metrics_are_cumulative_and_named_by_phase():
    m = ledger().metrics()
    for key in ("compute/gen_tokens", "compute/train_tokens", "compute/gen_flops", "compute/train_flops",
                "compute/total_flops", "compute/gen_seconds", "compute/train_seconds", "compute/eval_seconds",
                "compute/other_seconds", "compute/mu", "compute/mu_flops", "compute/gamma", "compute/eval_flops",
                "compute/gen_train_ratio", "compute/gen_rollouts", "compute/train_rollouts"):
        assert key in m, key
    assert m["compute/total_flops"] == m["compute/gen_flops"] + m["compute/train_flops"]


def test_empty_ledger_reports_nan_not_an_error():
    led = ComputeLedger(parameters=10)
    assert math.isnan(led.mu()) and math.isnan(led.gamma()) and math.isnan(led.mu_flops())
    with pytest.raises(KeyError, match="unknown ledger entry"):
        led.add(gpu_hours=1.0)
