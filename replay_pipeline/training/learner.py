"""The learner: one optimizer step of a registered objective on a minibatch of stored
rollouts.

It re-scores each rollout (prompt + completion tokens, as stored) under the current
weights at the generation temperature, and compares with the behaviour log-probs and the
frozen advantages stored with the rollout (LossInputs). AdamW with a constant learning
rate and global-norm gradient clipping (`adamw`: torch's fused kernel where it has one). The minibatch is collated on the CPU and moved to
the model's device (`model.device`), so the learner runs wherever its model was put.

The objective is looked up by name in `OBJECTIVES`; it receives only the hyper-parameters
its signature declares (from `objective_params`, e.g. {"delta_v": -0.1, "tis_cap": 2.0}), so
the learner never branches on the objective's name. With `kl_coef > 0` the learner keeps a
frozen copy of the starting model and adds kl_coef * k3(current || reference) per token.

A step can run in micro-batches (`micro_batch_size`: forward and backward on that many rows at
a time, gradients summed) and as one rank of a data-parallel group (`group`: every rank is given
the same whole minibatch, trains on its contiguous share of the rows, and the gradients and the
diagnostics' sums are summed over the group before clipping and the step). Either way each part's
aggregated loss is weighted by its share of the whole minibatch's tokens (or sequences), so the
update is one process's on the whole minibatch up to float rounding (tests: the unit test of
micro-batches, tests/integration/test_data_parallel_learner.py); one process without
micro-batches computes exactly as a plain step. The group runs in one of two modes (`shard`):
- replicated (None, the default): every rank keeps the whole model and its optimizer state, and
  the gradients go over the group as one flat all-reduce (what DDP does, without its wrapper or
  bucketing). Right where the model, its gradients and AdamW's two moments fit one device
  (about 16 bytes a parameter in float32: SmolLM2-135M's 2 GB, not a 7B model's 112 GB): one
  collective a step, no gathering of weights, and every rank has the weights to publish.
- "fsdp2": the model is sharded with FSDP2 (replay_pipeline.training.sharding); each rank holds
  1/N of the weights, gradients and AdamW moments, all-gathers a block's weights for its forward
  and backward, and reduce-scatters its gradients; the KL reference is sharded the same way.
  Right where they do not fit one device; it costs up to two all-gathers per block and part
  (forward, backward; the reference's forward one more) and a reduce-scatter per block and part.
  Every forward and backward is then a collective, so every rank runs as many parts as the
  first (a rank with a short or empty share runs parts with no completion token, which add
  nothing). Micro-batches reduce-scatter after each part and add up in the sharded gradients
  (FSDP2's default and torchtitan's, its authors' advice where memory is the limit): holding
  the sync until the last part (`set_requires_gradient_sync`) would save parts - 1
  reduce-scatters a step but keep a whole unsharded gradient on every rank, as large as the
  whole float32 weights. Clipping uses the whole model's norm (clip_grad_norm_ on
  the sharded gradients all-reduces it). The whole weights and optimizer state for checkpoints
  and publication are gathered onto rank 0 by the sharding module's collectives (`state_dict()`
  is one), in the one-process format. `gradient()` is refused (the gradient exists only as
  shards); `watch()` works (its norm is all-reduced).
  Tested: tests/integration/test_fsdp2_learner.py (2 ranks against one process). A run drives it
  with learner.world_size=N learner.shard=fsdp2 (replay_pipeline/run/handover.py: how rank 0's
  generator, checkpoints and publications get the whole state; tests/integration/
  test_fsdp2_run.py: such a run against one process).

Every step returns diagnostics (the trainer logs them as learn/<name>): loss, entropy,
clip_frac and truncated_frac (the same number: the fraction of completion tokens whose
weight the objective clipped or truncated; clip_frac is the older name), ratio_mean,
ratio_max, kl_behaviour (k1 estimate of KL(behaviour || current), mean of
behaviour_logprob - logprob over completion tokens) and kl_behaviour_k3 (r - 1 - log r,
r = current / behaviour: non-negative, lower variance), grad_norm (before clipping), tokens,
advantage_abs_mean, and kl_ref (mean k3 to the reference) when kl_coef > 0.

Bad input (decisions):
- Refused before the forward pass, with a ValueError naming the rollout (its rollout_id
  when the rows carry one, else its row index) and the fix, so nothing is trained on it: a
  rollout whose prompt + completion is longer than the model's max_position_embeddings
  (rotary models would silently run past their trained positions), a rollout with no prompt
  tokens (the first completion token would have nothing to be predicted from), and a
  non-finite advantage, reward, group_reward_mean or behaviour log-prob (one NaN would turn
  every weight into NaN).
- Empty completions (no completion tokens; the transformers backend makes them only with
  max_new_tokens=0, an EOS-first completion is the one token <eos>) are accepted: they add
  nothing to the loss (objectives.aggregate). A minibatch with no completion token at all
  takes no optimizer step (AdamW's momentum alone would still move the weights, on no
  data) but still counts as a learner step, so usage records keep their numbering; its
  loss, grad_norm and every per-token diagnostic are 0 and `tokens` is 0.
- Log-probs at positions that are not completion tokens (prompt, padding) are set to 0
  before the objective and the KL term see them, so an extreme value there cannot reach
  the loss or the gradient.
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass, fields
from itertools import chain
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from replay_pipeline.algo.bounds import Bound
from replay_pipeline.algo.objectives import (OBJECTIVES, LossInputs, aggregate, get_objective,
                                        kl_penalty, objective_param_names)
from replay_pipeline.training.sharding import SHARD_MODES, full_model_state, shard_model, unsharded


#: The learner's own bounds, stated once: the algo.* configuration fields of the same name
#: refer to these (replay_pipeline.config.owned).
LEARNER_BOUNDS = {
    "kl_coef": Bound(ge=0, hint="0 turns the KL penalty off"),
    "entropy_coef": Bound(ge=0, hint="0 turns the entropy bonus off"),
}


@dataclass
class Batch:
    """A minibatch as tensors, right-padded; logits column t predicts token t + 1."""

    input_ids: torch.Tensor           # (B, L) prompt + completion, right-padded
    attention_mask: torch.Tensor      # (B, L)
    completion_mask: torch.Tensor     # (B, L-1) 1 where target token t+1 is a completion token
    behaviour_logprobs: torch.Tensor  # (B, L-1) aligned with completion_mask, 0 elsewhere
    advantages: torch.Tensor          # (B,)
    rewards: torch.Tensor | None = None            # (B,) when the rows carry `reward`
    group_reward_mean: torch.Tensor | None = None  # (B,) when they carry `group_reward_mean`

    def to(self, device: torch.device) -> "Batch":
        """The minibatch on `device` (the model's); on the CPU, the same tensors."""
        tensors = (getattr(self, f.name) for f in fields(self))
        return Batch(*(None if t is None else t.to(device) for t in tensors))


def _rows(batch: Batch, cut: slice) -> Batch:
    """Rows `cut` of a Batch."""
    return Batch(*(None if t is None else t[cut] for t in (getattr(batch, f.name) for f in fields(batch))))


def _row_temperature(temperature: float | torch.Tensor, cut: slice) -> float | torch.Tensor:
    """Rows `cut` of a per-row temperature (one temperature for every row: itself)."""
    return temperature[cut] if isinstance(temperature, torch.Tensor) else temperature


def _filler(batch: Batch) -> Batch:
    """The first row of `batch` with no completion token: a part that runs the model's forward
    and backward (FSDP2's collectives) and adds nothing to the loss, its gradient or the sums."""
    row = _rows(batch, slice(0, 1))
    row.completion_mask = torch.zeros_like(row.completion_mask)
    row.behaviour_logprobs = torch.zeros_like(row.behaviour_logprobs)
    return row


def _optional_vector(values: Sequence[float] | None) -> torch.Tensor | None:
    return None if values is None else torch.tensor(list(values), dtype=torch.float32)


def _ragged_positions(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows of the given lengths laid end to end: each element's row and its index within
    the row (lengths [2, 0, 3] -> rows [0, 0, 2, 2, 2], indexes [0, 1, 0, 1, 2])."""
    row = np.repeat(np.arange(len(lengths)), lengths)
    return row, np.arange(len(row)) - np.repeat(np.cumsum(lengths) - lengths, lengths)


def collate(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
            behaviour_logprobs: Sequence[Sequence[float]], advantages: Sequence[float],
            pad_id: int, rewards: Sequence[float] | None = None,
            group_reward_mean: Sequence[float] | None = None) -> Batch:
    """The rows as one right-padded Batch: row i is prompt i then completion i, padded with
    `pad_id`; completion token k of row i sits at column len(prompt)+k and is predicted by
    column len(prompt)+k-1, where completion_mask is 1 and behaviour_logprobs holds its
    behaviour log-prob. Laid out with numpy in a few whole-array steps (a per-row loop of
    torch assignments cost ~1.2 ms for 64 rows, once per learner update) and then shared
    with torch, so the values are those of float32(value) exactly."""
    b = len(prompt_ids)
    lp = np.fromiter(map(len, prompt_ids), np.int64, b)
    lc = np.fromiter(map(len, completion_ids), np.int64, b)
    ll = np.fromiter(map(len, behaviour_logprobs), np.int64, len(behaviour_logprobs))
    if len(ll) == b and (bad := np.flatnonzero(ll != lc)).size:
        i = int(bad[0])
        raise ValueError(f"row {i}: {lc[i]} completion tokens but {ll[i]} behaviour log-probs")
    if b == 0 or (lp < 1).any():
        raise ValueError("every row needs a prompt of at least one token (the first completion token is "
                         "predicted from the prompt's last)" if b else "no rows to collate")
    n = lp + lc
    width = int(n.max())
    row, col = _ragged_positions(n)
    input_ids = np.full((b, width), pad_id, dtype=np.int64)
    input_ids[row, col] = np.fromiter(chain.from_iterable(chain(p, c) for p, c in zip(prompt_ids, completion_ids)),
                                      np.int64, len(row))
    attention = (np.arange(width)[None, :] < n[:, None]).astype(np.int64)
    crow, k = _ragged_positions(lc)
    ccol = lp[crow] - 1 + k  # completion token k is predicted by column len(prompt) + k - 1
    mask = np.zeros((b, width - 1), dtype=np.float32)
    old = np.zeros((b, width - 1), dtype=np.float32)
    mask[crow, ccol] = 1.0
    old[crow, ccol] = np.fromiter(chain.from_iterable(behaviour_logprobs), np.float64, len(crow))
    return Batch(torch.from_numpy(input_ids), torch.from_numpy(attention), torch.from_numpy(mask),
                 torch.from_numpy(old), torch.tensor(list(advantages), dtype=torch.float32),
                 _optional_vector(rewards), _optional_vector(group_reward_mean))


def token_logprobs_and_entropy(model, batch: Batch, temperature: float | torch.Tensor,
                               entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L-1) log-probs of each next token and entropy of each next-token distribution
    (differentiable only with `entropy_grad`, for an entropy bonus), under softmax(logits /
    temperature): one temperature, or one per row (a (B,) tensor).

    Only the columns from the first one that predicts a completion token are projected onto
    the vocabulary (the model's `logits_to_keep`); the columns before it, prompt positions,
    hold 0. With a real vocabulary the projection and the softmax over it are a large share of
    a step: SmolLM2's 49,152 tokens over 64 rows of ~60 tokens made 0.75 GB of logits, three
    quarters of them at prompt positions no loss reads."""
    start = _first_completion_column(batch.completion_mask)
    width = batch.input_ids.shape[1]
    if _takes_logits_to_keep(model):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       logits_to_keep=width - start).logits
    else:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, start:]
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(logits.device, torch.float32).view(-1, 1, 1)
    logits = logits[:, :-1].float() / temperature  # columns start..L-2 predict tokens start+1..L-1
    logp_all = torch.log_softmax(logits, dim=-1)
    targets = batch.input_ids[:, start + 1:].unsqueeze(-1)
    logp = logp_all.gather(-1, targets).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    if start:  # the prompt columns before `start`: nothing computed, 0
        logp, entropy = (torch.nn.functional.pad(t, (start, 0)) for t in (logp, entropy))
    return logp, entropy


