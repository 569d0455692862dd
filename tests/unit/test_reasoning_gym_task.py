"""The reasoning_gym task (replay_pipeline/tasks/reasoning_gym.py): datasets by name, splits
disjoint by question and deterministic, rewards only for a full score, answers read from tags
or (with the fallback) a sentence's last number, bad names refused naming the nearest ones."""

from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from replay_pipeline.config import TASK_DEFAULTS, ConfigError
from replay_pipeline.run.resume import resolve_config
from replay_pipeline.tasks import task_from_config
from replay_pipeline.tasks.base import Prompt
from replay_pipeline.tasks.reasoning_gym import ReasoningGymTask

pytest.importorskip("reasoning_gym", reason="the reasoning-gym package (the dev install has it)")

TWO_TERMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


@pytest.fixture(scope="module")
def task() -> ReasoningGymTask:
    return ReasoningGymTask(dataset="chain_sum", config=TWO_TERMS, answer_fallback="last_number",
                            heldout_size=64, validation_size=32)


def test_splits_are_disjoint_by_question_and_sized(task):
    """Held-out, validation and training questions never coincide: validation skips held-out
    questions, training draws skip both; held-out questions are distinct."""
    held, val = task.heldout_prompts(), task.validation_prompts()
    assert len(held) == 64 and len(val) == 32
    held_q, val_q = {p.text for p in held}, {p.text for p in val}
    assert len(held_q) == 64 and len(val_q) == 32 and not held_q & val_q
    train = task.train_prompts(400, np.random.default_rng(0))
    assert len(train) == 400 and not {p.text for p in train} & (held_q | val_q)
    assert all(p.prompt_id.startswith("rg-chain_sum-train-") for p in train)


def test_deterministic_given_the_seeds(task):
    """Another instance with the same settings has the same sets; the same rng state draws the
    same training prompts; another split_seed gives another held-out set."""
    again = ReasoningGymTask(dataset="chain_sum", config=TWO_TERMS, answer_fallback="last_number",
                             heldout_size=64, validation_size=32)
    assert again.heldout_prompts() == task.heldout_prompts()
    assert again.validation_prompts() == task.validation_prompts()
    assert task.train_prompts(20, np.random.default_rng(5)) == again.train_prompts(20, np.random.default_rng(5))
    assert task.train_prompts(20, np.random.default_rng(5)) != task.train_prompts(20, np.random.default_rng(6))
    other = ReasoningGymTask(dataset="chain_sum", config=TWO_TERMS, heldout_size=64, validation_size=32,
                             split_seed=99)
    assert other.heldout_prompts() != task.heldout_prompts()


def test_reward_is_one_only_for_a_full_score(task):
    """Tags are read wherever the completion stopped; the fallback reads a finished sentence's
    last number; partial credit (reasoning-gym gives 0.5 for a wrong number that contains the
    right one) counts 0, and so does a cut-off sentence."""
    p = next(p for p in task.heldout_prompts() if len(p.answer) >= 2 and not p.answer.startswith("-"))
    item = task._source("heldout")[int(p.prompt_id.rsplit("-", 1)[1])]
    assert 0 < task._source("heldout").score_answer(p.answer + "1", item) < 1  # the partial credit exists
    assert task.reward(p, f"<answer>{p.answer}</answer>", "stop") == 1.0
    assert task.reward(p, f"I think <answer> {p.answer} </answer>", "length") == 1.0
    assert task.reward(p, f"<answer>{p.answer}1</answer>", "stop") == 0.0
    assert task.reward(p, f"The answer to the given arithmetic problem is {p.answer}.", "stop") == 1.0
    assert task.reward(p, f"The answer to the given arithmetic problem is {p.answer}", "length") == 0.0
    assert task.reward(p, f"{p.answer} is what you get, not 3", "stop") == 0.0  # the last number counts
    assert task.reward(p, "no number at all", "stop") == 0.0
    strict = ReasoningGymTask(dataset="chain_sum", config=TWO_TERMS, heldout_size=64, validation_size=32)
    assert strict.reward(p, f"The answer is {p.answer}.", "stop") == 0.0  # tags only without the fallback
    assert strict.reward(p, f"<answer>{p.answer}</answer>", "stop") == 1.0


