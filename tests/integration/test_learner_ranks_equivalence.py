"""A run with learner.world_size=2 (replay_pipeline/run/ranks.py: rank 0 in this process, rank
1 a spawned child) against the same run in one process, at the same global batch: the same
rollouts, losses and gradient norms within float rounding, final weights within
WEIGHT_TOLERANCE; usage records written once; the other rank gone when the run finishes.
Sync and async loops, with a KL reference and micro-batches, so every piece of learner state
that rank 0 hands over at the start is exercised."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from replay_pipeline.buffer.usage import UsageStore
from replay_pipeline.run.build import build_run
from replay_pipeline.run.resume import resolve_config
from tests.conftest import TINY_OVERRIDES
from tests.integration.test_resume import drive

STEPS = 4
#: 4 rounds of 2 AdamW updates: the two ranks' gradient sums add in another order than one
#: process's, and Adam divides by the gradient's own scale, so weights move apart by rounding
#: (measured: 7e-9 here) but never by a whole update (lr 3e-5 x 8 updates ~ 2.4e-4).
WEIGHT_TOLERANCE = 1e-6
LOSS_TOLERANCE = 1e-5


def run_once(root, world_size: int, *extra: str):
    cfg = resolve_config([f"tracking.root_dir={root}", *TINY_OVERRIDES, f"loop.steps={STEPS}",
                          f"run_id=ws{world_size}", f"learner.world_size={world_size}", "tracking.log_model=false",
                          "algo.kl_coef=0.01", "algo.micro_batch_size=6", "loop.eval_every=0", "loop.passk_every=0",
                          *extra])
    run = build_run(cfg, log=lambda _: None)
    start = {k: v.detach().clone() for k, v in run.learner.model.state_dict().items()}
    try:
        metrics = drive(run)
        weights = {k: v.detach().clone() for k, v in run.learner.model.state_dict().items()}
        rollouts = run.store.window(10_000, columns=["step", "prompt_id", "completion_ids"]).to_pydict()
    finally:
        run.finish()
    return metrics, weights, rollouts, start


def test_two_ranks_learn_what_one_process_learns(tmp_path):
    one = run_once(tmp_path, 1)
    two = run_once(tmp_path, 2)
    assert not multiprocessing.active_children()  # rank 1 stopped with the run
    assert two[2] == one[2]  # the same rollouts: generation saw the same weights every step
    for step in range(STEPS):
        for key in ("learn/loss", "learn/grad_norm", "learn/kl_behaviour", "learn/tokens"):
            assert two[0][step][key] == pytest.approx(one[0][step][key], rel=LOSS_TOLERANCE, abs=1e-7), (step, key)
    worst = max(float((two[1][k] - one[1][k]).abs().max()) for k in one[1])
    assert worst < WEIGHT_TOLERANCE, worst
    moved = max(float((two[1][k] - two[3][k]).abs().max()) for k in one[1])
    assert moved > 100 * WEIGHT_TOLERANCE  # the runs learned: the comparison is not of two idle models
    used = UsageStore.open(tmp_path / "lancedb", "ws2").rows(columns=["learner_step", "position"]).to_pydict()
    pairs = list(zip(used["learner_step"], used["position"]))
    assert len(pairs) == len(set(pairs)) == STEPS * 2 * 16  # K=2 updates of B=16 a step, recorded once

