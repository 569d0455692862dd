"""What a task is: prompts with reference answers, fixed evaluation splits, an exact verifier.

A task owns three disjoint sets of prompts:
- train: sampled with replacement by the RL loop (and the warm start);
- held-out: the fixed test set every reported accuracy is measured on, never trained on;
- validation: a second fixed set used only to decide when the supervised warm start stops.
Validation is separate from held-out so that early stopping does not select on the test set:
the warm start stops at an abrupt jump in accuracy, and picking the stopping step on held-out
prompts would bias every later held-out figure upwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    """Stable id, e.g. "add-007+110"; the same prompt always has the same id."""
    text: str
    """The text fed to the tokenizer, e.g. "007+110="."""
    answer: str
    """Reference answer the verifier compares against, e.g. "117"."""


@runtime_checkable
class Task(Protocol):
    name: str
    """Registry name, see replay_pipeline.tasks.TASKS."""

    def train_prompts(self, n: int, rng: np.random.Generator) -> list[Prompt]:
        """`n` training prompts drawn with replacement; deterministic given `rng`'s state."""
        ...

    def heldout_prompts(self) -> list[Prompt]:
        """The fixed held-out test set; never trained on."""
        ...

    def validation_prompts(self) -> list[Prompt]:
        """Fixed, disjoint from held-out and train; only for warm-start early stopping."""
        ...

    def reward(self, prompt: Prompt, completion: str, finish_reason: str) -> float:
        """Exact verifier. `completion` is decoded text with special tokens removed;
        `finish_reason` is "stop" when the end token was generated, else "length".

        Optional, not part of the protocol's required members: a task may also define
        `reward_batch(prompts, completions, finish_reasons) -> list[float]`, which scores a whole
        batch in one call and is then used instead of `reward` (replay_pipeline/algo/scoring.py
        rewards_of)."""
        ...
