"""Tasks: prompt sets with exact verifiers, looked up by name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replay_pipeline.tasks.addition import AdditionTask
from replay_pipeline.tasks.base import Prompt, Task

TASKS: dict[str, type] = {"addition": AdditionTask}


def task_from_config(task_cfg: Mapping[str, Any]) -> Task:
    """The task a config's `task` section describes: `name` picks it, the rest are its
    constructor arguments."""
    fields = dict(task_cfg)
    return make_task(fields.pop("name"), **fields)


def make_task(name: str, **kwargs: Any) -> Task:
    """Build the task registered as `name` with its constructor arguments."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name](**kwargs)


__all__ = ["TASKS", "AdditionTask", "Prompt", "Task", "make_task", "task_from_config"]
