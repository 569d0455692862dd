"""Evaluate a checkpoint of a finished (or running) training run: python -m flows.evaluate.

    python -m flows.evaluate RUN_ID                      # newest complete checkpoint, n = 16
    python -m flows.evaluate RUN_ID --step 200 --n 32    # a given checkpoint, 32 samples/prompt
    python -m flows.evaluate RUN_ID --root /data/runs --prompts 64   # first 64 held-out prompts

Rebuilds the run's task and generator from `<root>/<run_id>/config.yaml`, loads the
checkpoint's Hugging Face `model/` directory and runs replay_pipeline.training.evaluation.evaluate_all
on the held-out prompts: greedy accuracy, the paper's pass@1 at temperature 0.1 and pass@k
and sampling entropy at temperature 1. The metrics go to the run's own MLflow run (from the
checkpoint's state.json) at step = the checkpoint's policy version, with the same numbers as
the artifact `eval/step-NNNNNN.json` (and a copy under `<root>/<run_id>/eval/`).

The run, checkpoint and MLflow run are resolved before Prefect or any model is touched; a
problem there exits with status 2 and a message that says how to fix the call.
"""

from __future__ import annotations

import os
import sys


def _root_from_argv(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--root" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--root="):
            return arg[len("--root="):]
    return None


# Prefect's state belongs under the evaluated root, as for training (flows/__init__.py).
if (_root := _root_from_argv(sys.argv[1:])) is not None:
    os.environ.setdefault("REPLAY_PIPELINE_ROOT", _root)

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import flows  # noqa: E402,F401  (sets Prefect's environment before prefect is imported)
from prefect import flow  # noqa: E402

from replay_pipeline.training.checkpoints import (CheckpointError, checkpoint_name, checkpoint_step,  # noqa: E402
                                         list_checkpoints, verify)
from replay_pipeline.system.runs import RunPaths  # noqa: E402


class EvaluateError(Exception):
    """Bad input found before any work; exit status 2 with this message."""


@dataclass(frozen=True)
class Target:
    """What to evaluate: one complete checkpoint of one run, and where its metrics go."""

    paths: RunPaths
    checkpoint: Path
    step: int
    policy_version: int
    mlflow_run_id: str | None
    mlflow_uri: str
    cfg: Any  # the run's resolved config (DictConfig)


def _runs_under(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "config.yaml").is_file())


def resolve(run_id: str, root: str | Path, step: int | None) -> Target:
    """Find the run, its checkpoint and its MLflow run; EvaluateError says how to fix a miss."""
    # start-up cost: the command answers --help and bad arguments before loading the library
    from omegaconf import OmegaConf

    paths = RunPaths.make(root, run_id)
    config = paths.run_dir / "config.yaml"
    if not config.is_file():
        runs = _runs_under(paths.root)
        found = f"runs found there: {', '.join(runs)}" if runs else "no runs found there"
        raise EvaluateError(f"unknown run {run_id!r} under {paths.root} (no {config.name}); {found}. "
                            "Pass one of those ids, or --root the tracking.root_dir it trained under")
    done = list_checkpoints(paths.checkpoints)
    if not done:
        raise EvaluateError(f"run {run_id!r} has no complete checkpoint under {paths.checkpoints}; "
                            "train with loop.checkpoint_every=N (checkpoints hold the weights to evaluate)")
    steps = {checkpoint_step(p): p for p in done}
    if step is None:
        step = max(steps)
    elif step not in steps:
        raise EvaluateError(f"run {run_id!r} has no complete checkpoint at step {step}; available "
                            f"steps: {', '.join(map(str, sorted(steps)))} (pass one with --step, or "
                            "omit --step for the newest)")
    ckpt = steps[step]
    try:
        state = verify(ckpt)  # state.json parses and every file matches its manifest
        version = int(state["policy_version"])
    except (CheckpointError, OSError, ValueError, KeyError, TypeError) as exc:
        raise EvaluateError(f"checkpoint {ckpt.name} cannot be used: {exc}; evaluate another checkpoint "
                            f"with --step (available: {', '.join(map(str, sorted(steps)))}) or delete {ckpt}") from exc
    cfg = OmegaConf.load(config)
    uri = cfg.tracking.mlflow_uri or paths.mlflow_uri
    mlflow_run_id = state.get("mlflow_run_id")
    if mlflow_run_id:
        # start-up cost: mlflow takes seconds to import; only this path talks to the store
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        try:
            MlflowClient(tracking_uri=uri).get_run(mlflow_run_id)
        except MlflowException as exc:
            raise EvaluateError(f"the MLflow run {mlflow_run_id} named by {ckpt / 'state.json'} is not "
                                f"in {uri} ({exc.message if hasattr(exc, 'message') else exc}); "
                                "check --root, or the run's tracking.mlflow_uri") from exc
    return Target(paths, ckpt, step, version, mlflow_run_id, uri, cfg)


