"""Your own task, by import path: `task=custom task.target=package.module:factory`.

    python -m flows.train task=custom task.target=mytasks.digits:make_task +task.args.terms=4
    python -m flows.train task=custom task.target=/abs/path/my_task.py:make_task

`task.target` names a callable, `module:attribute` for a module on PYTHONPATH or
`/path/to/file.py:attribute` for a file (a relative path is taken from the working directory
and recorded absolute). It is called with `task.args` (a mapping, any keys) plus those of
task.heldout_size, task.validation_size and task.split_seed that its signature accepts, and
returns a task: an object with `name`, `train_prompts(n, rng)`, `heldout_prompts()`,
`validation_prompts()` and `reward(prompt, completion, finish_reason)` (the protocol of
replay_pipeline/tasks/base.py; replay_pipeline/tasks/template.py is a complete example to copy).

Every process that builds the task imports the target again from the run's config.yaml: the
trainer, `resume=` and `fork=`, the async generator processes and Ray actors (the file or
module must be reachable there too), `flows.evaluate`, `flows.sweep` and deployment runs. A
target that cannot be imported is refused before any work (the pre-flight), naming it and
the fix.

Ground floor of the tasks: imports nothing of the project but the protocol.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

#: The protocol's members a task must have.
MEMBERS = ("name", "train_prompts", "heldout_prompts", "validation_prompts", "reward")
#: Task-section fields a custom factory is also offered (when its signature takes them).
COMMON = ("heldout_size", "validation_size", "split_seed")


def absolute_target(target: str) -> str:
    """A file target with its path made absolute (module targets unchanged)."""
    where, sep, attr = str(target).rpartition(":")
    if sep and where.endswith(".py"):
        return f"{Path(where).expanduser().resolve()}:{attr}"
    return str(target)


def load_target(target: str, key: str = "task.target") -> Callable[..., Any]:
    """The callable `target` names (the config key `key` holds it: task.target, or a reward
    term's reward.terms.NAME.target); ValueError saying what is wrong and how to fix it."""
    where, sep, attr = str(target or "").rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(f"{key}={target!r} must be `package.module:factory` or `/path/to/file.py:factory`")
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"{key}={target!r}: no file {path}; give the path of the file that defines "
                             f"{attr!r} (absolute, or relative to the working directory)")
        name = f"replay_pipeline_user_task_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # before exec: dataclasses and pickling look it up
            try:
                spec.loader.exec_module(module)
            except Exception as exc:
                del sys.modules[name]
                raise ValueError(f"{key}={target!r}: importing {path} failed: "
                                 f"{type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ValueError(f"{key}={target!r}: cannot import {where!r} ({exc}); put its directory on "
                             "PYTHONPATH (in every process that builds the task: generator processes and "
                             f"Ray actors too), or name the file: {key}=/path/to/file.py:{attr}") from exc
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ValueError(f"{key}={target!r}: {where} has no callable {attr!r}")
    return factory


def build_custom_task(target: str, args: Mapping[str, Any] | None, common: Mapping[str, Any]) -> Any:
    """The task `target`'s factory returns for `args` (and the COMMON fields it accepts),
    checked against the task protocol."""
    factory = load_target(target)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in common.items() if k in COMMON and (k in params or takes_any)}
    kwargs |= dict(args or {})
    try:
        task = factory(**kwargs)
    except TypeError as exc:
        raise ValueError(f"task.target={target!r} called with {sorted(kwargs)}: {exc}; set its arguments with "
                         "+task.args.NAME=VALUE") from exc
    missing = [m for m in MEMBERS if not hasattr(task, m)]
    if missing:
        raise ValueError(f"task.target={target!r} returned a {type(task).__name__} without {missing}: a task "
                         "has name, train_prompts(n, rng), heldout_prompts(), validation_prompts() and "
                         "reward(prompt, completion, finish_reason); see replay_pipeline/tasks/template.py")
    if not task.heldout_prompts():
        raise ValueError(f"task.target={target!r}: the task has no held-out prompts; every reported accuracy "
                         "is measured on them")
    return task
