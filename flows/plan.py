"""Plan a replay buffer from the paper's compute model: python -m flows.plan.

    python -m flows.plan --mu 6.84                              # the paper's Qwen3-0.6B mu
    python -m flows.plan --run RUN_ID                           # mu, R and B from a run
    python -m flows.plan --run RUN_ID --measure                 # and alpha, rho measured on its data
    python -m flows.plan --probe 12                             # a 12-step probe run, measured
    python -m flows.plan --mu 5.28 --rollouts-per-step 128 --minibatch 32 --alpha 0.2 --json

Prints the optimal staleness horizon x* (in learner updates: x = K N / R) and replay ratio y* = K B / R, the buffer.capacity
and loop.updates_per_step that realise them for R rollouts per step and minibatches of B, as
Hydra overrides for flows.train, and the model's predicted gamma (compute to a target over
on-policy). The math is replay_pipeline.algo.planner; this module parses, reads the run and prints.

With --run, mu is the latest finite value of the run's `compute/mu` metric (seconds to
generate a rollout over seconds to train on one) in its MLflow store, and R and B come from
its params loop.prompts_per_step x loop.group_size and loop.minibatch_size unless given.
alpha and rho default to illustrative values (0.25, 0.05) unless the run's `noise.json` holds
measured ones: `--measure` writes it (replay_pipeline/run/measure.py: per-rollout gradients at
the run's newest checkpoint, estimators and assumptions in replay_pipeline/algo/noise.py), and
`--probe STEPS` first trains a short run to measure. The report says where each value came
from, with the measured values' 95% intervals. Errors go to stderr with exit status 2 and say
how to fix the call. Neither Prefect nor torch is imported (but by --measure and --probe), and
mlflow only with --run, so the answer comes at once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import flows  # noqa: F401  (the package's environment defaults: MLflow logging level)
from replay_pipeline.algo import planner

# The project's defaults (replay_pipeline.config.LoopConfig; a test keeps them equal). Not
# imported from there so that this CLI does not load Hydra.
DEFAULT_PROMPTS_PER_STEP = 8
DEFAULT_GROUP_SIZE = 8
DEFAULT_MINIBATCH = 64
RUN_TAG = "replay_pipeline.run_id"
MU_METRIC = "compute/mu"
KNOWN_RUNS_SHOWN = 5

EXAMPLES = """\
examples:
  python -m flows.plan --mu 6.84                        # the paper's Qwen3-0.6B (5.28 for Qwen2.5-7B)
  python -m flows.plan --run 20261129-183716-d88f17     # mu, R and B measured by a run
  python -m flows.plan --run RUN_ID --root /data/replay-runs
  python -m flows.plan --mu 5.28 --rollouts-per-step 128 --minibatch 32 --alpha 0.2 --rho 0.1 --json