def load_generator(target: Target, task):
    """The checkpoint's policy behind a generator with the run's settings (generator.backend,
    replay_pipeline.generation.build_generator), on the run's model.device. Close it after use."""
    # start-up cost: torch/transformers, only on this path
    import torch
    from omegaconf import OmegaConf
    from transformers.utils import logging as hf_logging

    # start-up cost: the library (torch, lancedb, mlflow) loads after the command has parsed its arguments
    from replay_pipeline.config import GeneratorConfig, RewardConfig
    from replay_pipeline.models.device import resolve_device
    from replay_pipeline.models.loading import generator_from_pretrained, read_state_dict
    from replay_pipeline.algo.scoring import set_reward_timeout

    hf_logging.disable_progress_bar()  # per-file load bars would bury the summary

    cfg = target.cfg
    if cfg.model.get("torch_threads"):
        torch.set_num_threads(cfg.model.torch_threads)
    # A run saved before the reward section existed: its default timeout.
    set_reward_timeout(OmegaConf.select(cfg, "reward.timeout", default=RewardConfig.timeout))
    # A run saved before a generator field existed evaluates with that field's default.
    gen_cfg = OmegaConf.merge(OmegaConf.structured(GeneratorConfig), cfg.generator)
    model_dir = target.checkpoint / "model"
    engine = engine_dir(target, task)
    generator = generator_from_pretrained(gen_cfg, model_dir, resolve_device(cfg.model.get("device", "auto")),
                                          checkpoint_dir=engine)
    if engine != model_dir:  # a vLLM engine on the starting policy: give it the checkpoint's weights
        try:
            generator.load_weights(read_state_dict(model_dir), target.policy_version)
        except BaseException:
            generator.close()
            raise
    return generator


def engine_dir(target: Target, task) -> Path:
    """The Hugging Face directory a vLLM engine builds from: the checkpoint's `model/` when it
    is one (config.json; save_pretrained writes it), else the run's starting policy directory
    (model.path or the cached warm start: replay_pipeline.models.policy.policy_dir, the
    directory the run's engine was built from), whose weights the checkpoint's replace."""
    # start-up cost: the library (torch, lancedb, mlflow) loads after the command has parsed its arguments
    from replay_pipeline.models.policy import policy_dir

    model_dir = target.checkpoint / "model"
    if (model_dir / "config.json").is_file():
        return model_dir
    return policy_dir(target.cfg, task, target.paths)


def build_task(cfg):
    # start-up cost: the command answers --help and bad arguments before loading the library
    from omegaconf import OmegaConf

    # start-up cost: the library (torch, lancedb, mlflow) loads after the command has parsed its arguments
    from replay_pipeline.config import TASK_DEFAULTS
    from replay_pipeline.tasks import task_from_config

    return task_from_config(OmegaConf.to_container(cfg.task, resolve=True), TASK_DEFAULTS)


