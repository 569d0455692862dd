"""What `python -m flows.train` answers before Prefect loads: `--help` and unknown flags in well
under two seconds, configuration errors once the configuration's validation has loaded what it
checks against (torch, transformers, lancedb: about 5 s here). Only Hydra and the configuration
package are imported here; flows/train.py calls `answer_early` before its own imports and goes
on when it returns None, with the configuration resolved here (`early_config`).
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

#: The keys people change most, shown by --help (every key: --cfg, replay_pipeline/config/schema.py).
MAIN_KEYS = [
    ("seed", "seeds the model's sampling and the replay sampler"),
    ("loop.steps", "RL steps (rounds) of the run"),
    ("loop.prompts_per_step, loop.group_size", "R = prompts x completions generated a step"),
    ("loop.updates_per_step, loop.minibatch_size", "K learner updates of B rollouts a step"),
    ("buffer.strategy, buffer.capacity", "how the window is drawn (fifo, positive_bias, prioritized, ...), its size"),
    ("algo.objective, algo.lr", "grpo_clip or asymre, the learning rate"),
    ("model.torch_threads", "0 (default): chosen from the machine's load"),
    ("tracking.root_dir", "where runs, tables, MLflow and checkpoints go (default ./runs)"),
    ("resume=RUN_ID|last, fork=RUN_ID@STEP", "continue a run, or start a new one from its checkpoint"),
]


def usage() -> str:
    from replay_pipeline.config import CONF_DIR  # start-up cost: after the interpreter is up, still fast

    groups = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())
    lines = ["usage: python -m flows.train [--help] [--cfg] [--config-dir DIR] [key=value ...] [group=option ...]",
             "", "--config-dir DIR: your own presets, DIR/<group>/<option>.yaml, selected as group=option", "",
             "Config groups (select with group=option):"]
    for g in groups:
        options = sorted(f.stem for f in (CONF_DIR / g).glob("*.yaml"))
        lines.append(f"  {g:<11} {', '.join(options)}")
    lines += ["", "Main keys (key=value):"]
    lines += [f"  {key:<44} {what}" for key, what in MAIN_KEYS]
    lines += ["", "Every key, its default, its bound and its meaning: replay_pipeline/config/schema.py "
              "(or --cfg to print the resolved values).",
              "Examples:", "  python -m flows.train buffer.capacity=512 algo.lr=3e-4",
              "  python -m flows.train experiment=no_buffer loop.steps=100",
              "  python -m flows.train model=hf model.path=/path/to/hf/checkpoint",
              "  python -m flows.train task=custom task.target=/path/to/my_task.py:make_task",
              "  python -m flows.train --config-dir ~/my-presets task=mine experiment=long",
              "  python -m flows.train resume=RUN_ID loop.steps=800   # continue (and extend) a run",
              "  python -m flows.train resume=last                    # the newest run under tracking.root_dir",
              "  python -m flows.train fork=RUN_ID@100 algo.lr=1e-4   # new run from a checkpoint"]
    return "\n".join(lines)


def say(text: str, stream=None) -> None:
    """Print `text`; a reader that left early (`| head`) is not an error."""
    stream = stream or sys.stdout
    try:
        print(text, file=stream, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


class UnknownFlags(ValueError):
    """Flags flows.train does not take."""


def command_line(argv: list[str]) -> tuple[list[str], bool]:
    """(Hydra overrides, whether --cfg was given) of flows.train's arguments: `--config-dir DIR`
    (or `--config-dir=DIR`, repeatable) becomes the one override that puts the directories on Hydra's search path
    (replay_pipeline/config/compose.py config_dir_override; ConfigError if it is not a
    directory). UnknownFlags for any other flag."""
    from replay_pipeline.config import config_dir_override  # start-up cost: hydra and the schema only

    overrides, folders, show_cfg, bad, rest = [], [], False, [], list(argv)
    while rest:
        arg = rest.pop(0)
        if arg == "--cfg":
            show_cfg = True
        elif arg == "--config-dir" or arg.startswith("--config-dir="):
            folder = arg.partition("=")[2] if "=" in arg else (rest.pop(0) if rest else "")
            if not folder:
                raise UnknownFlags("--config-dir needs a directory: --config-dir DIR")
            folders.append(folder)
        elif arg.startswith("-"):
            bad.append(arg)
        else:
            overrides.append(arg)
    if bad:
        raise UnknownFlags(f"unknown flag(s) {bad}")
    return ([config_dir_override(*folders)] if folders else []) + overrides, show_cfg


#: The command line answer_early resolved last, and its configuration (early_config).
_resolved: tuple[list[str], Any] | None = None


def early_config(argv: list[str]) -> Any | None:
    """A copy of the configuration answer_early resolved for exactly this command line (None
    for another): resolving costs ~0.35 s even once everything is imported, and a run's
    start-up pays it once instead of twice."""
    if _resolved is None or _resolved[0] != list(argv):
        return None
    return copy.deepcopy(_resolved[1])


def names_a_live_run(argv: list[str]) -> bool:
    """Whether the command line continues (`resume=ID`) or reuses (`run_id=ID`) a run that
    another live process drives (its lease, replay_pipeline/system/lease.py), read from the command
    line alone, before anything loads: such a command is refused once its configuration is
    checked, so flows/train.py then does not boot a Prefect server for it (5-9 s of CPU beside
    the live run). `resume=last` and anything unclear say False: the server then boots as usual."""
    from flows import root_dir_from_argv  # start-up cost: none, stdlib only
    from replay_pipeline.system.lease import holder

    for arg in argv:
        key, sep, value = arg.lstrip("+").partition("=")
        if sep and key in ("resume", "run_id") and value not in ("", "last", "null", "None") and "/" not in value:
            return holder(Path(root_dir_from_argv(argv)).expanduser() / value) is not None
    return False


def answer_early(argv: list[str]) -> int | None:
    """The exit code for --help (0), an unknown flag or a configuration error (2), printed
    here; None when the command line composes and the run should go on (its configuration is
    kept for early_config)."""
    global _resolved
    if any(a in ("-h", "--help") for a in argv):
        say(usage())
        return 0
    from replay_pipeline.config import ConfigError  # start-up cost: hydra and the schema only
    from replay_pipeline.run.resume import resolve_config

    try:
        overrides, _ = command_line(argv)
        _resolved = (list(argv), resolve_config(overrides))
    except UnknownFlags as exc:
        print(f"error: {exc}\n\n{usage()}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return None
