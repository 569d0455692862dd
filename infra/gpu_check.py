#!/usr/bin/env python3
"""The GPU check: what a lent GPU machine runs, prepared so that its minutes go to measuring.

One command, as one `run` call of the device tool (timeout_s=420, then give_back):

    python3 infra/gpu_check.py --out "$OUT"

(`python3`: on the lent machines a plain `python3` is the interpreter that holds torch.) The
script starts no phase after --deadline-s (360 s from its start by default) and gives pytest only
what is left of it, so that the JSON is complete before a 420 s `run` limit; expected time on one
H100 or H200, not yet measured: 2 to 4 minutes.

What it does (docs/guides/gpus-and-vllm.md, "The GPU check"):
1. builds a Qwen3-0.6B-shaped model from the published config values of Qwen/Qwen3-0.6B
   (`QWEN3_0P6B`; random weights, nothing downloaded) in bf16 on CUDA, and a tokenizer built
   in code: the project's character tokenizer (replay_pipeline.models.tiny.build_tokenizer)
   given one character per id of the model's 151,936, so that every sampled id decodes;
2. generates with the project's transformers backend, built as the trainer builds it
   (`build_generator` on the learner's model, then `share_weights`): 8 prompts x 16
   completions, 512 new tokens, temperature 1, top_p 1, per-token log-probs; timed (after a
   two-token warm-up), with tokens a second and the part spent inside `model.generate`;
3. runs the GRPO-clip learner (replay_pipeline.training.learner.Learner, AdamW) over those 128
   rollouts, every rollout once, in minibatches of --minibatch-size rows (16: see "Memory");
   timed, each step's seconds and diagnostics kept;
4. mu = generation seconds / learner seconds for that batch (the paper: 6.84 for Qwen3-0.6B,
   with vLLM generating; this is the transformers backend, far slower per token, so expect a
   larger mu), and the learner's log-probs against the generator's on the same weights (max,
   mean and 99th percentile of the absolute difference over every completion token), taken
   before the first update;
5. runs pytest in subprocesses (`tests_step`): the generator contract suite
   (tests/contract/test_generator_contract.py) with its transformers case's generator on the
   check's device, and the `gpu`-marked tests of tests/integration/test_device_and_close.py
   (the CUDA learner test). A file whose imports fail on this machine is not run: the JSON
   says which import failed. Its outcome is recorded; a failing test does not change this
   script's exit status;
6. writes everything to <out>/gpu_check.json (rewritten after every phase, so a run cut off
   leaves what it measured), pytest's output and junit XML beside it. <out> is --out, else
   $OUT, else runs/gpu-check/.

Exit status: 0 when the measurements (1-4) ran, whatever pytest said; 1 when one of them
failed (the error is in the JSON) or the device is not there.

The contract suite has no CUDA case of its own (its vLLM case is the only `gpu`-marked one, and
skips without vLLM). This file is also a pytest plugin (`-p gpu_check`, with infra/ on the
path): when GPU_CHECK_GENERATOR_DEVICE is set it builds the suite's transformers generators on
that device, a float32 copy of the suite's CPU model, so every check compares a CUDA generator
with the learner's CPU float32 re-scoring (as the vLLM case does). The share_weights check is
skipped there: a CUDA generator cannot alias the suite's CPU model, and refuses to by design.

What the lent machine lacks: lancedb, prefect, mlflow, vllm, omegaconf and hydra. The script
imports only the bare modules (training, algo, generation, models: infra/check_imports.py) and
builds the generator's settings as a SimpleNamespace, because GeneratorConfig lives in
replay_pipeline.config, which imports omegaconf and hydra. The pytest step needs them (the
tests' conftest imports replay_pipeline.config): carry them as wheels, or that step records
"not run". Here, in the repository root (antlr4-python3-runtime 4.9.3 exists only as a source
archive; its wheel is built here, pure Python):

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 -d .whl omegaconf==2.3.1 hydra-core==1.3.8
    python3 -m pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3

and the `run` call carries [".whl"] with the command

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site; python3 infra/gpu_check.py --out "$OUT"

The suite (tests/unit/test_gpu_check.py) runs it on a CPU at a tiny shape:

    OMP_NUM_THREADS=1 python infra/gpu_check.py --device cpu --tiny --no-pytest --out /tmp/gpu-check

(`--tiny`: the same architecture class with 2 layers, a 128-id vocabulary, 2 prompts x 2
completions x 8 tokens, float32). Every shape flag overrides the profile's value.

Memory (estimates, the reason for the defaults; none measured on a GPU yet):
- The transformers backend asks `generate` for every step's logits, float32 (transformers 5
  copies them to float32), stacks them on the GPU and moves them to the CPU for the
  log-softmax: per generate call about rows x 512 x 151,936 x 4 B = 0.31 GB a row, twice on
  the GPU (the list and the stack) and three times on the host (the copy, / temperature, the
  log-softmax), plus the KV cache. 128 rows in one call (the config's default
  generator.batch_size is 256) would need about 88 GB of GPU memory (more than an H100's) and
  120 GB of host memory (most of the machine's 128 GiB). --gen-batch-size 64 (two calls) needs
  about 44 GB and 60 GB; it is lowered further when 70% of the host's MemAvailable or of the
  GPU's free memory would not hold it (`generation_bytes`), and halved on a CUDA out-of-memory
  error.
- The learner scores a whole minibatch in one forward pass (no gradient accumulation): about
  2.6 MB a token is kept for the backward pass (about 70 KB per layer, read on a CPU from
  autograd's saved tensors at this width, and 0.6 MB of float32 log-softmax over the
  vocabulary), 1.4 GB a 530-token row, plus several vocabulary-wide float32 temporaries.
  All 128 rows in one step would need over 250 GB; 16 rows about 40 GB. So the learner phase
  is 8 steps of 16 rows (every rollout once), halved on an out-of-memory error, and mu compares
  the generation of the batch with one pass of the learner over it. --minibatch-size 128 asks
  for the single step.
"""

