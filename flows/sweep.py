"""A sweep: named training configurations, each with several seeds, as child runs of one Prefect
flow run and of one MLflow parent run.

    python -m flows.sweep                                      # no_buffer vs replay, seeds 0 and 1
    python -m flows.sweep --seeds 0 1 2 3 loop.steps=200       # overrides shared by every child
    python -m flows.sweep --config base=experiment=no_buffer \\
        --config big=experiment=replay,buffer.capacity=512 --name capacity

Each child is the `train` flow run as a sub-flow (so the Prefect UI shows it under the sweep),
with run id `<name>-<config>-s<seed>-<sweep id>` and `tracking.parent_run_id` set, so its MLflow
run is nested under the sweep's parent run. Every child configuration is composed and
validated before the first child starts; a bad one stops the sweep before any work (exit 2). A
child that fails is recorded as failed and the others still run; the parent run ends FAILED
then. The parent run holds `sweep.json`: each child's configuration, seed, run ids, status,
held-out accuracy before, after and best, and the generation and training compute.

The same flow is the `sweep` deployment (flows/deploy.py): its parameters are `configs` (name
-> Hydra overrides), `seeds`, `overrides` and `name`.
"""

from __future__ import annotations

import argparse
import re
import sys
import uuid
from dataclasses import dataclass
from typing import Any

import flows  # noqa: F401  (sets Prefect's environment before prefect is imported)
from prefect import flow

from replay_pipeline.config import ConfigError
from replay_pipeline.resume import resolve_config
from replay_pipeline.runs import RunPaths, ensure_writable

#: The default grid: the paper's on-policy baseline against the replay preset.
DEFAULT_CONFIGS: dict[str, list[str]] = {"no_buffer": ["experiment=no_buffer"], "replay": ["experiment=replay"]}
DEFAULT_SEEDS = [0, 1]
_NAME = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(frozen=True)
class Child:
    config: str
    seed: int
    run_id: str
    overrides: list[str]


def plan(configs: dict[str, list[str]], seeds: list[int], overrides: list[str], name: str,
         sweep_id: str) -> list[Child]:
    """Every child run of the sweep, each configuration composed and validated first; raises
    ConfigError naming every configuration that is wrong."""
    problems = []
    if not configs:
        problems.append("no configurations: give at least one --config NAME=OVERRIDE[,OVERRIDE...]")
    if not seeds:
        problems.append("no seeds: give at least one --seeds N")
    if len(set(seeds)) != len(seeds):
        problems.append(f"seeds repeat: {seeds}")
    for label in [name, *configs]:
        if not _NAME.fullmatch(str(label)):
            problems.append(f"{label!r}: sweep and configuration names use letters, digits, - and _ only")
    fixed = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in ("seed", "run_id", "resume", "fork")]
    if fixed:
        problems.append(f"{fixed}: the sweep sets seed and run_id itself, and does not resume or fork")
    if problems:
        raise ConfigError("Invalid sweep:\n  - " + "\n  - ".join(problems))
    children = []
    for config, extra in configs.items():
        for seed in seeds:
            run_id = f"{name}-{config}-s{seed}-{sweep_id}"
            child = [*overrides, *extra, f"seed={seed}", f"run_id={run_id}"]
            try:
                resolve_config(child)
            except ConfigError as exc:
                problems.append(f"configuration {config!r} (seed {seed}): {exc}")
                break
            children.append(Child(config, int(seed), run_id, child))
    if problems:
        raise ConfigError("Invalid sweep:\n  - " + "\n  - ".join(problems))
    return children


