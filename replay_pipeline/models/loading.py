"""Load the policy a run starts from: a Hugging Face checkpoint directory (`model.path`) or
the built-in tiny model with its cached supervised warm start.

Both paths end in the same place, `AutoModelForCausalLM.from_pretrained(dir)`, because the
warm start is itself saved as a Hugging Face checkpoint directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig

from replay_pipeline.runs import RunPaths


def load_pretrained(path: str | Path):
    """(model, tokenizer) from a Hugging Face checkpoint directory, set up for batched
    generation: a pad token (eos if the tokenizer has none) and left padding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model.config.use_cache = True
    return model, tokenizer


def load_policy(cfg: DictConfig, task, paths: RunPaths, log: Callable[[str], Any] = print):
    """(model, tokenizer, info) where info describes where the weights came from."""
    m = cfg.model
    if m.path is not None:
        path = Path(m.path).expanduser().resolve()
        try:
            model, tokenizer = load_pretrained(path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"could not load a Hugging Face checkpoint from model.path={m.path}: "
                             f"{exc}. It must hold config.json, the weights and the tokenizer "
                             "files written by save_pretrained().") from exc
        info = {"source": "path", "path": str(path)}
    else:
        from replay_pipeline.models.warmstart import warm_start

        w = m.warmstart
        result = warm_start(
            task, paths.cache, hidden_size=m.hidden_size, num_layers=m.num_layers,
            num_heads=m.num_heads, intermediate_size=m.intermediate_size, lr=w.lr,
            warmup_steps=w.warmup_steps, batch_size=w.batch_size, max_steps=w.max_steps,
            eval_every=w.eval_every, target_accuracy=w.target_accuracy, seed=w.seed, log=log)
        model, tokenizer = load_pretrained(result.path)
        info = {"source": "warmstart", "path": str(result.path), "warmstart_steps": result.steps,
                "warmstart_heldout_accuracy": result.heldout_accuracy,
                "warmstart_seconds": round(result.seconds, 1), "warmstart_cached": result.cached}
    return model, tokenizer, info