def test_reward_in_another_instance_and_foreign_prompts(task):
    """A process that builds the task from its config scores a prompt of this one the same way
    (the item is regenerated from the id); a prompt id whose item has another question (other
    settings) is refused rather than scored against the wrong item."""
    p = task.heldout_prompts()[3]
    built = task_from_config(dict(TASK_DEFAULTS, name="reasoning_gym", dataset="chain_sum", config=TWO_TERMS,
                                  answer_fallback="last_number", heldout_size=64, validation_size=32),
                             TASK_DEFAULTS)
    assert isinstance(built, ReasoningGymTask)
    assert built.reward(p, f"<answer>{p.answer}</answer>", "stop") == 1.0
    with pytest.raises(ValueError, match="not this task's item"):
        task.reward(Prompt(p.prompt_id, "State the final answer: 1 + 1 =", "2"), "<answer>2</answer>", "stop")


def test_mixtures_score_through_their_source(task):
    """Several datasets joined by commas are mixed; each prompt names its source dataset and is
    scored by that dataset's verifier; per-dataset settings go under the dataset's name."""
    mix = ReasoningGymTask(dataset="chain_sum,products", config={"chain_sum": {"max_terms": 3}},
                           weights={"products": 2}, heldout_size=30, validation_size=0)
    sources = {p.prompt_id.split("-")[1] for p in mix.heldout_prompts()}
    assert sources == {"chain_sum", "products"}
    for p in mix.heldout_prompts()[:6]:
        assert mix.reward(p, f"<answer>{p.answer}</answer>", "stop") == 1.0
        assert mix.reward(p, "<answer>nonsense</answer>", "stop") == 0.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(dataset="chain_summ"), "no reasoning-gym dataset 'chain_summ'; nearest: chain_sum"),
    (dict(dataset="chain_sum", config={"max_digit": 2}), "task.config.max_digit: chain_sum has no such setting; "
                                                           "nearest: max_digits"),
    (dict(dataset="chain_sum", config={"min_terms": 5, "max_terms": 2}), "max_terms must be >= min_terms"),
    (dict(dataset="chain_sum,products", config={"max_digits": 2}), r"\+task.config.chain_sum.max_digits"),
    (dict(dataset="chain_sum,products", weights={"product": 1}), "task.weights.product: product is not one"),
    (dict(dataset="chain_sum", weights={"chain_sum": -1}), "must be a positive number"),
    (dict(dataset="chain_sum", answer_fallback="first_number"), "must be null or last_number"),
    (dict(dataset="chain_sum", config={"min_terms": 2, "max_terms": 2, "max_digits": 1}, heldout_size=512),
     "200 distinct heldout questions .* fewer than task.heldout_size=512"),
])
def test_bad_choices_are_refused_naming_the_fix(kwargs, message):
    """Each mistake is a ValueError saying what exists (the nearest names) or what to change."""
    with pytest.raises(ValueError, match=message):
        ReasoningGymTask(**{"heldout_size": 16, "validation_size": 0, **kwargs})


def test_configuration_keys_and_rules():
    """task.config.* and task.weights.* take any key (the dataset's own settings) without a
    `+`; task=reasoning_gym without a dataset, and generator.system_prompt without the chat
    template, are refused at validation."""
    cfg = resolve_config(["model=smollm2", "task=chain_sum", "task.config.max_digits=3", "task.weights.chain_sum=2"])
    assert cfg.task.config.max_digits == 3 and cfg.task.weights.chain_sum == 2
    assert cfg.task.name == "reasoning_gym" and cfg.generator.chat_template
    with pytest.raises(ConfigError, match="needs a dataset: task.dataset=NAME"):
        resolve_config(["model=smollm2", "task=reasoning_gym"])
    with pytest.raises(ConfigError, match="generator.system_prompt is set but generator.chat_template=false"):
        resolve_config(["generator.system_prompt=Be brief."])


def test_a_mixture_from_the_command_line_is_a_list():
    """`'task.dataset=[chain_sum,products]'` composes (an unquoted comma is Hydra's sweep
    syntax) and builds the mixture the comma-joined string builds."""
    cfg = resolve_config(["model=smollm2", "task=reasoning_gym", "task.dataset=[chain_sum,products]",
                          "task.heldout_size=8", "task.validation_size=0"])
    task = task_from_config(OmegaConf.to_container(cfg.task, resolve=True), TASK_DEFAULTS)
    same = ReasoningGymTask(dataset="chain_sum,products", heldout_size=8, validation_size=0)
    assert task.heldout_prompts() == same.heldout_prompts()
