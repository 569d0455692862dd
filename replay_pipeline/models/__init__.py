"""Models: the built-in character tokenizer, the tiny Llama and its cached supervised warm start,
and the device the policy lives on (`model.device`)."""

from replay_pipeline.models.device import device_problem, resolve_device
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
    "device_problem",
    "greedy_accuracy",
    "load_warm_start",
    "resolve_device",
    "warm_start",
]
