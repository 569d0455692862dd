"""Generation backends: sample G completions per prompt with per-token behaviour log-probs.

Every backend returns `Sample`s and accepts new weights with `load_weights(state_dict,
version)`; the transformers backend runs anywhere torch runs.
"""

from replay_pipeline.generation.base import Sample
from replay_pipeline.generation.transformers_backend import TransformersGenerator

__all__ = ["Sample", "TransformersGenerator"]
