"""The one runtime form of a run's configuration: `Settings`, frozen, built once from the
validated configuration, with the values derived from it computed once.

The per-round code reads plain attributes (an OmegaConf node costs ~40 us an attribute, and
a round read about forty); nothing can change them mid-run (every section is a frozen
dataclass, `storage_options` a read-only mapping). Derived values live here and nowhere
else: rollouts per step (R), the sampler's window size, the target replay ratio K x B / R,
the reuse policy and the minibatches a round draws (replay_pipeline/algo/reuse.py), the chosen objective's hyper-parameters (read off its signature, so a new hyper-parameter of
an objective is a keyword argument of its function and an `algo.*` field of the same name)
and the sampling rules. `resolved` is the resolved configuration as plain data, for what is
written (config.yaml, MLflow params, the generator workers' copy) and `config_hash` its hash
over the keys that shape the trajectory (replay_pipeline/run/resume.py).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from replay_pipeline.buffer.sampling import SamplingRules, window_for
from replay_pipeline.config import Config
from replay_pipeline.algo.objectives import get_objective, objective_param_names
from replay_pipeline.run.resume import config_hash
from replay_pipeline.algo.reuse import ReusePolicy

_FROZEN: dict[type, type] = {}


def _frozen_class(cls: type) -> type:
    """A frozen dataclass with the fields of the schema class `cls` (made once per class)."""
    if cls not in _FROZEN:
        _FROZEN[cls] = dataclasses.make_dataclass(
            cls.__name__, [(f.name, Any) for f in dataclasses.fields(cls)], frozen=True,
            namespace={"__doc__": f"{cls.__name__}, frozen (replay_pipeline/config/schema.py documents it)."})
    return _FROZEN[cls]


def freeze(obj: Any) -> Any:
    """A deep, frozen copy of a schema dataclass instance (dicts become read-only mappings)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values = {f.name: freeze(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return _frozen_class(type(obj))(**values)
    if isinstance(obj, dict):
        return MappingProxyType({k: freeze(v) for k, v in obj.items()})
    if isinstance(obj, list):
        return tuple(freeze(v) for v in obj)
    return obj


@dataclass(frozen=True)
class Settings:
    seed: int
    run_id: str
    """This run's id (a new run's is chosen before the settings are built)."""
    mode: str
    """How the run starts: `new`, `resume` or `fork`."""
    resume: str | None
    fork: str | None
    model: Any
    task: Any
    generator: Any
    buffer: Any
    algo: Any
    loop: Any
    ray: Any
    """loop.engine=ray: the Ray cluster and placement (replay_pipeline/run/ray_engine.py)."""
    tracking: Any
    reward: Any
    reuse: Any
    learner: Any
    resolved: Mapping[str, Any]
    """The resolved configuration as plain data (read-only), run_id included."""
    config_hash: str
    rollouts_per_step: int
    """R = loop.prompts_per_step x loop.group_size."""
    window_size: int
    """Rows of the table the sampler reads: buffer.capacity, or the fresh batch (R) for the
    no-buffer baseline."""
    replay_ratio: float
    """The target replay ratio K x B / R (the realised one is measured from the usage records)."""
    objective_params: Mapping[str, float]
    """algo.* values of the hyper-parameters algo.objective declares."""
    sampling_rules: SamplingRules
    reuse_policy: ReusePolicy
    """The `reuse` section as replay_pipeline/algo/reuse.py's rules read it."""
    updates_drawn: int
    """Minibatches a round draws: loop.updates_per_step, or reuse.max_updates when a reuse rule
    decides how many of them are applied."""

    @property
    def async_loop(self) -> bool:
        return self.loop.mode == "async"

    def container(self) -> dict[str, Any]:
        """The resolved configuration as a fresh, mutable dict (a copy of `resolved`)."""
        return copy.deepcopy(_thaw(self.resolved))


def _thaw(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: _thaw(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return [_thaw(v) for v in obj]
    return obj


def build_settings(cfg: DictConfig, run_id: str, mode: str) -> Settings:
    """The frozen settings of a validated configuration `cfg`, for run `run_id`."""
    typed: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["run_id"] = run_id
    loop, buf, algo = typed.loop, typed.buffer, typed.algo
    rollouts = loop.prompts_per_step * loop.group_size
    names = objective_param_names(get_objective(algo.objective))
    rules = SamplingRules(reuse_cap=buf.reuse_cap, max_staleness=buf.max_staleness,
                          recency_half_life=buf.recency_half_life, priority_alpha=buf.priority_alpha)
    r = typed.reuse
    policy = ReusePolicy(rule=r.rule, max_updates=r.max_updates, min_updates=r.min_updates,
                         spike_factor=r.spike_factor, kl_budget=r.kl_budget, clip_budget=r.clip_budget)
    drawn = r.max_updates if policy.adaptive else loop.updates_per_step
    sections = {f.name: freeze(getattr(typed, f.name)) for f in dataclasses.fields(typed)
                if dataclasses.is_dataclass(getattr(typed, f.name))}
    return Settings(
        seed=typed.seed, run_id=run_id, mode=mode, resume=typed.resume, fork=typed.fork, **sections,
        resolved=freeze(resolved), config_hash=config_hash(cfg), rollouts_per_step=rollouts,
        window_size=window_for(buf.strategy, buf.capacity, rollouts),
        replay_ratio=loop.updates_per_step * loop.minibatch_size / rollouts,
        objective_params=MappingProxyType({k: getattr(algo, k) for k in names}),
        sampling_rules=rules, reuse_policy=policy, updates_drawn=drawn)
