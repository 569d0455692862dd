"""reasoning-gym's procedural datasets by name, with their own verifiers.

    python -m flows.train experiment=smollm2_chain_sum        # the preset that learns on a CPU
    python -m flows.train model=smollm2 task=reasoning_gym task.dataset=chain_sum +task.config.max_digits=2
    python -m flows.train model=smollm2 task=reasoning_gym 'task.dataset=[chain_sum,products]' \\
        +task.config.chain_sum.max_terms=2 +task.weights.products=2

reasoning-gym (Apache-2.0, ``sh infra/install.sh reasoning`` or the dev install) generates
over 100 datasets (arithmetic, logic, puzzles, ...) item by item from a seed, each with a
``score_answer`` verifier. This task feeds the dataset's question as the prompt (an instruct
model gets it through its chat template: generator.chat_template=true, with
generator.system_prompt as the system message when set) and scores completions with the
dataset's verifier.

- ``dataset``: a name of ``reasoning_gym.factory.DATASETS``, or a list of them (or one string
  of names joined by commas), a mixture (reasoning-gym's ``composite`` dataset; ``weights``
  NAME -> weight, 1 each by default). ``config``: the dataset's knobs (its config dataclass's fields: ``max_digits``,
  ``min_terms``...); for a mixture, one mapping per dataset (``config.chain_sum.max_digits``).
  A name or a knob that does not exist, or a value its config's ``validate`` rejects, is
  refused when the task is built (the pre-flight: before any work), naming the nearest ones.
- **Answers.** reasoning-gym's examples ask for the answer between ``<answer>`` tags (its
  ``SYSTEM_PROMPTS``) and read the last tagged span (``reasoning_gym.utils.extract_answer``);
  so does this task. ``answer_fallback=last_number`` also reads, from a completion without
  tags that ended with the end token, its last number: a small instruct model answers in a
  sentence ("The answer is 72.") and does not follow the tag format, so without the fallback
  it would score 0 everywhere and learn nothing. A completion cut by the length cap has no
  fallback answer (its last number could be a prefix of the one it was writing).
- **Reward** is 1.0 only when ``score_answer`` gives a full score (>= 1): reasoning-gym gives
  partial credit (e.g. 0.01 for a wrong number, more for a substring), which never counts as
  correct here.
- **Splits.** Held-out, validation and training items come from three generators seeded
  ``split_seed``, ``split_seed + 1`` and ``split_seed + 2``; held-out questions are kept once
  each, validation skips held-out questions, and a training draw that repeats a held-out or
  validation question is drawn again, so the sets are disjoint by question. Everything is
  deterministic given the seeds (reasoning-gym seeds item ``i`` with ``seed + i``). A dataset
  with fewer distinct questions than the held-out and validation sets need is refused.
- **Ids.** ``rg-<source dataset>-<split>-<index>``: the reward regenerates the item (its
  metadata, which some verifiers read) from the id, so any process that builds the task scores
  the same way.

Tasks floor: imports reasoning_gym (when built), the answers module and the protocol.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from functools import cached_property
from typing import Any, ClassVar, Optional

import numpy as np

from replay_pipeline.tasks.answers import last_number
from replay_pipeline.tasks.base import Prompt

INSTALL = "pip install reasoning-gym==0.1.25 (or: sh infra/install.sh reasoning; the dev install has it)"
FALLBACKS = (None, "last_number")
#: Items tried for each one a split needs before its dataset is called too small.
ATTEMPTS = 20
#: Indices training prompts are drawn from (reasoning-gym generates any index; this bounds the pool).
TRAIN_POOL = 1_000_000
SPLITS = ("heldout", "validation", "train")


def _registry() -> dict[str, tuple[type, type]]:
    if importlib.util.find_spec("reasoning_gym") is None:
        raise ValueError(f"task=reasoning_gym needs the reasoning-gym package, which is not installed: {INSTALL}")
    with warnings.catch_warnings():  # its dependencies' SyntaxWarnings when compiled on first import
        warnings.simplefilter("ignore")
        from reasoning_gym.factory import DATASETS  # start-up cost: every dataset module (~1.5 s)
    return DATASETS


def _nearest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=3, cutoff=0.5)
    return f"nearest: {', '.join(close)}" if close else f"known: {', '.join(sorted(options)[:12])}..."


def dataset_names(dataset: str | list[str] | None) -> list[str]:
    """The dataset names `task.dataset` holds (a name, names joined by commas, or a list)."""
    if dataset is None:
        return []
    items = dataset if isinstance(dataset, (list, tuple)) else str(dataset).split(",")
    return [str(d).strip() for d in items if str(d).strip()]


def check_dataset(dataset: Any, config: Mapping[str, Any] | None, weights: Mapping[str, Any] | None) -> list[str]:
    """What is wrong with a dataset choice (unknown names, knobs or values, bad weights), as
    problem lines naming the nearest valid ones; none when it builds."""
    names = dataset_names(dataset)
    if not names:
        return ["task=reasoning_gym needs task.dataset=NAME (e.g. chain_sum; a list of names, [a,b], mixes them)"]
    registry = _registry()
    problems = [f"task.dataset: no reasoning-gym dataset {n!r}; {_nearest(n, list(registry))}"
                for n in names if n not in registry]
    if problems:
        return problems
    config = dict(config or {})
    per = _per_dataset(names, config)
    if isinstance(per, str):
        return [per]
    for name in names:
        cfg_cls = registry[name][1]
        known = [f.name for f in fields(cfg_cls) if f.name not in ("seed", "size")] if is_dataclass(cfg_cls) else []
        bad = [k for k in per[name] if k not in known]
        where = "task.config" if len(names) == 1 else f"task.config.{name}"
        problems += [f"{where}.{k}: {name} has no such setting; {_nearest(k, known)}" for k in bad]
        if not bad:
            try:
                cfg = cfg_cls(**per[name], seed=0, size=1)
                if hasattr(cfg, "validate"):
                    cfg.validate()
            except (AssertionError, TypeError, ValueError) as exc:
                problems.append(f"{where}: {name} rejects {per[name]}: {exc or type(exc).__name__}; see "
                                f"{cfg_cls.__name__}'s fields: {', '.join(known)}")
    for k, w in dict(weights or {}).items():
        if k not in names:
            problems.append(f"task.weights.{k}: {k} is not one of task.dataset's ({', '.join(names)})")
        elif not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            problems.append(f"task.weights.{k}={w!r} must be a positive number")
    return problems


def _per_dataset(names: list[str], config: dict[str, Any]) -> dict[str, dict[str, Any]] | str:
    """Each dataset's knobs: the whole `config` for one dataset; `config[name]` for a mixture."""
    if len(names) == 1:
        return {names[0]: config}
    loose = [k for k, v in config.items() if k not in names or not isinstance(v, Mapping)]
    if loose:
        return (f"task.config.{loose[0]}: with several datasets each one's settings go under its name "
                f"(+task.config.{names[0]}.{loose[0]}=...)")
    return {n: dict(config.get(n, {})) for n in names}


