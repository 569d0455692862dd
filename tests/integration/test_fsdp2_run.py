"""A run with learner.world_size=2 learner.shard=fsdp2 (each rank holding half of every weight,
gradient and AdamW moment; rank 0 in this process, rank 1 a spawned child) against the same run
in one process at the same global batch, with a KL reference (sharded too) and micro-batches:
the same rollouts (rank 0's generator sampled from the gathered weights after every round),
losses and gradient norms within LOSS_TOLERANCE, the checkpoint's weights and AdamW moments
within WEIGHT_TOLERANCE; the checkpoint is a one-process one: the generator held exactly its
weights, a one-process resume of it goes on as the one-process run's own resume does,
flows.evaluate scores it as it scores the one-process run's, and it is logged as MLflow's model.

One spawn of the ranks for the whole file (it costs most of its time)."""

from __future__ import annotations

import glob
import multiprocessing

import pytest
import torch
from safetensors.torch import load_file

from replay_pipeline.run.build import build_run
from replay_pipeline.run.resume import resolve_config
from replay_pipeline.training.checkpoints import latest_valid, load_optimizer_state
from tests.conftest import TINY_OVERRIDES
from tests.integration.test_resume import drive

STEPS = 4
#: 4 rounds of 2 AdamW updates: FSDP2's reduce-scatter and the sharded norm add over ranks in
#: another order than one process, so weights move apart by rounding (measured: 7.5e-9), never
#: by a whole update (lr 3e-5 x 8 updates ~ 2.4e-4).
WEIGHT_TOLERANCE = 1e-6
#: AdamW's moments, each tensor's largest difference over its largest value (measured: 5e-7;
#: a near-zero entry's own relative difference is larger, so it is measured against the tensor).
MOMENT_TOLERANCE = 1e-5
LOSS_TOLERANCE = 1e-5


def config(root, run_id: str, *extra: str):
    return resolve_config([f"tracking.root_dir={root}", *TINY_OVERRIDES, f"loop.steps={STEPS}", f"run_id={run_id}",
                           "tracking.log_model=false", "algo.kl_coef=0.01", "algo.micro_batch_size=6",
                           "loop.eval_every=0", "loop.passk_every=0", *extra])


def run_once(cfg, log_model: bool = False):
    run = build_run(cfg, log=lambda _: None)
    try:
        metrics = drive(run)
        generator = {k: v.detach().clone() for k, v in run.generator.model.state_dict().items()}
        rollouts = run.store.window(10_000, columns=["step", "prompt_id", "completion_ids"]).to_pydict()
        logged = run.log_final_model() if log_model else None
        local = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in run.learner.model.parameters())
    finally:
        run.finish()
    return metrics, generator, rollouts, logged, local / run.learner.num_parameters()


def checkpoint(root, run_id: str):
    path, state = latest_valid(root / run_id / "checkpoints")
    (weights,) = glob.glob(str(path / "model" / "*.safetensors"))
    return load_file(weights), load_optimizer_state(path), state


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp2")
    one = run_once(config(root, "one"))
    sharded = run_once(config(root, "sharded", "learner.world_size=2", "learner.shard=fsdp2",
                              "tracking.log_model=true"), log_model=True)
    assert not multiprocessing.active_children()  # rank 1 stopped with the run
    return root, one, sharded


def test_fsdp2_ranks_learn_what_one_process_learns(runs):
    root, one, sharded = runs
    assert one[4] == 1 and sharded[4] < 0.51  # rank 0 held its half of every parameter (dim-0 shards)
    assert sharded[2] == one[2]  # the same rollouts: the generator saw the same weights every step
    for step in range(STEPS):
        for key in ("learn/loss", "learn/grad_norm", "learn/kl_ref", "learn/kl_behaviour", "learn/tokens"):
            assert sharded[0][step][key] == pytest.approx(one[0][step][key], rel=LOSS_TOLERANCE, abs=1e-7), (step, key)
    (w1, o1, s1), (w2, o2, s2) = checkpoint(root, "one"), checkpoint(root, "sharded")
    assert w2.keys() == w1.keys()
    worst = max(float((w2[k] - w1[k]).abs().max()) for k in w1)
    assert worst < WEIGHT_TOLERANCE, worst
    # the one-process optimizer format: keyed by parameter index, the same hyper-parameters and step counts
    assert o2["param_groups"] == o1["param_groups"] and o2["state"].keys() == o1["state"].keys()
    for i, state in o1["state"].items():
        assert torch.equal(o2["state"][i]["step"], state["step"])
        for k in ("exp_avg", "exp_avg_sq"):
            assert float((o2["state"][i][k] - state[k]).abs().max()) <= MOMENT_TOLERANCE * float(state[k].abs().max())
    assert (s2["learner_steps"], s2["policy_version"]) == (s1["learner_steps"], s1["policy_version"]) == (2 * STEPS, STEPS)
    # rank 0's generator held exactly the gathered weights the checkpoint wrote (tied names: one tensor)
    assert all(torch.equal(sharded[1][k], w2[k]) for k in w2)


def test_the_checkpoint_is_a_one_process_runs(runs):
    """A one-process resume of the sharded run's checkpoint takes the step the one-process run's
    own resume takes; flows.evaluate scores both checkpoints alike; MLflow logged the model."""
    from flows.evaluate import evaluate

    root, one, sharded = runs
    assert sharded[3] is not None and sharded[3].startswith("models:/")
    extra = (f"loop.steps={STEPS + 1}", "learner.world_size=1", "learner.shard=null")
    ones = {run_id: run_once(resolve_config([f"tracking.root_dir={root}", f"resume={run_id}", *extra]))
            for run_id in ("one", "sharded")}
    assert ones["sharded"][2] == ones["one"][2]
    assert ones["sharded"][0][STEPS]["learn/loss"] == pytest.approx(ones["one"][0][STEPS]["learn/loss"],
                                                                    rel=LOSS_TOLERANCE, abs=1e-7)
    (w1, _, _), (w2, _, _) = checkpoint(root, "one"), checkpoint(root, "sharded")
    assert max(float((w2[k] - w1[k]).abs().max()) for k in w1) < WEIGHT_TOLERANCE
    scores = {run_id: evaluate.fn(run_id, root=str(root), step=STEPS, n=2, prompts=8) for run_id in ("one", "sharded")}
    assert scores["sharded"]["eval/accuracy"] == scores["one"]["eval/accuracy"]
    assert scores["sharded"]["eval/pass_at_1"] == scores["one"]["eval/pass_at_1"]
