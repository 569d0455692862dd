"""A complete custom task to copy: the sum of a few one-digit numbers ("3+5+1=" -> "9").

Copy this file anywhere, change the prompts and the reward, and train on it:

    python -m flows.train task=custom task.target=/path/to/my_task.py:make_task +task.args.terms=4

(or `task.target=mypackage.my_task:make_task` with its directory on PYTHONPATH). What a task
must have (replay_pipeline/tasks/base.py, the Task protocol):

- `name`: a short name, logged with the run;
- `train_prompts(n, rng)`: `n` prompts drawn with the numpy Generator `rng` (deterministic
  given its state: a resumed run must draw the same ones);
- `heldout_prompts()`: the fixed test set every reported accuracy is measured on, never
  trained on; `validation_prompts()`: a second fixed set, only for the built-in model's warm
  start to decide when to stop (it may be empty with a Hugging Face model: no warm start);
- `reward(prompt, completion, finish_reason)`: a float for one completion (`completion` is the
  decoded text without special tokens; `finish_reason` is "stop" when the end token came,
  "length" when the budget ran out). A reward that raises, returns something that is not a
  number, or runs longer than reward.timeout scores 0 and is flagged (replay_pipeline/algo/scoring.py).
  Optional: `reward_batch(prompts, completions, finish_reasons)`, a list of floats for a whole
  batch in one call (a reward model scores faster in batches); when a task has it, it is used
  instead of `reward` everywhere, and may take reward.timeout seconds a completion.

Shaping the training reward with weighted terms (a length penalty, a format bonus) needs no
change to the task: `+reward.terms.NAME.target=/path/to/file.py:fn +reward.terms.NAME.weight=W`
adds W x fn(prompt, completion, finish_reason) to the reward in training; `reward` stays the
verifier that decides what is correct (replay_pipeline/config/schema.py, RewardConfig).

The factory gets `task.args` as keyword arguments, plus task.heldout_size,
task.validation_size and task.split_seed when it takes them. This one uses only the
characters of the built-in tiny model's tokenizer (digits, "+", "="), so it trains with the
default model; a task with other text needs `model=hf model.path=...`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from replay_pipeline.tasks.base import Prompt


@dataclass(frozen=True)
class DigitSumTask:
    terms: int = 3
    heldout_size: int = 256
    validation_size: int = 128
    split_seed: int = 1234
    name: str = "digit-sum"

    def _prompt(self, index: int) -> Prompt:
        digits = [int(c) for c in f"{index:0{self.terms}d}"]
        text = "+".join(map(str, digits)) + "="
        return Prompt(prompt_id=f"sum-{text[:-1]}", text=text, answer=str(sum(digits)))

    def _split(self) -> tuple[list[int], list[int]]:
        order = np.random.default_rng(self.split_seed).permutation(10 ** self.terms)
        held = order[: self.heldout_size]
        return [int(i) for i in held], [int(i) for i in order[self.heldout_size:self.heldout_size + self.validation_size]]

    def train_prompts(self, n: int, rng: np.random.Generator) -> list[Prompt]:
        excluded = set(sum(self._split(), []))
        out: list[Prompt] = []
        while len(out) < n:
            i = int(rng.integers(0, 10 ** self.terms))
            if i not in excluded:
                out.append(self._prompt(i))
        return out

    def heldout_prompts(self) -> list[Prompt]:
        return [self._prompt(i) for i in self._split()[0]]

    def validation_prompts(self) -> list[Prompt]:
        return [self._prompt(i) for i in self._split()[1]]

    def reward(self, prompt: Prompt, completion: str, finish_reason: str) -> float:
        return 1.0 if finish_reason == "stop" and completion.strip() == prompt.answer else 0.0


def make_task(terms: int = 3, heldout_size: int = 256, validation_size: int = 128,
              split_seed: int = 1234) -> DigitSumTask:
    """The factory task.target names."""
    if not 2 <= terms <= 5 or heldout_size + validation_size >= 10 ** terms:
        raise ValueError(f"terms={terms} gives {10 ** terms} prompts: too few for {heldout_size} held-out and "
                         f"{validation_size} validation ones (raise terms or lower the sizes)")
    return DigitSumTask(terms=terms, heldout_size=heldout_size, validation_size=validation_size,
                        split_seed=split_seed)
