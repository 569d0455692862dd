"""The vLLM backend where vLLM is absent: configuration, validation, presets, the backend
factory, and VLLMGenerator's own logic driven by a stand-in engine.

The real engine is exercised by tests/contract/test_generator_contract.py on GPU machines.
Here a `FakeEngine` with vllm.LLM's methods (generate, apply_model, reset_prefix_cache,
sleep, wake_up, shutdown) returns RequestOutput-shaped results, so request building (seeds,
SamplingParams), output conversion (cut at <eos>, finish reasons, log-probs), weight
publication, sleep bookkeeping and the teacher-forced top-p re-scoring run on CPU.
"""

from __future__ import annotations

import copy
import logging
import os
import random
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from replay_pipeline.config import VLLM_ONLY_FIELDS, ConfigError, GeneratorConfig, load_config
from replay_pipeline.generation import GENERATOR_BACKENDS, TransformersGenerator, build_generator
from replay_pipeline.models.loading import generator_from_pretrained
from replay_pipeline.generation import vllm_backend
from replay_pipeline.generation.vllm_backend import (LOGPROBS_MODE, VLLM_INSTALL, VLLMGenerator,
                                                     engine_settings, request_seeds, vllm_unavailable)
from replay_pipeline.training.learner import collate, token_logprobs_and_entropy
from replay_pipeline.models.tiny import build_tiny_model, build_tokenizer
from replay_pipeline.run.resume import resolve_config

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=0)
PROMPTS = ["1+2=", "012+345=", "99+1="]
HERE = vllm_unavailable()  # why vLLM cannot run on this machine (None on a GPU machine with it)
needs_no_vllm = pytest.mark.skipif(HERE is None, reason="vLLM and a GPU are available here")


@pytest.fixture
def available(monkeypatch):
    """Pretend vLLM and a GPU are there (validation reads vllm_unavailable at call time)."""
    monkeypatch.setattr(vllm_backend, "vllm_unavailable", lambda: None)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tok) -> Path:
    """A tiny LlamaForCausalLM and its tokenizer, written by save_pretrained."""
    path = tmp_path_factory.mktemp("hf-checkpoint")
    build_tiny_model(tok, **TINY).save_pretrained(path)
    tok.save_pretrained(path)
    return path


# --- the package imports without vllm ----------------------------------------------------------