def summary_text(target: Target, metrics: dict[str, float], logged: bool) -> str:
    passk = sorted((int(k.rsplit("_", 1)[1]), v) for k, v in metrics.items()
                   if k.startswith("eval/pass_at_") and k.rsplit("_", 1)[1].isdigit())
    lines = [
        f"Run {target.paths.run_id}, checkpoint {target.checkpoint.name} (policy version "
        f"{target.policy_version}), {int(metrics['eval/prompts'])} held-out prompts",
        f"  greedy accuracy        {metrics['eval/accuracy']:.3f}",
        f"  pass@1 (T=0.1, p=0.95) {metrics['eval/pass_at_1_t01']:.3f}",
        "  pass@k (T=1)           " + "  ".join(f"k={k}: {v:.3f}" for k, v in passk),
        f"  sample entropy         {metrics['eval/sample_entropy']:.3f} nats/token (estimate "
        f"from sampled tokens), mean length {metrics['eval/sample_length']:.2f} tokens",
    ]
    if logged:
        lines.append(f"  MLflow                 run {target.mlflow_run_id} at {target.mlflow_uri}, "
                     f"step {target.policy_version}, artifact eval/{target.checkpoint.name}.json")
    else:
        lines.append("  MLflow                 not logged: the checkpoint names no MLflow run")
    return "\n".join(lines)


@flow(name="evaluate")
def evaluate(run_id: str, root: str = "runs", step: int | None = None, n: int = 16,
             prompts: int | None = None, seed: int = 0) -> dict[str, float]:
    """Evaluate one checkpoint of `run_id` and log the metrics to its MLflow run."""
    # start-up cost: the library (torch, lancedb, mlflow) loads after the command has parsed its arguments
    from replay_pipeline.training.evaluation import evaluate_all

    target = resolve(run_id, root, step)
    task = build_task(target.cfg)
    heldout = list(task.heldout_prompts())
    if prompts is not None:
        heldout = heldout[:prompts]
    generator = load_generator(target, task)
    try:
        metrics = evaluate_all(generator, task, heldout, n=n, seed=seed)
    finally:
        generator.close()  # a vLLM engine's GPU memory
    metrics["eval/policy_version"] = float(target.policy_version)

    record = {"run_id": run_id, "checkpoint": str(target.checkpoint), "step": target.step,
              "policy_version": target.policy_version, "n": n, "seed": seed, "metrics": metrics}
    artifact = f"{checkpoint_name(target.step)}.json"
    local = target.paths.run_dir / "eval" / artifact
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_text(json.dumps(record, indent=2, sort_keys=True))
    logged = bool(target.mlflow_run_id)
    if logged:
        # start-up cost: mlflow takes seconds to import; only this path talks to the store
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=target.mlflow_uri)
        now = int(time.time() * 1000)
        client.log_batch(target.mlflow_run_id, metrics=[
            Metric(k, float(v), now, target.policy_version) for k, v in metrics.items()])
        client.log_text(target.mlflow_run_id, json.dumps(record, indent=2, sort_keys=True),
                        f"eval/{artifact}")
    print(summary_text(target, metrics, logged), flush=True)
    return metrics


def _positive(what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a whole number, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{what} must be >= 1, got {value}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flows.evaluate", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: python -m flows.evaluate 20261129-171530-3fa2c1 --step 200 --n 16")
    p.add_argument("run_id", help="the training run's id (a directory under --root)")
    p.add_argument("--step", type=int, default=None,
                   help="checkpoint step to evaluate (default: the newest complete checkpoint)")
    p.add_argument("--root", default=os.environ.get("REPLAY_PIPELINE_ROOT", "runs"),
                   help="the run's tracking.root_dir (default: ./runs)")
    p.add_argument("--n", type=_positive("--n"), default=16,
                   help="samples per prompt for pass@k at temperature 1 (default 16); "
                        "k runs over the powers of two up to n")
    p.add_argument("--prompts", type=_positive("--prompts"), default=None,
                   help="evaluate only the first K held-out prompts (default: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        resolve(args.run_id, args.root, args.step)  # fail before Prefect or any model is touched
    except EvaluateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # start-up cost: the library (torch, lancedb, mlflow) loads after the command has parsed its arguments
    from flows.prefect_server import temporary_server
    from flows.progress import quiet_prefect_task_logs

    quiet_prefect_task_logs()
    with temporary_server():  # the private server flows.train uses, not Prefect's own (flows/prefect_server.py)
        evaluate(args.run_id, root=args.root, step=args.step, n=args.n, prompts=args.prompts,
                 seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
