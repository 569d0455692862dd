"""Fixed-width integer addition: "007+110=" -> "117".

Operands are zero-padded to `digits` characters so every prompt has the same length (batches
need no padding); the answer is the plain sum, 1 to digits+1 characters.

Splits: pair (a, b) has index a * 10**digits + b. One PRNG seeded with `split_seed` draws
distinct indices in order; the first `heldout_size` are the held-out set and the next
`validation_size` the validation set, so the held-out set does not change when only
`validation_size` does. Every other pair is training data; `train_prompts` samples indices
uniformly and rejects the held-out and validation ones (fine while they are a small part of the
space, which the constructor checks only loosely: at least one training pair must remain).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from replay_pipeline.tasks.base import Prompt


@dataclass(frozen=True)
class AdditionTask:
    digits: int = 3
    """Operand width; operands are 0 .. 10**digits - 1, zero-padded."""
    heldout_size: int = 512
    """Size of the fixed held-out test set (CPU-DEMO: 256 is noisy by +/- 3 points)."""
    validation_size: int = 256
    """Size of the fixed validation set used for warm-start early stopping."""
    split_seed: int = 1234
    """Seed of the held-out/validation draw; train prompts use the caller's rng instead."""

    name: ClassVar[str] = "addition"

    def __post_init__(self) -> None:
        if not isinstance(self.digits, int) or not 1 <= self.digits <= 6:
            raise ValueError(f"digits={self.digits!r} must be an integer in 1..6")
        for arg in ("heldout_size", "validation_size"):
            value = getattr(self, arg)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg}={value!r} must be a positive integer")
        space, n_eval = self.space_size, self.heldout_size + self.validation_size
        if n_eval >= space:
            raise ValueError(
                f"heldout_size + validation_size = {n_eval} "
                f"must be below the {space} pairs of {self.digits}-digit operands so that "
                "training pairs remain; lower the sizes or raise digits"
            )
        indices = _distinct_indices(space, n_eval, self.split_seed)
        # Derived state, not dataclass fields: repr, equality and asdict() stay the four params.
        object.__setattr__(self, "_heldout", tuple(indices[: self.heldout_size]))
        object.__setattr__(self, "_validation", tuple(indices[self.heldout_size :]))
        object.__setattr__(self, "_excluded", frozenset(indices))

    @property
    def space_size(self) -> int:
        """Number of (a, b) pairs."""
        return (10**self.digits) ** 2

    @property
    def max_answer_chars(self) -> int:
        """Longest possible answer (digits + 1 with a carry out); add 1 for the end token."""
        return self.digits + 1

    def prompt(self, a: int, b: int) -> Prompt:
        text = f"{a:0{self.digits}d}+{b:0{self.digits}d}="
        return Prompt(prompt_id=f"add-{text[:-1]}", text=text, answer=str(a + b))

    def train_prompts(self, n: int, rng: np.random.Generator) -> list[Prompt]:
        if n < 0:
            raise ValueError(f"n={n} must be >= 0")
        chosen: list[int] = []
        while len(chosen) < n:
            draws = rng.integers(0, self.space_size, size=n - len(chosen))
            chosen.extend(int(i) for i in draws if int(i) not in self._excluded)
        return [self._prompt_at(i) for i in chosen]

    def heldout_prompts(self) -> list[Prompt]:
        return [self._prompt_at(i) for i in self._heldout]

    def validation_prompts(self) -> list[Prompt]:
        return [self._prompt_at(i) for i in self._validation]

    def reward(self, prompt: Prompt, completion: str, finish_reason: str) -> float:
        # Only a completion that ended with the end token counts: a model that never learns to
        # stop must not be rewarded for a correct prefix.
        return 1.0 if finish_reason == "stop" and completion == prompt.answer else 0.0

    def _prompt_at(self, index: int) -> Prompt:
        a, b = divmod(index, 10**self.digits)
        return self.prompt(a, b)


def _distinct_indices(space: int, k: int, seed: int) -> list[int]:
    """`k` distinct integers in [0, space), in draw order, from a PRNG seeded with `seed`."""
    rng = np.random.default_rng(seed)
    seen: set[int] = set()
    out: list[int] = []
    while len(out) < k:
        for i in rng.integers(0, space, size=k - len(out)):
            i = int(i)
            if i not in seen:
                seen.add(i)
                out.append(i)
    return out
