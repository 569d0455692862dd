"""Load Hugging Face checkpoint directories: a model and its tokenizer set up for batched
generation, only the tensors, or a generator sampling from the checkpoint. The models' lowest
room: imports only the generation backends (replay_pipeline/models/policy.py picks which
directory a run's policy comes from).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from replay_pipeline.generation import build_generator


def load_pretrained(path: str | Path):
    """(model, tokenizer) from a Hugging Face checkpoint directory, set up for batched
    generation (load_tokenizer). The model is on the CPU: callers move it to model.device."""
    from transformers import AutoModelForCausalLM  # start-up cost: transformers' model classes

    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = load_tokenizer(path)
    model.config.use_cache = True
    return model, tokenizer


def load_tokenizer(path: str | Path):
    """The tokenizer of a Hugging Face checkpoint directory with a pad token (eos if it has
    none) and left padding, as batched generation needs."""
    from transformers import AutoTokenizer  # start-up cost: transformers' tokenizer classes

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def read_state_dict(directory: str | Path) -> dict[str, Any]:
    """The tensors of a save_pretrained directory's *.safetensors files (Hugging Face names, on
    the CPU), without building a model: what a generator's load_weights takes."""
    from safetensors.torch import load_file  # start-up cost: torch

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} holds no *.safetensors weights (save_pretrained writes them)")
    return {name: tensor for f in files for name, tensor in load_file(f, device="cpu").items()}


def generator_from_pretrained(gen_cfg: Any, path: str | Path, device, *,
                              checkpoint_dir: str | Path | None = None):
    """A generator for a process that only samples (an async generator process,
    flows.evaluate), built by `build_generator` from the Hugging Face directory `path`:
    `transformers` loads the model from `path` onto `device` and samples with it in place
    (copy_model=False); `vllm` reads only the tokenizer from `path` (no model copy in this
    process) and builds its engine from `checkpoint_dir` (default: `path`)."""
    if str(gen_cfg.backend) == "vllm":  # the engine loads the weights itself
        model, tokenizer = None, load_tokenizer(path)
    else:
        model, tokenizer = load_pretrained(path)
        model.to(device)
    return build_generator(gen_cfg, model, tokenizer, checkpoint_dir=checkpoint_dir or path, copy_model=False)
