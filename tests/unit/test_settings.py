"""The run's one runtime form of the configuration (replay_pipeline/run/settings.py) and the
bounds declared with the fields (replay_pipeline/config/schema.py, replay_pipeline/algo/bounds.py)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from replay_pipeline.algo import objectives
from replay_pipeline.algo.bounds import Bound
from replay_pipeline.buffer.sampling import RULE_BOUNDS
from replay_pipeline.config import Config, ConfigError, load_config
from replay_pipeline.training.learner import LEARNER_BOUNDS
from replay_pipeline.run.resume import config_hash
from replay_pipeline.run.settings import build_settings


def test_settings_are_frozen_and_derive_once():
    cfg = load_config(["loop.prompts_per_step=4", "loop.group_size=8", "loop.minibatch_size=16",
                       "loop.updates_per_step=3", "buffer.capacity=96"])
    s = build_settings(cfg, "run-x", "new")
    assert (s.rollouts_per_step, s.window_size, s.replay_ratio) == (32, 96, 3 * 16 / 32)
    assert dict(s.objective_params) == {"eps_low": 0.2, "eps_high": 0.2}  # grpo_clip's own keywords
    assert s.sampling_rules.reuse_cap is None and s.config_hash == config_hash(cfg)
    assert s.resolved["run_id"] == "run-x" and s.container()["loop"]["minibatch_size"] == 16
    for section, key in ((s.loop, "steps"), (s.buffer, "capacity"), (s.model.warmstart, "lr"), (s, "seed")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, key, 1)
    with pytest.raises(TypeError):
        s.resolved["seed"] = 3  # a read-only mapping
    copy = s.container()
    copy["loop"]["steps"] = 1  # a fresh copy: the settings are untouched
    assert s.loop.steps == cfg.loop.steps and s.resolved["loop"]["steps"] == cfg.loop.steps


def test_the_fresh_baseline_window_is_the_fresh_batch():
    s = build_settings(load_config(["experiment=no_buffer"]), "b", "new")
    assert s.window_size == s.rollouts_per_step and s.replay_ratio == 1.0


@pytest.mark.parametrize("preset,params", [("algo=asymre", {"delta_v": -0.1}), ("algo=tis", {"tis_cap": 2.0}),
                                           ("algo=topr", {})])
def test_objective_params_are_read_off_the_objectives_signature(preset, params):
    assert dict(build_settings(load_config([preset]), "o", "new").objective_params) == params


def test_an_objective_whose_hyper_parameter_has_no_field_is_refused(monkeypatch):
    def new_objective(inputs, *, gamma_x: float = 1.0):  # a keyword the configuration lacks
        raise AssertionError("never called")

    monkeypatch.setitem(objectives.OBJECTIVES, "new_objective", new_objective)
    with pytest.raises(ConfigError, match=r"algo.objective=new_objective takes \['gamma_x'\].*AlgoConfig"):
        load_config(["algo.objective=new_objective"])


def _bounded_fields():
    """(dotted key, Bound) of every field of the schema that declares or owns a bound."""
    out = []

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
                walk(f.default_factory, f"{prefix}{f.name}.")
            elif "bound" in f.metadata:
                out.append((f"{prefix}{f.name}", f.metadata["bound"]))
            elif "owner" in f.metadata:
                owned = LEARNER_BOUNDS if f.metadata["owner"] == "learner" else RULE_BOUNDS
                out.append((f"{prefix}{f.name}", owned[f.name]))

    walk(Config, "")
    return out


def _outside(bound: Bound):
    if bound.ge is not None:
        return bound.ge - 1 if bound.integer else bound.ge - 0.5
    if bound.gt is not None:
        return int(bound.gt) if bound.integer else bound.gt
    return bound.le + 1 if bound.le is not None else bound.lt


@pytest.mark.parametrize("key,bound", _bounded_fields(), ids=[k for k, _ in _bounded_fields()])
def test_every_declared_bound_refuses_a_value_outside_it_and_names_the_key(key, bound):
    value = _outside(bound)
    with pytest.raises(ConfigError) as err:
        load_config([f"{key}={value}"])
    assert re.search(rf"{re.escape(key)}=-?[0-9.]+ must be {re.escape(bound.rule())}", str(err.value)), str(err.value)


def test_bound_words():
    assert Bound(ge=0, lt=1).problem("x", 1) == "x=1 must be in [0, 1)"
    assert Bound(gt=0, le=1).problem("x", 0) == "x=0 must be in (0, 1]"
    assert Bound(ge=1, integer=True, null="for no cap").problem("x", 0) == "x=0 must be an integer >= 1, or null for no cap"
    assert Bound(ge=1, integer=True, null="for no cap").problem("x", None) is None
    assert Bound(gt=0, finite=True, hint="h").problem("x", float("inf")) == "x=inf must be a finite number > 0 (h)"
    assert Bound(ge=0).problem("x", float("nan")) == "x=nan must be >= 0"
    assert Bound(ge=0).problem("x", True) == "x=True must be >= 0" and Bound(ge=0).problem("x", 0.0) is None