The model: compute to a target ~ s(x) (y + mu)(1/y + rho + 1/x) with x = K N / R (learner
updates), y = K B / R and the
noise variance s(x) = x^(2 alpha); alpha and rho default to illustrative values, measure them.
"""


class PlanError(Exception):
    """A problem with the call or the run; the message says how to fix it."""


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number, e.g. 6.84") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number, e.g. 6.84")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer, e.g. 64")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flows.plan", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Recommend buffer.capacity and loop.updates_per_step from the paper's compute "
                    "model: the optimal staleness horizon x* (learner updates) and replay ratio y* = K B / R for a "
                    "generation/training cost ratio mu.",
        epilog=EXAMPLES)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--mu", type=_number, help="generation/training cost ratio (seconds per rollout)")
    source.add_argument("--run", metavar="RUN_ID",
                        help="take mu (its latest compute/mu), R and B from this run's MLflow record, and "
                             "alpha and rho from its noise.json when measured (--measure)")
    source.add_argument("--probe", type=_positive_int, metavar="STEPS",
                        help="train a short probe run of STEPS steps (python -m flows.train, the defaults plus "
                             "--probe-override ones), measure alpha and rho on it and plan from it")
    parser.add_argument("--measure", action="store_true",
                        help="with --run: measure alpha and rho from the run's own rollouts at its newest "
                             "checkpoint (replay_pipeline/run/measure.py; seconds on the tiny model), write "
                             "them to its noise.json, and plan with them")
    parser.add_argument("--probe-override", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override for the --probe run (repeat)")
    parser.add_argument("--rollouts-per-step", "-R", type=_positive_int, metavar="R",
                        help="rollouts per step, loop.prompts_per_step x loop.group_size (default: the "
                             f"run's, else {DEFAULT_PROMPTS_PER_STEP * DEFAULT_GROUP_SIZE})")
    parser.add_argument("--minibatch", "-B", type=_positive_int, metavar="B",
                        help=f"rollouts per learner step, loop.minibatch_size (default: the run's, else "
                             f"{DEFAULT_MINIBATCH})")
    parser.add_argument("--alpha", type=_number,
                        help="noise growth with staleness, sigma(x) ~ x^alpha, 0 < alpha < 1/2 "
                             f"(default {planner.DEFAULT_ALPHA}: illustrative, measure it)")
    parser.add_argument("--rho", type=_number,
                        help=f"correlation between samples, >= 0 (default {planner.DEFAULT_RHO}: "
                             "illustrative, measure it)")
    parser.add_argument("--root", default=os.environ.get("REPLAY_PIPELINE_ROOT", "runs"),
                        help="the runs' tracking.root_dir (default: $REPLAY_PIPELINE_ROOT or runs)")
    parser.add_argument("--mlflow-uri", metavar="URI",
                        help="MLflow tracking store (default: sqlite:///ROOT/mlflow.db)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    return parser


# ------------------------------------------------------------------ reading a run
def _tracking_uri(root: str, uri: Optional[str]) -> str:
    if uri:
        path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else None
    else:
        path = str(Path(root).expanduser().resolve() / "mlflow.db")
        uri = f"sqlite:///{path}"
    if path is not None and not Path(path).is_file():  # MLflow would create an empty store
        raise PlanError(f"no MLflow store at {path}: pass the runs' root with --root DIR (where "
                        "flows.train wrote mlflow.db) or the store with --mlflow-uri URI")
    return uri


def read_run(uri: str, run_id: str) -> dict[str, Any]:
    """The MLflow record of the run tagged replay_pipeline.run_id = run_id: mu and params."""
    if "'" in run_id or "`" in run_id:
        raise PlanError(f"{run_id!r} is not a run id (e.g. 20261129-183716-d88f17)")
    from mlflow.tracking import MlflowClient  # only here: mlflow takes seconds to import

    client = MlflowClient(tracking_uri=uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, filter_string=f"tags.`{RUN_TAG}` = '{run_id}'",
                              order_by=["attributes.start_time DESC"], max_results=10) if experiments else []
    if not runs:
        recent = client.search_runs(experiments, order_by=["attributes.start_time DESC"],
                                    max_results=50) if experiments else []
        known = [r.data.tags[RUN_TAG] for r in recent if RUN_TAG in r.data.tags][:KNOWN_RUNS_SHOWN]
        listing = ", ".join(known) if known else "none: train one with python -m flows.train"
        raise PlanError(f"no run {run_id!r} in {uri}; recent runs: {listing}. Pass one of them, or "
                        "the right store with --root DIR or --mlflow-uri URI")
    run = runs[0]
    history = [m for m in client.get_metric_history(run.info.run_id, MU_METRIC) if math.isfinite(m.value)]
    if not history:
        raise PlanError(f"run {run_id} has no {MU_METRIC} yet: it is logged once the run has generated "
                        "and trained on a batch. Wait for its first steps, or pass --mu instead of --run")
    latest = max(history, key=lambda m: (m.step, m.timestamp))
    return {"run_id": run_id, "mlflow_run_id": run.info.run_id, "mu": latest.value,
            "step": latest.step, "params": dict(run.data.params)}


def _int_param(params: dict[str, str], name: str, run_id: str) -> Optional[int]:
    if name not in params:
        return None
    try:
        return int(params[name])
    except ValueError:
        raise PlanError(f"run {run_id} has param {name}={params[name]!r}, not an integer; "
                        "pass the value on the command line instead") from None


# ------------------------------------------------------------------ the report
def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """mu, R, B and where each came from."""
    prompts = group = None
    minibatch = None
    if args.run is not None:
        run = read_run(_tracking_uri(args.root, args.mlflow_uri), args.run)
        mu = run["mu"]
        mu_source = f"run {run['run_id']}, {MU_METRIC} at step {run['step']}"
        prompts = _int_param(run["params"], "loop.prompts_per_step", args.run)
        group = _int_param(run["params"], "loop.group_size", args.run)
        minibatch = _int_param(run["params"], "loop.minibatch_size", args.run)
    else:
        run, mu, mu_source = None, args.mu, "--mu"
    if args.rollouts_per_step is not None:
        R, R_source, prompts, group = args.rollouts_per_step, "--rollouts-per-step", None, None
    elif prompts is not None and group is not None:
        R, R_source = prompts * group, f"run: loop.prompts_per_step {prompts} x loop.group_size {group}"
    else:
        prompts, group = DEFAULT_PROMPTS_PER_STEP, DEFAULT_GROUP_SIZE
        R, R_source = prompts * group, f"default: {prompts} prompts x {group} completions"
    if args.minibatch is not None:
        B, B_source = args.minibatch, "--minibatch"
    elif minibatch is not None:
        B, B_source = minibatch, "run: loop.minibatch_size"
    else:
        B, B_source = DEFAULT_MINIBATCH, "default loop.minibatch_size"
    illustrative = "illustrative default: measure it with --run RUN_ID --measure"
    alpha, alpha_source = (planner.DEFAULT_ALPHA, illustrative) if args.alpha is None else (args.alpha, "--alpha")
    rho, rho_source = (planner.DEFAULT_RHO, illustrative) if args.rho is None else (args.rho, "--rho")
    measured = read_noise(args.root, args.run) if args.run is not None else None
    if measured is not None:
        where = (f"measured on run {args.run}: {measured['rollouts']} rollouts of steps "
                 f"{measured['steps'][0]}..{measured['steps'][-1]} at {measured['checkpoint']}")
        if args.alpha is None:
            alpha, alpha_source = _usable_alpha(measured["alpha"], where)
        if args.rho is None:
            est = measured["rho"]
            rho, rho_source = max(est["value"], 0.0), f"{where}, 95% interval [{est['low']:.3g}, {est['high']:.3g}]"
    return {"mu": mu, "mu_source": mu_source, "alpha": alpha, "rho": rho, "alpha_source": alpha_source,
            "rho_source": rho_source, "R": R, "R_source": R_source, "B": B, "B_source": B_source,
            "prompts_per_step": prompts, "group_size": group, "run": run, "measured": measured}


#: The planner's power law has a finite optimum for 0 < alpha < 1/2: a measured value outside
#: is brought to the nearest end of this range (and the report says so).
ALPHA_RANGE = (0.01, 0.49)


def _usable_alpha(est: dict[str, Any], where: str) -> tuple[float, str]:
    value = min(max(est["value"], ALPHA_RANGE[0]), ALPHA_RANGE[1])
    source = f"{where}, 95% interval [{est['low']:.3g}, {est['high']:.3g}]"
    if value != est["value"]:
        source += (f"; measured {est['value']:.3g}, outside the power law's range with a finite optimum, "
                   f"planned at {value:g}")
    return value, source


def read_noise(root: str, run_id: str) -> Optional[dict[str, Any]]:
    """The run's measured alpha and rho (<root>/<run>/noise.json, written by --measure), or None."""
    path = Path(root).expanduser().resolve() / run_id / "noise.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise PlanError(f"{path} does not read as JSON ({exc}); measure again with --run {run_id} --measure") from None


