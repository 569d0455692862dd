"""Resume and fork: which configuration a continued run uses, and what may change.

    python -m flows.train resume=<run_id> [loop.steps=N ...]
    python -m flows.train resume=last                 # the newest run under tracking.root_dir
    python -m flows.train fork=<run_id>@<step> [any overrides]

**Resume** continues a run from its newest valid checkpoint into the same rollout table, usage
table and MLflow run. Its configuration is the run's own `<root>/<run_id>/config.yaml`; the
command line may change only the keys in :data:`RESUMABLE`, which do not change the
trajectory (the run length, the evaluation and checkpoint cadence, the progress bar, the
torch thread count, the device: a run may continue on another machine). Any other change is
refused before work starts, naming the keys and suggesting a fork, because a resumed run
must replay exactly what the stopped run would have done. The checkpoint stores
:func:`config_hash` of the configuration it was trained with; a resume whose configuration
hashes differently (an edited config.yaml) is refused too.

**Fork** starts a *new* run (new run id, new MLflow run tagged with its lineage) from the
source run's checkpoint at `step`: its configuration is the source's config.yaml with the
command line's changes applied. Everything may change except `model.*` (the weights come
from the checkpoint), `buffer.uri` (the new table is a shallow clone inside the source's
LanceDB database) and `tracking.*` other than `progress` and `root_dir`.

"Changed on the command line" means: differs between the composed configuration with the
given overrides and the composed defaults (so a group choice such as `algo=asymre` counts as
the keys it changes), and differs from the saved run's value (repeating the run's own
overrides is harmless).
"""

from __future__ import annotations

from collections.abc import Iterable

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from replay_pipeline.config import DASK_REASON, Config, ConfigError, flatten, load_config, validate
from replay_pipeline.system.runs import RunPaths, list_runs

#: `resume=last`: the newest run under tracking.root_dir (replay_pipeline.system.runs.list_runs).
LAST = "last"

#: Keys a resume may change: they do not alter what the run generates or learns.
RESUMABLE = ("loop.steps", "loop.eval_every", "loop.passk_every", "loop.eval_samples", "loop.eval_top_p",
             "loop.pass1_samples",
             "loop.checkpoint_every", "loop.keep_checkpoints", "tracking.progress", "tracking.log_model",
             "model.torch_threads", "model.device", "buffer.read_cache", "buffer.write_behind",
             "loop.engine", "loop.heartbeat_timeout",
             "ray.address", "ray.num_cpus", "ray.num_gpus", "ray.placement_timeout", "ray.max_restarts",
             "ray.generator_python",
             "loop.rounds_per_task", "buffer.read_ahead", "buffer.commit_seconds",
             # the learner's ranks: another world size or shard mode sums the same gradients in
             # another order (equal within float rounding; bit for bit only with the same ones);
             # a checkpoint holds the one-process state either way
             "learner.world_size", "learner.backend", "learner.timeout", "learner.shard")
#: Keys that name or locate a run rather than configure it (never part of the hash); a key
#: ending in "." covers every key below it (the object store's endpoint and credentials may
#: change between a run and its resume).
IDENTITY = ("run_id", "resume", "fork", "tracking.root_dir", "tracking.parent_run_id",
            "buffer.storage_options.")
#: Keys an earlier version saved and this one no longer has. None of them was ever hashed
#: (each was in RESUMABLE), so an old checkpoint's config hash still matches without them;
#: `_retired` drops them from a saved config.yaml, or refuses a run that cannot go on
#: without them.
RETIRED = ("loop.dask_address",)


def _identity(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in IDENTITY)
#: Prefixes a fork may not change (plus the listed exceptions, which it may).
FORK_FIXED = ("model.", "buffer.uri", "tracking.")
FORK_FREE = ("tracking.progress", "tracking.log_model", "tracking.root_dir", "model.torch_threads", "model.device")

def config_hash(cfg: DictConfig | dict, keys: Iterable[str] | None = None) -> str:
    """SHA-256 (16 hex digits) of every key that shapes the trajectory (not RESUMABLE or
    IDENTITY keys), so a resume can prove it continues with the configuration it stopped with.

    ``keys`` restricts the hash to those keys: a resume hashes the keys of the run's saved
    config.yaml only, so configuration fields added to the project after the run was saved
    (which resolve_config keeps at their defaults on a resume) do not make its checkpoints
    unresumable."""
    wanted = None if keys is None else set(keys)
    flat = {k: v for k, v in flatten(cfg).items()
            if k not in RESUMABLE and k not in RETIRED and not _identity(k) and (wanted is None or k in wanted)}
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:16]


def parse_fork(spec: str) -> tuple[str, int]:
    run_id, _, step = str(spec).partition("@")
    return run_id, int(step)


def changed_keys(cfg: DictConfig, defaults: DictConfig) -> dict[str, Any]:
    """Keys whose value the overrides changed from the defaults (identity keys excluded)."""
    new, old = flatten(cfg), flatten(defaults)
    return {k: v for k, v in new.items() if not _identity(k) and old.get(k, object()) != v}


def saved_config(root: str | Path, run_id: str) -> dict[str, Any]:
    """A run's resolved config.yaml as a dict; ConfigError (with the runs there) if missing."""
    paths = RunPaths.make(root, run_id)
    path = paths.run_dir / "config.yaml"
    if not path.is_file():
        have = sorted(p.parent.name for p in paths.root.glob("*/config.yaml")) if paths.root.is_dir() else []
        raise ConfigError(f"no run {run_id!r} under {paths.root} (no {path}); runs there: "
                          f"{', '.join(have[-10:]) or 'none'}. Pass the run id printed at its start, "
                          "and the same tracking.root_dir it used.")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def _given(overrides: list[str], key: str) -> str | None:
    """The value the command line gives `key` (last one wins), or None: `changed_keys` misses
    a key set to its default (loop.engine=local)."""
    found = None
    for item in overrides:
        name, sep, value = str(item).lstrip("+~").partition("=")
        if sep and name == key:
            found = value
    return found


