"""The learner as one rank of a data-parallel group (Learner(group=...), issue 47 item 2's
core): N processes on a real gloo process group, each given the same whole minibatch, each
training on its contiguous share of the rows, gradients summed over the group. Every rank ends
with the same weights, and those equal one process's at the same global batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from replay_pipeline.generation import TransformersGenerator
from replay_pipeline.models.tiny import build_tiny_model, build_tokenizer
from replay_pipeline.training.learner import Learner

TINY = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=0)
SETTINGS = dict(lr=1e-2, kl_coef=0.05, entropy_coef=0.01)
STEPS = 3
#: Weights after 3 AdamW steps of lr 1e-2 agree this closely with one process's (the sums over
#: ranks add in another order; Adam divides by the gradient's own scale, so a rounding
#: difference in a near-zero gradient moves a weight by up to a few 1e-6, as with micro-batches).
WEIGHT_TOLERANCE = 1e-5


def _rows() -> dict:
    tok = build_tokenizer()
    gen = TransformersGenerator(build_tiny_model(tok, **TINY), tok, max_new_tokens=6)
    samples = [s for group in gen.generate(["012+345=", "9+1=", "123+4="], n=3, seed=5) for s in group]
    return {"prompt_ids": [s.prompt_ids for s in samples] + [samples[0].prompt_ids],
            "completion_ids": [s.completion_ids for s in samples] + [[]],
            "behaviour_logprobs": [s.logprobs for s in samples] + [[]],
            "advantage": [1.0, -0.5, 0.3, -1.2, 0.8, 0.0, 0.4, -0.9, 0.6, 0.2]}


def _train(rows: dict, group=None, micro: int | None = None, loss_agg: str = "token_mean"):
    torch.manual_seed(0)
    tok = build_tokenizer()
    model = build_tiny_model(tok, **TINY)
    learner = Learner(model, pad_id=tok.pad_token_id, loss_agg=loss_agg, group=group, micro_batch_size=micro,
                      **SETTINGS)
    metrics = [learner.step(rows) for _ in range(STEPS)]
    return metrics, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rank(rank: int, world: int, init: str, rows: dict, out: str, micro, loss_agg: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        metrics, weights = _train(rows, dist.group.WORLD, micro, loss_agg)
        torch.save({"metrics": metrics, "weights": weights}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, micro, loss_agg, rows_kept", [
    (2, None, "token_mean", 10),   # 5 rows each
    (3, 2, "seq_mean", 10),        # 4, 4 and 2 rows, in micro-batches of 2
    (4, None, "token_mean", 3),    # 1, 1, 1 and an empty share: the fourth rank takes part all the same
])
def test_ranks_take_one_process_update(tmp_path, world, micro, loss_agg, rows_kept):
    """After 3 steps every rank's weights are bit-identical to each other's and within
    WEIGHT_TOLERANCE of one process on the whole minibatch; the diagnostics (loss, clip
    fraction, entropy, ratios, KL terms, grad norm, tokens) are the whole minibatch's on every
    rank (1e-5 relative)."""
    rows = {k: v[:rows_kept] for k, v in _rows().items()}
    mp.spawn(_rank, args=(world, f"file://{tmp_path / 'init'}", rows, str(tmp_path), micro, loss_agg),
             nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    one_metrics, one_weights = _train(rows, loss_agg=loss_agg)
    for other in ranks[1:]:
        assert all(torch.equal(ranks[0]["weights"][k], other["weights"][k]) for k in one_weights)
        assert other["metrics"] == ranks[0]["metrics"]
    worst = max(float((ranks[0]["weights"][k] - one_weights[k]).abs().max()) for k in one_weights)
    assert worst < WEIGHT_TOLERANCE, worst
    for got, want in zip(ranks[0]["metrics"], one_metrics):
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert one_metrics[0]["tokens"] > 0 and one_metrics[-1]["kl_ref"] > 0  # the comparison has substance