from __future__ import annotations

import time

STARTED = time.monotonic()
"""When the process started this module (before torch and transformers load): --deadline-s counts from here."""

import argparse
import ast
import copy
import gc
import inspect
import json
import math
import os
import platform
import resource
import subprocess
import sys
import traceback
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script (or loaded as a pytest plugin): the library of this checkout
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from replay_pipeline.algo.scoring import group_advantages  # noqa: E402
from replay_pipeline.generation import TransformersGenerator, build_generator  # noqa: E402
from replay_pipeline.models.tiny import DEFAULT_CHARS, SPECIAL_TOKENS, build_tokenizer  # noqa: E402
from replay_pipeline.training.learner import Learner, collate, token_logprobs_and_entropy  # noqa: E402

#: Qwen/Qwen3-0.6B's published config.json (Hugging Face), the values that fix its shape.
QWEN3_0P6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                  rope_theta=1_000_000, rms_norm_eps=1e-6, tie_word_embeddings=True)
#: --tiny: the same architecture class (Qwen3ForCausalLM, grouped-query attention, tied embeddings).
TINY_MODEL = dict(QWEN3_0P6B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256)
#: The run's shape: the first GPU run's (docs/guides/gpus-and-vllm.md) by default, --tiny's for the CPU test.
FULL_SHAPE = dict(device="cuda", dtype="bfloat16", prompts=8, completions=16, max_new_tokens=512,
                  gen_batch_size=64, minibatch_size=16, prompt_chars=32)
TINY_SHAPE = dict(device="cuda", dtype="float32", prompts=2, completions=2, max_new_tokens=8,
                  gen_batch_size=64, minibatch_size=16, prompt_chars=8)
PAPER_MU = 6.84
"""mu the paper measured for Qwen3-0.6B (vLLM generating)."""
TEMPERATURE = 1.0
LR = 3.37e-7
"""The Qwen3-0.6B preset's learning rate (conf/experiment/qwen3_0p6b.yaml); the step is timed, not judged."""
HEAVY = ("lancedb", "lance", "prefect", "mlflow", "omegaconf", "hydra", "vllm")
"""Not on the lent machine (omegaconf and hydra can be carried): this script imports none of them."""
DEVICE_ENV = "GPU_CHECK_GENERATOR_DEVICE"
"""Set for the pytest subprocess: the contract suite's transformers generators go to this device."""
PYTEST_RUNS = (
    dict(name="contract", file="tests/contract/test_generator_contract.py", args=[],
         what="the generator contract suite: its transformers case with the generator on the check's device "
              "(this file as a pytest plugin); its vllm case (marked gpu) skips without vllm"),
    dict(name="gpu_marked", file="tests/integration/test_device_and_close.py", args=["-m", "gpu"],
         what="the gpu-marked tests of this file: the CUDA learner test"),
)
WHEELS_HINT = ("carry omegaconf, hydra-core and antlr4-python3-runtime as wheels (.whl; infra/gpu_check.py's "
               "docstring says how): the tests' conftest imports replay_pipeline.config")
GIB = 1024 ** 3


# --- the model, the tokenizer, the prompts ---------------------------------------------------------

