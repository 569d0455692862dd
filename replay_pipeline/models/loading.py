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
    generation (load_tokenizer). The model is on the CPU: callers move it to model.device."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = load_tokenizer(path)
    model.config.use_cache = True
    return model, tokenizer


def load_tokenizer(path: str | Path):
    """The tokenizer of a Hugging Face checkpoint directory with a pad token (eos if it has
    none) and left padding, as batched generation needs."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def read_state_dict(directory: str | Path) -> dict[str, Any]:
    """The tensors of a save_pretrained directory's *.safetensors files (Hugging Face names, on
    the CPU), without building a model: what a generator's load_weights takes."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} holds no *.safetensors weights (save_pretrained writes them)")
    return {name: tensor for f in files for name, tensor in load_file(f, device="cpu").items()}


def policy_dir(cfg: DictConfig, task, paths: RunPaths) -> Path:
    """The Hugging Face directory a run's starting policy (version 0) is loaded from, without
    loading it: `model.path`, or the built-in model's cached warm start
    (`<root_dir>/cache/warmstart-<hash>`, there once a run has trained it)."""
    if cfg.model.path is not None:
        return Path(cfg.model.path).expanduser().resolve()
    from replay_pipeline.models.warmstart import warm_start_dir

    return warm_start_dir(task, paths.cache, _warm_start_settings(cfg))


def _warm_start_settings(cfg: DictConfig) -> dict[str, Any]:
    """warm_start's keyword arguments (but `log`) for the built-in model of `cfg`."""
    m, w = cfg.model, cfg.model.warmstart
    return dict(hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
                intermediate_size=m.intermediate_size, lr=w.lr, warmup_steps=w.warmup_steps,
                batch_size=w.batch_size, max_steps=w.max_steps, eval_every=w.eval_every,
                target_accuracy=w.target_accuracy, seed=w.seed)


def load_policy(cfg: DictConfig, task, paths: RunPaths, log: Callable[[str], Any] = print):
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
        from replay_pipeline.models.warmstart import warm_start

        result = warm_start(task, paths.cache, **_warm_start_settings(cfg), log=log)
        model, tokenizer = load_pretrained(result.path)
        info = {"source": "warmstart", "path": str(result.path), "warmstart_steps": result.steps,
                "warmstart_heldout_accuracy": result.heldout_accuracy,
                "warmstart_seconds": round(result.seconds, 1), "warmstart_cached": result.cached}
    return model, tokenizer, info