@dataclass(frozen=True)
class ReasoningGymTask:
    dataset: Any = None
    """reasoning-gym dataset name, or a list of names (a mixture)."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """The dataset's settings (for a mixture: one mapping per dataset name)."""
    weights: Mapping[str, Any] = field(default_factory=dict)
    """A mixture's weights by dataset name (default 1 each)."""
    answer_fallback: Optional[str] = None
    """`last_number`: without <answer> tags, a completion that ended reads as its last number."""
    heldout_size: int = 512
    """Size of the fixed held-out test set."""
    validation_size: int = 256
    """Size of the fixed validation set."""
    split_seed: int = 1234
    """Seed of the three generators (held-out, validation, train)."""

    name: ClassVar[str] = "reasoning_gym"

    def __post_init__(self) -> None:
        problems = check_dataset(self.dataset, self.config, self.weights)
        if self.answer_fallback not in FALLBACKS:
            problems.append(f"task.answer_fallback={self.answer_fallback!r} must be null or last_number")
        if problems:
            raise ValueError("; ".join(problems))
        self._splits  # noqa: B018  (built now: a dataset too small for the sets is refused before any work)

    @cached_property
    def names(self) -> list[str]:
        return dataset_names(self.dataset)

    @cached_property
    def _sources(self) -> dict[str, Any]:
        """Each split's reasoning-gym dataset, seeded split_seed + its place in SPLITS."""
        return {split: _make_dataset(self.names, dict(self.config), dict(self.weights), self.split_seed + i)
                for i, split in enumerate(SPLITS)}

    def _source(self, split: str):
        return self._sources[split]

    def _item(self, split: str, index: int) -> dict[str, Any]:
        return self._source(split)[index]

    def _prompt(self, split: str, index: int, item: dict[str, Any]) -> Prompt:
        source = (item.get("metadata") or {}).get("source_dataset") or self.names[0]
        return Prompt(prompt_id=f"rg-{source}-{split}-{index}", text=str(item["question"]), answer=str(item["answer"]))

    @cached_property
    def _splits(self) -> tuple[list[Prompt], list[Prompt], frozenset[str]]:
        taken: set[str] = set()
        out = []
        for split, size in (("heldout", self.heldout_size), ("validation", self.validation_size)):
            prompts, index = [], 0
            while len(prompts) < size:
                if index >= ATTEMPTS * max(size, 1):
                    raise ValueError(
                        f"reasoning-gym {','.join(self.names)} with {dict(self.config)} gave {len(prompts)} distinct "
                        f"{split} questions in {index} items, fewer than task.{split}_size={size}: make the "
                        "dataset harder (more digits, terms) or lower the sizes")
                item = self._item(split, index)
                if item["question"] not in taken:
                    taken.add(item["question"])
                    prompts.append(self._prompt(split, index, item))
                index += 1
            out.append(prompts)
        return out[0], out[1], frozenset(taken)

    def train_prompts(self, n: int, rng: np.random.Generator) -> list[Prompt]:
        excluded = self._splits[2]
        out: list[Prompt] = []
        tries = 0
        while len(out) < n:
            tries += 1
            if tries > ATTEMPTS * max(n, 1):
                raise ValueError(f"reasoning-gym {','.join(self.names)}: nearly every drawn question is a held-out or "
                                 "validation one; make the dataset larger (harder settings) or lower the sizes")
            index = int(rng.integers(0, TRAIN_POOL))
            item = self._item("train", index)
            if item["question"] not in excluded:
                out.append(self._prompt("train", index, item))
        return out

    def heldout_prompts(self) -> list[Prompt]:
        return list(self._splits[0])

    def validation_prompts(self) -> list[Prompt]:
        return list(self._splits[1])

    def extract(self, completion: str, finish_reason: str) -> Optional[str]:
        """The answer a completion gives: its last <answer> span, else (answer_fallback) the
        last number of a completion that ended; None."""
        from reasoning_gym.utils import extract_answer  # optional dependency: reasoning-gym

        found = extract_answer(completion or "")
        if found is None and self.answer_fallback == "last_number" and finish_reason == "stop":
            found = last_number(completion)
        return found

    def reward(self, prompt: Prompt, completion: str, finish_reason: str) -> float:
        answer = self.extract(completion, finish_reason)
        if answer is None:
            return 0.0
        _, _, split, index = prompt.prompt_id.rsplit("-", 3)
        source = self._source(split)
        item = source[int(index)]
        if item["question"] != prompt.text:
            raise ValueError(f"prompt {prompt.prompt_id} is not this task's item (another dataset, settings or "
                             "split_seed made it)")
        score = source.score_answer(answer, item)
        return 1.0 if score is not None and score >= 1.0 - 1e-9 else 0.0


def _make_dataset(names: list[str], config: Mapping[str, Any], weights: Mapping[str, Any], seed: int):
    """The reasoning-gym dataset object of one split (its items are generated on demand)."""
    _registry()  # reasoning-gym installed, else the error that says how to install it
    import reasoning_gym  # optional dependency: reasoning-gym

    if len(names) == 1:
        return reasoning_gym.create_dataset(names[0], seed=seed, size=TRAIN_POOL, **config)
    from reasoning_gym.composite import DatasetSpec  # optional dependency: reasoning-gym

    specs = [DatasetSpec(name=n, weight=float(weights.get(n, 1.0)), config=dict(config.get(n, {}))) for n in names]
    return reasoning_gym.create_dataset("composite", seed=seed, size=TRAIN_POOL, datasets=specs)
