"""The learner's data-parallel ranks as a user meets them (`python -m flows.train
learner.world_size=2`, loop.engine=local: rank 1 a child process): a rank killed mid-run
stops the run with one line and the resume ends bit for bit where a run that was never
stopped ends (rollouts, usage records, the checkpoint's weights and optimizer state), for
replicated ranks and for a sharded learner (learner.shard=fsdp2: the resume's start loads the
checkpoint's one-process state into both ranks' shards); a rank that stops answering is caught
by learner.timeout instead of hanging the run (replicated ranks only: the collectives differ
under FSDP2, the guard around them does not); an async run with a sharded learner publishes the
whole weights rank 0 gathers."""

from __future__ import annotations

import glob
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import TINY_OVERRIDES
from tests.e2e.test_faults import mlflow_run, rows, train, usage

STEPS = 6
PER_STEP = 16


def args(run_id: str, *extra: str) -> list[str]:
    return [*TINY_OVERRIDES, f"run_id={run_id}", f"loop.steps={STEPS}", "loop.checkpoint_every=2",
            "loop.keep_checkpoints=5", "loop.eval_every=0", "loop.passk_every=0", "buffer.strategy=prioritized",
            "buffer.reuse_cap=3", "learner.world_size=2", *extra]


def weights(root: Path, run_id: str, step: int) -> dict:
    (path,) = glob.glob(str(root / run_id / "checkpoints" / f"step-{step:06d}" / "model" / "*.safetensors"))
    return load_file(path)


def optimizer(root: Path, run_id: str, step: int) -> dict:
    return torch.load(root / run_id / "checkpoints" / f"step-{step:06d}" / "optimizer.pt", weights_only=True)


def error_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ranks")


@pytest.mark.parametrize("shard", ["null", "fsdp2"])
def test_a_killed_rank_stops_the_run_with_one_line_and_the_resume_is_bit_for_bit(root, shard):
    straight, chain = f"straight-{shard}", f"chain-{shard}"
    done = train(root, *args(straight, f"learner.shard={shard}"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "learner: 2 data-parallel ranks (gloo)" in done.stdout

    # rank 1 SIGKILLs itself before the round of learner steps 4 and 5 (step 2; checkpoint at 2)
    crashed = train(root, *args(chain, f"learner.shard={shard}"), crash="learner_rank:4")
    assert crashed.returncode == 1, crashed.stdout[-3000:] + crashed.stderr[-3000:]
    (line,) = error_lines(crashed.stderr)
    assert "RankLost: learner rank 1 (process" in line and "killed by signal 9), during learner step 4" in line
    assert f"resume with: python -m flows.train resume={chain}" in line
    _, runs = mlflow_run(root, chain)
    assert runs[0].info.status == "FAILED"

    resumed = train(root, f"resume={chain}")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resume {chain} at step 2" in resumed.stdout

    got, ref = rows(root, chain), rows(root, straight)
    assert len(got["rollout_id"]) == len(set(got["rollout_id"])) == STEPS * PER_STEP  # none lost, none twice
    for key in ("seq", "step", "policy_version", "reward", "completion_ids", "behaviour_logprobs", "advantage"):
        assert got[key] == ref[key], key
    u, ref_u = usage(root, chain), usage(root, straight)
    assert len(u["learner_step"]) == STEPS * 2 * PER_STEP  # written once, by rank 0
    for key in ("learner_step", "position", "rollout_seq", "staleness"):
        assert u[key] == ref_u[key], key
    a, b = weights(root, chain, STEPS), weights(root, straight, STEPS)
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    oa, ob = optimizer(root, chain, STEPS), optimizer(root, straight, STEPS)
    assert oa["param_groups"] == ob["param_groups"]
    assert all(torch.equal(oa["state"][i][k], v) for i, s in ob["state"].items() for k, v in s.items())


def test_a_rank_that_stops_answering_ends_the_run_at_the_timeout(root):
    began = time.monotonic()
    # rank 1 SIGSTOPs itself: alive, but silent in the step's all-reduce
    hung = train(root, *args("hung", "learner.timeout=8"), signal_at="learner_rank:2:SIGSTOP")
    took = time.monotonic() - began
    assert hung.returncode == 1, hung.stdout[-3000:] + hung.stderr[-3000:]
    (line,) = error_lines(hung.stderr)
    assert "learner step 2 failed across the learner's 2 ranks, none of which exited" in line, line
    assert "learner.timeout=8 s" in line and "resume with: python -m flows.train resume=hung" in line
    assert took < 150, took  # start-up, the warm start's cache, one step and the 8 s timeout; not a hang


def test_an_async_run_with_a_sharded_learner_publishes_the_gathered_weights(root):
    """loop=async with learner.shard=fsdp2: the generator process samples from the whole weights
    rank 0 gathers after each round and publishes (the starting ones from before the sharding);
    the newest published version is the final checkpoint's weights, bit for bit."""
    done = train(root, *TINY_OVERRIDES, "run_id=async-fsdp2", "loop=async", "loop.steps=4", "loop.checkpoint_every=2",
                 "loop.eval_every=0", "loop.passk_every=0", "learner.world_size=2", "learner.shard=fsdp2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    published = torch.load(root / "async-fsdp2" / "weights" / "v-000004" / "weights.pt", weights_only=True)
    final = weights(root, "async-fsdp2", 4)
    assert all(torch.equal(published[k], v) for k, v in final.items())
    assert len(set(rows(root, "async-fsdp2")["policy_version"])) > 1  # the generator loaded later versions