def _retired(saved: dict[str, Any], overrides: list[str], how: str) -> dict[str, Any]:
    """A saved config.yaml of an earlier version, made to fit this one: a null
    `loop.dask_address` is dropped; a run whose generators ran on Dask (loop.engine=dask, or a
    scheduler address) needs the command line to pick loop.engine=ray or loop.engine=local
    (loop.engine may change on a resume), or is refused saying how. `how` is resume=RUN or
    fork=RUN@STEP."""
    loop = saved.get("loop")
    if not isinstance(loop, dict) or ("dask_address" not in loop and loop.get("engine") != "dask"):
        return saved
    loop = dict(loop)
    address = loop.pop("dask_address", None)
    if loop.get("engine") == "dask" or address is not None:
        engine = _given(overrides, "loop.engine")
        if engine not in ("local", "ray"):
            was = "loop.engine=dask" + (f" loop.dask_address={address}" if address is not None else "")
            rest = " ".join(o for o in overrides if _given([o], "loop.engine") is None)
            raise ConfigError(
                f"{how}: this run's generators ran on Dask ({was}), and the Dask engine was retired: "
                f"{DASK_REASON}. loop.engine may change on a resume, with the same trajectory; continue on Ray "
                "or locally:\n"
                f"  python -m flows.train {rest} loop.engine=ray    # a local Ray instance; on a cluster add "
                "ray.address=HEAD:6379 (infra/distributed.md)\n"
                f"  python -m flows.train {rest} loop.engine=local    # generator processes of the flow")
        loop["engine"] = engine
    return {**saved, "loop": loop}


def _merge(saved: dict[str, Any], changes: dict[str, Any], identity: dict[str, Any]) -> DictConfig:
    base = OmegaConf.structured(Config)
    try:
        cfg = OmegaConf.merge(base, OmegaConf.create(saved))
    except Exception as exc:  # keys this version does not know, or wrong types
        raise ConfigError(f"the saved configuration no longer fits this version's schema: {exc}") from exc
    for key, value in {**changes, **identity}.items():
        OmegaConf.update(cfg, key, value, merge=False)
    validate(cfg)
    return cfg


def resolve_config(overrides: list[str] | None) -> DictConfig:
    """The configuration a `python -m flows.train` command line runs with: composed and
    validated, then (for resume or fork) rebuilt from the saved run's config as described in
    the module docstring. Raises ConfigError before any work."""
    overrides = list(overrides or [])
    cfg = load_config(overrides, check=False)  # a resume's command line is checked merged into the saved run's
    if cfg.resume is None and cfg.fork is None:
        validate(cfg)
        return cfg
    if cfg.resume is not None and cfg.fork is not None:
        raise ConfigError("give either resume=<run_id> or fork=<run_id>@<step>, not both")
    changes = changed_keys(cfg, load_config([]))
    root = cfg.tracking.root_dir
    if cfg.resume == LAST:
        runs = list_runs(root)
        if not runs:
            raise ConfigError(f"resume={LAST}: no run under {RunPaths.make(root, LAST).root} (no */config.yaml); "
                              "pass tracking.root_dir=<the runs' root>")
        cfg.resume = runs[-1]
    if cfg.resume is not None:
        saved = _retired(saved_config(root, cfg.resume), overrides, f"resume={cfg.resume}")
        old = flatten(saved)
        refused = {k: v for k, v in changes.items() if k not in RESUMABLE and old.get(k) != v}
        if refused:
            listed = ", ".join(f"{k} ({old.get(k)!r} -> {v!r})" for k, v in sorted(refused.items()))
            raise ConfigError(
                f"resume={cfg.resume} cannot change {listed}: a resumed run replays exactly what "
                f"the stopped run would have done. Only {', '.join(RESUMABLE)} may change. To try a "
                f"change from a checkpoint, fork it: python -m flows.train fork={cfg.resume}@<step> "
                + " ".join(f"{k}={v}" for k, v in sorted(refused.items())))
        identity = {"run_id": cfg.resume, "resume": cfg.resume, "tracking.root_dir": root}
        return _merge(saved, changes, identity)
    source, step = parse_fork(cfg.fork)
    saved = _retired(saved_config(root, source), overrides, f"fork={cfg.fork}")
    old = flatten(saved)
    refused = {k: v for k, v in changes.items()
               if k.startswith(FORK_FIXED) and k not in FORK_FREE and old.get(k) != v}
    if refused:
        raise ConfigError(
            f"fork={cfg.fork} cannot change {', '.join(sorted(refused))}: the fork starts from the "
            "source's weights, inside the source's LanceDB database and MLflow store. Start a new "
            "run for a different model or store.")
    sampling = {k: (old.get(k), v) for k, v in changes.items()
                if k in ("generator.temperature", "generator.top_p") and old.get(k) != v}
    if sampling:
        warnings.warn(f"fork={cfg.fork} changes " + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in sampling.items())
                      + ": the rollouts it inherits keep the settings they were sampled with (stored on "
                      "every rollout) and are re-scored at their own temperature; new rollouts use the new "
                      "settings", stacklevel=2)
    identity = {"run_id": cfg.run_id, "resume": None, "fork": cfg.fork, "tracking.root_dir": root}
    return _merge(saved, changes, identity)
