"""The policy a run starts from (version 0): a Hugging Face checkpoint directory
(`model.path`) or the built-in tiny model with its cached supervised warm start.

Both paths end in the same place, `AutoModelForCausalLM.from_pretrained(dir)`, because the
warm start is itself saved as a Hugging Face checkpoint directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from replay_pipeline.models.loading import load_pretrained
from replay_pipeline.models.warmstart import warm_start, warm_start_dir
from replay_pipeline.system.runs import RunPaths


def policy_dir(cfg: Any, task, paths: RunPaths) -> Path:
    """The Hugging Face directory a run's starting policy (version 0) is loaded from, without
    loading it: `model.path`, or the built-in model's cached warm start
    (`<root_dir>/cache/warmstart-<hash>`, there once a run has trained it)."""
    if cfg.model.path is not None:
        return Path(cfg.model.path).expanduser().resolve()
    return warm_start_dir(task, paths.cache, _warm_start_settings(cfg))


def _warm_start_settings(cfg: Any) -> dict[str, Any]:
    """warm_start's keyword arguments (but `log`) for the built-in model of `cfg`; it trains
    at model.torch_threads (part of its cache key: another count gives other weights)."""
    m, w = cfg.model, cfg.model.warmstart
    return dict(hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
                intermediate_size=m.intermediate_size, lr=w.lr, warmup_steps=w.warmup_steps,
                batch_size=w.batch_size, max_steps=w.max_steps, eval_every=w.eval_every,
                target_accuracy=w.target_accuracy, seed=w.seed, threads=int(m.torch_threads or 0))


def load_policy(cfg: Any, task, paths: RunPaths, log: Callable[[str], Any] = print):
    """(model, tokenizer, info) where info describes where the weights came from; info["path"]
    is policy_dir(cfg, task, paths)."""
    m = cfg.model
    if m.path is not None:
        path = policy_dir(cfg, task, paths)
        try:
            model, tokenizer = load_pretrained(path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"could not load a Hugging Face checkpoint from model.path={m.path}: "
                             f"{exc}. It must hold config.json, the weights and the tokenizer "
                             "files written by save_pretrained().") from exc
        info = {"source": "path", "path": str(path)}
    else:
        result = warm_start(task, paths.cache, **_warm_start_settings(cfg), log=log)
        model, tokenizer = load_pretrained(result.path)
        info = {"source": "warmstart", "path": str(result.path), "warmstart_steps": result.steps,
                "warmstart_heldout_accuracy": result.heldout_accuracy,
                "warmstart_seconds": round(result.seconds, 1), "warmstart_cached": result.cached}
    return model, tokenizer, info
