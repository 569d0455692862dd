"""Models: the built-in character tokenizer, the tiny Llama and its cached supervised warm start."""

from replay_pipeline.models.tiny import build_tiny_model, build_tokenizer
from replay_pipeline.models.warmstart import (
    WarmStartResult,
    completion_budget,
    greedy_accuracy,
    load_warm_start,
    warm_start,
)

__all__ = [
    "WarmStartResult",
    "build_tiny_model",
    "build_tokenizer",
    "completion_budget",
    "greedy_accuracy",
    "load_warm_start",
    "warm_start",
]
