"""FSDP2 sharding of the learner's model over a process group, and the whole model and
optimizer state in and out of it, as one process holds them.

`shard_model` applies torch's FSDP2 (`fully_shard`) to each transformer block (the classes a
Hugging Face model names in `_no_split_modules`) and then to the whole model, on a 1-D device
mesh over the learner's group (gloo on the CPU, NCCL on GPUs). Each rank then holds a
dim-0 shard of every parameter (a DTensor), of its gradient and, once the optimizer is built
on those parameters, of the AdamW moments. A block's parameters are all-gathered before its
forward and again before its backward (`reshard_after_forward`: FSDP2's default, memory over
communication) and its gradients reduce-scattered after its backward. Tied input and output
embeddings stay one parameter: both sit in the outermost group.

The gradients are reduced as a plain SUM (`set_gradient_divide_factor(1.0)`, with
`set_force_sum_reduction_for_comms` because gloo has no PREMUL_SUM or AVG): the learner weights
each rank's loss by its share of the whole minibatch's tokens, so the sum over ranks is the
whole minibatch's gradient; FSDP2's default (the mean over ranks) would halve it on 2 ranks.

The state functions are what a checkpoint and weight publication need: the full (unsharded)
state on rank 0, in exactly the format a one-process learner's `model.state_dict()` and
`optimizer.state_dict()` have (the optimizer's state keyed by parameter index, not by name),
so a checkpoint written from it loads in a one-process run, in evaluation and as a Hugging
Face directory; and the inverse, a one-process state loaded into the sharded ranks.

`full_model_state`, `full_optimizer_state`, `load_full_state` and `load_full_model_state` are
collectives over the learner's group: every rank must call them, in the same order, or the
others wait (for the process group's timeout). They run over torch's default process group
(torch.distributed.checkpoint's gather and broadcast use it), so `shard_model` refuses a group
that is not the whole default group. `shard_model` is not a collective, but every rank must shard the same model
the same way; `unsharded` is one exactly when its DTensor is not already replicated.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

#: The learner's `shard` settings: None (every rank keeps the whole model: replicated data
#: parallel) or "fsdp2".
SHARD_MODES = (None, "fsdp2")

#: Gathered onto rank 0 and moved to the CPU there (the other ranks get an empty dict).
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
#: Rank 0 holds the full state; the others receive their shards of it.
_SCATTER = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def shard_model(model: torch.nn.Module, group: Any, *, frozen: bool = False) -> torch.nn.Module:
    """`model` sharded in place with FSDP2 over `group` (one FSDP unit per transformer block,
    then the whole model), its gradients reduced as a sum. Every rank must shard the same model
    the same way. `frozen` (a model only run without gradients, the KL reference): its outermost
    unit is resharded after each forward too, as there is no backward to keep it for (FSDP2's
    default keeps the outermost unit's, e.g. the embeddings, whole from forward to backward).
    Returns `model`."""
    if dist.get_world_size(group) != dist.get_world_size():
        raise ValueError(f"shard='fsdp2' needs the learner's group to be the whole default process group "
                         f"(it has {dist.get_world_size(group)} of {dist.get_world_size()} ranks): the full-state "
                         "gather and broadcast of torch.distributed.checkpoint run over the default group. Start "
                         "one process group per learner and pass group=torch.distributed.group.WORLD")
    mesh = DeviceMesh.from_group(group, next(model.parameters()).device.type)
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=True if frozen else None)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def unsharded(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (an all-gather, or a no-op for a replicated one such as the
    gradient norm clip_grad_norm_ returns); any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective (all-gathers over the group; every rank must call it): the sharded model's
    whole state dict on rank 0, on the CPU, key for key what the model's `state_dict()` holds
    in one process (tied weights under both names, one tensor, so save_pretrained writes it
    once as it does in one process); an empty dict on every other rank. A snapshot: no tensor
    in it is the live model's (an unsharded buffer is copied)."""
    live = {id(t) for t in model.state_dict().values()}
    whole = {k: _copy_if(v, live) for k, v in get_model_state_dict(model, options=_GATHER).items()}
    first: dict[int, str] = {}  # a parameter's first name; a tied one's other names get that name's tensor
    tied = {name: first.setdefault(id(p), name) for name, p in model.named_parameters(remove_duplicate=False)}
    return {k: whole[tied[k]] if tied.get(k, k) in whole else v for k, v in whole.items()}


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective (all-gathers over the group; every rank must call it): the optimizer's whole
    state on rank 0, on the CPU, as a one-process `optimizer.state_dict()` holds it (state and
    param_groups' params keyed by parameter index in the optimizer's order); an empty dict on
    every other rank. A snapshot: no tensor in it is the live optimizer's (AdamW's `step`
    counters, which are not sharded, are copied; the next step increments the live ones).

    Before the first step the optimizer has no state; that is returned as it is, without
    torch.distributed.checkpoint (which would initialise the state with a zero-learning-rate
    step, and so count a step the run never took)."""
    if not optimizer.state:
        return optimizer.state_dict() if dist.get_rank() == 0 else {}
    by_name = get_optimizer_state_dict(model, optimizer, options=_GATHER)
    if not by_name:
        return {}
    names = [name for group in by_name["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    live = {id(t) for state in optimizer.state.values() for t in state.values()}
    return {"state": {index[name]: {k: _copy_if(v, live) for k, v in by_name["state"][name].items()}
                      for name in names if name in by_name["state"]},
            "param_groups": [group | {"params": [index[name] for name in group["params"]]}
                             for group in by_name["param_groups"]]}


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    model_state: dict[str, torch.Tensor] | None,
                    optimizer_state: dict[str, Any] | None) -> None:
    """Collective (broadcasts from rank 0 over the group; every rank must call it): load a
    whole model state dict and optimizer state, as one process's `model.state_dict()` and
    `optimizer.state_dict()` hold them (a checkpoint's), into the sharded model and its
    optimizer. Rank 0 passes them; the other ranks pass None and receive their shards. The
    optimizer's hyper-parameters (param_groups) are rank 0's on every rank afterwards. What
    rank 0 was given is checked before any tensor moves, and a mismatch raises on every rank
    (none is left waiting)."""
    names = _parameter_names(model, optimizer)
    header: list[Any] = [None]
    if dist.get_rank() == 0 and model_state is not None and optimizer_state is not None:
        header = [(bool(optimizer_state["state"]), optimizer_state["param_groups"])]
    dist.broadcast_object_list(header, src=0)
    if header[0] is None:
        raise ValueError("rank 0 must pass the whole model and optimizer state to load (the other ranks pass None)")
    has_state, param_groups = header[0]
    saved = sum(len(group["params"]) for group in param_groups)
    if saved != len(names):
        raise ValueError(f"the optimizer state holds {saved} parameters but this model has {len(names)}: it is "
                         "not this model's checkpoint")
    set_model_state_dict(model, dict(model_state or {}), options=_SCATTER)  # a copy: it is filled in place
    if not has_state:  # saved before the first step: only hyper-parameters, nothing to scatter
        optimizer.load_state_dict({"state": {}, "param_groups": param_groups})
        return
    by_name = {}
    if dist.get_rank() == 0:
        # 0-d tensors (AdamW's `step`) copied: they are handed over as they are, and the optimizer would step
        # the caller's counters in place (the sharded moments are copied into each rank's shard anyway)
        by_name = {"state": {names[i]: {k: v.clone() if torch.is_tensor(v) and v.dim() == 0 else v
                                        for k, v in value.items()}
                             for i, value in optimizer_state["state"].items()},
                   "param_groups": [group | {"params": [names[i] for i in group["params"]]}
                                    for group in optimizer_state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=_SCATTER)
    for group, saved_group in zip(optimizer.param_groups, param_groups):
        group.update({k: v for k, v in saved_group.items() if k != "params"})


def load_full_model_state(model: torch.nn.Module, model_state: dict[str, torch.Tensor] | None) -> None:
    """Collective (broadcasts from rank 0 over the group; every rank must call it): a whole
    model state dict (rank 0's; None on the other ranks) into a sharded model that has no
    optimizer, such as the KL reference."""
    set_model_state_dict(model, dict(model_state or {}), options=_SCATTER)


def _copy_if(value: Any, live: set[int]) -> Any:
    """A copy of `value` if it is one of the `live` tensors (by id), else `value` itself."""
    return value.detach().clone() if id(value) in live else value


def _parameter_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each of the optimizer's parameters, in the order its state_dict numbers them."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
