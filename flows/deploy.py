"""Prefect deployments of the train, evaluate and sweep flows, so runs can be launched from the
Prefect UI, the CLI or the API with an edited configuration.

    export PREFECT_API_URL=http://127.0.0.1:4200/api     # a Prefect server (infra/compose.yaml)
    python -m flows.deploy                               # all three, on work pool `replay-pipeline`
    python -m flows.deploy --pool gpu --flows train sweep
    python -m flows.deploy --serve                       # no work pool: this process runs them
    prefect worker start --pool replay-pipeline          # a worker picks the runs up (pool: process)

    prefect deployment run train/train --param overrides='["loop.steps=100", "algo.lr=3e-4"]'
    prefect deployment run sweep/sweep --param seeds='[0,1,2,3]' --param overrides='["loop.steps=200"]'
    prefect deployment run evaluate/evaluate --param run_id=RUN_ID --param root=/shared/runs

Parameters are the flows' own: `train(overrides)` takes Hydra overrides exactly as
`python -m flows.train` does (in the UI, edit the list), `sweep(configs, seeds, overrides,
name)` and `evaluate(run_id, root, step, n, prompts, seed)`. `infra/prefect.yaml` declares the
same deployments for `prefect deploy --all`.

Decisions:
* **Source, not images.** Deployments pull the code from this checkout (`flow.from_source` on
  the repository root): the worker's machine runs it from the same path (a shared checkout or
  the same image, see infra/README.md). The work pool is created as a `process` pool if it
  does not exist; a pool of another type (docker, kubernetes) made beforehand is used as is.
* **A server is required.** Without PREFECT_API_URL there is only Prefect's ephemeral mode,
  whose state no worker can see; this refuses to run then (exit 2) instead of registering
  deployments nobody can pick up.
* **Where runs write.** A run launched on a worker writes under its own `tracking.root_dir`
  (default `runs` in the worker's working directory); pass `tracking.root_dir=/shared/runs`,
  `tracking.mlflow_uri=http://mlflow:5000` and `buffer.uri=s3://...` in the overrides (or as
  the deployment's defaults, `--train-overrides`) for runs that several machines share.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import flows  # noqa: F401  (sets Prefect's environment before prefect is imported)

ROOT = Path(__file__).resolve().parent.parent
ENTRYPOINTS = {"train": "flows/train.py:train", "evaluate": "flows/evaluate.py:evaluate",
               "sweep": "flows/sweep.py:sweep"}
DESCRIPTIONS = {
    "train": "RL post-training with experience replay. overrides: Hydra overrides, as for python -m flows.train.",
    "evaluate": "Evaluate a checkpoint of a run: greedy accuracy, pass@1, pass@k; logged to the run's MLflow run.",
    "sweep": "Training configurations x seeds as child runs (configs: name -> Hydra overrides).",
}
DEFAULT_POOL = "replay-pipeline"
TAGS = ["replay-pipeline"]


class DeployError(Exception):
    """Bad input found before anything is registered; exit status 2."""


def api_url() -> str:
    # start-up cost: Prefect; only this command talks to a server
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise DeployError("PREFECT_API_URL is not set: deployments live on a Prefect server. Start one "
                          "(`prefect server start`, or `docker compose -f infra/compose.yaml up`) and "
                          "`export PREFECT_API_URL=http://127.0.0.1:4200/api`.")
    return url


def default_parameters(name: str, train_overrides: list[str]) -> dict[str, Any]:
    if name == "train":
        return {"overrides": list(train_overrides)}
    if name == "sweep":
        return {"overrides": list(train_overrides)}
    return {}


def ensure_pool(pool: str) -> str:
    """The work pool's type; a missing pool is created as a `process` pool."""
    # start-up cost: Prefect; only this command talks to a server
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return client.read_work_pool(pool).type
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
            return "process"


def deploy(names: list[str], pool: str = DEFAULT_POOL, train_overrides: list[str] | None = None,
           source: Path = ROOT) -> dict[str, str]:
    """Register the named flows as deployments on `pool`; returns name -> deployment id."""
    # start-up cost: Prefect; only this command talks to a server
    from prefect import Flow

    api_url()
    ensure_pool(pool)
    ids = {}
    for name in names:
        flow = Flow.from_source(source=str(source), entrypoint=ENTRYPOINTS[name])
        ids[name] = str(flow.deploy(name=name, work_pool_name=pool, build=False, push=False,
                                    parameters=default_parameters(name, train_overrides or []),
                                    description=DESCRIPTIONS[name], tags=TAGS, print_next_steps=False))
    return ids


def serve(names: list[str], train_overrides: list[str] | None = None) -> None:
    """Serve the named flows from this process (no work pool or worker): it polls the server
    and runs each launched flow run in a subprocess, until stopped."""
    # start-up cost: Prefect; only this command talks to a server
    from prefect import serve as prefect_serve

    # start-up cost: the library (torch, lancedb, mlflow) loads after the command has parsed its arguments
    from flows.evaluate import evaluate
    from flows.sweep import sweep
    from flows.train import train

    api_url()
    objects = {"train": train, "evaluate": evaluate, "sweep": sweep}
    prefect_serve(*[objects[n].to_deployment(name=n, parameters=default_parameters(n, train_overrides or []),
                                             description=DESCRIPTIONS[n], tags=TAGS) for n in names])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flows.deploy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--flows", nargs="+", choices=sorted(ENTRYPOINTS), default=sorted(ENTRYPOINTS))
    parser.add_argument("--pool", default=os.environ.get("REPLAY_PIPELINE_POOL", DEFAULT_POOL),
                        help=f"work pool (created as a process pool if missing; default {DEFAULT_POOL})")
    parser.add_argument("--serve", action="store_true", help="serve from this process instead of a work pool")
    parser.add_argument("--train-overrides", nargs="*", default=[],
                        help="default overrides of the train and sweep deployments (editable per run)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.serve:
            serve(args.flows, args.train_overrides)
            return 0
        ids = deploy(args.flows, args.pool, args.train_overrides)
    except DeployError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, deployment_id in ids.items():
        print(f"deployment {name}/{name} ({deployment_id}) on work pool {args.pool}")
    # The deployment's defaults stay in the hint: --param replaces the whole list.
    launch = json.dumps([*args.train_overrides, "loop.steps=100"])
    print(f"start a worker: prefect worker start --pool {args.pool}\n"
          f"launch a run:   prefect deployment run train/train --param overrides='{launch}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
