"""A sweep's report: accuracy against compute, seeds aggregated, plots and ``report.md``.

    from replay_pipeline.reports.report import build_report
    report = build_report("sqlite:///runs/mlflow.db", parent_run_id)   # or: python -m flows.report ID
    print(report.path, report.table)

Input: the parent MLflow run of a sweep (flows/sweep.py) and its ``sweep.json`` =
{"name", "sweep_id", "mlflow_run_id", "children": [{"config", "seed", "run_id",
"mlflow_run_id", "status", "overrides", ...}], optional "baseline" (default "no_buffer") and
optional "families" ({config: family}; a config left out is its own family) and optional
"pending" (run ids of children not yet ended: an interim report, `partial_notes`)}. Only
FINISHED children are read; the others are listed in the report.

Decisions:

* **Three compute measures**, all cumulative, from the ledger each child logs under
  ``compute/``: generated tokens (``compute/gen_tokens``); measured seconds of generation +
  training on this machine (``compute/gen_train_seconds``, shown with each configuration's
  final measured ``compute/mu``); and compute projected at a stated mu (default 5.28, the
  paper's Qwen2.5-7B), ``mu * gen_rollouts + train_rollouts`` in units of one training pass
  over one rollout, labelled everywhere "projected at mu=5.28 (GPU-scale projection)".
* **Evaluation steps pair with the ledger as of the steps before them.** The flow logs round
  s's metrics and ledger at step s, then the evaluation after that round at step s + 1
  (flows/train.py), so an evaluation at step E saw the compute of the newest ledger entry at
  a step < E, i.e. after E rounds (0 for the evaluation at step 0). A step logged twice (a
  resumed run replays steps) keeps its latest value.
* **Seeds are aggregated per evaluation step**: median and 25th/75th percentiles (pandas'
  linear interpolation) of accuracy and pass@k over the seeds that logged that step, and the
  median of each compute measure there. Peak and final accuracy are read off the median
  curve; final pass@k is the median curve's value at the last step pass@k was logged, max
  pass@k (the paper's statistic) the median curve's maximum over training. pass@k is sampled at
  temperature 1; the paper's pass@1 at temperature 0.1 (eval/pass_at_1_t01) is read the same
  two ways.
* **Compute to reach the baseline's peak, on the median curves.** The peak is the maximum of
  the baseline's median accuracy curve. A configuration reaches it at its first evaluation step whose median
  accuracy is >= the peak (1e-9 tolerance); the compute is the median compute there, and the
  ratio divides by the baseline's median compute at its own (first) peak step. No such step:
  "not reached" (None in report.json). A baseline that peaks at step 0 has no ratio (None).
* **Per-seed crossings** (replay_pipeline/reports/evidence.py): the target is the baseline's median
  peak, or a stated accuracy (`target`, `--target`); each seed's compute at its first
  evaluation at or above it, interpolated linearly from the evaluation before, their median and
  IQR (a seed that never reaches counts as infinite), and the ratio of the median to the
  baseline's with a 95% seed-bootstrap interval; the grid's resolution (median compute between
  evaluations) beside them. The median-curve reading above stays, beside it. A baseline whose
  median peak is its last evaluation is flagged "still rising". Every configuration's target
  replay ratio K x B / R and gamma at the projection mu are stated.
* **Best buffer configuration**: the non-baseline configuration (outside the baseline's
  family) with the lowest median per-seed crossing in projected compute (ties: generated
  tokens); configurations within one evaluation interval of it are named as ties.
* **Protocol**: sweep.json's `protocol` (flows/sweep.py) says which seeds chose the
  configurations and how many were tried; the report says whether this sweep's seeds are a
  held-out confirmation, or that nothing was held out.
* **Pareto frontier per family** (configurations that differ only in learning rate): the
  points (median compute, median accuracy) of the family's median curves that no other point
  beats with less or equal compute; the frontier reaches the peak at its first point >= it.
* **Should replay pay off at the measured mu?** mu is the median of the finished runs' final
  ``compute/mu`` (a property of the machine and model more than of the buffer). The answer is
  replay_pipeline.algo.planner.plan(mu, R, B) with R and B from the baseline's params and the
  planner's illustrative noise defaults (alpha 0.25, rho 0.05; the report says so): replay
  pays off when the realised design's predicted gamma is below 1. The same at the projection mu.
* **Buffer distributions** (staleness, reuse count, steps since last use) come from each
  child's LanceDB usage table (tag ``replay_pipeline.lancedb_uri``, else ``buffer.uri``, else
  ``<tracking.root_dir>/lancedb``), pooled over seeds; a child whose tables cannot be read is
  skipped and named in the report.
* **At a smaller budget** (`budget`, `--budget 1/3`): every run is read as if it had stopped
  after that fraction of its own ``loop.steps`` rounds (its generation budget: equal_budget
  gives every configuration the baseline's rollouts): its history up to the evaluation at step
  ``cut = fraction x loop.steps``, that step's evaluation kept and the rounds from it on
  dropped. Exact only where nothing a run does before the cut depends on its length (so here:
  a constant learning rate, evaluations at fixed multiples of steps); checked for this
  project's runs against runs stopped there (docs/guides/sweeps-and-reports.md, "Budget
  cuts"). Every run must have evaluated at its cut, pass@k and the paper's pass@1 too if it
  logs them at all (a run that stopped there would have), else ReportError. The buffer
  distributions cover whole runs and are left out (a note says so); the report says what it read, and its outputs go to
  ``.../<name>-<id>-budget<f>`` and the parent run's ``report-budget<f>/``.
* **Plots** are drawn with matplotlib's Agg canvas on ``Figure`` objects (no pyplot state).
* **Outputs** go to ``out`` (default ``<root>/reports/<name>-<sweep_id>/``) and are logged as
  artifacts of the parent run under ``report/``. Bad input raises ReportError saying how to
  fix it.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from replay_pipeline.reports import evidence

from replay_pipeline.algo import planner
from replay_pipeline.config import LoopConfig
from replay_pipeline.system.runs import RunPaths

__all__ = ["DEFAULT_MU", "ReportError", "Report", "Measure", "Child", "Sweep", "measures", "tracking_uri",
           "load_sweep", "metric_frame", "load", "eval_table", "aggregate", "summarise", "frontier", "best_config",
           "replay_payoff", "distributions", "render_markdown", "build_report"]

DEFAULT_MU = 5.28
"""The paper's measured mu for Qwen2.5-7B: the default GPU-scale projection."""
DEFAULT_BASELINE = "no_buffer"
ACCURACY = "eval/accuracy"
SAMPLE_ENTROPY = "eval/sample_entropy"
LEARN_ENTROPY = "learn/entropy"
REUSE_UPDATES = "reuse/updates"  # adaptive reuse: the updates each round took (replay_pipeline/algo/reuse.py)
MU_METRIC = "compute/mu"
UNTIMED = "compute/gen_untimed_rollouts"  # rollouts a resume replayed from the store (algo/compute.py)
LEDGER = ("compute/gen_tokens", "compute/gen_rollouts", "compute/train_rollouts",
          "compute/gen_seconds", "compute/train_seconds", "compute/gen_train_seconds", MU_METRIC, UNTIMED)
_PASS_AT = re.compile(r"eval/pass_at_(\d+)$")
PAPER_PASS1 = "eval/pass_at_1_t01"  # the paper's pass@1: temperature 0.1, top_p 0.95 (training/evaluation.py)
DEFAULT_KS = (1, 2, 4, 8, 16)
TOLERANCE = 1e-9
#: name -> (replay_pipeline.reports.analysis function, its count column); analysis (lancedb) is imported
#: only when the distributions are read, so that errors in the CLI answer at once.
DISTRIBUTIONS = {"staleness": ("staleness_histogram", "uses"),
                 "reuse_count": ("reuse_histogram", "rollouts"),
                 "steps_since_last_use": ("steps_since_last_use_histogram", "uses")}
PLOTS = ("accuracy_vs_tokens.png", "accuracy_vs_seconds.png", "accuracy_vs_projected.png",
         "frontier.png", "pass_at_k.png", "entropy.png", "buffer_distributions.png")