def test_the_package_never_imports_vllm(tmp_path):
    """A `vllm` that raises when imported sits first on the path: the package, the backend
    module, the config (with generator=vllm validated and pre-flighted) and the run's modules
    import without it."""
    poisoned = tmp_path / "vllm"
    poisoned.mkdir()
    (poisoned / "__init__.py").write_text("raise RuntimeError('vllm was imported')\n")
    code = textwrap.dedent("""
        import sys
        import replay_pipeline.generation, replay_pipeline.generation.vllm_backend
        import replay_pipeline.run.build, replay_pipeline.run.loop
        from replay_pipeline.config import ConfigError, load_config
        from replay_pipeline.run.preflight import preflight
        try:
            preflight(load_config(["generator=vllm"]))
        except ConfigError:
            pass
        assert "vllm" not in sys.modules, "vllm was imported"
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


# --- configuration and validation ----------------------------------------------------------------

def test_defaults_leave_the_transformers_backend_unchanged():
    cfg = load_config([])
    assert cfg.generator.backend == "transformers" and "vllm" in GENERATOR_BACKENDS
    for key in VLLM_ONLY_FIELDS:
        assert getattr(cfg.generator, key) == getattr(GeneratorConfig(), key)


@needs_no_vllm
def test_generator_vllm_is_refused_here_with_the_install_message(tmp_path):
    from replay_pipeline.run.preflight import preflight

    with pytest.raises(ConfigError) as err:
        preflight(load_config(["generator=vllm", f"tracking.root_dir={tmp_path}"]))
    text = str(err.value)
    assert "generator.backend=vllm cannot run here" in text
    assert "pip install -e '.[vllm]'" in text and "vLLM 0.33 pins torch 2.14" in text
    assert HERE in text


def test_vllm_unavailable_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(vllm_backend.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reason = vllm_unavailable()
    assert "vllm is not installed" in reason and "no CUDA GPU" in reason


def test_generator_vllm_validates_where_vllm_runs(available):
    cfg = load_config(["generator=vllm"])
    g = cfg.generator
    assert g.backend == "vllm" and g.gpu_memory_utilization == 0.3 and g.dtype == "auto"
    assert g.rescore_top_p is True and g.enable_sleep_mode is False and g.max_model_len is None


@pytest.mark.parametrize("overrides,needle", [
    (["loop=async", "loop.workers=2", "generator.gpu_memory_utilization=0.4"], "below 0.333"),
    (["generator.gpu_memory_utilization=0"], "gpu_memory_utilization=0"),
    (["generator.gpu_memory_utilization=1.5"], "must be in (0, 1]"),
    (["generator.dtype=float8"], "generator.dtype='float8'"),
    (["generator.max_model_len=1"], "max_model_len=1"),
    (["generator.rescore_top_p=false", "generator.top_p=0.9"], "rescore_top_p=true"),
])
def test_invalid_vllm_settings_say_how_to_fix(available, overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(["generator=vllm", *overrides])
    assert needle in str(err.value)


def test_vllm_runs_in_the_async_loops_generator_processes(available):
    cfg = load_config(["generator=vllm", "loop=async", "loop.workers=2", "generator.gpu_memory_utilization=0.3"])
    assert cfg.generator.backend == "vllm" and cfg.loop.mode == "async"


def test_vllm_settings_validate(available):
    cfg = load_config(["generator=vllm", "generator.gpu_memory_utilization=0.5", "generator.dtype=bfloat16",
                       "generator.max_model_len=2048", "generator.enable_sleep_mode=true",
                       "generator.enforce_eager=true", "generator.rescore_top_p=false"])
    assert cfg.generator.max_model_len == 2048 and cfg.generator.enable_sleep_mode


@pytest.mark.parametrize("override", ["generator.gpu_memory_utilization=0.5", "generator.dtype=bfloat16",
                                      "generator.enable_sleep_mode=true", "generator.rescore_top_p=false",
                                      "generator.enforce_eager=true", "generator.max_model_len=64"])
def test_vllm_only_settings_are_refused_with_transformers(override):
    with pytest.raises(ConfigError) as err:
        load_config([override])
    assert "only used by generator.backend=vllm" in str(err.value)


def test_engine_settings():
    settings = engine_settings(GeneratorConfig(backend="vllm", batch_size=12))
    assert settings == {"skip_tokenizer_init": True, "dtype": "auto", "gpu_memory_utilization": 0.3,
                        "enforce_eager": False, "max_num_seqs": 12, "logprobs_mode": "processed_logprobs",
                        "generation_config": "vllm", "seed": 0}
    assert LOGPROBS_MODE == "processed_logprobs"
    more = engine_settings(GeneratorConfig(backend="vllm", max_model_len=4096, enable_sleep_mode=True,
                                           dtype="bfloat16", enforce_eager=True))
    assert more["max_model_len"] == 4096 and more["enable_sleep_mode"] is True
    assert more["dtype"] == "bfloat16" and more["enforce_eager"] is True


# --- the paper's presets ------------------------------------------------------------------------

def _check_paper_settings(cfg):
    assert cfg.model.name == "hf" and cfg.loop.group_size == 16 and cfg.loop.prompts_per_step == 60
    assert cfg.loop.mode == "sync"
    assert cfg.algo.objective == "grpo_clip" and cfg.algo.eps_low == cfg.algo.eps_high == 0.2
    assert cfg.algo.lr == pytest.approx(3.37e-7) and cfg.algo.weight_decay == 0 and cfg.algo.kl_coef == 0
    assert cfg.generator.temperature == 1.0 and cfg.generator.top_p == 1.0


def test_qwen3_preset_composes_and_validates(checkpoint):
    cfg = resolve_config(["experiment=qwen3_0p6b", f"model.path={checkpoint}", "generator=transformers"])
    _check_paper_settings(cfg)
    rollouts = cfg.loop.prompts_per_step * cfg.loop.group_size
    assert rollouts == cfg.loop.minibatch_size == 960  # a batch is 60 prompts' worth of rollouts
    assert cfg.buffer.strategy == "uniform" and cfg.buffer.capacity == 252 * 16
    assert cfg.loop.updates_per_step * cfg.loop.minibatch_size / rollouts == 2  # replay ratio
    assert cfg.generator.backend == "transformers"
    assert load_config(["experiment=qwen3_0p6b", f"model.path={checkpoint}", "generator=transformers",
                        "task=gsm8k", f"task.path={checkpoint}"]).generator.max_new_tokens == 512


def test_qwen3_no_buffer_preset_composes_and_validates(checkpoint):
    cfg = resolve_config(["experiment=qwen3_0p6b_no_buffer", f"model.path={checkpoint}",
                          "generator=transformers"])
    _check_paper_settings(cfg)
    assert cfg.buffer.strategy == "fresh" and cfg.loop.updates_per_step == 1
    assert cfg.loop.minibatch_size == cfg.buffer.capacity == 960


@pytest.mark.parametrize("preset", ["qwen3_0p6b", "qwen3_0p6b_no_buffer"])
def test_qwen3_presets_use_vllm(available, checkpoint, preset):
    cfg = resolve_config([f"experiment={preset}", f"model.path={checkpoint}"])
    assert cfg.generator.backend == "vllm" and cfg.generator.gpu_memory_utilization == 0.3


@needs_no_vllm
def test_qwen3_preset_with_vllm_is_refused_here(checkpoint, tmp_path):
    from replay_pipeline.run.preflight import preflight

    with pytest.raises(ConfigError) as err:
        preflight(resolve_config(["experiment=qwen3_0p6b", f"model.path={checkpoint}",
                                  f"tracking.root_dir={tmp_path}"]))
    assert "pip install -e '.[vllm]'" in str(err.value)


def test_qwen3_preset_needs_the_checkpoint(available):
    with pytest.raises(ConfigError) as err:
        resolve_config(["experiment=qwen3_0p6b"])
    assert "model.path" in str(err.value)


# --- the factory ---------------------------------------------------------------------------------

def test_build_generator_transformers(tok):
    model = build_tiny_model(tok, **TINY)
    gen = build_generator(GeneratorConfig(max_new_tokens=3), model, tok)
    assert isinstance(gen, TransformersGenerator) and gen.max_new_tokens == 3
    assert callable(gen.share_weights)


def test_build_generator_vllm_uses_the_checkpoint_directory(monkeypatch, tok, checkpoint):
    calls = []
    monkeypatch.setattr(VLLMGenerator, "from_pretrained",
                        classmethod(lambda cls, path, tokenizer, gen_cfg: calls.append((path, tokenizer, gen_cfg))
                                    or "engine"))
    cfg = GeneratorConfig(backend="vllm")
    assert build_generator(cfg, object(), tok, checkpoint_dir=checkpoint) == "engine"
    assert calls == [(str(checkpoint), tok, cfg)]
    with pytest.raises(ValueError, match="checkpoint directory"):
        build_generator(cfg, object(), tok)
    with pytest.raises(ValueError, match="not one of"):
        build_generator(GeneratorConfig(backend="sglang"), object(), tok)


@needs_no_vllm
def test_from_pretrained_without_vllm_says_how_to_install(tok, checkpoint):
    with pytest.raises(RuntimeError) as err:
        VLLMGenerator.from_pretrained(str(checkpoint), tok, GeneratorConfig(backend="vllm"))
    assert "pip install -e '.[vllm]'" in str(err.value)


def test_build_generator_copies_the_model_unless_told_not_to(tok):
    model = build_tiny_model(tok, **TINY)
    assert build_generator(GeneratorConfig(), model, tok).model is not model
    assert build_generator(GeneratorConfig(), model, tok, copy_model=False).model is model


def test_generator_from_pretrained_samples_in_place_on_the_device(tok, checkpoint):
    """What an async generator process and flows.evaluate build for generator.backend=transformers."""
    gen = generator_from_pretrained(GeneratorConfig(max_new_tokens=3), checkpoint, torch.device("cpu"))
    assert isinstance(gen, TransformersGenerator) and gen.device == torch.device("cpu")
    assert not any(p.requires_grad for p in gen.model.parameters()) and not gen.model.training
    assert gen.tokenizer.padding_side == "left" and gen.max_new_tokens == 3
    assert [len(g) for g in gen.generate(PROMPTS, n=2, seed=0)] == [2, 2, 2]
    gen.close()
    gen.close()  # nothing to release; idempotent


def test_generator_from_pretrained_builds_vllm_from_the_checkpoint_directory(monkeypatch, tok, checkpoint, tmp_path):
    calls = []
    monkeypatch.setattr(VLLMGenerator, "from_pretrained",
                        classmethod(lambda cls, path, tokenizer, gen_cfg: calls.append((path, tokenizer)) or "engine"))
    cfg = GeneratorConfig(backend="vllm")
    assert generator_from_pretrained(cfg, checkpoint, torch.device("cpu")) == "engine"
    assert generator_from_pretrained(cfg, checkpoint, torch.device("cpu"), checkpoint_dir=tmp_path) == "engine"
    assert [path for path, _ in calls] == [str(checkpoint), str(tmp_path)]
    assert all(t.eos_token_id == tok.eos_token_id and t.padding_side == "left" for _, t in calls)


@needs_no_vllm
def test_an_async_generator_or_evaluation_with_vllm_here_says_how_to_install(checkpoint):
    with pytest.raises(RuntimeError) as err:
        generator_from_pretrained(GeneratorConfig(backend="vllm"), checkpoint, torch.device("cpu"))
    assert "pip install -e '.[vllm]'" in str(err.value)


def test_the_run_builds_by_backend_and_shares_only_when_possible(monkeypatch, tmp_path, tok, checkpoint):
    """build_run asks build_generator (with the checkpoint the policy came from) and calls
    share_weights only on a generator that has it."""
    from replay_pipeline.run import build as trainer
    from replay_pipeline.tracking.tracker import NullTracker

    model = build_tiny_model(tok, **TINY)
    info = {"source": "path", "path": str(checkpoint)}
    monkeypatch.setattr(trainer, "load_policy", lambda cfg, task, paths, log=print: (model, tok, info))
    seen = {}

    class EngineLike:  # a generator with no share_weights, as VLLMGenerator
        shares_weights, policy_version, pad_id, eos_id = False, 0, tok.pad_token_id, tok.eos_token_id

        def load_weights(self, state_dict, version):
            self.policy_version = version

    def fake_build(gen_cfg, model_, tokenizer, *, checkpoint_dir=None):
        seen.update(backend=gen_cfg.backend, model=model_, checkpoint_dir=checkpoint_dir)
        return EngineLike()

    monkeypatch.setattr(trainer, "build_generator", fake_build)
    cfg = load_config([f"tracking.root_dir={tmp_path}", "tracking.progress=false", "task.digits=1",
                       "task.heldout_size=20", "task.validation_size=20", "run_id=wiring"])
    run = trainer.build_run(cfg, log=lambda *_: None, tracker=NullTracker())
    assert isinstance(run.generator, EngineLike)
    assert seen == {"backend": "transformers", "model": model, "checkpoint_dir": str(checkpoint)}


# --- VLLMGenerator with a stand-in engine --------------------------------------------------------

@dataclass
class FakeParams:
    """Records what would be vllm.SamplingParams."""
    n: int
    max_tokens: int
    logprobs: int
    stop_token_ids: list
    ignore_eos: bool
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    detokenize: bool = True


class EngineModel(torch.nn.Module):
    """Stands in for vLLM's model: load_weights takes (Hugging Face name, tensor) pairs, copies
    them into its own parameters and returns the names it wrote."""

    def __init__(self, hf_model):
        super().__init__()
        self.inner = copy.deepcopy(hf_model)

    def load_weights(self, weights):
        params = dict(self.inner.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name in params:
                params[name].data.copy_(tensor)
                loaded.add(f"inner.{name}")
        return loaded


@dataclass
class FakeEngine:
    """The vllm.LLM methods the backend calls. Sampling: per completion, a random.Random seeded
    with the request seed + sample index (vLLM's rule for n > 1); <eos> with probability 1/4;
    the log-prob of the k-th token is -(k + 1) / 10, so conversions can be checked."""
    eos: int
    vocab: int
    model: EngineModel | None = None
    calls: list = field(default_factory=list)
    events: list = field(default_factory=list)

    def generate(self, prompts, params, use_tqdm=True):
        assert use_tqdm is False and len(prompts) == len(params)
        self.calls.append((prompts, params))
        self.events.append("generate")
        outputs = []
        for p in params:
            completions = []
            for j in range(p.n):
                rng = random.Random((p.seed or 0) + j)
                ids = []
                while len(ids) < p.max_tokens:
                    ids.append(self.eos if rng.random() < 0.25 else rng.randrange(4, self.vocab))
                    if ids[-1] in p.stop_token_ids:
                        break
                logprobs = [{t: SimpleNamespace(logprob=-(k + 1) / 10), 99: SimpleNamespace(logprob=-9.0)}
                            for k, t in enumerate(ids)]
                reason = "stop" if ids[-1] in p.stop_token_ids else "length"
                completions.append(SimpleNamespace(index=j, token_ids=tuple(ids), logprobs=logprobs,
                                                   finish_reason=reason))
            outputs.append(SimpleNamespace(outputs=completions[::-1]))  # any order: sorted by index
        return outputs

    def apply_model(self, fn):
        self.events.append("apply_model")
        return [fn(self.model)]

    def reset_prefix_cache(self):
        self.events.append("reset_prefix_cache")

    def sleep(self, level=1):
        self.events.append(("sleep", level))

    def wake_up(self, tags=None):
        self.events.append(("wake_up", tuple(tags)))

    def shutdown(self):
        self.events.append("shutdown")


@pytest.fixture
def policy(tok):
    return build_tiny_model(tok, **TINY).eval()


def make(tok, policy=None, *, scorer=None, sleep_mode=False, max_positions=64, **kw):
    engine = FakeEngine(eos=tok.eos_token_id, vocab=len(tok),
                        model=EngineModel(policy) if policy is not None else None)
    gen = VLLMGenerator(engine, tok, max_new_tokens=5, batch_size=12, max_positions=max_positions,
                        scorer=scorer, sleep_mode=sleep_mode, sampling_params_cls=FakeParams, **kw)
    return gen, engine


def _flat(out):
    return [s for group in out for s in group]


def test_generate_builds_requests_and_converts_outputs(tok):
    gen, engine = make(tok)
    assert gen.policy_version == 0 and gen.shares_weights is False and not hasattr(gen, "share_weights")
    assert gen.eos_id == tok.eos_token_id and gen.pad_id == tok.pad_token_id
    out = gen.generate(PROMPTS, n=8, seed=3, temperature=0.7)
    (prompts, params), = engine.calls
    encoded = [tok(p, add_special_tokens=True)["input_ids"] for p in PROMPTS]
    assert [p["prompt_token_ids"] for p in prompts] == encoded
    assert [p.seed for p in params] == request_seeds(3, len(PROMPTS)) and len({p.seed for p in params}) == 3
    for p in params:
        assert (p.n, p.max_tokens, p.logprobs, p.temperature, p.top_p) == (8, 5, 0, 0.7, 1.0)
        assert p.stop_token_ids == [tok.eos_token_id] and p.ignore_eos is True and p.detokenize is False
    assert [len(g) for g in out] == [8, 8, 8]
    eos = tok.eos_token_id
    for prompt, group in zip(PROMPTS, out):
        for s in group:
            ids = s.completion_ids
            assert s.prompt_ids == tok(prompt, add_special_tokens=True)["input_ids"]
            assert 1 <= len(ids) <= 5 and eos not in ids[:-1] and len(s.logprobs) == len(ids)
            assert s.logprobs == pytest.approx([-(k + 1) / 10 for k in range(len(ids))])
            assert s.finish_reason == ("stop" if ids[-1] == eos else "length")
            assert s.finish_reason == "stop" or len(ids) == 5
            assert s.text == tok.decode(ids, skip_special_tokens=True)
    assert {s.finish_reason for s in _flat(out)} == {"stop", "length"}
    assert len({tuple(s.completion_ids) for s in out[0]}) > 1  # the samples of a group differ


def test_same_seed_same_samples_other_seed_other_samples(tok):
    gen, _ = make(tok)
    a = gen.generate(PROMPTS, n=4, seed=11)
    torch.rand(100), random.random()
    assert gen.generate(PROMPTS, n=4, seed=11) == a
    assert gen.generate(PROMPTS, n=4, seed=12) != a


def test_request_seeds():
    seeds = request_seeds(2**62 + 5, 1000)
    assert seeds == request_seeds(2**62 + 5, 1000) and len(set(seeds)) == 1000
    assert all(0 <= s < 2**31 - 2**20 for s in seeds)
    assert request_seeds(1, 3) != request_seeds(2, 3) and request_seeds(0, 0) == []


def test_per_call_settings_and_config_defaults(tok):
    gen, engine = make(tok, temperature=0.9, top_p=1.0)
    gen.generate(PROMPTS[:1], n=2, seed=0)
    gen.generate(PROMPTS[:1], n=2, seed=0, temperature=1.3, max_new_tokens=2)
    (_, (first,)), (_, (second,)) = engine.calls
    assert (first.temperature, first.max_tokens) == (0.9, 5)
    assert (second.temperature, second.max_tokens) == (1.3, 2)


def test_greedy_decodes_once_and_copies(tok):
    gen, engine = make(tok)
    out = gen.generate(PROMPTS, n=3, seed=8, greedy=True, temperature=0.7)
    (_, params), = engine.calls
    assert all(p.n == 1 and p.temperature == 0.0 and p.seed is None for p in params)
    for group in out:
        assert len(group) == 3 and len({tuple(s.completion_ids) for s in group}) == 1
        assert group[0] is not group[1] and group[0].logprobs is not group[1].logprobs


def test_no_tokens_to_sample_runs_no_engine(tok):
    gen, engine = make(tok)
    out = gen.generate(PROMPTS[:2], n=2, seed=0, max_new_tokens=0)
    assert engine.calls == [] and [[s.completion_ids for s in g] for g in out] == [[[], []], [[], []]]
    assert all(s.finish_reason == "length" and s.text == "" for s in _flat(out))
    assert gen.generate([], n=2, seed=0) == [] and engine.calls == []


def test_refuses_a_prompt_longer_than_the_model(tok):
    gen, engine = make(tok, max_positions=64)
    fits = "1" * (64 - 5 - 1)  # <bos> + prompt + 5 new tokens == 64 positions
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen.generate([PROMPTS[0], fits + "1"], n=1, seed=9)
    assert engine.calls == []
    (s,), = gen.generate([fits], n=1, seed=9)
    assert len(s.prompt_ids) + 5 == 64


def test_a_stop_without_eos_is_an_error(tok):
    gen, engine = make(tok)
    bad = SimpleNamespace(index=0, token_ids=(5, 6), logprobs=[{5: -0.1}, {6: -0.2}], finish_reason="stop")
    engine.generate = lambda prompts, params, use_tqdm: [SimpleNamespace(outputs=[bad])]
    with pytest.raises(RuntimeError, match="without <eos>"):
        gen.generate(PROMPTS[:1], n=1, seed=0)


def test_load_weights_reaches_the_engine_and_is_copied(tok, policy):
    gen, engine = make(tok, policy)
    new = build_tiny_model(tok, **{**TINY, "seed": 1})
    gen.load_weights(new.state_dict(), version=3)
    assert gen.policy_version == 3 and engine.events == ["apply_model", "reset_prefix_cache"]
    for name, tensor in new.state_dict().items():
        assert torch.equal(engine.model.inner.state_dict()[name], tensor), name
    with torch.no_grad():  # the engine copied: editing the published tensors changes nothing
        for p in new.parameters():
            p.zero_()
    assert engine.model.inner.model.norm.weight.abs().sum() > 0


def test_a_partial_weight_update_is_refused(tok, policy):
    gen, _ = make(tok, policy)
    weights = {k: v for k, v in policy.state_dict().items() if k != "model.norm.weight"}
    with pytest.raises(RuntimeError, match="unwritten"):
        gen.load_weights(weights, version=1)
    assert gen.policy_version == 0


def test_sleep_mode_frees_the_engine_between_calls(tok, policy):
    gen, engine = make(tok, policy, sleep_mode=True)
    gen.generate(PROMPTS[:1], n=2, seed=0)
    assert engine.events == ["generate", ("sleep", 1)]
    engine.events.clear()
    gen.load_weights(policy.state_dict(), version=1)  # the weights alone wake for an update
    assert engine.events == [("wake_up", ("weights",)), "apply_model", "reset_prefix_cache"]
    engine.events.clear()
    gen.generate(PROMPTS[:1], n=2, seed=0)  # then the KV cache, for sampling
    assert engine.events == [("wake_up", ("kv_cache",)), "reset_prefix_cache", "generate", ("sleep", 1)]
    engine.events.clear()
    gen.generate(PROMPTS[:1], n=2, seed=0)
    assert engine.events == [("wake_up", ("weights", "kv_cache")), "reset_prefix_cache", "generate", ("sleep", 1)]


def test_no_sleep_without_sleep_mode(tok):
    gen, engine = make(tok)
    gen.generate(PROMPTS[:1], n=2, seed=0)
    assert engine.events == ["generate"]


def test_close_shuts_the_engine_down(tok):
    gen, engine = make(tok)
    gen.close()
    gen.close()
    assert engine.events == ["shutdown"]
    with pytest.raises(RuntimeError, match="closed"):
        gen.generate(PROMPTS, n=1, seed=0)
    with pytest.raises(RuntimeError, match="closed"):
        gen.load_weights({}, version=1)


def _reference(model, samples, temperature, pad_id):
    batch = collate([s.prompt_ids for s in samples], [s.completion_ids for s in samples],
                    [s.logprobs for s in samples], [0.0] * len(samples), pad_id=pad_id)
    with torch.no_grad():
        logp, _ = token_logprobs_and_entropy(model.eval(), batch, temperature)
    return [logp[i, len(s.prompt_ids) - 1:len(s.prompt_ids) - 1 + len(s.completion_ids)].tolist()
            for i, s in enumerate(samples)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_top_p_calls_are_rescored_to_the_untruncated_softmax(tok, policy, temperature):
    scorer = copy.deepcopy(policy)
    gen, _ = make(tok, policy, scorer=scorer)
    samples = _flat(gen.generate(PROMPTS, n=6, seed=4, temperature=temperature, top_p=0.3))
    reference = _reference(policy, samples, temperature, tok.pad_token_id)
    for got, want in zip([s.logprobs for s in samples], reference):
        assert got == pytest.approx(want, abs=1e-5)
    kept = _flat(gen.generate(PROMPTS, n=6, seed=4, temperature=temperature))  # top_p = 1: vLLM's own
    assert all(s.logprobs == pytest.approx([-(k + 1) / 10 for k in range(len(s.completion_ids))]) for s in kept)


def test_the_rescorer_follows_published_weights(tok, policy):
    gen, _ = make(tok, policy, scorer=copy.deepcopy(policy))
    new = build_tiny_model(tok, **{**TINY, "seed": 2})
    gen.load_weights(new.state_dict(), version=1)
    samples = _flat(gen.generate(PROMPTS, n=4, seed=5, top_p=0.5))
    for got, want in zip([s.logprobs for s in samples], _reference(new, samples, 1.0, tok.pad_token_id)):
        assert got == pytest.approx(want, abs=1e-5)


def test_rescoring_in_small_chunks_gives_the_same_numbers(monkeypatch, tok, policy):
    gen, _ = make(tok, policy, scorer=copy.deepcopy(policy))
    whole = _flat(gen.generate(PROMPTS, n=4, seed=6, top_p=0.5))
    monkeypatch.setattr(vllm_backend, "_RESCORE_ELEMENTS", 1)  # one row per forward pass
    rows = _flat(gen.generate(PROMPTS, n=4, seed=6, top_p=0.5))
    for a, b in zip(whole, rows):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_without_the_rescorer_top_p_logprobs_are_vllms(tok, caplog):
    gen, _ = make(tok)
    with caplog.at_level(logging.WARNING, logger=vllm_backend.__name__):
        out = _flat(gen.generate(PROMPTS, n=2, seed=0, top_p=0.5))
        gen.generate(PROMPTS, n=2, seed=0, top_p=0.5)
    assert all(s.logprobs == pytest.approx([-(k + 1) / 10 for k in range(len(s.completion_ids))]) for s in out)
    assert sum("rescore_top_p" in r.message for r in caplog.records) == 1


def test_bad_arguments(tok):
    gen, engine = make(tok)
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen.generate(PROMPTS, n=1, seed=0, max_new_tokens=-1)
    with pytest.raises(ValueError, match="temperature"):
        gen.generate(PROMPTS, n=1, seed=0, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        gen.generate(PROMPTS, n=1, seed=0, top_p=0.0)
    assert engine.calls == []
    assert VLLM_INSTALL.endswith("pip install -e '.[vllm]'")


# --- flows.evaluate with generator=vllm ----------------------------------------------------------

def _target(tmp_path, model_dir, cfg):
    """flows.evaluate's Target for the checkpoint holding `model_dir` (step 3, policy version 7)."""
    from flows.evaluate import Target
    from replay_pipeline.system.runs import RunPaths

    return Target(RunPaths.make(tmp_path / "runs", "ev"), model_dir.parent, 3, 7, None, "", cfg)


@pytest.mark.parametrize("hf_directory", [True, False])
def test_evaluate_builds_the_engine_from_the_checkpoint_or_the_start_policy(
        monkeypatch, available, tmp_path, tok, checkpoint, policy, hf_directory):
    """The checkpoint's model/ is the engine's directory when it holds config.json; otherwise the
    engine builds from the run's starting policy (model.path) and takes the checkpoint's weights."""
    from flows.evaluate import engine_dir, load_generator
    from replay_pipeline.models.loading import read_state_dict

    model_dir = tmp_path / "step-000003" / "model"
    trained = build_tiny_model(tok, **{**TINY, "seed": 5})
    trained.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    if not hf_directory:
        (model_dir / "config.json").unlink()
    cfg = load_config(["generator=vllm", "model=hf", f"model.path={checkpoint}"])
    target = _target(tmp_path, model_dir, cfg)
    built = []

    def from_pretrained(cls, path, tokenizer, gen_cfg):
        gen, engine = make(tokenizer, policy)  # the stand-in engine holds other weights
        built.append((path, engine))
        return gen

    monkeypatch.setattr(VLLMGenerator, "from_pretrained", classmethod(from_pretrained))
    expected = model_dir if hf_directory else checkpoint.resolve()
    assert engine_dir(target, task=None) == expected
    gen = load_generator(target, task=None)
    (path, engine), = built
    assert path == str(expected)
    if hf_directory:
        assert gen.policy_version == 0 and "apply_model" not in engine.events
    else:
        assert gen.policy_version == 7 and "apply_model" in engine.events
        engine_weights = engine.model.inner.state_dict()
        for name, tensor in read_state_dict(model_dir).items():
            assert torch.equal(engine_weights[name], tensor), name
    gen.close()
    assert engine.events[-1] == "shutdown"