def qwen3_config(shape: dict | None = None, *, pad_token_id: int = 0, bos_token_id: int = 1,
                 eos_token_id: int = 2) -> Qwen3Config:
    """The model's configuration (default: Qwen3-0.6B's shape), with the check tokenizer's
    special ids (build_tokenizer's: <pad> 0, <bos> 1, <eos> 2). Nothing is built. The rotary
    base goes where this transformers reads it (5.x: rope_parameters; 4.x: rope_theta)."""
    kwargs = dict(QWEN3_0P6B if shape is None else shape)
    theta = kwargs.pop("rope_theta")
    if "rope_parameters" in inspect.signature(Qwen3Config.__init__).parameters:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:
        kwargs["rope_theta"] = theta
    return Qwen3Config(**kwargs, pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id)


def rope_theta(config) -> float | None:
    """The rotary base, wherever this transformers keeps it (5.x: rope_parameters)."""
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_theta", getattr(config, "rope_theta", None))


def config_summary(config) -> dict:
    """The shape-defining values of `config`, as QWEN3_0P6B names them, and its model type."""
    out = {k: getattr(config, k) for k in QWEN3_0P6B if k != "rope_theta"}
    return {"model_type": config.model_type, **out, "rope_theta": rope_theta(config)}


def parameter_count(config) -> int:
    """Parameters of a Qwen3ForCausalLM with `config`, from the config alone (tied embeddings
    counted once): embeddings, per layer q/k/v/o, q_norm/k_norm, the gated MLP and two norms,
    the final norm, an untied head."""
    h, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    layer = h * q + 2 * h * kv + q * h + 2 * d + 3 * h * f + 2 * h
    head = 0 if config.tie_word_embeddings else config.vocab_size * h
    return config.vocab_size * h + config.num_hidden_layers * layer + h + head


def check_tokenizer(vocab_size: int, max_positions: int):
    """The project's character tokenizer with one character per model id: DEFAULT_CHARS (the
    prompts' digits, + and =) then code points from U+0100 up, surrogates skipped."""
    need = vocab_size - len(SPECIAL_TOKENS) - len(DEFAULT_CHARS)
    if need < 0:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's "
                         f"{len(SPECIAL_TOKENS) + len(DEFAULT_CHARS)} base tokens")
    fillers, cp = [], 0x100
    while len(fillers) < need:
        if not 0xD800 <= cp <= 0xDFFF:
            fillers.append(chr(cp))
        cp += 1
    tok = build_tokenizer(DEFAULT_CHARS + "".join(fillers))
    tok.model_max_length = max_positions
    return tok