class ReportError(Exception):
    """Input the report cannot use; the message says how to fix it."""


@dataclass(frozen=True)
class Measure:
    key: str
    """Column in the evaluation tables and key in report.json: tokens, seconds, projected."""
    name: str
    """The label used everywhere (lines, headers, axes)."""
    unit: str
    fmt: str


def measures(mu: float = DEFAULT_MU) -> tuple[Measure, Measure, Measure]:
    """The three compute measures; the projected one is labelled with its mu."""
    return (Measure("tokens", "generated tokens", "tokens", ",.0f"),
            Measure("seconds", "measured seconds", "s of generation + training, this machine", ",.1f"),
            Measure("projected", f"projected at mu={mu:g} (GPU-scale projection)",
                    "training passes over one rollout", ",.0f"))


@dataclass
class Child:
    config: str
    seed: int
    run_id: str
    mlflow_run_id: str
    params: dict[str, str]
    tags: dict[str, str]
    history: pd.DataFrame
    """One row per logged step, one column per metric (NaN where not logged)."""


@dataclass
class Sweep:
    record: dict[str, Any]
    """sweep.json as stored."""
    parent_run_id: str
    baseline: str
    families: dict[str, str]
    configs: list[str]
    children: list[Child]
    notes: list[str] = field(default_factory=list)
    budget: dict[str, Any] | None = None
    """{"fraction", "cuts": {config: step}} when the runs are read at a smaller budget (at_budget)."""


@dataclass
class Report:
    path: Path
    """report.md."""
    table: str
    """The results table (markdown)."""
    summary: dict[str, Any]
    """report.json's content."""
    artifact_uri: str


# ------------------------------------------------------------------ loading
def tracking_uri(root: str | Path = "runs", uri: str | None = None) -> str:
    """``uri``, or the project's default ``sqlite:///<root>/mlflow.db``; a SQLite store that does
    not exist raises (MLflow would create an empty one)."""
    uri = uri or RunPaths.make(root, "report").mlflow_uri
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        raise ReportError(f"no MLflow store at {uri[len('sqlite:///'):]}: pass the runs' root with --root DIR "
                          "(where flows.sweep wrote mlflow.db) or the store with --mlflow-uri URI")
    return uri


def _recent_sweeps(client: Any, limit: int = 5) -> str:
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, order_by=["attributes.start_time DESC"],
                              max_results=200) if experiments else []
    found = [f"{r.info.run_id} ({r.info.run_name})" for r in runs
             if "replay_pipeline.sweep_id" in r.data.tags][:limit]
    return ", ".join(found) if found else "none: run one with python -m flows.sweep"


def _parent_run(client: Any, uri: str, parent_run_id: str) -> Any:
    # start-up cost: mlflow takes seconds to import; only this path talks to the store
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(parent_run_id)
    except MlflowException as exc:
        raise ReportError(
            f"no MLflow run {parent_run_id!r} in {uri} ({exc.error_code}); pass the sweep's parent run id "
            f"(python -m flows.sweep prints it as 'MLflow parent run ID'), or the right store with --root DIR "
            f"or --mlflow-uri URI. Recent sweep parent runs there: {_recent_sweeps(client)}") from None


def load_sweep(client: Any, uri: str, parent_run_id: str) -> dict[str, Any]:
    """The parent run's sweep.json, checked."""
    run = _parent_run(client, uri, parent_run_id)
    if "sweep.json" not in {f.path for f in client.list_artifacts(parent_run_id)}:
        raise ReportError(
            f"MLflow run {parent_run_id} ({run.info.run_name}) has no sweep.json artifact: it is not a sweep's "
            "parent run, or no child of its sweep has ended yet (flows.sweep writes sweep.json after each child; "
            "a sweep of an earlier version only at its end). Pass the parent run id that python -m flows.sweep "
            f"printed; recent sweep parent runs: {_recent_sweeps(client)}")
    with tempfile.TemporaryDirectory() as tmp:
        record = json.loads(Path(client.download_artifacts(parent_run_id, "sweep.json", tmp)).read_text())
    children = record.get("children") if isinstance(record, dict) else None
    if not isinstance(children, list) or not children or not all(
            isinstance(c, dict) and {"config", "seed", "status"} <= c.keys() for c in children):
        raise ReportError(f"sweep.json of run {parent_run_id} has no children with config, seed and status; "
                          "it was not written by flows.sweep: rerun the sweep")
    pending = record.get("pending") or []
    if not isinstance(pending, list) or not all(isinstance(p, str) for p in pending):
        raise ReportError(f"sweep.json of run {parent_run_id}: 'pending' must list run ids, got {pending!r}")
    if not isinstance(record.get("families") or {}, dict):
        raise ReportError(f"sweep.json of run {parent_run_id}: 'families' must map config -> family, "
                          f"got {record['families']!r}")
    return record


def _series(points: Sequence[Any]) -> pd.Series:
    """A metric history as step -> value; a step logged twice keeps its latest value."""
    ordered = sorted(points, key=lambda m: (m.step, m.timestamp))
    s = pd.Series([m.value for m in ordered], index=[m.step for m in ordered], dtype=float)
    return s[~s.index.duplicated(keep="last")]


def metric_frame(client: Any, mlflow_run_id: str, keys: Sequence[str]) -> pd.DataFrame:
    """Metric histories of one run aligned by step: index step, one column per key (NaN
    where a key was not logged at a step; a key never logged is an all-NaN column)."""
    columns = {k: _series(client.get_metric_history(mlflow_run_id, k)) for k in keys}
    frame = pd.DataFrame(columns, columns=list(keys)).sort_index()
    frame.index.name = "step"
    return frame


def _child_keys(metric_names: Sequence[str]) -> list[str]:
    ks = sorted({int(m.group(1)) for n in metric_names if (m := _PASS_AT.match(n))} or DEFAULT_KS)
    return [*LEDGER, LEARN_ENTROPY, ACCURACY, SAMPLE_ENTROPY, REUSE_UPDATES, PAPER_PASS1,
            *(f"eval/pass_at_{k}" for k in ks)]


def _load_child(client: Any, record: dict[str, Any], notes: list[str]) -> Child | None:
    # start-up cost: mlflow takes seconds to import; only this path talks to the store
    from mlflow.exceptions import MlflowException

    label = f"{record['config']} seed {record['seed']} ({record.get('run_id')})"
    if record["status"] != "FINISHED":
        notes.append(f"{label}: {record['status']}, left out ({record.get('error', 'no error recorded')})")
        return None
    try:
        run = client.get_run(record.get("mlflow_run_id") or "")
    except MlflowException:
        notes.append(f"{label}: its MLflow run {record.get('mlflow_run_id')!r} is not in this store, left out")
        return None
    history = metric_frame(client, run.info.run_id, _child_keys(list(run.data.metrics)))
    if not history[ACCURACY].notna().any():
        notes.append(f"{label}: no eval/accuracy logged, left out")
        return None
    return Child(str(record["config"]), int(record["seed"]), str(record.get("run_id")), run.info.run_id,
                 dict(run.data.params), dict(run.data.tags), history)


#: Overrides that say where a shard's runs were stored, not how they trained: shards may differ in them.
_PLACE_KEYS = ("seed", "run_id", "tracking.root_dir", "tracking.mlflow_uri", "tracking.artifact_location",
               "tracking.parent_run_id", "buffer.uri")


def _overrides_without(child: dict[str, Any], keys: Sequence[str]) -> list[str]:
    """A child record's overrides but those setting one of `keys`."""
    return [o for o in child.get("overrides") or [] if o.split("=", 1)[0] not in keys]


def _design_overrides(record: dict[str, Any]) -> dict[str, list[str]]:
    """Each configuration's overrides without those that only place its runs."""
    return {str(c["config"]): _overrides_without(c, _PLACE_KEYS) for c in record["children"]}


