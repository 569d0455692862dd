"""Generation backends: sample G completions per prompt with per-token behaviour log-probs.

Every backend returns `Sample`s and accepts new weights with `load_weights(state_dict,
version)`; the transformers backend runs anywhere torch runs, the vLLM backend
(`replay_pipeline.generation.vllm_backend`, `generator.backend=vllm`) on a CUDA GPU with the
`vllm` extra. `build_generator` picks one by `generator.backend`. vllm is imported only inside
the vLLM backend, when an engine is built: this package imports without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from replay_pipeline.generation.base import Sample
from replay_pipeline.generation.transformers_backend import TransformersGenerator

GENERATOR_BACKENDS = ("transformers", "vllm")


def build_generator(gen_cfg: Any, model, tokenizer, *, checkpoint_dir: str | Path | None = None):
    """The generator that the config section `gen_cfg` (`generator`) asks for, holding the
    policy `model` (version 0).

    - `transformers`: ``TransformersGenerator.from_config(model, tokenizer, gen_cfg)``, a copy
      of `model` in this process (the trainer then aliases it with ``share_weights``).
    - `vllm`: ``VLLMGenerator.from_pretrained(checkpoint_dir, tokenizer, gen_cfg)``. The engine
      loads its weights from `checkpoint_dir`, the Hugging Face checkpoint directory `model`
      was loaded from: `model.path` for `model=hf`, the cached warm start directory
      (`runs/cache/warmstart-<hash>/`, written by save_pretrained) for the built-in model,
      so nothing is copied. Later versions arrive through ``load_weights``.
    """
    backend = str(gen_cfg.backend)
    if backend == "transformers":
        return TransformersGenerator.from_config(model, tokenizer, gen_cfg)
    if backend == "vllm":
        if checkpoint_dir is None:
            raise ValueError("generator.backend=vllm builds its engine from a Hugging Face checkpoint directory "
                             "(config.json + weights); none was given")
        from replay_pipeline.generation.vllm_backend import VLLMGenerator

        return VLLMGenerator.from_pretrained(str(checkpoint_dir), tokenizer, gen_cfg)
    raise ValueError(f"generator.backend={backend!r} is not one of {list(GENERATOR_BACKENDS)}")


__all__ = ["GENERATOR_BACKENDS", "Sample", "TransformersGenerator", "build_generator"]
