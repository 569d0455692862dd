"""Batched sampling with Hugging Face transformers' ``generate``.

Decisions:
- Behaviour log-probs are those of softmax(logits / temperature) at each sampled token,
  computed from generate's raw logits. Top-p truncation is not folded into them (as in
  verl and TRL): the learner scores tokens with the same temperature and no truncation,
  so on-policy ratios are exactly 1 when top_p = 1.
- Prompts are left-padded so every row's completion starts at the same column; the
  learner re-scores prompt + completion unpadded-then-right-padded, with the same
  positions (generate derives position ids from the attention mask).
- The generator owns its own copy of the weights: new weights reach it only through
  ``load_weights``, as they would reach a separate inference engine (vLLM). The one exception
  is the learner's own process (the sync loop, and evaluation in the async loop):
  ``share_weights`` aliases the generator's parameters to the learner's, so the optimizer's
  in-place update is the new policy and publishing a version copies nothing (a 2-18 ms
  copy a round on the default model otherwise). The modules stay separate (the generator's
  in eval mode, without gradients).
- Sampling runs on the model's device (``model.device``): prompts are laid out on the CPU
  and moved there, completions and log-probs come back to the CPU.
- Sampling is seeded per call (torch.manual_seed(seed)), so a run is reproducible.
- Edge completions are ordinary Samples. A completion whose first token is <eos> is
  ``completion_ids == [eos]`` with text "" and finish_reason "stop" (the <eos> is a real
  token the learner trains on). One that reaches ``max_new_tokens`` without <eos> is cut
  there with finish_reason "length". ``max_new_tokens=0`` (refused by the run's config, but
  accepted here) returns empty completions (no ids, no log-probs, text "", "length")
  without running the model.
- Too long for the model: a prompt whose token count plus ``max_new_tokens`` exceeds the
  model's ``max_position_embeddings`` is refused before any sampling, with a ValueError that
  names the prompt, the numbers and the fix. Rotary models would otherwise run on past
  their trained positions without complaint.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch

from replay_pipeline.system import stopping
from replay_pipeline.generation.base import Sample, call_settings, check_positions, encode_prompts


class TransformersGenerator:
    def __init__(self, model, tokenizer, *, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 6, batch_size: int = 256, copy_model: bool = True,
                 chat_template: bool = False, system_prompt: str | None = None):
        self.model = copy.deepcopy(model) if copy_model else model
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.top_p = top_p
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self.policy_version = 0
        self.shares_weights = False
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        if self.eos_id is None:
            raise ValueError("the tokenizer has no eos_token_id; completions could never stop")

    @classmethod
    def from_config(cls, model, tokenizer, gen_cfg, copy_model: bool = True) -> "TransformersGenerator":
        """A generator with the sampling settings of a config's `generator` section."""
        return cls(model, tokenizer, temperature=gen_cfg.temperature, top_p=gen_cfg.top_p,
                   max_new_tokens=gen_cfg.max_new_tokens, batch_size=gen_cfg.batch_size,
                   copy_model=copy_model, chat_template=bool(getattr(gen_cfg, "chat_template", False)),
                   system_prompt=getattr(gen_cfg, "system_prompt", None))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Publish new policy weights to the generator; later samples use them."""
        self.model.load_state_dict(state_dict)
        self.policy_version = version

    def share_weights(self, model: torch.nn.Module) -> None:
        """Alias this generator's parameters and buffers to those of `model` (same
        architecture, dtype and device, same process): every in-place change to `model`'s
        weights is then this generator's too; ``load_weights`` still copies into them."""
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        for mine, theirs in ((self.model.named_parameters(), params), (self.model.named_buffers(), buffers)):
            for name, tensor in mine:
                source = theirs.get(name)
                if source is None or source.shape != tensor.shape or source.dtype != tensor.dtype \
                        or source.device != tensor.device:
                    raise ValueError(f"cannot share weights: {name!r} differs between the generator and the model")
                tensor.data = source.data
        self.shares_weights = True

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def close(self) -> None:
        """Nothing to release: the model is an ordinary module (possibly the learner's own
        weights, aliased by ``share_weights``), freed with its last reference. Idempotent."""

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], n: int, seed: int, *, greedy: bool = False,
                 temperature: float | None = None, top_p: float | None = None,
                 max_new_tokens: int | None = None) -> list[list[Sample]]:
        """`n` completions of every prompt; result[i][j] is sample j of prompt i."""
        temperature, top_p, max_new = call_settings(self, temperature, top_p, max_new_tokens)
        encoded = encode_prompts(self.tokenizer, prompts, self.chat_template, self.system_prompt)
        self._check_positions(prompts, encoded, max_new)
        rows = [ids for ids in encoded for _ in range(n)]  # group-major: prompt i's samples adjacent
        if max_new == 0:  # nothing to sample; generate() would still run a forward pass
            empty = [Sample(prompt_ids=list(r), completion_ids=[], logprobs=[], text="",
                            finish_reason="length") for r in rows]
            return [empty[i * n:(i + 1) * n] for i in range(len(prompts))]
        torch.manual_seed(seed)
        flat: list[Sample] = []
        for start in range(0, len(rows), self.batch_size):
            stopping.check("generation")  # a Ctrl-C does not wait for a long evaluation
            flat.extend(self._generate_rows(rows[start:start + self.batch_size], greedy,
                                            temperature, top_p, max_new))
        return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]

    @property
    def max_positions(self) -> int | None:
        """The model's ``max_position_embeddings`` (None if its config does not say)."""
        return getattr(getattr(self.model, "config", None), "max_position_embeddings", None)

    def _check_positions(self, prompts: Sequence[str], encoded: list[list[int]], max_new: int) -> None:
        check_positions(prompts, encoded, max_new, self.max_positions,
                        f"the model's max_position_embeddings={self.max_positions}")

    def _generate_rows(self, rows: list[list[int]], greedy: bool, temperature: float,
                       top_p: float, max_new: int) -> list[Sample]:
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding
            input_ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            attention[i, width - len(r):] = 1
        kwargs = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature,
                                                           top_p=top_p, top_k=0)
        out = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
            max_new_tokens=max_new, eos_token_id=self.eos_id, pad_token_id=self.pad_id,
            return_dict_in_generate=True, output_logits=True, **kwargs,
        )
        new_tokens = out.sequences[:, width:].cpu()                     # (N, T)
        scale = 1.0 if greedy else temperature
        # each step's raw logits (N, V) to the chosen token's log-prob, one step at a time: a
        # stacked (N, T, V) copy and its log-softmax would hold two more copies of every step's
        # logits (with a 49k vocabulary, 256 rows x 32 steps: 1.6 GB each)
        token_logp = torch.stack([
            torch.log_softmax(step.float().cpu() / scale, dim=-1).gather(-1, new_tokens[:, t, None]).squeeze(-1)
            for t, step in enumerate(out.logits)], dim=1) if out.logits else torch.zeros(new_tokens.shape)  # (N, T)
        samples = []
        for i, r in enumerate(rows):
            ids = new_tokens[i].tolist()
            if self.eos_id in ids:
                length, reason = ids.index(self.eos_id) + 1, "stop"
            else:
                length, reason = len(ids), "length"
            completion = ids[:length]
            samples.append(Sample(
                prompt_ids=list(r), completion_ids=completion,
                logprobs=token_logp[i, :length].tolist(),
                text=self.tokenizer.decode(completion, skip_special_tokens=True),
                finish_reason=reason,
            ))
        return samples
