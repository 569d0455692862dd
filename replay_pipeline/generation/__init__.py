"""Generation backends: sample G completions per prompt with per-token behaviour log-probs.

Every backend returns `Sample`s, accepts new weights with `load_weights(state_dict,
version)` and releases what it holds with `close()` (idempotent; the run, the async generator
processes and flows.evaluate call it when they end); the transformers backend runs anywhere
torch runs, on its model's device, the vLLM backend (`replay_pipeline.generation.vllm_backend`,
`generator.backend=vllm`) on a CUDA GPU with the `vllm` extra. `build_generator` picks one by
`generator.backend` (replay_pipeline.models.loading.generator_from_pretrained does the same for
a process that starts from a checkpoint directory). The package imports nothing of the models:
it is the floor below them. vllm is imported only inside the vLLM backend, when an engine is
built: this package imports without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from replay_pipeline.generation.base import Sample
from replay_pipeline.generation.transformers_backend import TransformersGenerator

GENERATOR_BACKENDS = ("transformers", "vllm")


def build_generator(gen_cfg: Any, model, tokenizer, *, checkpoint_dir: str | Path | None = None,
                    copy_model: bool = True):
    """The generator that the config section `gen_cfg` (`generator`) asks for, holding the
    policy `model` (version 0).

    - `transformers`: ``TransformersGenerator.from_config(model, tokenizer, gen_cfg,
      copy_model)``, on `model`'s device: a copy of `model` in this process (the trainer then
      aliases it with ``share_weights``), or with ``copy_model=False`` `model` itself, put in
      eval mode without gradients (a process whose only use of the model is sampling).
    - `vllm`: ``VLLMGenerator.from_pretrained(checkpoint_dir, tokenizer, gen_cfg)``. The engine
      loads its weights from `checkpoint_dir`, the Hugging Face checkpoint directory `model`
      was loaded from: `model.path` for `model=hf`, the cached warm start directory
      (`runs/cache/warmstart-<hash>/`, written by save_pretrained) for the built-in model,
      so nothing is copied. Later versions arrive through ``load_weights``. `model` and
      `copy_model` are not used.
    """
    backend = str(gen_cfg.backend)
    if backend == "transformers":
        return TransformersGenerator.from_config(model, tokenizer, gen_cfg, copy_model=copy_model)
    if backend == "vllm":
        if checkpoint_dir is None:
            raise ValueError("generator.backend=vllm builds its engine from a Hugging Face checkpoint directory "
                             "(config.json + weights); none was given")
        # start-up cost: kept off the transformers path (the module itself never imports vllm
        # at load time; VLLMGenerator imports it when an engine is built)
        from replay_pipeline.generation.vllm_backend import VLLMGenerator

        return VLLMGenerator.from_pretrained(str(checkpoint_dir), tokenizer, gen_cfg)
    raise ValueError(f"generator.backend={backend!r} is not one of {list(GENERATOR_BACKENDS)}")


__all__ = ["GENERATOR_BACKENDS", "Sample", "TransformersGenerator", "build_generator"]
