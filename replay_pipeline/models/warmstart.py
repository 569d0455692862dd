"""Supervised warm start: bring the tiny model from random to a 10-40% greedy accuracy.

RL with a 0/1 reward needs a policy that already succeeds sometimes; this module trains one
with teacher forcing on <bos> + prompt + answer + <eos> (loss on answer and <eos> only) and
stops early, caching the checkpoint on disk so every run and seed starts from the same weights.

Decisions:
- Stop on validation accuracy, report held-out accuracy. Accuracy jumps abruptly (CPU-DEMO:
  3.5% -> 34% within 50 steps), so the stopping step is chosen by looking at accuracy; doing
  that on the held-out set would bias every later held-out figure. The held-out set is measured
  exactly once, after stopping.
- Evaluate every `eval_every` = 25 steps, the resolution the jump needs to land inside 10-40%.
- Linear warm-up then a constant learning rate, as in the prototype; no decay, because the
  run length is decided by early stopping, not in advance.
- Cache key: a hash of every argument that changes the result (model sizes, optimisation,
  stopping rule, seed, the task's name, parameters and evaluation prompts, the tokenizer
  characters) plus a format version. A run trains into a temporary sibling directory and renames
  it into place after `warmstart.json` is written, so a directory holding `warmstart.json` is
  always complete; one without it (left by a crash or an interrupted copy) is rebuilt.
- Deterministic given `seed` and the thread count: seeded initialisation, numpy batches,
  no dropout. It trains at the caller's torch thread count (a run's `model.torch_threads`:
  two threads on two cores shared with another job spin-wait 10-30x slower), and the count is
  part of the cache key, since another count sums in another order and gives other weights.
- A stop request (Ctrl-C, SIGTERM: replay_pipeline/system/stopping.py) ends it between steps; the
  temporary directory is removed and nothing is cached.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from replay_pipeline.system import faults, stopping
from replay_pipeline.training.evaluation import evaluate_greedy
from replay_pipeline.generation import TransformersGenerator
from replay_pipeline.models.loading import load_pretrained
from replay_pipeline.models.tiny import DEFAULT_CHARS, build_tiny_model, build_tokenizer
from replay_pipeline.tasks.base import Prompt, Task

CACHE_FORMAT = 1
"""Bump when training or the checkpoint layout changes so old caches stop matching."""
RESULT_FILE = "warmstart.json"


@dataclass
class WarmStartResult:
    path: Path
    """Hugging Face checkpoint directory: model, tokenizer and warmstart.json."""
    steps: int
    """Optimizer steps taken before validation accuracy reached the target."""
    validation_accuracy: float
    """Greedy accuracy on task.validation_prompts() at the stopping step."""
    heldout_accuracy: float
    """Greedy accuracy on task.heldout_prompts(), measured once after stopping."""
    seconds: float
    """Wall time the checkpoint took to train (the original run's, when loaded from cache)."""
    cached: bool
    """True when this call loaded an existing checkpoint instead of training."""


def warm_start(
    task: Task,
    cache_dir: Path,
    *,
    hidden_size: int = 192,
    num_layers: int = 4,
    num_heads: int = 6,
    intermediate_size: int = 512,
    lr: float = 1e-3,
    warmup_steps: int = 100,
    batch_size: int = 128,
    max_steps: int = 3000,
    eval_every: int = 25,
    target_accuracy: float = 0.25,
    seed: int = 0,
    threads: int | None = None,
    log: Callable[[str], Any] = print,
) -> WarmStartResult:
    """Return the cached warm-start checkpoint for these settings, training it if missing.
    `threads`: torch threads to train with (None or 0: torch's current count, keyed as 0).

    Raises RuntimeError if validation accuracy has not reached `target_accuracy` after
    `max_steps` steps.
    """
    settings = dict(
        hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        intermediate_size=intermediate_size, lr=lr, warmup_steps=warmup_steps,
        batch_size=batch_size, max_steps=max_steps, eval_every=eval_every,
        target_accuracy=target_accuracy, seed=seed, threads=int(threads or 0),
    )  # fmt: skip
    _validate(settings)
    key = _cache_key(task, settings)
    cache_dir = Path(cache_dir)
    final = cache_dir / _cache_name(key)

    cached = _load_result(final)
    if cached is not None:
        log(f"warm start: cached {final} (held-out accuracy {cached.heldout_accuracy:.3f})")
        return cached

    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        result = _train(task, tmp, settings, log)
        (tmp / RESULT_FILE).write_text(json.dumps({**_result_json(result), "key": key}, indent=2))
        if final.exists() and _load_result(final) is None:
            shutil.rmtree(final)  # a leftover without warmstart.json is never reused
        try:
            os.replace(tmp, final)
        except OSError:  # another process renamed its complete copy in first: keep theirs
            other = _load_result(final)
            if other is None:
                raise
            shutil.rmtree(tmp)
            return other
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dataclasses.replace(result, path=final)


def warm_start_dir(task: Task, cache_dir: Path, settings: dict[str, Any]) -> Path:
    """Where `warm_start` keeps the checkpoint for `task` and `settings` (every keyword of
    warm_start but `log`), without training it: `<cache_dir>/warmstart-<hash>`."""
    return Path(cache_dir) / _cache_name(_cache_key(task, settings))


def _cache_key(task: Task, settings: dict[str, Any]) -> dict[str, Any]:
    return {"format": CACHE_FORMAT, "chars": DEFAULT_CHARS, "task": _task_fingerprint(task), **settings}


def _cache_name(key: dict[str, Any]) -> str:
    return f"warmstart-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]}"


def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    batch_size: int = 256,
) -> float:
    """Mean verifier reward of greedy completions: the fraction correct for a 0/1 verifier.

    The same evaluation as the training loop's (replay_pipeline.training.evaluation), on a copy of
    `model` (the caller's weights, mode and gradients are left alone).
    """

    if not prompts:
        raise ValueError("prompts is empty; greedy accuracy needs at least one prompt")
    generator = TransformersGenerator(model, tokenizer, max_new_tokens=max_new_tokens,
                                      batch_size=batch_size)
    return evaluate_greedy(generator, task, prompts)["eval/accuracy"]