def measure(root: str, run_id: str) -> None:
    """--measure: alpha and rho from the run's data, into its noise.json (imports torch)."""
    from replay_pipeline.run.measure import measure_run  # start-up cost: torch, transformers, lancedb

    try:
        measure_run(root, run_id, log=lambda line: print(line, file=sys.stderr))
    except (ValueError, FileNotFoundError) as exc:
        raise PlanError(f"cannot measure run {run_id}: {exc}") from None


def probe(root: str, steps: int, extra: list[str]) -> str:
    """--probe: a short run of flows.train (one torch thread, checkpointed at its end); its id."""
    run_id = time.strftime("probe-%Y%m%d-%H%M%S")
    command = [sys.executable, "-m", "flows.train", f"tracking.root_dir={root}", f"run_id={run_id}",
               f"loop.steps={steps}", f"loop.checkpoint_every={steps}", "tracking.progress=false", *extra]
    print(f"probe: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    done = subprocess.run(command, stdout=sys.stderr)
    if done.returncode != 0:
        raise PlanError(f"the probe run {run_id} failed (exit {done.returncode}); its output is above")
    return run_id


def current_design(inputs: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The run's own design (x, y) and its predicted gamma, when its params say it."""
    run = inputs["run"]
    if run is None:
        return None
    params, run_id = run["params"], run["run_id"]
    values = {name: _int_param(params, name, run_id) for name in (
        "buffer.capacity", "loop.updates_per_step", "loop.prompts_per_step", "loop.group_size",
        "loop.minibatch_size")}
    if any(v is None or v < 1 for v in values.values()):
        return None
    R = values["loop.prompts_per_step"] * values["loop.group_size"]
    # `fresh` samples only the newest batch whatever the capacity: x = 1
    # x counts learner updates: K updates share a round's R rollouts, so x = K N / R
    x = 1.0 if params.get("buffer.strategy") == "fresh" else \
        values["loop.updates_per_step"] * values["buffer.capacity"] / R
    y = values["loop.updates_per_step"] * values["loop.minibatch_size"] / R
    gamma = planner.predicted_gamma(inputs["mu"], x, y, planner.power_law_noise(inputs["alpha"]),
                                    inputs["rho"])
    return {"capacity": values["buffer.capacity"], "updates_per_step": values["loop.updates_per_step"],
            "strategy": params.get("buffer.strategy"), "x": x, "y": y, "gamma": gamma}


def overrides(result: planner.Plan, inputs: dict[str, Any]) -> list[str]:
    """Hydra overrides for flows.train that realise the plan."""
    out = [f"buffer.capacity={result.capacity}", f"loop.updates_per_step={result.updates_per_step}"]
    prompts, group = inputs["prompts_per_step"], inputs["group_size"]
    if prompts is not None and (prompts, group) != (DEFAULT_PROMPTS_PER_STEP, DEFAULT_GROUP_SIZE):
        out += [f"loop.prompts_per_step={prompts}", f"loop.group_size={group}"]
    if result.minibatch_size != DEFAULT_MINIBATCH:
        out.append(f"loop.minibatch_size={result.minibatch_size}")
    return out


def render(result: planner.Plan, inputs: dict[str, Any]) -> str:
    R, B = result.rollouts_per_step, result.minibatch_size
    lines = [
        "Replay plan (the paper's compute model, replay_pipeline.algo.planner)",
        f"  mu     {result.mu:.4g}  ({inputs['mu_source']})",
        f"  alpha  {result.alpha:.4g}  noise growth, sigma(x) ~ x^alpha ({inputs['alpha_source']})",
        f"  rho    {result.rho:.4g}  sample correlation ({inputs['rho_source']})",
        f"  R      {R}  rollouts per step ({inputs['R_source']})",
        f"  B      {B}  rollouts per minibatch ({inputs['B_source']})",
        "",
        f"optimum ({result.method}):  x* = {result.x_star:.4g} learner updates   y* = {result.y_star:.4g}"
        f"   predicted gamma {result.gamma_star:.3f}",
        f"recommended:  buffer.capacity = {result.capacity}   loop.updates_per_step = {result.updates_per_step}",
        f"realised:     x = K N / R = {result.x:.4g} learner updates   replay ratio y = K x B / R = {result.y:.4g}"
        f"   predicted gamma {result.gamma:.3f}",
    ]
    current = current_design(inputs)
    if current is not None:
        lines.append(f"this run:     buffer.capacity = {current['capacity']}   loop.updates_per_step = "
                     f"{current['updates_per_step']} ({current['strategy']}): x = {current['x']:.4g}   "
                     f"y = {current['y']:.4g}   predicted gamma {current['gamma']:.3f}")
    lines.append("  gamma: the model's predicted compute to reach a target, over on-policy (x = y = 1)")
    lines.append("  x and x* count learner updates (the paper's unit): with K updates a round, the window "
                 "N = x R / K keeps a rollout x updates")
    if result.x_star * R / result.updates_per_step < result.capacity - 0.5:
        lines.append(f"  note: x* R / K = {result.x_star * R / result.updates_per_step:.1f} < {result.capacity}, "
                     "raised so that the window holds at least one batch and one minibatch")
        if result.x_star < 1:
            lines.append("        generation is cheap here (mu small), so the model says stay near on-policy")
    if inputs["prompts_per_step"] is None and R != DEFAULT_PROMPTS_PER_STEP * DEFAULT_GROUP_SIZE:
        lines.append(f"  note: set loop.prompts_per_step x loop.group_size = {R} as well")
    lines += ["", "  python -m flows.train " + " ".join(overrides(result, inputs))]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.measure and args.run is None:
        parser.error("--measure measures a run: give it --run RUN_ID (or use --probe STEPS for a new one)")
    try:
        if args.probe is not None:
            args.run = probe(args.root, args.probe, args.probe_override)
            args.measure = True
        if args.measure:
            measure(args.root, args.run)
        inputs = resolve(args)
        result = planner.plan(inputs["mu"], inputs["R"], inputs["B"], alpha=inputs["alpha"],
                              rho=inputs["rho"])
    except (PlanError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        run = inputs["run"]
        record = {**asdict(result), "mu_source": inputs["mu_source"],
                  "run_id": run["run_id"] if run else None,
                  "mlflow_run_id": run["mlflow_run_id"] if run else None,
                  "mu_step": run["step"] if run else None, "current": current_design(inputs),
                  "alpha_source": inputs["alpha_source"], "rho_source": inputs["rho_source"],
                  "measured": inputs["measured"], "overrides": overrides(result, inputs)}
        print(json.dumps(record, indent=2))
    else:
        print(render(result, inputs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
