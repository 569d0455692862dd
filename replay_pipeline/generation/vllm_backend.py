"""Sampling with a vLLM engine in the process that uses it (``generator.backend=vllm``): the
learner's in the sync loop; in the async loop (loop.engine=local) each generator process owns
one, built from the published base weights and fed every new version through ``load_weights``,
plus the learner's for evaluation.

Coded against vLLM 0.33.0 (the ``vllm`` extra pins ``vllm==0.33.*``; it brings torch 2.14 and
transformers < 5.21, so it lives in its own environment on a GPU machine:
``pip install -e '.[vllm]'``). Nothing here imports vllm at module level: the package, this
module included, imports without it, and ``import vllm`` happens in
``VLLMGenerator.from_pretrained`` only. Not yet run on a GPU by its author: the engine is
exercised by ``tests/contract/test_generator_contract.py`` on GPU machines; the rest (request
building, output conversion, seeds, weight publication, sleep bookkeeping, the top-p
re-scoring) is tested on CPU with a stand-in engine (``tests/unit/test_vllm_backend.py``).

vLLM APIs used, and where they are documented (docs.vllm.ai, "latest" as of vLLM 0.32/0.33):
- ``vllm.LLM(model, skip_tokenizer_init=True, dtype, gpu_memory_utilization, enforce_eager,
  max_model_len, max_num_seqs, enable_sleep_mode, logprobs_mode="processed_logprobs",
  generation_config="vllm", seed)`` (api/vllm/entrypoints/llm; the engine arguments are
  EngineArgs / ModelConfig fields, configuration/engine_args).
- ``LLM.generate([{"prompt_token_ids": ids}, ...], [SamplingParams, ...], use_tqdm=False)``
  -> RequestOutputs in prompt order, each with ``outputs[j].token_ids``, ``.logprobs`` (one
  ``{token_id: Logprob}`` per generated token), ``.finish_reason``.
- ``SamplingParams(n, temperature, top_p, seed, max_tokens, logprobs=0, stop_token_ids,
  ignore_eos, detokenize)``. ``logprobs=0`` returns the sampled token's log-prob only. With
  ``n > 1`` and a seed, sample j runs with seed + j (vllm/v1/engine/parallel_sampling.py).
- ``LLM.apply_model(fn)`` ("run a function directly on the model inside each worker") to call
  the model's own ``load_weights(iterable of (hf_name, tensor))``; ``LLM.reset_prefix_cache()``;
  ``LLM.sleep(level=1)`` / ``LLM.wake_up(tags=["weights"] | ["kv_cache"])``
  (features/sleep_mode).
- ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (usage/reproducibility: "in offline mode ... makes
  scheduling deterministic").

Decisions:
- Behaviour log-probs follow the project's convention (docs/concepts.md, "Rewards and
  advantages, frozen at generation"): log_softmax(logits / T) of the sampled token, *without*
  top-p truncation. vLLM's ``logprobs_mode`` offers "raw_logprobs" (the default: before
  temperature) and "processed_logprobs" (after temperature *and* top-k/top-p, renormalised over
  the kept tokens; vllm/v1/sample/sampler.py and the Model Runner V2 sampler). Neither is the
  convention in general, so: the engine runs with "processed_logprobs", which *is* the
  convention whenever top_p = 1 (no top-k, min-p or penalties are ever set here) -- the
  paper's training setting and this project's default -- and a call with top_p < 1 is
  re-scored by a teacher-forced pass of a transformers copy of the policy (loaded as the
  learner loads it, kept on the engine's GPU, updated by every ``load_weights``), computing
  exactly what the learner computes. ``generator.rescore_top_p=false`` drops that copy: calls
  with top_p < 1 then keep vLLM's nucleus-renormalised log-probs, which exceed the
  convention by -log(kept mass) per token (huggingface/trl#6789 derives this bias); the
  configuration refuses that for training rollouts (``generator.top_p < 1``), and the
  evaluation that samples with top_p < 1 (pass@1 at T = 0.1, top_p 0.95) reads no
  log-probs. Greedy calls (temperature 0 in vLLM) get temperature-1 log-probs, as the
  transformers backend's do.
- Token ids in, token ids out: prompts are encoded with the project's tokenizer and sent as
  ``prompt_token_ids``; completions are decoded with it (``skip_tokenizer_init=True``, so the
  engine never loads a tokenizer: the built-in character tokenizer works too). Stopping is
  the tokenizer's ``eos_token_id`` alone (``stop_token_ids=[eos]``, ``ignore_eos=True``,
  ``generation_config="vllm"``), so a checkpoint's generation_config.json neither adds stop
  tokens nor changes sampling defaults; the completion is cut at the first <eos>, inclusive,
  exactly like the transformers backend.
- Seeds: request i of a call with seed s gets a seed derived from (s, i) (vLLM adds the
  sample index j); a call is reproducible from its seed, whatever the global RNG. The engine
  core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set unless the
  environment already sets it), which vLLM documents as what makes offline scheduling, and
  so the batches and their numerics, deterministic. vLLM seeds Python's, NumPy's and torch's
  global RNGs when its worker starts in-process; the constructor restores them, so building
  a generator does not move a run's random streams.
- Weights: ``load_weights(state_dict, version)`` hands the learner's Hugging Face-named
  tensors to the model's own ``load_weights`` through ``LLM.apply_model`` (the engine copies
  them into its parameters, so later edits of the source change nothing), checks that every
  engine parameter was written (a silent partial update would make every later ratio wrong),
  then resets the prefix cache (cached KV blocks were computed with the old weights). No
  restart. ``share_weights`` does not exist here: the engine owns its tensors, so
  ``shares_weights`` is always False and the trainer publishes every version. Quantized
  checkpoints (whose loaded weights need post-processing) are not supported.
  With ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` the function and tensors are pickled to the
  engine process, which vLLM allows only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.
- Colocation with the learner on one GPU: ``generator.gpu_memory_utilization`` (default 0.3,
  vLLM's own 0.92 would leave nothing for the learner); ``generator.enable_sleep_mode`` puts
  the engine to sleep at level 1 after every ``generate`` (weights offloaded to CPU memory,
  KV cache dropped) and wakes the weights alone for ``load_weights`` and the KV cache for
  the next ``generate``. Level 2 (weights discarded) is not offered: a generate with no
  publication since the engine slept (the evaluation before step 0, a resume) would need the
  weights kept somewhere else, which is what level 1 does. vLLM's sleep allocator is
  process-wide: one sleeping engine per process.
- ``generator.batch_size`` becomes vLLM's ``max_num_seqs`` (sequences decoded at once); the
  engine batches by itself, so one call submits every prompt.
- Too long for the model: a prompt whose tokens plus max_new_tokens exceed the model's
  max_position_embeddings (or ``generator.max_model_len`` when smaller) is refused before
  sampling with the same ValueError as the transformers backend.
- ``close()`` shuts the engine down and frees its GPU memory; it leaves vLLM's distributed
  state alone, since other engines of the process may still use it.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import os
import random
from functools import partial
from typing import Any, Sequence

import numpy as np
import torch

from replay_pipeline.generation.base import Sample, call_settings, check_positions, encode_prompts
from replay_pipeline.training.learner import collate

log = logging.getLogger(__name__)

VLLM_VERSION = "0.33"
"""The vLLM release this backend was written against (the `vllm` extra pins vllm==0.33.*)."""

VLLM_INSTALL = ("Install the `vllm` extra on a GPU machine, in a separate environment (vLLM 0.33 pins "
                "torch 2.14 and transformers <5.21): pip install -e '.[vllm]'")
"""How to get the backend; part of every refusal."""

LOGPROBS_MODE = "processed_logprobs"
"""vLLM's logprobs_mode: after temperature (and top-p, which is re-scored away)."""

