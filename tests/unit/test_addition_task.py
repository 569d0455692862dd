"""The addition task: prompt format, exact verifier, disjoint deterministic splits."""

from __future__ import annotations

import numpy as np
import pytest

from replay_pipeline.tasks import TASKS, AdditionTask, Prompt, Task, make_task


def test_prompt_format_pads_operands_not_answer():
    p = AdditionTask().prompt(7, 110)
    assert p == Prompt(prompt_id="add-007+110", text="007+110=", answer="117")
    assert AdditionTask().prompt(999, 999).answer == "1998"


@pytest.mark.parametrize(
    ("completion", "finish_reason", "expected"),
    [
        ("117", "stop", 1.0),  # exact match that ended with <eos>
        ("118", "stop", 0.0),  # wrong answer
        ("117", "length", 0.0),  # right digits but no <eos>
        ("1170", "stop", 0.0),  # extra character
        ("117 ", "stop", 0.0),
        ("0117", "stop", 0.0),  # the answer is not zero-padded
        ("", "stop", 0.0),
    ],
)
def test_reward_is_exact_match_ending_with_stop(completion, finish_reason, expected):
    task = AdditionTask()
    assert task.reward(task.prompt(7, 110), completion, finish_reason) == expected


def test_splits_are_disjoint_sized_and_unique():
    task = AdditionTask()
    heldout = {p.prompt_id for p in task.heldout_prompts()}
    validation = {p.prompt_id for p in task.validation_prompts()}
    assert len(heldout) == 512 and len(validation) == 256
    assert not heldout & validation


def test_splits_are_deterministic_and_follow_split_seed():
    a, b = AdditionTask(), AdditionTask()
    assert a.heldout_prompts() == b.heldout_prompts()
    assert a.validation_prompts() == b.validation_prompts()
    assert AdditionTask(split_seed=1).heldout_prompts() != a.heldout_prompts()
    # The held-out set is the first draws: resizing validation leaves it unchanged.
    assert AdditionTask(validation_size=10).heldout_prompts() == a.heldout_prompts()


def test_train_sampling_never_yields_evaluation_prompts_and_covers_the_rest():
    task = AdditionTask(digits=1, heldout_size=30, validation_size=30)  # 100 pairs, 40 train
    excluded = {p.prompt_id for p in task.heldout_prompts() + task.validation_prompts()}
    drawn = {p.prompt_id for p in task.train_prompts(2000, np.random.default_rng(0))}
    assert not drawn & excluded
    assert len(drawn) == 100 - len(excluded)


def test_train_sampling_is_deterministic_given_rng():
    task = AdditionTask()
    first = task.train_prompts(64, np.random.default_rng(5))
    assert len(first) == 64
    assert first == task.train_prompts(64, np.random.default_rng(5))
    assert first != task.train_prompts(64, np.random.default_rng(6))
    assert task.train_prompts(0, np.random.default_rng(5)) == []


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(digits=0),
        dict(digits=7),
        dict(heldout_size=0),
        dict(digits=1, heldout_size=60, validation_size=40),  # no training pair would remain
    ],
)
def test_invalid_arguments_are_rejected(kwargs):
    with pytest.raises(ValueError):
        AdditionTask(**kwargs)


def test_registry():
    task = make_task("addition", digits=2, heldout_size=10, validation_size=10)
    assert isinstance(task, Task) and task.name == "addition" and task.digits == 2
    assert TASKS["addition"] is AdditionTask
    with pytest.raises(ValueError, match="addition"):
        make_task("subtraction")