def _first_completion_column(completion_mask: torch.Tensor) -> int:
    """The first column of a (B, L-1) completion mask that predicts a completion token in any
    row (L-1 when there is none)."""
    used = torch.nonzero(completion_mask.any(dim=0))
    return int(used[0]) if len(used) else completion_mask.shape[1]


def _takes_logits_to_keep(model) -> bool:
    """Whether the model's forward takes `logits_to_keep` (transformers' causal LMs do)."""
    kind = type(model)
    if kind not in _LOGITS_TO_KEEP:
        try:
            _LOGITS_TO_KEEP[kind] = "logits_to_keep" in inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            _LOGITS_TO_KEEP[kind] = False
    return _LOGITS_TO_KEEP[kind]


_LOGITS_TO_KEEP: dict[type, bool] = {}


def adamw(params, **settings) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel where it has one (floating-point parameters on the CPU
    or CUDA), else its default implementation. The fused step is the same update in one kernel
    (measured on the default 1.8M-parameter model, 2 CPU threads: 1.0 ms a step against 5-6 ms
    for the per-tensor loop torch uses on the CPU; weights within 1e-8 of it after 3 steps)
    and what transformers' Trainer (and so TRL) takes by default (`adamw_torch_fused`). A
    checkpoint's optimizer state loads either way; its param_groups carry the implementation
    it was saved with, so a resumed run keeps stepping as it did."""
    params = list(params)
    fused = bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, fused=True if fused else None, **settings)


class Learner:
    def __init__(self, model, *, objective: str = "grpo_clip", lr: float = 3e-5,
                 eps_low: float = 0.2, eps_high: float = 0.2,
                 objective_params: Mapping[str, float] | None = None, kl_coef: float = 0.0,
                 entropy_coef: float = 0.0, loss_agg: str = "token_mean",
                 max_grad_norm: float = 1.0, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), temperature: float = 1.0,
                 pad_id: int = 0, micro_batch_size: int | None = None, group: Any = None,
                 shard: str | None = None):
        """`objective_params` holds hyper-parameters for any objective (eps_low, eps_high,
        delta_v, tis_cap); the chosen objective gets the ones it declares and the rest are
        ignored, so one config serves every objective. `eps_low` / `eps_high` keywords are
        kept for callers that pass them directly; `objective_params` overrides them.
        `micro_batch_size`: :meth:`step` runs the forward and backward passes on at most this
        many rows at a time and sums their gradients (None: the whole minibatch at once).
        `group`: a torch.distributed process group this learner is one rank of (data
        parallel: every rank holds the same weights and is given the same whole minibatch,
        trains on its contiguous share of the rows, and the gradients are summed over the
        group before clipping and the step, so every rank takes the update one process would;
        None: one process). `shard`: None (each rank of `group` keeps the whole model and
        optimizer state) or "fsdp2" (the model, and the reference with kl_coef > 0, are sharded
        over `group` with FSDP2, replay_pipeline.training.sharding: each rank keeps a shard of
        the weights, gradients and AdamW moments)."""
        if shard not in SHARD_MODES:
            raise ValueError(f"shard={shard!r} is not one of {list(SHARD_MODES)}; None keeps the whole model on "
                             "every rank, 'fsdp2' shards it over the group")
        if shard is not None and group is None:
            raise ValueError(f"shard={shard!r} shards the model over a process group; pass group= (e.g. "
                             "torch.distributed.group.WORLD after init_process_group), or shard=None for one process")
        if micro_batch_size is not None and (isinstance(micro_batch_size, bool) or int(micro_batch_size) < 1):
            raise ValueError(f"micro_batch_size={micro_batch_size!r} must be an integer >= 1 (or None)")
        self.micro_batch_size = None if micro_batch_size is None else int(micro_batch_size)
        self.group = group
        self.rank, self.world_size = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
        self.objective = get_objective(objective)
        self.objective_kwargs = select_objective_params(
            self.objective, {"eps_low": eps_low, "eps_high": eps_high, **(objective_params or {})})
        for name, value in (("kl_coef", kl_coef), ("entropy_coef", entropy_coef)):
            LEARNER_BOUNDS[name].check(name, value)
        self.model = model
        self.model.train()
        self.kl_coef = kl_coef
        self.entropy_coef = entropy_coef
        # Frozen starting policy for the KL penalty; only built when it is used.
        self.reference = None
        if kl_coef > 0:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.sharded = shard is not None
        if self.sharded:  # the reference the same way: a model too large for one device is not held whole twice
            shard_model(model, group)
            if self.reference is not None:
                shard_model(self.reference, group, frozen=True)
        self.loss_agg = loss_agg
        self.max_grad_norm = max_grad_norm
        self.temperature = temperature
        self.pad_id = pad_id
        self.optimizer = adamw(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
        self.steps = 0
        self.watched: list[torch.nn.Parameter] = []  # watch(): the group whose gradient norm is reported
        self.refused: str | None = None  # why step()'s `accept` refused the last update

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def device(self) -> torch.device:
        """Where the model is (model.device): minibatches are moved there."""
        return next(self.model.parameters()).device

    @property
    def max_positions(self) -> int | None:
        """The model's ``max_position_embeddings`` (None if its config does not say)."""
        return getattr(getattr(self.model, "config", None), "max_position_embeddings", None)

    def check_rows(self, rows: Mapping[str, Sequence[Any]]) -> None:
        """Refuse a minibatch the learner must not train on (see the module docstring);
        the ValueError names the rollout and the fix. Called by :meth:`step`."""
        ids = rows.get("rollout_id")
        name = lambda i: (f"rollout {ids[i]!r} (row {i} of the minibatch)"  # noqa: E731
                          if ids is not None else f"row {i} of the minibatch")
        limit = self.max_positions
        for i, (p, c, lps) in enumerate(zip(rows["prompt_ids"], rows["completion_ids"],
                                            rows["behaviour_logprobs"])):
            if p is None or c is None or lps is None:
                raise ValueError(f"{name(i)} has null prompt_ids, completion_ids or behaviour_logprobs; "
                                 "store [] for an empty completion")
            if len(p) == 0:
                raise ValueError(f"{name(i)} has no prompt tokens; every rollout needs at least "
                                 "one (the tokenizer's <bos>) to predict its first completion token from")
            if limit and len(p) + len(c) > limit:
                raise ValueError(
                    f"{name(i)} has {len(p)} prompt + {len(c)} completion = {len(p) + len(c)} "
                    f"tokens, more than the model's max_position_embeddings={limit}; refusing to "
                    f"train on it. Lower generator.max_new_tokens (so prompt + max_new_tokens <= "
                    f"{limit}) or shorten the prompts, or use a model with more positions")
        for column in ("advantage", "reward", "group_reward_mean"):
            values = rows.get(column)
            if values is None:
                continue
            for i, v in enumerate(values):
                if v is None or not math.isfinite(v):
                    raise ValueError(f"{name(i)} has {column}={v}; the learner needs finite values "
                                     "(scoring flags a bad reward and stores 0.0 instead)")

    def _check_logprobs(self, rows: Mapping[str, Sequence[Any]], batch: Batch) -> None:
        """Non-finite stored behaviour log-probs, checked on the collated tensor (one pass)."""
        bad = ~torch.isfinite(batch.behaviour_logprobs).all(dim=-1)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            ids = rows.get("rollout_id")
            who = f"rollout {ids[i]!r} (row {i} of the minibatch)" if ids is not None else f"row {i} of the minibatch"
            raise ValueError(f"{who} has a non-finite behaviour log-prob; it cannot be re-weighted "
                             "against the current policy (refusing to train on it)")

    def row_temperature(self, rows: Mapping[str, Sequence[Any]]) -> float | torch.Tensor:
        """The temperature each row is re-scored at: its stored `temperature` (the one it was
        sampled at), or the learner's for rows without one (null: not recorded). The learner's
        own float when every row has it, so such a minibatch is computed exactly as before."""
        stored = rows.get("temperature")
        if stored is None:
            return self.temperature
        values = [self.temperature if t is None else float(t) for t in stored]
        if all(v == self.temperature for v in values):
            return self.temperature
        if not all(math.isfinite(v) and v > 0 for v in values):
            raise ValueError(f"stored temperatures {sorted(set(values))} must be finite numbers > 0")
        return torch.tensor(values, dtype=torch.float32)

    def watch(self, group: str) -> None:
        """Report the gradient norm of one parameter group with every step (`group_grad_norm`,
        before clipping): "output" for the output embedding (the LM head, tied or not), else
        the parameters whose name contains `group`. ValueError if none matches."""
        if group == "output":
            head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
            params = [head.weight] if head is not None else []
        else:
            params = [p for name, p in self.model.named_parameters() if group in name]
        if not params:
            names = [name for name, _ in self.model.named_parameters()][:6]
            raise ValueError(f"reuse.group={group!r} matches no parameter of the model (names look like "
                             f"{names}); use reuse.group=output or part of a parameter's name")
        self.watched = params

    def _prepare(self, rows: Mapping[str, Sequence[Any]]) -> tuple[Batch, float | torch.Tensor]:
        """The checked minibatch as a Batch on the model's device, and each row's temperature."""
        self.check_rows(rows)
        batch = collate(rows["prompt_ids"], rows["completion_ids"], rows["behaviour_logprobs"],
                        rows["advantage"], self.pad_id, rewards=rows.get("reward"),
                        group_reward_mean=rows.get("group_reward_mean")).to(self.device)
        self._check_logprobs(rows, batch)
        return batch, self.row_temperature(rows)

    def _loss(self, rows: Mapping[str, Sequence[Any]]):
        """The minibatch's loss (objective, KL and entropy terms, aggregated) and what the
        diagnostics are computed from: (batch, mask, on, objective output, logp, entropy, kl_ref)."""
        batch, temperature = self._prepare(rows)
        return self._part_loss(batch, temperature)

    def _parts(self, batch: Batch, temperature: float | torch.Tensor):
        """(part, its temperature, its weight) for each micro-batch of this rank's share of
        `batch` (rows in order; one part, the batch itself with weight 1, for one process
        without micro_batch_size): the weight makes the parts' aggregated losses, over every
        rank, sum to the whole minibatch's (loss_agg's denominator is the whole minibatch's
        token or sequence count). A rank whose share is empty (fewer rows than ranks) has none,
        except under FSDP2, where every forward and backward is a collective (all-gathers and
        reduce-scatters): there each rank runs as many parts as the first rank does, padding its
        own with `_filler` parts."""
        rows = batch.input_ids.shape[0]
        share = -(-rows // self.world_size)  # this rank's contiguous rows: [lo, hi)
        lo, hi = min(self.rank * share, rows), min((self.rank + 1) * share, rows)
        size = self.micro_batch_size or max(hi - lo, 1)
        if self.world_size == 1 and size >= rows:
            yield batch, temperature, 1.0
            return
        tokens = batch.completion_mask.sum(-1)  # each row's; seq_mean counts the rows that have any
        counts = (tokens > 0).float() if self.loss_agg == "seq_mean" else tokens
        total = float(counts.sum().clamp_min(1.0))
        for start in range(lo, hi, size):
            cut = slice(start, min(start + size, hi))
            part_total = float(counts[cut].sum())
            weight = part_total / total if part_total > 0 else 0.0
            yield _rows(batch, cut), _row_temperature(temperature, cut), weight
        if self.sharded:
            for _ in range(-(-(hi - lo) // size), -(-share // (self.micro_batch_size or share))):
                yield _filler(batch), _row_temperature(temperature, slice(0, 1)), 0.0

    def _part_loss(self, batch: Batch, temperature: float | torch.Tensor, weight: float = 1.0):
        """_loss on a Batch (a minibatch or one of its parts), the aggregated loss times `weight`."""
        logp, entropy = token_logprobs_and_entropy(self.model, batch, temperature,
                                                   entropy_grad=self.entropy_coef > 0)
        m = batch.completion_mask
        on = m > 0
        logp = torch.where(on, logp, torch.zeros_like(logp))  # only completion tokens matter
        out = self.objective(LossInputs(logp, batch.behaviour_logprobs, batch.advantages, m,
                                        rewards=batch.rewards,
                                        group_reward_mean=batch.group_reward_mean),
                             **self.objective_kwargs)
        per_token = out.per_token
        kl_ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logp, _ = token_logprobs_and_entropy(self.reference, batch, temperature)
                ref_logp = torch.where(on, ref_logp, torch.zeros_like(ref_logp))
            kl_ref = kl_penalty(logp, ref_logp)
            per_token = per_token + self.kl_coef * kl_ref
        if self.entropy_coef > 0:  # bonus: higher entropy lowers the loss (aggregate drops padding)
            per_token = per_token - self.entropy_coef * entropy
        loss = aggregate(per_token, m, self.loss_agg)
        if weight != 1.0:
            loss = loss * weight
        return loss, (batch, m, on, out, logp, entropy, kl_ref)

    def gradient(self, rows: Mapping[str, Sequence[Any]]) -> list[torch.Tensor]:
        """The loss's gradient on a minibatch, one tensor a parameter (zeros where it has
        none), without clipping, without a step, the model's own .grad left untouched: what
        replay_pipeline/run/measure.py takes for each rollout. One process or a replicated rank
        only: under FSDP2 a gradient exists only as shards, reduced over the group in backward."""
        if self.sharded:
            raise ValueError("Learner.gradient() is refused under shard='fsdp2' (the gradient exists only as "
                             "shards reduce-scattered in backward); measure per-rollout gradients with a "
                             "one-process Learner (shard=None) on the gathered weights")
        loss, _ = self._loss(rows)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not loss.requires_grad:  # only empty completions
            return [torch.zeros_like(p) for p in params]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]

    def step(self, rows: Mapping[str, Sequence[Any]],
             accept: Callable[[Mapping[str, float]], str | None] | None = None) -> dict[str, float]:
        """One optimizer step on a minibatch given as columns of stored rollouts.

        `accept` (adaptive reuse, replay_pipeline/algo/reuse.py) sees the update's diagnostics after
        its backward pass and before the optimizer step; if it returns a reason, the update is
        not applied (gradients dropped, no step counted), the metrics carry `applied` 0 (1 when
        `accept` let it through) and the reason is kept in `refused`."""
        whole, temperature = self._prepare(rows)
        self.optimizer.zero_grad(set_to_none=True)
        pieces, losses = [], []
        for part, part_temperature, weight in self._parts(whole, temperature):
            part_loss, (batch, m, on, out, logp, entropy, kl_ref) = self._part_loss(part, part_temperature, weight)
            if self.sharded or bool(on.any()):  # (FSDP2: every part's backward is a collective, on every rank)
                part_loss.backward()  # the parts' gradients add up in .grad (FSDP2: in the sharded .grad)
            losses.append(part_loss.detach())
            pieces.append((batch.behaviour_logprobs, m, on, out.ratio.detach(), out.clipped, logp.detach(),
                           entropy.detach(), None if kl_ref is None else kl_ref.detach()))
        sums = self._sums(pieces, losses)
        if self.world_size > 1:  # the group's gradients and sums: every rank then steps alike
            if not self.sharded:  # (FSDP2's backward has reduce-scattered them)
                self._all_reduce_gradients()
            sums = self._all_reduce_sums(sums)
        learned = bool(sums["tokens"] > 0)
        group_norm = 0.0
        if learned:
            if self.watched:
                group_norm = float(unsharded(torch.linalg.vector_norm(torch.stack(
                    [torch.linalg.vector_norm(p.grad) for p in self.watched if p.grad is not None] or
                    [torch.zeros(())]))))
            norm_cap = self.max_grad_norm if self.max_grad_norm > 0 else float("inf")
            # on FSDP2's sharded gradients: the whole model's norm, replicated (an all-reduce)
            grad_norm = unsharded(torch.nn.utils.clip_grad_norm_(self.model.parameters(), norm_cap))
        else:  # only empty completions: nothing to learn, and no momentum-only update
            grad_norm = torch.zeros(())
        tokens = sums["tokens"].clamp_min(1.0)
        truncated_frac = float(sums["clipped"] / tokens)
        metrics = {
            "loss": float(sums["loss"]),
            "clip_frac": truncated_frac,
            "truncated_frac": truncated_frac,
            "entropy": float(sums["entropy"] / tokens),
            "ratio_mean": float(sums["ratio"] / tokens),
            "ratio_max": float(sums["ratio_max"]) if learned else 0.0,
            "kl_behaviour": float(sums["kl_behaviour"] / tokens),
            "kl_behaviour_k3": float(sums["kl_behaviour_k3"] / tokens),
            "grad_norm": float(grad_norm),
            "tokens": float(sums["tokens"]),
            "advantage_abs_mean": float(whole.advantages.abs().mean()),
        }
        if "kl_ref" in sums:
            metrics["kl_ref"] = float(sums["kl_ref"] / tokens)
        if self.watched:
            metrics["group_grad_norm"] = group_norm
        self.refused = accept(metrics) if accept is not None else None
        if self.refused is not None:
            self.optimizer.zero_grad(set_to_none=True)
            return metrics | {"applied": 0.0}
        if learned:
            self.optimizer.step()
        self.steps += 1
        return metrics if accept is None else metrics | {"applied": 1.0}

    def _sums(self, pieces: list[tuple], losses: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The step's diagnostics as sums over this rank's completion tokens (divided by the
        token count once summed over the group): loss (the parts' `losses` added), tokens,
        clipped, entropy, ratio, the two KL estimates, kl_ref when there is a reference, and
        ratio_max (a maximum). `pieces` are the parts' columns, concatenated row-wise."""
        if not pieces:  # an empty share: nothing of this rank's, but it still takes part
            zero = torch.zeros((), device=self.device)
            out = {k: zero for k in ("loss", "tokens", "clipped", "entropy", "ratio", "kl_behaviour",
                                     "kl_behaviour_k3", "ratio_max")}
            return out | ({"kl_ref": zero} if self.reference is not None else {})
        behaviour, m, on, ratio, clipped, logp, entropy, kl_ref = (
            None if column[0] is None else torch.cat(column) for column in zip(*pieces))
        log_ratio = (logp - behaviour) * m  # log(current / behaviour)
        total = lambda x: (x.detach() * m).sum()  # noqa: E731
        out = {"loss": torch.stack(losses).sum(), "tokens": m.sum(), "clipped": total(clipped.float()),
               "entropy": total(entropy), "ratio": total(ratio), "kl_behaviour": total(-log_ratio),
               "kl_behaviour_k3": total(torch.exp(log_ratio) - 1.0 - log_ratio),
               "ratio_max": ratio[on].max() if bool(on.any()) else torch.zeros((), device=m.device)}
        return out | ({"kl_ref": total(kl_ref)} if kl_ref is not None else {})

    def _all_reduce_gradients(self) -> None:
        """Sum every parameter's gradient over the group, as one flat tensor (a rank that
        computed none contributes zeros)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n

    def _all_reduce_sums(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`sums` summed over the group (ratio_max: the group's maximum)."""
        keys = [k for k in sums if k != "ratio_max"]
        flat = torch.stack([sums[k].float() for k in keys])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        top = sums["ratio_max"].float().clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.group)
        return dict(zip(keys, flat)) | {"ratio_max": top}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Weights to publish to the generator (detached copies, safe to load elsewhere). Under
        FSDP2 a collective every rank must call (sharding.full_model_state): the whole weights
        on rank 0, on the CPU, and an empty dict on the other ranks."""
        if self.sharded:
            return full_model_state(self.model)
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def select_objective_params(objective, params: Mapping[str, float]) -> dict[str, float]:
    """The entries of `params` that `objective` declares. A key no registered objective
    declares is a typo and fails here, at start-up, rather than being silently ignored."""
    known = {name for fn in OBJECTIVES.values() for name in objective_param_names(fn)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"unknown objective parameter(s) {unknown}; known: {sorted(known)}")
    wanted = objective_param_names(objective)
    return {k: v for k, v in params.items() if k in wanted}