_SEED_SPAN = 2**31 - 2**20
"""Request seeds stay below this so that seed + sample index fits in 31 bits."""

_RESCORE_ELEMENTS = 2**27
"""Re-scoring chunk: rows x positions x vocabulary of float32 log-probs at once (512 MiB)."""


def vllm_unavailable() -> str | None:
    """Why the vLLM backend cannot run here (None when it can), without importing vllm."""
    reasons = []
    if importlib.util.find_spec("vllm") is None:
        reasons.append("vllm is not installed")
    if not torch.cuda.is_available():
        reasons.append("no CUDA GPU is visible (torch.cuda.is_available() is False)")
    return "; ".join(reasons) or None


def request_seeds(seed: int, count: int) -> list[int]:
    """One seed per request (prompt) of a call with `seed`: deterministic, spread over
    [0, 2**31 - 2**20) so that vLLM's seed + sample index cannot overflow 31 bits."""
    if count <= 0:
        return []
    state = np.random.SeedSequence(int(seed) & (2**64 - 1)).generate_state(count, dtype=np.uint64)
    return [int(v) % _SEED_SPAN for v in state]


def engine_settings(gen_cfg: Any) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` (besides the model path) for a `generator` config
    section: the colocation settings, token-ids-only I/O and the log-probs mode."""
    settings: dict[str, Any] = {
        "skip_tokenizer_init": True,
        "dtype": str(getattr(gen_cfg, "dtype", "auto")),
        "gpu_memory_utilization": float(getattr(gen_cfg, "gpu_memory_utilization", 0.3)),
        "enforce_eager": bool(getattr(gen_cfg, "enforce_eager", False)),
        "max_num_seqs": int(getattr(gen_cfg, "batch_size", 256)),
        "logprobs_mode": LOGPROBS_MODE,
        "generation_config": "vllm",
        "seed": 0,
    }
    max_model_len = getattr(gen_cfg, "max_model_len", None)
    if max_model_len is not None:
        settings["max_model_len"] = int(max_model_len)
    if getattr(gen_cfg, "enable_sleep_mode", False):
        settings["enable_sleep_mode"] = True
    return settings


@contextlib.contextmanager
def _preserved_global_rng():
    """Restore Python's, NumPy's and torch's global RNG states afterwards (vLLM's in-process
    worker seeds them when it starts)."""
    py, np_state, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _load_weights_into(weights: list[tuple[str, torch.Tensor]], model) -> list[str]:
    """Runs inside the engine's worker (``LLM.apply_model``): load Hugging Face-named weights
    with the model's own loader; return the engine parameters that were NOT written."""
    target = model
    while not hasattr(target, "load_weights") and callable(getattr(target, "unwrap", None)):
        target = target.unwrap()  # a compilation / CUDA-graph wrapper around the model
    loaded = target.load_weights(iter(weights))
    if loaded is None:  # a loader that does not report what it wrote: nothing to check
        return []
    return sorted({name for name, _ in target.named_parameters()} - set(loaded))


def _max_positions(path: str, max_model_len: int | None) -> int | None:
    # start-up cost: torch/transformers, only on this path
    from transformers import AutoConfig

    limit = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
    if max_model_len is not None:
        limit = int(max_model_len) if limit is None else min(int(limit), int(max_model_len))
    return limit


def _load_scorer(path: str, device: torch.device):
    """The teacher-forced re-scorer: the checkpoint loaded as the learner loads it
    (replay_pipeline.models.loading.load_pretrained: AutoModelForCausalLM.from_pretrained)."""
    # start-up cost: torch/transformers, only on this path
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class VLLMGenerator:
    """G completions per prompt with per-token behaviour log-probs, from a vLLM engine.

    Build it with :meth:`from_pretrained`; the constructor takes a ready engine (``vllm.LLM``
    or a stand-in with the same methods), which is what the CPU tests use."""

    def __init__(self, engine, tokenizer, *, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 6, batch_size: int = 256, max_positions: int | None = None,
                 scorer=None, sleep_mode: bool = False, sampling_params_cls=None,
                 prefix_caching: bool = True, chat_template: bool = False, system_prompt: str | None = None):
        self.engine = engine
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.top_p = top_p
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.max_positions = max_positions
        self.scorer = scorer
        self.sleep_mode = sleep_mode
        self.prefix_caching = prefix_caching
        self._sampling_params_cls = sampling_params_cls
        self._asleep = {"weights": False, "kv_cache": False}
        self._warned_nucleus = False
        self.policy_version = 0
        self.shares_weights = False  # a separate engine: new weights arrive through load_weights only
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        if self.eos_id is None:
            raise ValueError("the tokenizer has no eos_token_id; completions could never stop")

    @classmethod
    def from_pretrained(cls, path: str, tokenizer, gen_cfg) -> "VLLMGenerator":
        """An engine on the Hugging Face checkpoint directory `path` (config.json and weights;
        its tokenizer files are not read), sampling with the settings of a config's
        `generator` section (a GeneratorConfig or the composed DictConfig)."""
        reason = vllm_unavailable()
        if reason:
            raise RuntimeError(f"generator.backend=vllm cannot start: {reason}. {VLLM_INSTALL}")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0" \
                and os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") != "1":
            log.warning("VLLM_ENABLE_V1_MULTIPROCESSING=%s runs the engine in another process: load_weights "
                        "sends it a function (LLM.apply_model), which vLLM accepts only with "
                        "VLLM_ALLOW_INSECURE_SERIALIZATION=1", os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"])
        try:
            # optional dependency: vllm (the vllm extra)
            import vllm
        except Exception as exc:  # a broken install: say so, with the fix
            raise RuntimeError(f"generator.backend=vllm: import vllm failed ({type(exc).__name__}: {exc}). "
                               f"{VLLM_INSTALL}") from exc
        version = str(getattr(vllm, "__version__", "?"))
        if not version.startswith(VLLM_VERSION + "."):
            log.warning("vLLM %s is installed; this backend was written against %s.*", version, VLLM_VERSION)
        settings = engine_settings(gen_cfg)
        prefix_caching = callable(getattr(vllm.LLM, "reset_prefix_cache", None))
        if not prefix_caching:  # cached KV blocks would outlive a weight update
            settings["enable_prefix_caching"] = False
        path = str(path)
        with _preserved_global_rng():
            engine = vllm.LLM(model=path, **settings)
        scorer = None
        if getattr(gen_cfg, "rescore_top_p", True):
            scorer = _load_scorer(path, torch.device("cuda", torch.cuda.current_device()))
        return cls(engine, tokenizer, temperature=gen_cfg.temperature, top_p=gen_cfg.top_p,
                   max_new_tokens=gen_cfg.max_new_tokens, batch_size=gen_cfg.batch_size,
                   max_positions=_max_positions(path, getattr(gen_cfg, "max_model_len", None)),
                   scorer=scorer, sleep_mode=bool(getattr(gen_cfg, "enable_sleep_mode", False)),
                   sampling_params_cls=vllm.SamplingParams, prefix_caching=prefix_caching,
                   chat_template=bool(getattr(gen_cfg, "chat_template", False)),
                   system_prompt=getattr(gen_cfg, "system_prompt", None))

    # ------------------------------------------------------------------ weights
    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Publish new policy weights (Hugging Face names, any device and dtype) to the engine;
        later samples use them. The engine copies them: the caller may change its tensors."""
        engine = self._require_open()
        weights = [(name, tensor.detach()) for name, tensor in state_dict.items()]
        self._wake(weights=True, kv_cache=False)
        missing = sorted({name for result in engine.apply_model(partial(_load_weights_into, weights))
                          for name in (result or ())})
        if missing:
            raise RuntimeError(
                f"load_weights (version {version}) left {len(missing)} engine parameters unwritten, e.g. "
                f"{missing[:5]}: the state dict does not match the checkpoint the engine was built from "
                "(its keys must be the Hugging Face names that save_pretrained writes)")
        self._reset_prefix_cache()
        if self.scorer is not None:
            self.scorer.load_state_dict(state_dict)
        self.policy_version = version

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: Sequence[str], n: int, seed: int, *, greedy: bool = False,
                 temperature: float | None = None, top_p: float | None = None,
                 max_new_tokens: int | None = None) -> list[list[Sample]]:
        """`n` completions of every prompt; result[i][j] is sample j of prompt i."""
        temperature, top_p, max_new = call_settings(self, temperature, top_p, max_new_tokens)
        if not greedy and not temperature > 0:
            raise ValueError(f"temperature={temperature} must be > 0 (use greedy=True for argmax decoding)")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p} must be in (0, 1]")
        encoded = encode_prompts(self.tokenizer, prompts, self.chat_template, self.system_prompt)
        self._check_positions(prompts, encoded, max_new)
        if n <= 0 or not encoded:
            return [[] for _ in encoded]
        if max_new == 0:  # nothing to sample; vLLM refuses max_tokens=0
            return [[Sample(prompt_ids=list(ids), completion_ids=[], logprobs=[], text="",
                            finish_reason="length") for _ in range(n)] for ids in encoded]
        engine = self._require_open()
        per_request = 1 if greedy else n  # greedy samples are identical: decode one, copy it
        params = [self._sampling_params(n=per_request, seed=s, greedy=greedy, temperature=temperature,
                                        top_p=top_p, max_tokens=max_new)
                  for s in request_seeds(seed, len(encoded))]
        self._wake(weights=True, kv_cache=True)
        try:
            outputs = engine.generate([{"prompt_token_ids": list(ids)} for ids in encoded], params,
                                      use_tqdm=False)
        finally:
            self._sleep()
        if len(outputs) != len(encoded):
            raise RuntimeError(f"vLLM returned {len(outputs)} results for {len(encoded)} prompts")
        groups = []
        for ids, out in zip(encoded, outputs):
            completions = sorted(out.outputs, key=lambda c: getattr(c, "index", 0))
            if len(completions) != per_request:
                raise RuntimeError(f"vLLM returned {len(completions)} completions, {per_request} were asked for")
            group = [self._sample(ids, c) for c in completions]
            if greedy:
                group = [Sample(prompt_ids=list(s.prompt_ids), completion_ids=list(s.completion_ids),
                                logprobs=list(s.logprobs), text=s.text, finish_reason=s.finish_reason)
                         for s in group for _ in range(n)]
            groups.append(group)
        if not greedy and top_p < 1:
            if self.scorer is not None:
                self._rescore([s for group in groups for s in group], temperature)
            elif not self._warned_nucleus:
                self._warned_nucleus = True
                log.warning("generator.rescore_top_p is off: log-probs of samples drawn with top_p=%s are "
                            "vLLM's, renormalised over the nucleus, not the untruncated softmax", top_p)
        return groups

    def _sampling_params(self, *, n: int, seed: int, greedy: bool, temperature: float, top_p: float,
                         max_tokens: int):
        cls = self._sampling_params_cls
        if cls is None:
            from vllm import SamplingParams as cls  # noqa: N813

            self._sampling_params_cls = cls
        kwargs: dict[str, Any] = dict(n=n, max_tokens=max_tokens, logprobs=0, stop_token_ids=[self.eos_id],
                                      ignore_eos=True)
        if greedy:
            kwargs["temperature"] = 0.0
        else:
            kwargs.update(temperature=float(temperature), top_p=float(top_p), seed=int(seed))
        try:
            return cls(detokenize=False, **kwargs)  # decoding is ours (the project's tokenizer)
        except TypeError:  # a SamplingParams without `detokenize`
            return cls(**kwargs)

    def _sample(self, prompt_ids: list[int], completion) -> Sample:
        ids = [int(t) for t in completion.token_ids]
        entries = completion.logprobs
        if entries is None or len(entries) < len(ids):
            raise RuntimeError("vLLM returned no log-prob for some sampled tokens (SamplingParams.logprobs=0 "
                               "should give the sampled token's)")
        if self.eos_id in ids:
            length, reason = ids.index(self.eos_id) + 1, "stop"
        elif getattr(completion, "finish_reason", None) == "stop":
            raise RuntimeError(f"vLLM stopped a completion ({ids[-5:]}...) without <eos> ({self.eos_id}) in its "
                               "token ids; the only stop token asked for is <eos>")
        else:
            length, reason = len(ids), "length"
        completion_ids = ids[:length]
        logprobs = []
        for k, token in enumerate(completion_ids):
            entry = entries[k][token]
            logprobs.append(float(getattr(entry, "logprob", entry)))
        return Sample(prompt_ids=list(prompt_ids), completion_ids=completion_ids, logprobs=logprobs,
                      text=self.tokenizer.decode(completion_ids, skip_special_tokens=True),
                      finish_reason=reason)

    @torch.no_grad()
    def _rescore(self, samples: list[Sample], temperature: float) -> None:
        """Replace each sample's log-probs by log_softmax(logits / temperature) of its tokens
        under the scorer (the learner's computation: right-padded prompt + completion)."""
        rows = [s for s in samples if s.completion_ids]
        if not rows:
            return
        device = next(self.scorer.parameters()).device
        vocab = self.scorer.get_output_embeddings().weight.shape[0]
        start = 0
        while start < len(rows):
            width, stop = 0, start
            while stop < len(rows):
                width_next = max(width, len(rows[stop].prompt_ids) + len(rows[stop].completion_ids))
                if stop > start and (stop - start + 1) * width_next * vocab > _RESCORE_ELEMENTS:
                    break
                width, stop = width_next, stop + 1
            chunk = rows[start:stop]
            batch = collate([s.prompt_ids for s in chunk], [s.completion_ids for s in chunk],
                            [s.logprobs for s in chunk], [0.0] * len(chunk), pad_id=self.pad_id)
            input_ids = batch.input_ids.to(device)
            logits = self.scorer(input_ids=input_ids, attention_mask=batch.attention_mask.to(device)).logits
            logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
            token_logp = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1).cpu()
            for i, s in enumerate(chunk):
                first = len(s.prompt_ids) - 1  # logits column t predicts token t + 1
                s.logprobs = token_logp[i, first:first + len(s.completion_ids)].tolist()
            start = stop

    def _check_positions(self, prompts: Sequence[str], encoded: list[list[int]], max_new: int) -> None:
        check_positions(prompts, encoded, max_new, self.max_positions,
                        f"the model's {self.max_positions} (max_position_embeddings, or generator.max_model_len "
                        "when smaller)")

    # ------------------------------------------------------------------ engine state
    def _require_open(self):
        if self.engine is None:
            raise RuntimeError("this VLLMGenerator is closed")
        return self.engine

    def _wake(self, *, weights: bool, kv_cache: bool) -> None:
        tags = [tag for tag, wanted in (("weights", weights), ("kv_cache", kv_cache))
                if wanted and self._asleep[tag]]
        if not tags:
            return
        self.engine.wake_up(tags=tags)
        for tag in tags:
            self._asleep[tag] = False
        if "kv_cache" in tags:
            self._reset_prefix_cache()  # the KV cache's content was dropped while asleep

    def _sleep(self) -> None:
        if self.sleep_mode and self.engine is not None:
            self.engine.sleep(level=1)
            self._asleep = {"weights": True, "kv_cache": True}

    def _reset_prefix_cache(self) -> None:
        if not self.prefix_caching:
            return
        for owner in (self.engine, getattr(self.engine, "llm_engine", None)):
            reset = getattr(owner, "reset_prefix_cache", None)
            if callable(reset):
                reset()
                return
        raise RuntimeError("the engine has no reset_prefix_cache(); build it with enable_prefix_caching=False")

    def close(self) -> None:
        """Shut the engine down and free its GPU memory (and the re-scorer's). Idempotent."""
        engine, self.engine, self.scorer = self.engine, None, None
        if engine is None:
            return
        shutdown = getattr(engine, "shutdown", None)
        if not callable(shutdown):
            shutdown = getattr(getattr(getattr(engine, "llm_engine", None), "engine_core", None), "shutdown", None)
        if callable(shutdown):
            shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


__all__ = ["LOGPROBS_MODE", "VLLM_INSTALL", "VLLM_VERSION", "VLLMGenerator", "engine_settings",
           "request_seeds", "vllm_unavailable"]

