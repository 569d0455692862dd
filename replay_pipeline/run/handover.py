"""The learner's state between its ranks (replay_pipeline/run/ranks.py), and the whole state
rank 0 needs for everything a run does with its weights, in both modes of `learner.shard`.

* Replicated (learner.shard=null): every rank holds the whole model. At the start rank 0
  broadcasts its weights, the KL reference's, the optimizer state and the step count
  (`send_state` / `receive_state`); from then on rank 0's own model *is* the run's weights:
  its generator shares them, checkpoints and publications read them, no collective needed.
* FSDP2 (learner.shard=fsdp2): rank 0 holds only its shard, so whatever needs the whole weights
  gets them from a collective every rank joins (replay_pipeline/training/sharding.py):
  - the start: rank 0's model is copied whole (`snapshot`) before the learner shards it; a
    resume's checkpoint is read into one-process state dicts instead of the sharded model
    (lineage.restore); then every rank loads rank 0's weights and optimizer state
    (`load_full_state`) and its KL reference (the version-0 policy, `load_full_model_state`);
  - after each round ("gather"): the whole weights onto rank 0 (`gather_state`), which its
    generator loads (`generator.load_weights`, as for any generator that does not share the
    learner's tensors) and the async loop publishes;
  - each checkpoint ("gather" with the optimizer): the whole weights and optimizer state onto
    rank 0, written by save_checkpoint exactly as a one-process run writes its own, so the
    checkpoint loads in a one-process run, a fork, `flows.evaluate`, as MLflow's logged model
    and in vLLM, and a resume may change learner.world_size and learner.shard.

What rank 0 holds under FSDP2: its 1/N shard of the weights, gradients and AdamW moments (and
of the reference); a whole copy of the weights in its generator (the transformers backend;
sampling a token needs every weight at hand, and a sharded generator would make each token a
collective over every rank); at a round's end the gathered weights (CPU, dropped once loaded
and published); at a checkpoint the gathered AdamW moments too (CPU, twice the weights); at
the start the snapshot (CPU, until every rank has loaded it). So rank 0 carries about one whole
copy of the weights more than the other ranks, where a replicated rank carries the whole
weights, gradients and moments (16 bytes a float32 parameter against 4 for the copy). That is
what generation costs anyway, in this process as in a one-process run; what FSDP2 saves is
the learner's gradients and optimizer state, which is what does not fit one device first. A
vLLM generator holds its whole weights in the engine (its own process and GPU memory), and
rank 0 then holds only its shard and, briefly, a gathered state on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from replay_pipeline.training.learner import Learner
from replay_pipeline.training.sharding import full_optimizer_state, load_full_model_state, load_full_state

#: The whole state rank 0 hands to the sharded ranks at the start: {"model", "optimizer",
#: "reference"}, one-process state dicts (the reference's None without a KL penalty).
WholeState = dict[str, Any]


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of a whole (unsharded) model's state dict: what FSDP2's sharding in place
    would otherwise leave rank 0 only a shard of."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def start_state(learner: Learner, whole: dict[str, torch.Tensor]) -> WholeState:
    """What a sharded learner's ranks start from when nothing is restored: `whole` (rank 0's
    model before sharding, the version-0 policy) as the weights and the KL reference, and the
    fresh optimizer's state (hyper-parameters only)."""
    return {"model": whole, "optimizer": learner.optimizer.state_dict(),
            "reference": whole if learner.reference is not None else None}


def send_state(learner: Learner, whole: WholeState | None = None) -> None:
    """Rank 0: hand its state to every rank (collectives under learner.timeout; every other
    rank calls `receive_state` at the same time). Replicated: a broadcast of the weights, the
    KL reference's weights and the optimizer state. FSDP2: `whole` loaded into every rank's
    shards. Either way, the step count."""
    _hand_over(learner, whole)


def receive_state(learner: Learner) -> None:
    """Ranks > 0: the counterpart of `send_state`."""
    _hand_over(learner, None)


def _hand_over(learner: Learner, whole: WholeState | None) -> None:
    rank0 = dist.get_rank() == 0
    if learner.sharded:
        whole = whole or {}
        load_full_state(learner.model, learner.optimizer, whole.get("model"), whole.get("optimizer"))
        if learner.reference is not None:
            load_full_model_state(learner.reference, whole.get("reference"))
        box = [None, learner.steps] if rank0 else [None, None]
    else:
        for module in (learner.model, learner.reference):
            if module is not None:
                for tensor in module.state_dict().values():
                    dist.broadcast(tensor, src=0)
        box = [learner.optimizer.state_dict(), learner.steps] if rank0 else [None, None]
    dist.broadcast_object_list(box, src=0)
    if not rank0:
        if box[0] is not None:
            learner.optimizer.load_state_dict(box[0])
        learner.steps = int(box[1])


def gather_state(learner: Learner, optimizer: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """FSDP2, a collective every rank calls (rank 0 after sending "gather"): the whole weights
    and, with `optimizer`, the whole optimizer state, on rank 0 in the one-process format, on
    the CPU (empty dicts on the other ranks)."""
    weights = learner.state_dict()
    return weights, (full_optimizer_state(learner.model, learner.optimizer) if optimizer else None)
