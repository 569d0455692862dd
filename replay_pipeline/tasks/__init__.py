"""Tasks: prompt sets with exact verifiers, looked up by name, or your own by import path
(task.name=custom, task.target=module:factory: replay_pipeline/tasks/custom.py).

The config's `task` section (replay_pipeline.config.TaskConfig) holds the fields of every
task; each task's constructor takes only its own. :func:`task_from_config` passes a task the
fields its constructor accepts and drops the other tasks' fields while they are at their
defaults; one set to something else (`task.path` with task.name=addition) is an error, not
silently ignored.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from replay_pipeline.tasks.addition import AdditionTask
from replay_pipeline.tasks.base import Prompt, Task
from replay_pipeline.tasks.custom import COMMON, build_custom_task
from replay_pipeline.tasks.math import MathTask
from replay_pipeline.tasks.reasoning_gym import ReasoningGymTask

TASKS: dict[str, type] = {"addition": AdditionTask, "math": MathTask, "reasoning_gym": ReasoningGymTask}
#: task.name of your own task from task.target (replay_pipeline/tasks/custom.py).
CUSTOM = "custom"
#: The fields of the task section a custom task reads.
CUSTOM_FIELDS = ("target", "args", *COMMON)


def task_from_config(task_cfg: Mapping[str, Any], defaults: Mapping[str, Any]) -> Task:
    """The task a config's `task` section describes: `name` picks it, the rest are its
    constructor arguments (other tasks' fields at their `defaults`, the section's defaults
    (replay_pipeline.config.TASK_DEFAULTS), are left out)."""
    fields = dict(task_cfg)
    name = fields.pop("name")
    unused = unused_task_fields(name, fields, defaults)
    if unused:
        raise ValueError(f"task {name!r} does not use {', '.join(f'task.{k}' for k in unused)}; "
                         "drop those overrides, or pick the task that uses them")
    if name == CUSTOM:
        return build_custom_task(fields["target"], fields.get("args"), fields)
    accepted = constructor_args(name)
    return make_task(name, **{k: v for k, v in fields.items() if k in accepted or k not in defaults})


def make_task(name: str, **kwargs: Any) -> Task:
    """Build the task registered as `name` with its constructor arguments."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name](**kwargs)


def constructor_args(name: str) -> set[str]:
    """Keyword arguments the task registered as `name` accepts."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return {p.name for p in inspect.signature(TASKS[name]).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def unused_task_fields(name: str, fields: Mapping[str, Any], defaults: Mapping[str, Any]) -> list[str]:
    """Fields of the config's task section (`fields`) that task `name` does not take but that
    differ from their `defaults` (so the user set them for nothing). Unknown tasks: none
    (reported elsewhere). The configuration passes its own defaults: this package knows no
    configuration."""
    if name == CUSTOM:
        accepted = set(CUSTOM_FIELDS)
    elif name not in TASKS:
        return []
    else:
        accepted = constructor_args(name)
    return sorted(k for k, v in fields.items()
                  if k != "name" and k in defaults and k not in accepted and v != defaults[k])


__all__ = ["CUSTOM", "CUSTOM_FIELDS", "TASKS", "AdditionTask", "MathTask", "Prompt", "ReasoningGymTask", "Task", "constructor_args", "make_task",
           "task_from_config", "unused_task_fields"]