def merge_shards(record: dict[str, Any], shards: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One sweep record from a sweep run in shards: the same grid (name, baseline and the
    overrides of every configuration two shards share, where its runs were stored aside)
    split by seeds or by configurations (no configuration and seed in two shards), each
    shard in its own process or store (a machine, or a core, each). The children and the
    confirmation seeds are pooled; the protocol is the first record's; `shards` lists the
    parts. Raises ReportError naming what differs. Without shards, `record` as it is."""
    if not shards:
        return record
    merged = {**record, "children": list(record["children"]),
              "shards": [{"name": r.get("name"), "sweep_id": r.get("sweep_id"), "mlflow_run_id": r.get("mlflow_run_id")}
                         for r in (record, *shards)]}
    design, runs = _design_overrides(record), {(str(c["config"]), int(c["seed"])) for c in record["children"]}
    for other in shards:
        label = f"shard {other.get('name')}-{other.get('sweep_id')}"
        problems = [f"{k}: {record.get(k)!r} here, {other.get(k)!r} there"
                    for k in ("name", "baseline") if record.get(k) != other.get(k)]
        theirs = _design_overrides(other)
        problems += [f"configuration {c!r} is trained with {design.get(c)} here, {theirs.get(c)} there"
                     for c in sorted(set(design) & set(theirs)) if design[c] != theirs[c]]
        theirs_runs = {(str(c["config"]), int(c["seed"])) for c in other["children"]}
        again = sorted(runs & theirs_runs)
        if again:
            problems.append(f"{', '.join(f'{c} seed {q}' for c, q in again[:5])} in both: shards split the "
                            "seeds or the configurations")
        if problems:
            raise ReportError(f"{label} is not a part of sweep {record.get('name')}-{record.get('sweep_id')}: "
                              + "; ".join(problems) + ". Shards are one grid run with --seeds (or its configurations) split between them")
        runs |= theirs_runs
        design = {**theirs, **design}  # a configuration may run on one shard's seeds only (the lr stage)
        merged["children"] += other["children"]
        merged["pending"] = [*(merged.get("pending") or []), *(other.get("pending") or [])]
    if merged.get("protocol"):
        merged["protocol"] = {**merged["protocol"], "confirmation_seeds": sorted({q for _, q in runs})}
    return merged


def _check_budget(budget: float | None) -> None:
    if budget is not None and not (isinstance(budget, (int, float)) and 0 < budget <= 1):
        raise ReportError(f"budget={budget!r} must be a fraction in (0, 1] of each run's steps, e.g. 1/3 to read "
                          "3x-budget runs at the default budget")


def at_budget(child: Child, fraction: float) -> tuple[Child, int]:
    """`child` read as if it had stopped after `fraction` of its ``loop.steps`` rounds, and the
    step it is cut at (see the module's "At a smaller budget"). Raises ReportError when the
    run has no ``loop.steps`` or did not evaluate (and, if it logs pass@k and the paper's pass@1,
    sample them) there."""
    label = f"{child.config} seed {child.seed} ({child.run_id})"
    try:
        steps = int(child.params["loop.steps"])
    except (KeyError, ValueError):
        raise ReportError(f"{label} has no loop.steps param, so its budget is unknown; report it whole "
                          "(without --budget)") from None
    cut = round(fraction * steps)
    evaluated = child.history.index[child.history[ACCURACY].notna()]
    sampled = [c for c in child.history.columns
               if (_PASS_AT.match(c) or c == PAPER_PASS1) and child.history[c].notna().any()]
    missing = [k for k in [ACCURACY, *sampled] if cut not in child.history.index or pd.isna(child.history.at[cut, k])]
    if missing:
        raise ReportError(f"{label}: {fraction:g} of its {steps} steps is step {cut}, where it did not log "
                          f"{', '.join(missing)} (it evaluated at steps {', '.join(map(str, evaluated[:8]))}, ...); "
                          "choose a budget that lands on an evaluation with pass@k in every run")
    history = child.history.loc[child.history.index <= cut].copy()
    history.loc[cut, [c for c in history.columns if not c.startswith("eval/")]] = np.nan
    return Child(child.config, child.seed, child.run_id, child.mlflow_run_id, child.params, child.tags,
                 history), cut


def partial_notes(record: dict[str, Any]) -> list[str]:
    """The report's first note when the sweep (or one of its shards) has children that have not
    ended (sweep.json's `pending`: still running, or stopped part-way): an interim report."""
    pending = record.get("pending") or []
    if not pending:
        return []
    ids = sorted({p.rsplit("-", 1)[-1] for p in pending})  # <name>-<config>-s<seed>-<sweep id>
    return [f"**Interim report**: {len(pending)} child run(s) of the sweep have not ended yet "
            f"({', '.join(pending[:6])}{', ...' if len(pending) > 6 else ''}); this report reads the "
            f"{len(record['children'])} that have. Continue the sweep (python -m flows.sweep ... --continue "
            f"{' / '.join(ids)}) and report again for the final figures."]


def load(uri: str, parent_run_id: str, baseline: str | None = None,
         shards: Sequence[tuple[str, str]] = (), budget: float | None = None) -> Sweep:
    """sweep.json and the metric histories of its FINISHED children; the baseline must have
    at least one finished child with held-out accuracy. `shards`: (uri, parent_run_id) of
    further parts of the same sweep (merge_shards), each read from its own store. `budget`:
    read every run at that fraction of its steps (at_budget)."""
    _check_budget(budget)
    # start-up cost: mlflow takes seconds to import; only this path talks to the store
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    record = load_sweep(client, uri, parent_run_id)
    parts = [(client, record)] + [(c, load_sweep(c, u, p)) for u, p in shards
                                  for c in [MlflowClient(tracking_uri=u)]]
    record = merge_shards(record, [r for _, r in parts[1:]])
    baseline = baseline or record.get("baseline") or DEFAULT_BASELINE
    statuses = [r["status"] for r in record["children"] if r["config"] == baseline]
    notes: list[str] = partial_notes(record)
    children = [] if "FINISHED" not in statuses else [  # fail before reading every history
        c for part_client, part in parts for r in part["children"]
        if (c := _load_child(part_client, r, notes)) is not None]
    configs = list(dict.fromkeys(str(r["config"]) for r in record["children"]))
    if baseline not in {c.config for c in children}:
        finished = sorted({str(r["config"]) for r in record["children"] if r["status"] == "FINISHED"})
        raise ReportError(
            f"no finished runs of the baseline configuration {baseline!r} with eval/accuracy in sweep "
            f"{record.get('name')}-{record.get('sweep_id')} (its children: {statuses or 'none'}; configurations "
            f"with finished runs: {finished or 'none'}). Rerun the sweep with a "
            f"--config {baseline}=... that finishes, or choose another baseline with --baseline NAME")
    families = {c: str((record.get("families") or {}).get(c, c)) for c in configs}
    read = None
    if budget is not None:
        cut_children = [at_budget(c, budget) for c in children]
        children = [c for c, _ in cut_children]
        read = {"fraction": float(budget),
                "cuts": {c.config: step for c, step in cut_children}}
    return Sweep(record, parent_run_id, baseline, families, configs, children, notes, read)


# ------------------------------------------------------------------ per run and per configuration
def _as_of(history: pd.DataFrame, key: str, steps: np.ndarray) -> np.ndarray:
    """The newest value of ``key`` logged at a step < each of ``steps`` (0 before the first)."""
    s = history[key].dropna() if key in history else pd.Series(dtype=float)
    if s.empty:
        return np.full(len(steps), np.nan)
    i = np.searchsorted(s.index.to_numpy(), steps, side="left") - 1
    return np.where(i >= 0, s.to_numpy()[np.maximum(i, 0)], 0.0)


def eval_table(history: pd.DataFrame, mu: float = DEFAULT_MU) -> pd.DataFrame:
    """One row per evaluation step (where eval/accuracy was logged): the eval/ metrics and the
    three compute measures as of that step (tokens, seconds, projected at ``mu``)."""
    steps = history.index[history[ACCURACY].notna()].to_numpy()
    out = history.loc[steps, [c for c in history.columns if c.startswith("eval/")]].copy()
    out["tokens"] = _as_of(history, "compute/gen_tokens", steps)
    out["seconds"] = _as_of(history, "compute/gen_train_seconds", steps)
    out["projected"] = (mu * _as_of(history, "compute/gen_rollouts", steps)
                        + _as_of(history, "compute/train_rollouts", steps))
    return out


def aggregate(tables: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """Seeds aggregated per step: columns (stat, metric) for stat in median, q25, q75, plus
    ("n", "n"), the number of seeds that logged the step."""
    stacked = pd.concat(list(tables), keys=range(len(tables)), names=["run", "step"])
    g = stacked.groupby(level="step")
    n = stacked.notna().any(axis=1).groupby(level="step").sum().to_frame("n")
    return pd.concat({"median": g.median(), "q25": g.quantile(0.25), "q75": g.quantile(0.75), "n": n}, axis=1)


def _number(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _at(curve: pd.DataFrame, step: int, metric: str) -> dict[str, float | None]:
    return {stat: _number(curve.loc[step, (stat, metric)]) for stat in ("median", "q25", "q75")}


def _reach(curve: pd.DataFrame, target: float, keys: Sequence[str]) -> dict[str, Any] | None:
    """The first step whose median accuracy is >= target, with the median compute there."""
    hit = curve.index[curve[("median", ACCURACY)] >= target - TOLERANCE]
    if len(hit) == 0:
        return None
    step = int(hit[0])
    return {"step": step, **{k: _number(curve.loc[step, ("median", k)]) for k in keys}}


def _final_mu(children: Sequence[Child]) -> float | None:
    finals = [s.iloc[-1] for c in children if not (s := c.history[MU_METRIC].dropna()).empty]
    return _number(np.median(finals)) if finals else None


def _read(curve: pd.DataFrame, metric: str, peak: bool = False) -> dict[str, Any] | None:
    """`metric` from the median curve: at the last step it was logged, or with `peak` at the
    step where the median curve is highest (the paper's statistic: the maximum over training
    of the median curve, with its IQR there); None where it was never logged."""
    if ("median", metric) not in curve or not curve[("median", metric)].notna().any():
        return None
    logged = curve[("median", metric)].dropna()
    step = int(logged.idxmax()) if peak else int(logged.index[-1])
    return {"step": step, **_at(curve, step, metric)}


def _pass_at_k(curve: pd.DataFrame, peak: bool = False) -> dict[int, dict[str, Any]]:
    """pass@k (temperature 1) per k, read as `_read` reads it."""
    out = {int(m.group(1)): read for metric in curve["median"].columns
           if (m := _PASS_AT.match(metric)) and (read := _read(curve, metric, peak)) is not None}
    return dict(sorted(out.items()))


def _config_summary(children: Sequence[Child], mu: float) -> tuple[dict[str, Any], pd.DataFrame]:
    curve = aggregate([eval_table(c.history, mu) for c in children])
    acc = curve[("median", ACCURACY)]
    peak, last = int(acc.idxmax()), int(curve.index[-1])
    return {"runs": len(children), "seeds": sorted(c.seed for c in children),
            "peak_step": peak, "peak_accuracy": _at(curve, peak, ACCURACY),
            "final_step": last, "final_accuracy": _at(curve, last, ACCURACY),
            "final_pass_at_k": _pass_at_k(curve), "max_pass_at_k": _pass_at_k(curve, peak=True),
            "final_pass1_t01": _read(curve, PAPER_PASS1), "max_pass1_t01": _read(curve, PAPER_PASS1, peak=True),
            "final_mu": _final_mu(children),
            "design": _design_of(children, mu)}, curve


def _design_of(children: Sequence[Child], mu: float) -> dict[str, Any]:
    """R, B (`_design`), K, the target replay ratio K x B / R and gamma at the projection mu
    (K from the first child's params that give it, else the project's default; with adaptive
    reuse, reuse.rule not fixed, K is the mean of the rounds' measured reuse/updates)."""
    R, B = _design(children)
    K: float = LoopConfig().updates_per_step
    for c in children:
        try:
            K = int(c.params["loop.updates_per_step"])
            break
        except (KeyError, ValueError):
            continue
    if any(c.params.get("reuse.rule", "fixed") != "fixed" for c in children):
        taken = [float(v) for c in children if REUSE_UPDATES in c.history
                 for v in c.history[REUSE_UPDATES].dropna()]
        K = float(np.mean(taken)) if taken else float("nan")
    ratio = K * B / R
    return {"R": R, "B": B, "K": K, "replay_ratio": ratio, "gamma": evidence.gamma(mu, ratio), "gamma_mu": mu}


def crossings(children: Sequence[Child], mu: float, target: float, keys: Sequence[str]) -> dict[str, dict[int, Any]]:
    """Per compute measure, each seed's interpolated first crossing of `target` (None: never)."""
    tables = [(c.seed, eval_table(c.history, mu)) for c in children]
    return {k: {seed: evidence.crossing(t[k].to_numpy(), t[ACCURACY].to_numpy(), target) for seed, t in tables}
            for k in keys}


def _evidence(per_seed: Mapping[str, Mapping[int, Any]], base: Mapping[str, Mapping[int, Any]],
              curve: pd.DataFrame, n_boot: int) -> dict[str, Any]:
    """Per measure: the per-seed crossings, their median and IQR, the ratio of the median to
    the baseline's with its seed-bootstrap interval, and the grid's resolution. The bootstrap
    resamples the crossings in seed order (the order ``per_seed`` lists them), so that the
    interval does not depend on the order sweep.json lists the runs (run order, shard order)."""
    out = {}
    for k, seeds in per_seed.items():
        ours, theirs = ([v for _, v in sorted(group.items())] for group in (seeds, base[k]))
        out[k] = {"per_seed": {str(s): v for s, v in sorted(seeds.items())}, **evidence.spread(ours),
                  "ratio": evidence.ratio_interval(ours, theirs, n_boot=n_boot),
                  "resolution": evidence.resolution(curve[("median", k)].to_numpy())}
    return out


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def _to_peak(curve: pd.DataFrame, target: float, base: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    reach = _reach(curve, target, keys)
    return {k: None if reach is None else {"step": reach["step"], "compute": reach[k],
                                           "ratio": _ratio(reach[k], base[k])} for k in keys}


# ------------------------------------------------------------------ frontier and best configuration
def frontier(curves: Mapping[str, pd.DataFrame], key: str) -> list[dict[str, Any]]:
    """The Pareto points of the configs' median curves in (median compute ``key``, median
    accuracy): sorted by compute, each more accurate than every point before it."""
    parts = [pd.DataFrame({"compute": c[("median", key)].to_numpy(), "accuracy": c[("median", ACCURACY)].to_numpy(),
                           "config": name, "step": c.index.to_numpy()}) for name, c in curves.items()]
    points = pd.concat(parts).dropna(subset=["compute", "accuracy"])
    points = points.sort_values(["compute", "accuracy"], ascending=[True, False], kind="stable")
    best_before = points["accuracy"].cummax().shift(fill_value=-np.inf)
    kept = points[points["accuracy"] > best_before]
    return [{"compute": float(r.compute), "accuracy": float(r.accuracy), "config": r.config, "step": int(r.step)}
            for r in kept.itertuples()]


def _frontier_reach(points: Sequence[dict[str, Any]], target: float, base: float | None) -> dict[str, Any] | None:
    hit = next((p for p in points if p["accuracy"] >= target - TOLERANCE), None)
    return None if hit is None else {**hit, "ratio": _ratio(hit["compute"], base)}


def best_config(configs: Mapping[str, Mapping[str, Any]], baseline: str) -> tuple[str | None, list[str]]:
    """The buffer configuration (outside the baseline's family: its learning-rate variants are
    on-policy runs too) with the lowest median per-seed crossing of the target in projected
    compute (ties: generated tokens), and the configurations within one evaluation interval of
    it (the coarser of the two: replay_pipeline.reports.evidence.apart), which the report names as
    ties. (None, []) if no configuration's median seed reaches the target."""
    def crossing(name: str, key: str) -> float | None:
        return configs[name]["evidence"][key]["median"]

    family = configs[baseline].get("family", baseline) if baseline in configs else baseline
    reached = [n for n, c in configs.items() if n != baseline and c.get("family", n) != family
               and crossing(n, "projected") is not None]
    if not reached:
        return None, []
    best = min(reached, key=lambda n: (crossing(n, "projected"), crossing(n, "tokens") or math.inf))

    def step(name: str) -> float | None:
        return configs[name]["evidence"]["projected"]["resolution"]

    ties = [n for n in reached if n != best and not evidence.apart(
        crossing(n, "projected"), crossing(best, "projected"), max(filter(None, (step(n), step(best))), default=None))]
    return best, ties


def replay_payoff(mu: float | None, R: int, B: int) -> dict[str, Any] | None:
    """The planner's optimal design at ``mu`` for R rollouts per step and minibatches of B,
    with its illustrative noise defaults, and whether its predicted gamma is below 1."""
    if mu is None or not mu > 0:
        return None
    p = planner.plan(mu, R, B)
    return {"mu": mu, "alpha": p.alpha, "rho": p.rho, "R": R, "B": B, "capacity": p.capacity,
            "updates_per_step": p.updates_per_step, "x_star": p.x_star, "y_star": p.y_star,
            "gamma": p.gamma, "gamma_star": p.gamma_star, "pays_off": p.gamma < 1.0 - TOLERANCE}


def _design(children: Sequence[Child]) -> tuple[int, int]:
    """R and B of the first child whose params give them, else the project's defaults."""
    for c in children:
        try:
            p = c.params
            return int(p["loop.prompts_per_step"]) * int(p["loop.group_size"]), int(p["loop.minibatch_size"])
        except (KeyError, ValueError):
            continue

    loop = LoopConfig()
    return loop.prompts_per_step * loop.group_size, loop.minibatch_size


# ------------------------------------------------------------------ the whole summary
def _overrides(sweep: Sweep) -> tuple[list[str], dict[str, list[str]]]:
    """Overrides shared by every child, and each config's own (seed and run_id left out)."""
    drop = _PLACE_KEYS if sweep.record.get("shards") else ("seed", "run_id")  # shards differ in place only
    lists = [_overrides_without(c, drop) for c in sweep.record["children"]]
    shared = [o for o in lists[0] if all(o in rest for rest in lists[1:])]
    per = {}
    for child, extra in zip(sweep.record["children"], lists):
        per.setdefault(str(child["config"]), [o for o in extra if o not in shared])
    return shared, per


def _frontiers(sweep: Sweep, curves: Mapping[str, pd.DataFrame], peak: float,
               base: Mapping[str, float | None]) -> dict[str, Any]:
    """Per family and measure: the frontier's points and where it reaches the baseline's peak."""
    fronts = {}
    for family in dict.fromkeys(sweep.families[c] for c in curves):
        members = {c: curves[c] for c in curves if sweep.families[c] == family}
        fronts[family] = {"configs": list(members)} | {
            k: {"points": (pts := frontier(members, k)), "to_baseline_peak": _frontier_reach(pts, peak, base[k])}
            for k in base}
    return fronts


def _sweep_info(sweep: Sweep) -> dict[str, Any]:
    shared, own = _overrides(sweep)
    return {"name": sweep.record.get("name"), "sweep_id": sweep.record.get("sweep_id"),
            "parent_run_id": sweep.parent_run_id, "baseline": sweep.baseline, "families": sweep.families,
            "seeds": sorted({int(c["seed"]) for c in sweep.record["children"]}),
            "shared_overrides": shared, "configs": own, "protocol": sweep.record.get("protocol"),
            "shards": sweep.record.get("shards"), "budget": sweep.budget,
            "pending": list(sweep.record.get("pending") or [])}


def _mu_info(sweep: Sweep, mu: float) -> dict[str, Any]:
    measured = _final_mu(sweep.children)
    R, B = _design([c for c in sweep.children if c.config == sweep.baseline])
    return {"measured": measured, "measured_runs": sum(not c.history[MU_METRIC].dropna().empty
                                                       for c in sweep.children),
            "payoff_measured": replay_payoff(measured, R, B), "payoff_projection": replay_payoff(mu, R, B)}


def summarise(sweep: Sweep, mu: float = DEFAULT_MU, target: float | None = None,
              n_boot: int = 10_000) -> tuple[dict[str, Any], dict[str, pd.DataFrame]]:
    """Every number of the report (report.json) and each config's aggregated curve.
    `target`: the accuracy the per-seed crossings are read at (default: the baseline's median
    peak)."""
    keys = [m.key for m in measures(mu)]
    configs, curves, members = {}, {}, {}
    for name in sweep.configs:
        if children := [ch for ch in sweep.children if ch.config == name]:
            configs[name], curves[name] = _config_summary(children, mu)
            members[name] = children
    b = configs[sweep.baseline]
    peak = b["peak_accuracy"]["median"]
    base = {k: _number(curves[sweep.baseline].loc[b["peak_step"], ("median", k)]) for k in keys}
    goal = peak if target is None else float(target)
    base_cross = crossings(members[sweep.baseline], mu, goal, keys)
    for name, curve in curves.items():
        configs[name] |= {"family": sweep.families[name], "to_baseline_peak": _to_peak(curve, peak, base, keys),
                          "evidence": _evidence(crossings(members[name], mu, goal, keys), base_cross, curve, n_boot)}
    best, ties = best_config(configs, sweep.baseline)
    summary = {
        "sweep": _sweep_info(sweep),
        "measures": {m.key: {"label": m.name, "unit": m.unit} for m in measures(mu)},
        "projection_mu": mu,
        "baseline": {"config": sweep.baseline, "peak_accuracy": peak, "peak_step": b["peak_step"],
                     "compute_at_peak": base},
        "configs": configs,
        "curves": {n: _curve_rows(c) for n, c in curves.items()},
        "frontiers": _frontiers(sweep, curves, peak, base),
        "target": {"accuracy": goal, "source": "stated (--target)" if target is not None else "the baseline's median peak",
                   "baseline_still_rising": b["peak_step"] == b["final_step"]},
        "best": None if best is None else {"config": best, "ties": ties, "chosen_by": "projected",
                                           **configs[best]["to_baseline_peak"],
                                           "evidence": configs[best]["evidence"]},
        "mu": _mu_info(sweep, mu),
        "notes": [*sweep.notes, *_untimed_notes(sweep.children)],
    }
    return summary, curves


def _untimed_notes(children: Sequence[Child]) -> list[str]:
    """A note when runs were resumed over steps their stopped process had stored: those
    rollouts count in tokens, rollouts and the projection, but their generation seconds ran
    in the stopped process, so the measured seconds leave them out."""
    untimed = {f"{c.config} seed {c.seed}": int(s.iloc[-1]) for c in children
               if UNTIMED in c.history and not (s := c.history[UNTIMED].dropna()).empty and s.iloc[-1] > 0}
    if not untimed:
        return []
    return [f"Measured seconds of {len(untimed)} run(s) leave out the generation of rollouts a resume read back "
            f"from the store ({', '.join(f'{k}: {v:,}' for k, v in untimed.items())}): a stopped process "
            "generated them and its seconds went with it; generated tokens, rollouts and the projection count them."]


def _curve_rows(curve: pd.DataFrame) -> list[dict[str, Any]]:
    rows = []
    for step in curve.index:
        row = {"step": int(step), "n": int(curve.loc[step, ("n", "n")])}
        for stat, metric in curve.columns:
            if stat != "n":
                row[f"{metric}/{stat}"] = _number(curve.loc[step, (stat, metric)])
        rows.append(row)
    return rows


# ------------------------------------------------------------------ LanceDB distributions
def _lancedb_uri(child: Child) -> str:
    uri = child.tags.get("replay_pipeline.lancedb_uri") or child.params.get("buffer.uri")
    if uri and uri not in ("None", "null"):
        return uri
    return str(Path(child.params.get("tracking.root_dir", "runs")).expanduser() / "lancedb")


def _pool(into: dict[int, int], table: Any, value: str, count: str) -> None:
    data = table.to_pydict()
    for v, n in zip(data[value], data[count]):
        into[int(v)] = into.get(int(v), 0) + int(n)


def distributions(children: Sequence[Child]) -> tuple[dict[str, dict[str, dict[int, int]]], list[str]]:
    """Per config, the staleness, reuse-count and steps-since-last-use histograms from LanceDB,
    pooled over its seeds ({config: {"runs": seeds read, name: {value: count}}}), and notes on
    what was skipped."""
    from replay_pipeline.reports import analysis  # start-up cost: lancedb, only when the report reads the buffer

    pooled: dict[str, dict[str, Any]] = {}
    notes = []
    for child in children:
        uri = _lancedb_uri(child)
        try:
            tables = {n: getattr(analysis, fn)(uri, child.run_id) for n, (fn, _) in DISTRIBUTIONS.items()}
        except (ValueError, OSError, RuntimeError) as exc:
            reason = str(exc).split(";")[0]
            notes.append(f"{child.config} seed {child.seed}: buffer tables not read at {uri} ({reason})")
            continue
        into = pooled.setdefault(child.config, {"runs": 0, **{n: {} for n in DISTRIBUTIONS}})
        into["runs"] += 1
        for n, table in tables.items():
            _pool(into[n], table, n, DISTRIBUTIONS[n][1])
    for config in dict.fromkeys(c.config for c in children):
        if config not in pooled:
            notes.append(f"{config}: no seed's LanceDB tables could be read; its distributions are left out")
    return {c: {n: h if n == "runs" else dict(sorted(h.items())) for n, h in d.items()}
            for c, d in pooled.items()}, notes


# ------------------------------------------------------------------ plots
def _figure(panels: int = 1, width: float = 6.0):
    # start-up cost: matplotlib, only when a plot is drawn
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * panels, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    return fig, list(axes)


def _peak_line(ax: Any, peak: float) -> None:
    ax.axhline(peak, color="grey", linestyle="--", linewidth=1, label=f"baseline peak {peak:.3f}")


def _plot_accuracy(curves: Mapping[str, pd.DataFrame], m: Measure, peak: float, path: Path) -> None:
    fig, (ax,) = _figure()
    for name, c in curves.items():
        x = c[("median", m.key)].to_numpy()
        (line,) = ax.plot(x, c[("median", ACCURACY)], marker="o", markersize=3, label=name)
        ax.fill_between(x, c[("q25", ACCURACY)], c[("q75", ACCURACY)], color=line.get_color(), alpha=0.2)
    _peak_line(ax, peak)
    ax.set(xlabel=f"{m.name}\n({m.unit})", ylabel="held-out accuracy (median, IQR over seeds)",
           title=f"accuracy vs {m.name}")
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)


def _plot_frontiers(fronts: Mapping[str, Any], ms: Sequence[Measure], peak: float, path: Path) -> None:
    fig, axes = _figure(len(ms), width=5.5)
    for ax, m in zip(axes, ms):
        for family, f in fronts.items():
            pts, n = f[m.key]["points"], len(f["configs"])
            ax.step([p["compute"] for p in pts], [p["accuracy"] for p in pts], where="post", marker="o",
                    markersize=3, label=f"{family} ({n} config{'s' if n > 1 else ''})")
        _peak_line(ax, peak)
        ax.set(xlabel=f"{m.name}\n({m.unit})", ylabel="frontier accuracy (median)", title=f"frontier:\n{m.name}")
        ax.legend(fontsize="x-small")
    fig.savefig(path, dpi=100)


def _plot_pass_at_k(configs: Mapping[str, Any], path: Path) -> None:
    fig, (ax,) = _figure()
    for name, c in configs.items():
        ks = list(c["final_pass_at_k"])
        med = np.array([c["final_pass_at_k"][k]["median"] for k in ks], dtype=float)
        err = [med - np.array([c["final_pass_at_k"][k]["q25"] for k in ks], dtype=float),
               np.array([c["final_pass_at_k"][k]["q75"] for k in ks], dtype=float) - med]
        ax.errorbar(ks, med, yerr=err, marker="o", capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="k", ylabel="pass@k at the end (median, IQR)", title="pass@k (temperature 1) at the end")
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)


def _band(ax: Any, curve: pd.DataFrame, metric: str, label: str) -> None:
    x = curve.index.to_numpy()
    (line,) = ax.plot(x, curve[("median", metric)], label=label)
    ax.fill_between(x, curve[("q25", metric)], curve[("q75", metric)], color=line.get_color(), alpha=0.2)


def _plot_entropy(sweep: Sweep, curves: Mapping[str, pd.DataFrame], path: Path) -> None:
    fig, (left, right) = _figure(2, width=5.5)
    for name in curves:
        runs = [c.history[[LEARN_ENTROPY]].dropna() for c in sweep.children if c.config == name]
        _band(left, aggregate(runs), LEARN_ENTROPY, name)
        _band(right, curves[name].dropna(subset=[("median", SAMPLE_ENTROPY)]), SAMPLE_ENTROPY, name)
    left.set(xlabel="generation step", ylabel="learn/entropy (median, IQR)", title="policy entropy on batches")
    right.set(xlabel="generation step", ylabel="eval/sample_entropy (median, IQR)",
              title="entropy of sampled completions")
    left.legend(fontsize="small")
    fig.savefig(path, dpi=100)


def _plot_distributions(dists: Mapping[str, Any], path: Path) -> None:
    # start-up cost: matplotlib, only when a plot is drawn
    from matplotlib.ticker import MaxNLocator

    fig, axes = _figure(len(DISTRIBUTIONS), width=4.5)
    for ax, name in zip(axes, DISTRIBUTIONS):
        for config, d in dists.items():
            total = sum(d[name].values())
            if total:
                ax.plot(list(d[name]), [n / total for n in d[name].values()], marker="o", markersize=4,
                        label=f"{config} ({d['runs']} run{'s' if d['runs'] > 1 else ''})")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel=name.replace("_", " "), ylabel="fraction (pooled over seeds)", title=name.replace("_", " "))
        if ax.get_legend_handles_labels()[0]:  # none when no run read has rows of this kind (a baseline alone)
            ax.legend(fontsize="x-small")
    fig.savefig(path, dpi=100)


def _plots(sweep: Sweep, summary: dict[str, Any], curves: Mapping[str, pd.DataFrame],
           dists: Mapping[str, Any], out: Path) -> list[str]:
    ms, peak, made = measures(summary["projection_mu"]), summary["baseline"]["peak_accuracy"], []
    for m in ms:
        _plot_accuracy(curves, m, peak, out / f"accuracy_vs_{m.key}.png")
        made.append(f"accuracy_vs_{m.key}.png")
    _plot_frontiers(summary["frontiers"], ms, peak, out / "frontier.png")
    made.append("frontier.png")
    if any(c["final_pass_at_k"] for c in summary["configs"].values()):
        _plot_pass_at_k(summary["configs"], out / "pass_at_k.png")
        made.append("pass_at_k.png")
    _plot_entropy(sweep, curves, out / "entropy.png")
    made.append("entropy.png")
    if dists:
        _plot_distributions(dists, out / "buffer_distributions.png")
        made.append("buffer_distributions.png")
    return made


# ------------------------------------------------------------------ markdown
def _fmt(value: float | None, spec: str = ".3f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _table(summary: dict[str, Any]) -> str:
    ms = measures(summary["projection_mu"])
    # the paper's pass@1 (T=0.1), and pass@1 and the largest k the runs sampled (loop.eval_samples)
    # at T=1, at the last step each was logged
    top = max((int(k) for c in summary["configs"].values() for k in c["final_pass_at_k"]), default=16)
    head = ["config", "runs", "peak acc", "final acc", "final pass@1, T=0.1", "final pass@1, T=1",
            f"final pass@{top}, T=1"]
    for m in ms:
        head += [f"{m.name} to baseline peak", "ratio"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, c in summary["configs"].items():
        pk = c["final_pass_at_k"]
        cells = [name + (" (baseline)" if name == summary["baseline"]["config"] else ""), str(c["runs"]),
                 _fmt(c["peak_accuracy"]["median"]), _fmt(c["final_accuracy"]["median"]),
                 _fmt((c.get("final_pass1_t01") or {}).get("median")), _fmt(pk.get(1, {}).get("median")),
                 _fmt(pk.get(top, {}).get("median"))]
        for m in ms:
            to = c["to_baseline_peak"][m.key]
            cells += ["not reached", "-"] if to is None else [_fmt(to["compute"], m.fmt), _fmt(to["ratio"], ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _shard_lines(s: Mapping[str, Any]) -> list[str]:
    shards = s.get("shards") or []
    if not shards:
        return []
    names = ", ".join(f"{x['name']}-{x['sweep_id']}" for x in shards)
    return [f"Run in {len(shards)} shards ({names}; parent "
            f"runs {', '.join(str(x['mlflow_run_id']) for x in shards)}): one grid, its seeds or configurations split between them, "
            "reported as one.", ""]


def _protocol_lines(s: Mapping[str, Any]) -> list[str]:
    p = s.get("protocol") or {}
    if not p.get("selection_seeds"):
        return ["**Protocol: nothing held out.** No selection seeds are recorded: the configurations may "
                "have been chosen on these very runs, so read this sweep as exploration, not as a "
                "confirmation.", ""]
    tried = ", ".join(f"{p[k]} {w}" for k, w in (("configs_tried", "configurations"), ("variants_tried", "variants"))
                      if p.get(k) is not None)
    return [f"**Protocol: held out.** The configurations were chosen on seeds "
            f"{', '.join(map(str, p['selection_seeds']))} ({p.get('chosen_on') or 'as recorded'}"
            + (f"; {tried} tried" if tried else "") + "); this report reads seeds "
            f"{', '.join(map(str, s['seeds']))}, none of which was used to choose.", ""]


def _budget_lines(s: Mapping[str, Any]) -> list[str]:
    b = s.get("budget")
    if not b:
        return []
    cuts = ", ".join(f"{c} at step {q}" for c, q in b["cuts"].items())
    return [f"**Read at {b['fraction']:.4g} of the budget.** Every run is read as if it had stopped after "
            f"{b['fraction']:.4g} of its steps ({cuts}): its evaluations up to there, the rounds after dropped. "
            "The measured seconds are those of the longer runs' first rounds.", ""]


def _swept(summary: dict[str, Any]) -> list[str]:
    s = summary["sweep"]
    lines = ["## What was swept", "", *_protocol_lines(s), *_shard_lines(s), *_budget_lines(s),
             f"Seeds: {', '.join(map(str, s['seeds']))}. Shared overrides: "
             f"`{' '.join(s['shared_overrides']) or '(none)'}`. Baseline: `{s['baseline']}`.", "",
             "| config | family | overrides | finished runs |", "|---|---|---|---|"]
    for name, own in s["configs"].items():
        runs = summary["configs"].get(name, {}).get("runs", 0)
        lines.append(f"| {name} | {s['families'][name]} | `{' '.join(own) or '(shared only)'}` | {runs} |")
    return lines


def _ratio_text(r: Mapping[str, Any]) -> str:
    if r["ratio"] is None and r["low"] is None:
        return "undefined"
    point = "not reached by the median seed" if r["ratio"] is None else f"{r['ratio']:.2f}"
    low = _fmt(r["low"], ".2f")
    return f"{point} [{low}, {'inf' if r['high'] == math.inf else _fmt(r['high'], '.2f')}]"


def _evidence_lines(summary: dict[str, Any]) -> list[str]:
    t, ms = summary["target"], measures(summary["projection_mu"])
    head = ["config", "replay ratio", f"gamma at mu={summary['projection_mu']:g}", "seeds reached",
            *(x for m in ms for x in (f"{m.name}: median crossing [IQR]", "ratio [95% CI]"))]
    lines = ["## Per-seed crossings", "",
             f"Target: accuracy {t['accuracy']:.3f} ({t['source']}). Each seed's compute at its first evaluation at "
             "or above the target, interpolated linearly from the evaluation before; median and IQR over seeds "
             "(a seed that never reaches counts as infinite); ratio = median / the baseline's median, with a "
             "95% seed-bootstrap interval.", ""]
    if t["baseline_still_rising"]:
        lines += ["**The baseline is still rising**: its median peak is its last evaluation, so the target is not "
                  "the accuracy it would plateau at. Read the ratio with a stated `--target` below that, or run "
                  "the baseline longer.", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, c in summary["configs"].items():
        d, ev = c["design"], c["evidence"]
        cells = [name, f"{d['replay_ratio']:.2f}", f"{d['gamma']:.2f}", f"{ev['tokens']['reached']}/{ev['tokens']['seeds']}"]
        for m in ms:
            e = ev[m.key]
            cells += [f"{_fmt(e['median'], m.fmt, 'not reached')} [{_fmt(e['q25'], m.fmt, 'inf')}, "
                      f"{_fmt(e['q75'], m.fmt, 'inf')}]", _ratio_text(e["ratio"])]
        lines.append("| " + " | ".join(cells) + " |")
    base_ev = summary["configs"][summary["baseline"]["config"]]["evidence"]
    if base_ev["tokens"]["median"] is None:
        lines += ["", f"**No ratio**: only {base_ev['tokens']['reached']} of the baseline's {base_ev['tokens']['seeds']} "
                  "seeds reach the target, so its median seed never does; read the crossings at a lower "
                  "`--target` (python -m flows.report PARENT_RUN_ID --target ACCURACY)."]
    lines += ["", "Resolution (median compute between evaluations, the baseline's): "
              + ", ".join(f"{m.name} {_fmt(base_ev[m.key]['resolution'], m.fmt)}" for m in ms) + "."]
    return lines + [""]


def _best_lines(summary: dict[str, Any]) -> list[str]:
    best = summary["best"]
    lines = ["## Best buffer configuration", ""]
    if best is None:
        return lines + [f"No buffer configuration's median seed reached the target {summary['target']['accuracy']:.3f}.",
                        ""]
    lines += [f"**{best['config']}** (the lowest median per-seed crossing of the target "
              f"{summary['target']['accuracy']:.3f} in projected compute"
              + (f"; within one evaluation interval of it, a tie: {', '.join(best['ties'])}" if best["ties"] else "")
              + "):", ""]
    for m in measures(summary["projection_mu"]):
        lines += [f"{m.name}: compute ratio {_ratio_text(best['evidence'][m.key]['ratio'])} (per-seed crossings); "
                  + (f"{best[m.key]['ratio']:.2f} read off the median curves"
                     if best[m.key] is not None and best[m.key]["ratio"] is not None
                     else "the median curve does not reach the baseline's peak"), ""]
    return lines


def _payoff_line(p: dict[str, Any] | None, what: str) -> str:
    if p is None:
        return f"- {what}: no mu was logged, so the planner cannot say whether replay pays off."
    verdict = "should pay off" if p["pays_off"] else "should not pay off"
    return (f"- {what} = {p['mu']:.2f}: replay {verdict}. The planner (replay_pipeline.algo.planner.plan, "
            f"R = {p['R']}, B = {p['B']}) recommends buffer.capacity = {p['capacity']}, loop.updates_per_step = "
            f"{p['updates_per_step']}, predicted gamma {p['gamma']:.2f} (at the continuous optimum "
            f"{p['gamma_star']:.2f}; below 1 pays off). Noise parameters: the planner's illustrative defaults "
            f"alpha = {p['alpha']:g}, rho = {p['rho']:g}, not measured for this setting.")


def _mu_lines(summary: dict[str, Any]) -> list[str]:
    mu = summary["mu"]
    per = ", ".join(f"{n} {_fmt(c['final_mu'], '.2f')}" for n, c in summary["configs"].items())
    return ["## Measured mu", "",
            f"Measured mu (median of the final compute/mu of {mu['measured_runs']} finished runs): "
            f"{_fmt(mu['measured'], '.2f')}; per configuration: {per}.", "",
            _payoff_line(mu["payoff_measured"], "At the measured mu"),
            _payoff_line(mu["payoff_projection"], "At the GPU-scale projection, mu"), ""]


def _details(summary: dict[str, Any]) -> list[str]:
    ks = sorted({k for c in summary["configs"].values() for k in c["final_pass_at_k"]})
    head = ["config", "peak step", "final step", "final measured mu", "pass@1, T=0.1", *(f"pass@{k}" for k in ks)]
    lines = ["## Per configuration", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cell(read: Mapping[str, Any] | None) -> str:
        if not read:
            return "-"
        return f"{_fmt(read['median'])} [{_fmt(read['q25'])}, {_fmt(read['q75'])}] (step {read['step']})"

    for name, c in summary["configs"].items():
        for which in ("max", "final"):
            pk = c.get(f"{which}_pass_at_k", {})
            cells = [f"{name} ({which})", str(c["peak_step"]), str(c["final_step"]), _fmt(c["final_mu"], ".2f"),
                     cell(c.get(f"{which}_pass1_t01")), *(cell(pk.get(k)) for k in ks)]
            lines.append("| " + " | ".join(cells) + " |")
    return lines + ["", "Median [25th, 75th percentile] over seeds. pass@k: sampled at temperature 1 (top_p "
                    "loop.eval_top_p); pass@1, T=0.1: the paper's pass@1 (top_p 0.95, loop.pass1_samples a prompt). "
                    "`max`: the paper's statistic, the maximum over training of the median curve, with the IQR at "
                    "that step; `final`: at the last step it was logged."]


def _frontier_lines(summary: dict[str, Any]) -> list[str]:
    ms = measures(summary["projection_mu"])
    head = ["family", "configs", *(x for m in ms for x in (f"{m.name} to baseline peak", "via"))]
    lines = ["## Pareto frontier per family", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for family, f in summary["frontiers"].items():
        cells = [family, ", ".join(f["configs"])]
        for m in ms:
            r = f[m.key]["to_baseline_peak"]
            cells += ["not reached", "-"] if r is None else [
                f"{_fmt(r['compute'], m.fmt)} (ratio {_fmt(r['ratio'], '.2f')})", f"{r['config']} step {r['step']}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _glance_lines(summary: dict[str, Any], plots: Sequence[str]) -> list[str]:
    """The answer first: accuracy against generated tokens (the figure a reader looks for) and
    one sentence on the best buffer configuration's token ratio, or why there is none."""
    lines = ["## At a glance", ""]
    if "accuracy_vs_tokens.png" in plots:
        lines += ["![held-out accuracy against generated tokens, median and IQR over seeds](accuracy_vs_tokens.png)", ""]
    t, best = summary["target"], summary["best"]
    base = summary["configs"][summary["baseline"]["config"]]["evidence"]["tokens"]
    if base["median"] is None:
        lines.append(f"No ratio: only {base['reached']} of the baseline's {base['seeds']} seeds reach the target "
                     f"{t['accuracy']:.3f}; read the crossings at a lower `--target` (Per-seed crossings below).")
    elif best is None:
        lines.append(f"No buffer configuration's median seed reaches the target {t['accuracy']:.3f} "
                     f"({t['source']}) within the budget.")
    else:
        e = best["evidence"]["tokens"]
        lines.append(f"**{best['config']}** reaches the target {t['accuracy']:.3f} ({t['source']}) with "
                     f"{_ratio_text(e['ratio'])} of the baseline's generated tokens (median ratio over seeds "
                     f"[95% seed-bootstrap interval]; {e['reached']}/{e['seeds']} seeds reach it).")
    return lines + [""]


def render_markdown(summary: dict[str, Any], plots: Sequence[str]) -> str:
    """report.md from the summary; ``plots`` are file names beside it."""
    s, b = summary["sweep"], summary["baseline"]
    ms = measures(summary["projection_mu"])
    lines = [f"# Sweep report: {s['name']} ({s['sweep_id']})", "",
             f"MLflow parent run `{s['parent_run_id']}`. Accuracy is held-out greedy accuracy, median over seeds "
             "(IQR in report.json and the plots).", "",
             *([summary["notes"][0], ""] if s.get("pending") else []),
             *_glance_lines(summary, plots), *_swept(summary), "",
             "## Results", "",
             f"Baseline `{b['config']}` peaks at median accuracy {b['peak_accuracy']:.3f} (step {b['peak_step']}). "
             "Compute to reach that peak, and its ratio to the baseline's compute at its own peak:", "",
             _table(summary), "",
             *(f"- {m.name}: {m.unit}" for m in ms),
             "- Evaluations at step E are paired with the compute of the first E rounds.", "",
             *_evidence_lines(summary), *_best_lines(summary), *_mu_lines(summary), *_details(summary), "", *_frontier_lines(summary), "",
             "## Plots", "", *(f"![{p}]({p})" for p in plots), ""]
    if summary["notes"]:
        lines += ["## Notes", "", *(f"- {n}" for n in summary["notes"]), ""]
    return "\n".join(lines)


# ------------------------------------------------------------------ everything
def _json_safe(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value.item() if isinstance(value, np.generic) else value


def build_report(uri: str, parent_run_id: str, *, mu: float = DEFAULT_MU, out: str | Path | None = None,
                 root: str | Path = "runs", baseline: str | None = None, target: float | None = None,
                 shards: Sequence[tuple[str, str]] = (), budget: float | None = None) -> Report:
    """Read the sweep under MLflow run ``parent_run_id`` at ``uri`` (with its ``shards``, each
    (uri, parent_run_id): see merge_shards; at ``budget``, a fraction of every run's steps:
    at_budget), write report.md, report.json and the plots to ``out`` (default
    ``<root>/reports/<name>-<sweep_id>``, ``-budget<f>`` added at a budget) and log them to the
    parent run under ``report/`` (``report-budget<f>/``)."""
    # start-up cost: mlflow takes seconds to import; only this path talks to the store
    from mlflow.tracking import MlflowClient

    if not (isinstance(mu, (int, float)) and math.isfinite(mu) and mu > 0):
        raise ReportError(f"mu={mu!r} must be a finite number > 0 (the paper's Qwen2.5-7B figure is 5.28)")
    sweep = load(uri, parent_run_id, baseline, shards, budget)
    if target is not None and not (isinstance(target, (int, float)) and 0 <= target <= 1):
        raise ReportError(f"target={target!r} must be an accuracy in [0, 1], e.g. --target 0.5")
    summary, curves = summarise(sweep, mu, target)
    if budget is None:
        dists, notes = distributions(sweep.children)
    else:
        dists, notes = {}, ["buffer distributions left out: the buffer tables hold whole runs, and this report "
                            f"reads them at {budget:.4g} of their budget"]
    summary["distributions"], summary["notes"] = dists, summary["notes"] + notes
    suffix = "" if budget is None else f"-budget{budget:.4g}"
    out = Path(out) if out else (Path(root).expanduser().resolve() / "reports"
                                 / f"{sweep.record.get('name')}-{sweep.record.get('sweep_id')}{suffix}")
    out.mkdir(parents=True, exist_ok=True)
    for name in PLOTS:  # a plot left out this time must not survive from an earlier report
        (out / name).unlink(missing_ok=True)
    summary["plots"] = _plots(sweep, summary, curves, dists, out)
    summary["table"] = table = _table(summary)
    (out / "report.json").write_text(json.dumps(_json_safe(summary), indent=2))
    (out / "report.md").write_text(render_markdown(summary, summary["plots"]))
    client = MlflowClient(tracking_uri=uri)
    client.log_artifacts(parent_run_id, str(out), f"report{suffix}")
    return Report(out / "report.md", table, summary, f"{client.get_run(parent_run_id).info.artifact_uri}/report{suffix}")
