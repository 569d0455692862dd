"""Composing a configuration: Hydra merges the conf/ presets and the command line's overrides
onto the schema (replay_pipeline/config/schema.py), then `validate` checks it
(replay_pipeline/config/rules.py). Plus the two plain forms a configuration is written in:
`flatten` (MLflow params) and `to_dataclass`. A user's own presets come from a directory on
Hydra's search path (`config_dir_override`, the CLIs' `--config-dir`).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from replay_pipeline.config.rules import identity_problems, validate
from replay_pipeline.config.schema import CONF_DIR, Config, ConfigError


def register_configs() -> None:
    """Register the dataclasses as the schema that conf/config.yaml builds on, and the
    `rp.mul` resolver that presets use to size things from the batch (`${rp.mul:a,b}`)."""
    node = OmegaConf.structured(Config)
    # Free-form keys (Lance's own option names): `buffer.storage_options={k:v,...}` and
    # `buffer.storage_options.k=v` must not need Hydra's `+`; every other key stays strict.
    OmegaConf.set_struct(node.buffer.storage_options, False)
    OmegaConf.set_struct(node.task.args, False)  # a custom task's factory arguments (task.args.NAME=V)
    OmegaConf.set_struct(node.task.config, False)  # a reasoning-gym dataset's settings (task.config.NAME=V)
    OmegaConf.set_struct(node.task.weights, False)  # a reasoning-gym mixture's weights (task.weights.NAME=W)
    OmegaConf.set_struct(node.reward.terms, False)  # weighted reward terms by name (rules.py checks them)
    ConfigStore.instance().store(name="base_config", node=node)
    if not OmegaConf.has_resolver("rp.mul"):
        OmegaConf.register_new_resolver("rp.mul", lambda a, b: int(a) * int(b))


def config_dir_override(*paths: str) -> str:
    """The override that adds a user's config directories to Hydra's search path (`--config-dir
    DIR` of flows.train and flows.sweep, repeatable): their presets (`DIR/buffer/big.yaml`,
    `DIR/task/mine.yaml`, `DIR/experiment/x.yaml`) are then selected like the built-in ones
    (`buffer=big`); the built-in conf/ comes first, so a built-in option's name keeps its
    meaning. ConfigError when one is not a directory."""
    folders = []
    for path in paths:
        folder = Path(os.path.expanduser(str(path))).resolve()
        if not folder.is_dir():
            raise ConfigError(f"--config-dir {path}: no directory {folder}; give a directory of presets laid out "
                              "like conf/ (DIR/<group>/<option>.yaml)")
        folders.append(f"file://{folder}")
    return f"hydra.searchpath=[{','.join(folders)}]"


def load_config(overrides: list[str] | None = None, check: bool = True) -> DictConfig:
    """Compose conf/ with Hydra overrides and validate; raise ConfigError on any problem.
    With `check=False` the rules across keys (replay_pipeline/config/rules.py) are left to the
    caller: a resume's command line is checked once merged into the saved run's configuration
    (replay_pipeline/run/resume.py), since alone it may lack what the run has (loop=async).
    Unknown keys, values of the wrong type and malformed run_id, resume or fork are refused
    either way."""
    register_configs()
    overrides = list(overrides or [])
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(_explain_composition_error(exc, overrides)) from exc
    unknown = unknown_keys(cfg)
    if unknown:  # `+key=value` adds a key Hydra's schema check never sees: refused like any other
        known = list(_schema_keys())
        raise ConfigError("Invalid configuration: unknown key(s) " + "; ".join(
            f"{k}" + (f" (did you mean {close[0]}?)" if (close := difflib.get_close_matches(k, known, 1)) else "")
            for k in unknown) + ". Keys are listed by `python -m flows.train --cfg`; a `+` does not make a key "
            "the schema lacks (replay_pipeline/config/schema.py) valid.")
    if check:
        validate(cfg)
    elif problems := identity_problems(cfg):  # the run a resume or fork names is read next
        raise ConfigError.listing(problems)
    return cfg


#: Sections whose keys are free-form (an object store's options, a custom task's arguments, reward
#: terms: replay_pipeline/config/rules.py checks their shape).
FREE_FORM = ("buffer.storage_options.", "task.args.", "task.config.", "task.weights.", "reward.terms.")


def _schema_keys() -> dict[str, Any]:
    return flatten(OmegaConf.structured(Config))


def unknown_keys(cfg: DictConfig) -> list[str]:
    """Keys of a composed configuration that the schema does not have (free-form sections aside)."""
    known = _schema_keys()
    return sorted(k for k in flatten(cfg) if k not in known and not k.startswith(FREE_FORM))


def _explain_composition_error(exc: Exception, overrides: list[str]) -> str:
    text = str(exc).strip()
    cause = getattr(exc, "__cause__", None)
    if cause is not None and "could not be converted" in str(cause):  # algo.lr=abc: say which type
        text = f"{text}: {str(cause).splitlines()[0]}"
    hint = (
        "Run `python -m flows.train --help` for the config groups and their options, or "
        "`python -m flows.train --cfg` to print every key with its value."
    )
    if "Could not override" in text or "not in struct" in text or "Key '" in text:
        hint = (
            "Check the key's spelling; keys are listed by `python -m flows.train --cfg`. "
            "To add a key that does not exist, Hydra needs `+key=value`, but unknown keys "
            "are rejected by the schema in replay_pipeline/config/schema.py."
        )
    elif "Could not find" in text or "In 'config'" in text:
        hint = "Pick one of the options listed above (files under conf/<group>/)."
    return f"Invalid configuration (overrides: {overrides or 'none'}):\n{text}\n{hint}"


def to_dataclass(cfg: DictConfig) -> Config:
    """A typed Config from a composed DictConfig (for code that wants attribute types)."""
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def flatten(cfg: DictConfig | dict, prefix: str = "") -> dict[str, Any]:
    """{"algo.lr": 3e-5, ...}: the form MLflow params take."""
    container = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    out: dict[str, Any] = {}
    for key, value in container.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, prefix=f"{name}."))
        else:
            out[name] = value
    return out