def completion_budget(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt]) -> int:
    """max_new_tokens that lets every reference answer in `prompts` finish: longest + <eos>."""
    return 1 + max(len(tokenizer(p.answer, add_special_tokens=False)["input_ids"]) for p in prompts)


def load_warm_start(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer of a warm-start checkpoint directory (it is a Hugging Face
    checkpoint directory, loaded like any other)."""

    return load_pretrained(path)


def _train(
    task: Task, out_dir: Path, s: dict[str, Any], log: Callable[[str], Any]
) -> WarmStartResult:
    threads = torch.get_num_threads()
    torch.set_num_threads(s["threads"] or threads)
    try:
        with torch.random.fork_rng(devices=[]):  # seed without disturbing the caller's RNG
            return _train_loop(task, out_dir, s, log)
    finally:
        torch.set_num_threads(threads)


def _train_loop(
    task: Task, out_dir: Path, s: dict[str, Any], log: Callable[[str], Any]
) -> WarmStartResult:
    t0 = time.perf_counter()
    tokenizer = build_tokenizer(DEFAULT_CHARS)
    validation, heldout = task.validation_prompts(), task.heldout_prompts()
    _check_vocabulary(tokenizer, [*validation, *heldout])
    max_new = completion_budget(tokenizer, [*validation, *heldout])
    model = build_tiny_model(
        tokenizer, hidden_size=s["hidden_size"], num_layers=s["num_layers"],
        num_heads=s["num_heads"], intermediate_size=s["intermediate_size"], seed=s["seed"],
    )  # fmt: skip
    torch.manual_seed(s["seed"])
    rng = np.random.default_rng(s["seed"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=s["lr"])
    warmup = s["warmup_steps"]
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    )
    accuracy, losses = 0.0, []
    for step in range(1, s["max_steps"] + 1):
        faults.crash_point("warm_start", step)
        stopping.check("the warm start")
        model.train()
        batch = _supervised_batch(tokenizer, task.train_prompts(s["batch_size"], rng))
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % s["eval_every"] and step != s["max_steps"]:
            continue
        accuracy = greedy_accuracy(model, tokenizer, task, validation, max_new)
        log(
            f"warm start step {step}: loss {np.mean(losses):.4f} "
            f"validation accuracy {accuracy:.3f} ({time.perf_counter() - t0:.0f}s)"
        )
        losses = []
        if accuracy >= s["target_accuracy"]:
            break
    else:
        raise RuntimeError(
            f"warm start reached validation accuracy {accuracy:.3f} after max_steps="
            f"{s['max_steps']}, below target_accuracy={s['target_accuracy']}; raise "
            "max_steps, lower target_accuracy, or change lr / model size"
        )
    heldout_accuracy = greedy_accuracy(model, tokenizer, task, heldout, max_new)
    seconds = time.perf_counter() - t0
    log(
        f"warm start done at step {step}: validation {accuracy:.3f}, "
        f"held-out {heldout_accuracy:.3f}, {seconds:.0f}s"
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return WarmStartResult(
        path=out_dir, steps=step, validation_accuracy=accuracy,
        heldout_accuracy=heldout_accuracy, seconds=seconds, cached=False,
    )  # fmt: skip


def _supervised_batch(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt]
) -> dict[str, torch.Tensor]:
    """<bos> prompt answer <eos>, right-padded; labels -100 except on answer and <eos>."""
    prompt_ids = tokenizer([p.text for p in prompts], add_special_tokens=True)["input_ids"]
    answer_ids = tokenizer([p.answer for p in prompts], add_special_tokens=False)["input_ids"]
    rows = [(p, [*a, tokenizer.eos_token_id]) for p, a in zip(prompt_ids, answer_ids)]
    width = max(len(p) + len(a) for p, a in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    # Right padding keeps position ids 0.. on every real token, matching left-padded
    # generation where transformers derives positions from the attention mask.
    for i, (p, a) in enumerate(rows):
        n = len(p) + len(a)
        input_ids[i, :n] = torch.tensor(p + a)
        labels[i, len(p) : n] = torch.tensor(a)
        mask[i, :n] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _task_fingerprint(task: Task) -> dict[str, Any]:
    """Name, constructor parameters and a digest of the evaluation prompts of `task`."""
    splits = {
        "validation": [dataclasses.astuple(p) for p in task.validation_prompts()],
        "heldout": [dataclasses.astuple(p) for p in task.heldout_prompts()],
    }
    return {
        "name": task.name,
        "params": dataclasses.asdict(task) if dataclasses.is_dataclass(task) else {},
        "splits": hashlib.sha256(json.dumps(splits).encode()).hexdigest(),
    }


def _check_vocabulary(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt]) -> None:
    for p in prompts:
        ids = tokenizer(p.text + p.answer, add_special_tokens=False)["input_ids"]
        if tokenizer.unk_token_id in ids:
            raise ValueError(
                f"prompt {p.prompt_id!r} has characters outside the tokenizer's {DEFAULT_CHARS!r}"
            )


def _validate(s: dict[str, Any]) -> None:
    positive = ("hidden_size", "num_layers", "num_heads", "intermediate_size", "batch_size",
                "max_steps", "eval_every")  # fmt: skip
    for name in positive:
        if s[name] < 1:
            raise ValueError(f"{name}={s[name]} must be >= 1")
    if s["warmup_steps"] < 0:
        raise ValueError(f"warmup_steps={s['warmup_steps']} must be >= 0")
    if not s["lr"] > 0:
        raise ValueError(f"lr={s['lr']} must be > 0")
    if not 0.0 <= s["target_accuracy"] <= 1.0:
        raise ValueError(f"target_accuracy={s['target_accuracy']} must be in [0, 1]")


def _result_json(r: WarmStartResult) -> dict[str, Any]:
    return {
        "steps": r.steps,
        "validation_accuracy": r.validation_accuracy,
        "heldout_accuracy": r.heldout_accuracy,
        "seconds": r.seconds,
    }


def _load_result(path: Path) -> WarmStartResult | None:
    """The stored result of a complete cache directory, or None if `path` is not one."""
    try:
        data = json.loads((path / RESULT_FILE).read_text())
        return WarmStartResult(
            path=path, steps=int(data["steps"]),
            validation_accuracy=float(data["validation_accuracy"]),
            heldout_accuracy=float(data["heldout_accuracy"]),
            seconds=float(data["seconds"]), cached=True,
        )  # fmt: skip
    except (OSError, ValueError, KeyError):
        return None