def _parent_tracker(overrides: list[str], name: str, sweep_id: str, configs: dict[str, list[str]],
                    seeds: list[int]):
    from replay_pipeline.tracking import MlflowTracker
    from replay_pipeline.trainer import artifact_location

    cfg = resolve_config(overrides)
    paths = RunPaths.make(cfg.tracking.root_dir, f"{name}-{sweep_id}")
    uri = cfg.tracking.mlflow_uri or paths.mlflow_uri
    tracker = MlflowTracker(uri=uri, experiment=cfg.tracking.experiment,
                            artifact_location=artifact_location(cfg, paths, uri),
                            run_name=f"{name}-{sweep_id}",
                            tags={"replay_pipeline.sweep": name, "replay_pipeline.sweep_id": sweep_id})
    tracker.log_params({"sweep.name": name, "sweep.seeds": str(seeds),
                        **{f"sweep.config.{k}": " ".join(v) for k, v in configs.items()},
                        "sweep.overrides": " ".join(overrides)})
    return tracker


@flow(name="sweep")
def sweep(configs: dict[str, list[str]] | None = None, seeds: list[int] | None = None,
          overrides: list[str] | None = None, name: str = "sweep") -> dict[str, Any]:
    """Train every configuration (name -> Hydra overrides) with every seed, as child runs;
    `overrides` apply to all of them."""
    from flows.train import train

    configs = dict(DEFAULT_CONFIGS if configs is None else configs)
    seeds = list(DEFAULT_SEEDS if seeds is None else seeds)
    overrides = list(overrides or [])
    sweep_id = uuid.uuid4().hex[:6]
    children = plan(configs, seeds, overrides, name, sweep_id)
    parent = _parent_tracker(overrides, name, sweep_id, configs, seeds)
    results = []
    for k, child in enumerate(children):
        record: dict[str, Any] = {"config": child.config, "seed": child.seed, "run_id": child.run_id,
                                  "overrides": child.overrides}
        try:
            summary = train(child.overrides + [f"tracking.parent_run_id={parent.run_id}"])
            record |= {"status": "FINISHED", "mlflow_run_id": summary.get("mlflow_run_id"),
                       **{k: summary.get(k) for k in ("accuracy_before", "accuracy_after", "accuracy_best",
                                                      "gen_tokens", "gen_seconds", "train_seconds")}}
            for key in ("accuracy_after", "accuracy_best"):
                if isinstance(summary.get(key), (int, float)):
                    parent.log_metrics({f"{child.config}/{key}": float(summary[key])}, step=child.seed)
        except Exception as exc:  # one failed child does not stop the others
            record |= {"status": "FAILED", "error": f"{type(exc).__name__}: {exc}"}
        results.append(record)
        parent.log_metrics({"sweep/children_done": float(k + 1)}, step=k)
    failed = [r for r in results if r["status"] != "FINISHED"]
    out = {"name": name, "sweep_id": sweep_id, "mlflow_run_id": parent.run_id, "children": results}
    parent.log_dict(out, "sweep.json")
    parent.finish("FAILED" if failed else "FINISHED")
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} sweep children failed: "
                           + "; ".join(f"{r['run_id']}: {r['error']}" for r in failed))
    return out


def _config_arg(text: str) -> tuple[str, list[str]]:
    name, sep, rest = text.partition("=")
    if not sep or not rest:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=OVERRIDE[,OVERRIDE...], e.g. big=buffer.capacity=512")
    return name, [o for o in rest.split(",") if o]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", type=_config_arg, default=None, metavar="NAME=OVERRIDES",
                        help="a configuration: its name and comma-separated Hydra overrides (repeat; "
                             f"default: {DEFAULT_CONFIGS})")
    parser.add_argument("--seeds", type=int, nargs="+", default=DEFAULT_SEEDS)
    parser.add_argument("--name", default="sweep")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every child (loop.steps=100 ...)")
    args = parser.parse_args(argv)
    configs = dict(args.config) if args.config else dict(DEFAULT_CONFIGS)
    try:
        plan(configs, args.seeds, args.overrides, args.name, "check")  # fail before Prefect starts
        ensure_writable(resolve_config(args.overrides).tracking.root_dir)
    except (ConfigError, PermissionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = sweep(configs=configs, seeds=args.seeds, overrides=args.overrides, name=args.name)
    for r in out["children"]:
        print(f"{r['run_id']:<48} {r['status']:<9} held-out accuracy {r.get('accuracy_after')}")
    print(f"MLflow parent run {out['mlflow_run_id']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
