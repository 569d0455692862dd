"""task=custom (replay_pipeline/tasks/custom.py): the factory by module or file path, its
arguments, and clear refusals for a target that cannot be used."""

from __future__ import annotations

import numpy as np
import pytest

from replay_pipeline.config import TASK_DEFAULTS, ConfigError, load_config
from replay_pipeline.tasks import task_from_config
from replay_pipeline.tasks.custom import absolute_target, build_custom_task, load_target


def section(**fields):
    return {**TASK_DEFAULTS, "name": "custom", **fields}


def test_a_module_target_builds_the_task_with_its_args_and_the_common_fields():
    task = task_from_config(section(target="replay_pipeline.tasks.template:make_task", args={"terms": 4},
                                    heldout_size=30, validation_size=10), TASK_DEFAULTS)
    assert task.name == "digit-sum" and task.terms == 4 and len(task.heldout_prompts()) == 30
    prompt = task.train_prompts(1, np.random.default_rng(0))[0]
    assert prompt.text.count("+") == 3 and task.reward(prompt, prompt.answer, "stop") == 1.0


def test_a_file_target_is_imported_from_its_path_and_recorded_absolute(tmp_path, monkeypatch):
    (tmp_path / "t.py").write_text(
        "from replay_pipeline.tasks.template import make_task as base\n"
        "def make(**kw):\n    return base(**kw)\n")
    monkeypatch.chdir(tmp_path)
    assert absolute_target("t.py:make") == f"{tmp_path / 't.py'}:make"
    assert load_target("t.py:make").__name__ == "make"
    assert build_custom_task("t.py:make", {}, {"heldout_size": 20, "validation_size": 5}).heldout_size == 20


@pytest.mark.parametrize("target, message", [
    ("no_colon", "must be `package.module:factory`"),
    ("nope.mod:f", "cannot import 'nope.mod'"),
    ("/does/not/exist.py:f", "no file /does/not/exist.py"),
    ("replay_pipeline.tasks.template:nothing_here", "has no callable 'nothing_here'"),
])
def test_a_target_that_cannot_be_used_is_refused_naming_it(target, message):
    with pytest.raises(ValueError, match=message):
        load_target(target)


def test_a_factory_that_returns_no_task_or_takes_other_args_is_refused():
    with pytest.raises(ValueError, match=r"returned a dict without \['name', 'train_prompts'"):
        build_custom_task("builtins:dict", {}, {})
    with pytest.raises(ValueError, match="set its arguments with \\+task.args.NAME=VALUE"):
        build_custom_task("replay_pipeline.tasks.template:make_task", {"colour": "red"}, {})


def test_the_config_wants_a_target_and_refuses_fields_of_other_tasks():
    with pytest.raises(ConfigError, match="task.name=custom needs its factory"):
        load_config(["task=custom"])
    with pytest.raises(ConfigError, match="task.digits=2 is not used by task.name=custom"):
        load_config(["task=custom", "task.target=replay_pipeline.tasks.template:make_task", "task.digits=2"])