def make_prompts(n: int, chars: int, seed: int) -> list[str]:
    """`n` addition prompts ("123+456=") of about `chars` characters, of different lengths
    (left padding is exercised)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        size = max(4, chars - i % 3)
        a = (size - 2) // 2
        digits = "".join(map(str, rng.integers(0, 10, size - 2)))
        out.append(f"{digits[:a]}+{digits[a:]}=")
    return out


def build_model(config, device: torch.device, dtype: torch.dtype, seed: int) -> Qwen3ForCausalLM:
    """Random weights (transformers' initialisation, seeded), built on `device`, in `dtype`."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    model = model.to(dtype)
    gen = model.generation_config
    gen.pad_token_id, gen.bos_token_id, gen.eos_token_id = (config.pad_token_id, config.bos_token_id,
                                                            config.eos_token_id)
    return model


# --- timing and memory -------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    """(fn(), its seconds), the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device) -> dict:
    """Peak GPU memory since the last reset_peak (GiB; None on the CPU) and the process's peak
    resident host memory so far."""
    out = {"peak_host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}
    if device.type == "cuda":
        out["peak_gpu_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        out["peak_gpu_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
    else:
        out["peak_gpu_allocated_gib"] = None
    return out


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def generation_bytes(rows: int, prompt_tokens: int, max_new: int, config) -> dict:
    """Estimated memory of one generate() call of the transformers backend on `rows` rows: the
    float32 logits of every step twice on the GPU (generate's list, then the stack) plus the
    KV cache, and three times on the host (the copy, / temperature, the log-softmax)."""
    logits = rows * max_new * config.vocab_size * 4
    kv = (rows * (prompt_tokens + max_new) * config.num_hidden_layers * 2 * config.num_key_value_heads
          * config.head_dim * 2)
    return {"gpu": 2 * logits + kv, "host": 3 * logits}


def fit_gen_batch(requested: int, rows: int, need: Callable[[int], dict], host_free: int | None,
                  gpu_free: int | None, share: float = 0.7) -> tuple[int, str | None]:
    """The generator batch size to use: `requested` (at most `rows`), halved while need(size)
    would take more than `share` of the host's or the GPU's free memory; and why it was lowered."""
    size = max(1, min(requested, rows))
    why = None
    while size > 1:
        est = need(size)
        over = [name for name, free in (("host", host_free), ("gpu", gpu_free))
                if free is not None and est[name] > share * free]
        if not over:
            break
        why = (f"lowered from {min(requested, rows)}: {size} rows a call would need about "
               + ", ".join(f"{est[n] / GIB:.0f} GiB of {n} memory" for n in over)
               + f" (over {share:.0%} of what is free)")
        size //= 2
    return size, why


def halving(run: Callable[[int], Any], size: int, device: torch.device) -> tuple[Any, int, list[dict]]:
    """run(size), halving `size` after each CUDA out-of-memory error (down to 1): (result, the
    size that ran, the attempts that ran out of memory)."""
    attempts: list[dict] = []
    while True:
        try:
            return run(size), size, attempts
        except torch.cuda.OutOfMemoryError as exc:
            attempts.append({"size": size, "error": str(exc).splitlines()[0][:300]})
            free_memory(device)
            if size <= 1:
                raise
            size //= 2


# --- the phases --------------------------------------------------------------------------------

def generate_phase(generator, prompts: list[str], completions: int, seed: int, size: int,
                   device: torch.device) -> tuple[list, dict]:
    """All completions, timed; the seconds inside the model's generate() counted apart (the rest
    is the backend's own work: the logits' log-softmax on the CPU, decoding)."""
    inner = generator.model.generate
    spent: list[float] = []

    def counted(*args, **kwargs):
        out, seconds = timed(device, lambda: inner(*args, **kwargs))
        spent.append(seconds)
        return out

    def run(batch: int):
        spent.clear()
        generator.batch_size = batch
        return timed(device, lambda: generator.generate(prompts, n=completions, seed=seed))

    generator.model.generate = counted  # an instance attribute: the module's method is untouched
    try:
        (groups, seconds), used, attempts = halving(run, size, device)
    finally:
        del generator.model.generate
    samples = [s for group in groups for s in group]
    tokens = sum(len(s.completion_ids) for s in samples)
    reasons = [s.finish_reason for s in samples]
    return samples, {
        "seconds": seconds, "rows": len(samples), "generate_calls": len(spent), "gen_batch_size": used,
        "out_of_memory_attempts": attempts, "model_generate_seconds": sum(spent),
        "backend_rest_seconds": seconds - sum(spent),
        "generated_tokens": tokens, "tokens_per_second": tokens / seconds,
        "completion_tokens_mean": tokens / len(samples),
        "finish_reasons": {r: reasons.count(r) for r in sorted(set(reasons))},
        "prompt_tokens": sorted({len(s.prompt_ids) for s in samples}),
    }


@torch.no_grad()
def logprob_phase(learner: Learner, samples: list, chunk: int, device: torch.device) -> dict:
    """The learner's re-scoring (collate + token_logprobs_and_entropy, as Learner.step does)
    against the generator's behaviour log-probs, every completion token, same weights."""
    diffs = []
    chunk = max(1, min(chunk, len(samples)))
    for start in range(0, len(samples), chunk):
        part = samples[start:start + chunk]
        batch = collate([s.prompt_ids for s in part], [s.completion_ids for s in part],
                        [s.logprobs for s in part], [0.0] * len(part), learner.pad_id).to(device)
        logp, _ = token_logprobs_and_entropy(learner.model, batch, learner.temperature)
        on = batch.completion_mask > 0
        diffs.append((logp[on] - batch.behaviour_logprobs[on]).abs().float().cpu())
    d = torch.cat(diffs).double()
    return {"tokens": d.numel(), "max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()),
            "p99_abs_diff": float(torch.quantile(d, 0.99)) if d.numel() else None}


def learn_phase(learner: Learner, rows: dict, size: int, device: torch.device) -> dict:
    """Learner.step over every rollout once, in minibatches of `size` rows (halved on an
    out-of-memory error, the pass then restarted), timed."""
    n = len(rows["advantage"])
    size = max(1, min(size, n))

    def run(batch: int):
        steps, metrics = [], []
        for start in range(0, n, batch):
            part = {k: v[start:start + batch] for k, v in rows.items()}
            m, seconds = timed(device, lambda: learner.step(part))
            steps.append(seconds)
            metrics.append(m)
        return steps, metrics

    (steps, metrics), used, attempts = halving(run, size, device)
    return {"seconds": sum(steps), "steps": len(steps), "minibatch_size": used, "step_seconds": steps,
            "out_of_memory_attempts": attempts, "tokens": sum(m["tokens"] for m in metrics),
            "step_metrics": [{k: m[k] for k in ("loss", "ratio_mean", "ratio_max", "kl_behaviour",
                                                "clip_frac", "grad_norm", "entropy", "tokens")}
                             for m in metrics]}


# --- the pytest step ---------------------------------------------------------------------------

def module_imports(path: Path) -> list[str]:
    """The modules `path` imports at its top level (absolute imports; `from x import y` as x)."""
    names: list[str] = []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module not in (None, "__future__"):
            names.append(node.module)
    return list(dict.fromkeys(names))


_PROBE = """
import importlib, json, sys
for name in {blocked!r}:
    sys.modules[name] = None
failed = {{}}
for name in {names!r}:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        failed[name] = f"{{type(exc).__name__}}: {{exc}}"[:300]
print(json.dumps(failed))
"""


def missing_imports(files: list[Path], blocked: tuple[str, ...] = (), timeout: float = 300) -> dict[str, str]:
    """The top-level imports of `files` that fail here, each with its error, tried in a fresh
    interpreter from the repository root (`blocked` modules made unimportable first, to ask what
    a machine without them would say)."""
    names = list(dict.fromkeys(n for f in files for n in module_imports(f)))
    code = _PROBE.format(blocked=tuple(blocked), names=names)
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, env=dict(os.environ, PYTHONPATH=_pythonpath()))
    except subprocess.TimeoutExpired:
        return {"(import probe)": f"timed out after {timeout:.0f} s"}
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"(import probe)": f"exit {done.returncode}: {done.stderr[-500:]}"}


def _pythonpath(*first: str) -> str:
    parts = [*first, str(ROOT), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in parts if p)


def junit_counts(path: Path) -> dict | None:
    """tests, failures, errors, skipped (and the failing tests' names) of a junit XML report."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["failed_tests"] = [f"{case.get('classname')}::{case.get('name')}" for case in root.iter("testcase")
                              if case.find("failure") is not None or case.find("error") is not None]
    return counts


def run_pytest(spec: dict, device: str, out_dir: Path, timeout: float, keyword: str | None = None,
               blocked: tuple[str, ...] = (), nodes: list[str] | None = None) -> dict:
    """One pytest run of `spec` (PYTEST_RUNS) in a subprocess, with this file as a plugin putting
    the contract suite's transformers generators on `device` (`keyword`: pytest's -k; `nodes`:
    only these tests of the file, e.g. "test_x[transformers]"). Never raises for a test outcome:
    the record says passed, failed, all skipped, no tests collected, timed out or not run (and
    why)."""
    path = ROOT / spec["file"]
    record: dict = {"file": spec["file"], "what": spec["what"], "device": device}
    deadline = time.monotonic() + timeout
    if not path.exists():
        return record | {"status": "not run", "reason": f"{spec['file']} does not exist"}
    conftest = ROOT / "tests" / "conftest.py"  # pytest loads it for every file under tests/
    missing = missing_imports([path, *([conftest] if conftest.parent in path.resolve().parents else [])],
                              blocked, timeout=min(timeout, 180))
    if missing:
        record |= {"status": "not run", "reason": "its imports (or the tests' conftest's) fail on this machine",
                   "failed_imports": missing}
        if any(n in e for e in missing.values() for n in ("omegaconf", "hydra", "antlr4")):
            record["hint"] = WHEELS_HINT
        return record
    xml = out_dir / f"pytest-{spec['name']}.xml"
    xml.unlink(missing_ok=True)  # counts come from this run's report only
    command = [sys.executable, "-m", "pytest", "-o", "addopts=", "-ra", "-p", "no:cacheprovider",
               "-p", Path(__file__).stem, f"--junitxml={xml}", *spec["args"],
               *(["-k", keyword] if keyword else []),
               *([f"{spec['file']}::{n}" for n in nodes] if nodes else [spec["file"]])]
    record["command"] = " ".join(command[1:])
    env = dict(os.environ, PYTHONPATH=_pythonpath(str(Path(__file__).resolve().parent)), **{DEVICE_ENV: device})
    start = time.monotonic()
    timeout = max(deadline - start, 1)
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        (out_dir / f"pytest-{spec['name']}.txt").write_text(output)
        return record | {"status": "timed out", "seconds": time.monotonic() - start, "timeout_s": timeout,
                         "output_tail": output[-3000:]}
    output = done.stdout + done.stderr
    (out_dir / f"pytest-{spec['name']}.txt").write_text(output)
    counts = junit_counts(xml)
    status = {0: "passed", 5: "no tests collected"}.get(done.returncode, "failed")
    if status == "passed" and counts and counts["passed"] == 0:
        status = "all skipped"
    return record | {"status": status, "returncode": done.returncode, "seconds": time.monotonic() - start,
                     "counts": counts, "output_tail": output[-3000:]}


def tests_step(device: str, out_dir: Path, timeout: float, keyword: str | None = None,
                runs: tuple[dict, ...] | None = None) -> dict:
    """Every run of `runs` (default PYTEST_RUNS) within `timeout` seconds in all. `ok`: none
    failed or timed out (a run not made for want of imports, or all skipped, is not a failure:
    `summary` says which)."""
    deadline = time.monotonic() + timeout
    records = []
    for spec in PYTEST_RUNS if runs is None else runs:
        left = deadline - time.monotonic()
        if left < 20:
            records.append({"file": spec["file"], "status": "not run", "reason": "the check's deadline"})
            continue
        records.append(run_pytest(spec, device, out_dir, left, keyword))
    ok = not any(r["status"] in ("failed", "timed out") for r in records)
    summary = ", ".join(f"{r['file']}: {r['status']}" for r in records)
    return {"status": "ran", "ok": ok, "summary": summary, "runs": records}


# --- the pytest plugin (`-p gpu_check`, active when GPU_CHECK_GENERATOR_DEVICE is set) ----------

_BUILT: list[str] = []


def _make_on_device(model, tokenizer, cfg, workdir):
    """The contract suite's transformers factory, on GPU_CHECK_GENERATOR_DEVICE: a copy of the
    suite's CPU float32 model moved there, owned by the generator."""
    generator = TransformersGenerator.from_config(copy.deepcopy(model).to(os.environ[DEVICE_ENV]), tokenizer,
                                                  cfg, copy_model=False)
    _BUILT.append(str(generator.device))
    return generator


def pytest_collection_modifyitems(config, items):
    device = os.environ.get(DEVICE_ENV)
    if not device:
        return
    # pytest: only here, where pytest itself loaded this file as a plugin
    import pytest

    for item in items:
        spec = getattr(getattr(item, "module", None), "TRANSFORMERS", None)
        if spec is None or getattr(spec, "name", None) != "transformers":
            continue
        object.__setattr__(spec, "make", _make_on_device)  # the suite's Backend is a frozen dataclass
        callspec = getattr(item, "callspec", None)
        on_it = callspec is not None and callspec.params.get("backend") is spec
        if device != "cpu" and on_it and item.originalname == "test_share_weights_when_supported":
            item.add_marker(pytest.mark.skip(
                reason=f"gpu_check: the generator on {device} cannot alias the suite's CPU model "
                       "(share_weights refuses another device by design)"))


def pytest_terminal_summary(terminalreporter):
    if os.environ.get(DEVICE_ENV):
        terminalreporter.write_line(f"gpu_check plugin: {len(_BUILT)} transformers generator(s) built on "
                                    f"{sorted(set(_BUILT)) or os.environ[DEVICE_ENV]}")


# --- the run -----------------------------------------------------------------------------------

def environment(device: torch.device) -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "numpy": np.__version__,
           "torch_cuda": torch.version.cuda, "torch_threads": torch.get_num_threads(),
           "cpu_count": os.cpu_count(), "platform": platform.platform(),
           "host_memory_available_gib": (host_available_bytes() or 0) / GIB or None,
           "cuda_available": torch.cuda.is_available()}
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        out |= {"device_name": props.name, "device_memory_gib": props.total_memory / GIB,
                "device_capability": f"{props.major}.{props.minor}",
                "multiprocessors": props.multi_processor_count}
    else:
        out["device_name"] = platform.processor() or "cpu"
    try:
        out["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                           text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["git_commit"] = None
    return out


class Report(dict):
    """The JSON, rewritten whole (through a temporary file) every time it is saved."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def save(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self, indent=2, default=str) + "\n")
        tmp.replace(self.path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder for gpu_check.json (default: $OUT, else runs/gpu-check/)")
    p.add_argument("--tiny", action="store_true",
                   help="2 layers, a 128-id vocabulary, 2 prompts x 2 completions x 8 tokens, float32")
    p.add_argument("--device", help="cuda (default), cuda:N or cpu")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                   help="bfloat16 (default), float32 with --tiny")
    for flag, what in (("prompts", "prompts (8)"), ("completions", "completions a prompt (16)"),
                       ("max-new-tokens", "new tokens a completion (512)"),
                       ("gen-batch-size", "rows a generate() call, lowered to fit memory (64)"),
                       ("minibatch-size", "rows a learner step (16)"),
                       ("prompt-chars", "characters a prompt, about (32)")):
        p.add_argument(f"--{flag}", type=int, help=what)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--deadline-s", type=float, default=360.0,
                   help="start no phase after this many seconds from the process's start, and give pytest only "
                        "what is left, so the JSON is complete before the run's limit (default 360)")
    p.add_argument("--no-pytest", action="store_true", help="skip the pytest step (recorded as skipped)")
    p.add_argument("--pytest-k", help="run only the tests matching this -k expression in the pytest step")
    args = p.parse_args(argv)
    profile = TINY_SHAPE if args.tiny else FULL_SHAPE
    for key, default in profile.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    for key in ("prompts", "completions", "max_new_tokens", "gen_batch_size", "minibatch_size", "prompt_chars"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """The check; `started`: the monotonic time --deadline-s counts from (default: now)."""
    args = parse_args(argv)
    started = time.monotonic() if started is None else started
    out_dir = Path(args.out or os.environ.get("OUT") or ROOT / "runs" / "gpu-check")
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    report = Report(out_dir / "gpu_check.json")
    shape = dict(TINY_MODEL if args.tiny else QWEN3_0P6B)
    report |= {"check": "infra/gpu_check.py", "status": "running", "argv": sys.argv[1:] if argv is None else argv,
               "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "environment": environment(device),
               "shape": {k: getattr(args, k) for k in (*FULL_SHAPE, "seed")} | {"tiny": args.tiny,
                                                                               "temperature": TEMPERATURE},
               "phases": {}, "errors": []}
    report["shape"]["device"] = str(device)
    report.save()

    def log(line: str) -> None:
        print(f"[gpu_check {time.monotonic() - started:6.1f}s] {line}", flush=True)

    measured = False
    if device.type == "cuda" and not torch.cuda.is_available():
        report["errors"].append(f"--device {args.device}: torch sees no CUDA GPU (torch {torch.__version__})")
    else:
        try:
            measured = measure(args, device, shape, report, log, started)
        except Exception as exc:  # recorded in the JSON, which is the point of the run
            report["errors"].append("".join(traceback.format_exception(exc))[-4000:])
            log(f"measurement failed: {type(exc).__name__}: {exc}")
        report.save()
    free_memory(device)

    if args.no_pytest:
        report["pytest"] = {"status": "skipped", "reason": "--no-pytest"}
    elif device.type == "cuda" and not torch.cuda.is_available():
        report["pytest"] = {"status": "skipped", "reason": "no CUDA GPU"}
    else:
        left = args.deadline_s - (time.monotonic() - started)
        log(f"pytest step ({left:.0f} s left)")
        report["pytest"] = tests_step(str(device), out_dir, max(left, 0), args.pytest_k)
        for run in report["pytest"]["runs"]:
            log(f"pytest {run['file']}: {run['status']} {run.get('counts') or run.get('reason') or ''}")
    report["seconds"] = time.monotonic() - started
    report["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    report["status"] = "done" if measured else "failed"
    report.save()
    log(f"wrote {report.path} (status {report['status']})")
    return 0 if measured else 1


def measure(args, device: torch.device, shape: dict, report: Report, log, started: float) -> bool:
    """Phases 1-4 into report["phases"] and report["result"]; True when all of them ran."""
    phases = report["phases"]
    dtype = getattr(torch, args.dtype)

    def check_deadline(what: str) -> bool:
        if time.monotonic() - started > args.deadline_s:
            report["errors"].append(f"{what}: not started, past the --deadline-s of {args.deadline_s:g} s")
            return False
        return True

    # 1. the model and the tokenizer
    reset_peak(device)
    tok = check_tokenizer(shape["vocab_size"], shape["max_position_embeddings"])
    config = qwen3_config(shape, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id)
    model, seconds = timed(device, lambda: build_model(config, device, dtype, args.seed))
    built = sum(p.numel() for p in model.parameters())
    report["model"] = {"class": type(model).__name__, "config": config_summary(model.config),
                       "parameters": built, "parameters_from_config": parameter_count(config),
                       "dtype": str(next(model.parameters()).dtype), "device": str(next(model.parameters()).device),
                       "attn_implementation": getattr(model.config, "_attn_implementation", None),
                       "tokenizer": {"kind": "replay_pipeline.models.tiny.build_tokenizer, one character an id",
                                     "size": len(tok)}}
    phases["build"] = {"seconds": seconds} | peak(device)
    report.save()
    log(f"built {type(model).__name__}: {built / 1e6:.1f}M parameters, {args.dtype} on {device} in {seconds:.1f} s")

    gen_cfg = SimpleNamespace(backend="transformers", temperature=TEMPERATURE, top_p=1.0,
                              max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch_size,
                              chat_template=False)
    generator = build_generator(gen_cfg, model, tok)
    generator.share_weights(model)  # as the trainer does (replay_pipeline/run/build.py)
    learner = Learner(model, objective="grpo_clip", lr=LR, eps_low=0.2, eps_high=0.2, max_grad_norm=1.0,
                      temperature=TEMPERATURE, pad_id=generator.pad_id)
    prompts = make_prompts(args.prompts, args.prompt_chars, args.seed)
    rows = args.prompts * args.completions

    # warm-up: kernels, allocator, cuBLAS handles; not timed into the phases
    def warm():
        (sample,), = generator.generate(prompts[:1], n=1, seed=args.seed + 1, max_new_tokens=2)
        learner.gradient({"prompt_ids": [sample.prompt_ids], "completion_ids": [sample.completion_ids],
                          "behaviour_logprobs": [sample.logprobs], "advantage": [1.0]})

    _, seconds = timed(device, warm)
    phases["warmup"] = {"seconds": seconds}
    free_memory(device)

    # 2. generation
    if not check_deadline("generation"):
        return False
    longest = max(len(tok(p)["input_ids"]) for p in prompts)
    gpu_free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    size, why = fit_gen_batch(args.gen_batch_size, rows,
                              lambda r: generation_bytes(r, longest, args.max_new_tokens, config),
                              host_available_bytes(), gpu_free)
    reset_peak(device)
    samples, gen = generate_phase(generator, prompts, args.completions, args.seed, size, device)
    est = generation_bytes(gen["gen_batch_size"], longest, args.max_new_tokens, config)
    phases["generate"] = gen | {"gen_batch_size_requested": args.gen_batch_size, "gen_batch_size_note": why,
                                "estimate_gib_per_call": {k: v / GIB for k, v in est.items()}} | peak(device)
    report.save()
    log(f"generated {gen['generated_tokens']} tokens in {gen['seconds']:.2f} s ({gen['tokens_per_second']:.0f} "
        f"tokens/s; {gen['generate_calls']} calls of {gen['gen_batch_size']} rows)")
    free_memory(device)

    # 4b. the learner's log-probs against the generator's, same weights (before any update)
    if not check_deadline("log-prob comparison"):
        return False
    reset_peak(device)
    (gap, used, attempts), seconds = timed(device, lambda: halving(
        lambda c: logprob_phase(learner, samples, c, device), args.minibatch_size, device))
    phases["logprobs"] = gap | {"seconds": seconds, "chunk_rows": min(used, len(samples)),
                                "out_of_memory_attempts": attempts} | peak(device)
    report.save()
    log(f"log-probs: learner vs generator max abs diff {gap['max_abs_diff']:.3g} "
        f"(mean {gap['mean_abs_diff']:.3g}) over {gap['tokens']} tokens")
    free_memory(device)

    # 3. the learner
    if not check_deadline("learner"):
        return False
    rewards = np.random.default_rng(args.seed).integers(0, 2, rows).astype(float)  # synthetic: a random model
    batch = {"prompt_ids": [s.prompt_ids for s in samples], "completion_ids": [s.completion_ids for s in samples],
             "behaviour_logprobs": [s.logprobs for s in samples],
             "advantage": group_advantages(rewards, args.completions).tolist()}
    reset_peak(device)
    learn = learn_phase(learner, batch, args.minibatch_size, device)
    phases["learn"] = learn | {"objective": "grpo_clip", "optimizer": type(learner.optimizer).__name__, "lr": LR,
                               "rewards": "synthetic: seeded Bernoulli(0.5), group-normalised advantages",
                               "minibatch_size_requested": args.minibatch_size} | peak(device)
    log(f"learner: {learn['steps']} step(s) of {learn['minibatch_size']} rows in {learn['seconds']:.2f} s")

    # 4. mu
    mu = gen["seconds"] / learn["seconds"] if learn["seconds"] > 0 else None
    report["result"] = {
        "mu": mu, "mu_model_generate_only": gen["model_generate_seconds"] / learn["seconds"] if mu else None,
        "mu_paper": PAPER_MU,
        "mu_note": ("generation seconds (the transformers backend, all rows) / learner seconds (one pass over "
                    "the same rollouts); the paper's 6.84 had vLLM generating"),
        "generation_seconds": gen["seconds"], "learner_seconds": learn["seconds"],
        "tokens_per_second": gen["tokens_per_second"], "logprob_max_abs_diff": gap["max_abs_diff"],
        "peak_gpu_allocated_gib": max((p.get("peak_gpu_allocated_gib") or 0) for p in phases.values()) or None,
    }
    report.save()
    log(f"mu = {mu:.2f} (paper, vLLM: {PAPER_MU})" if mu else "mu: the learner took no time")
    del generator, learner, model
    return mu is not None and math.isfinite(mu)


if __name__ == "__main__":
    sys.exit(main(started=STARTED))
