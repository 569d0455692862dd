"""A run's lineage: where it starts (new, resume, fork), which tables and MLflow run it
continues, what its checkpoints hold, and its record `<run_dir>/run.json`.

- `start_point`: the verified checkpoint a resume or fork starts from (or step 0);
- `open_tables`: a new run's tables, a resume's own, or a fork's shallow clones at the tag;
- `check_resume_tables`: a resume's tables can continue the run: no damaged file (else the
  repair command), no row lost before the checkpoint (else the fork to take);
- `open_tracker`: a new MLflow run tagged with the lineage, or the resumed one;
- `checkpoint_state` / `restore`: what a checkpoint's state.json holds for a bit-for-bit
  resume, and loading it back into a freshly built run;
- `write_run_info` / `note_flow_run` / `note_end`: run.json, the run's MLflow run id, tables, fork
  lineage, resumes, Prefect flow runs and how its last process ended; `run_status` reads it back
  with the lease and the newest checkpoint (`flows.query runs`) (a resume needs the MLflow run id even if the run stopped before its first
  checkpoint).

Configuration rules for resume and fork (which keys may change) are
replay_pipeline/run/resume.py's; this module reads and writes the run's files and tables.
"""

from __future__ import annotations

import json
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from replay_pipeline.buffer import RolloutStore
from replay_pipeline.buffer.lance_table import StoreError, sql_str
from replay_pipeline.buffer.usage import UsageStore
from replay_pipeline.training.checkpoints import (CheckpointError, capture_rng, checkpoint_step, latest_valid,
                                         list_checkpoints, load_optimizer_state, read_state, remove_partial,
                                         restore_rng)
from replay_pipeline.algo.compute import ComputeLedger
from replay_pipeline.config import ConfigError, flatten
from replay_pipeline.system.lease import holder as lease_holder
from replay_pipeline.models.loading import load_pretrained
from replay_pipeline.run.resume import config_hash, parse_fork, saved_config
from replay_pipeline.system.runs import RunPaths, artifact_location
from replay_pipeline.tracking.tracker import MlflowTracker

RUN_INFO = "run.json"


def json_dumps(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, sort_keys=True, default=str)


def read_run_info(root: str | Path, run_id: str) -> dict[str, Any]:
    """`<run_dir>/run.json`: the MLflow run id and fork lineage, written when a run starts."""
    path = RunPaths.make(root, run_id).run_dir / RUN_INFO
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is garbled ({exc}); restore it or fork from a checkpoint instead") from exc


def start_point(cfg: Any, mode: str, paths: RunPaths, log: Callable[[str], Any]
                 ) -> tuple[tuple[Path, dict[str, Any]] | None, dict[str, Any]]:
    """The verified checkpoint a resume or fork starts from (None: step 0), and the lineage.

    Resume: the run's newest valid checkpoint (incomplete or corrupt ones are skipped with a
    warning); with none, the run restarts from step 0 (a fork from its source checkpoint),
    reusing every rollout it stored. Fork: the source's checkpoint at the given step."""
    if mode == "new":
        return None, {"mode": "new"}
    if mode == "fork":
        source, step = parse_fork(cfg.fork)
        src = RunPaths.make(paths.root, source)
        found = latest_valid(src.checkpoints, at_step=step)
        if found is None:
            have = [checkpoint_step(p) for p in list_checkpoints(src.checkpoints)]
            raise CheckpointError(
                f"cannot fork {source}@{step}: run {source} has no valid checkpoint at step {step} "
                f"under {src.checkpoints} (valid or not, it has: {have or 'none'}). Checkpoints are "
                "written every loop.checkpoint_every steps and the newest loop.keep_checkpoints kept.")
        path, state = found
        return found, {"mode": "fork", "source_run": source, "source_step": step,
                       "source_checkpoint": str(path), "source_mlflow_run_id": state.get("mlflow_run_id"),
                       "tag": state["table_tag"], "learner_steps": int(state["learner_steps"])}
    for tmp in remove_partial(paths.checkpoints):
        log(f"removed {tmp.name}: a checkpoint the stopped process was still writing")
    found = latest_valid(paths.checkpoints)
    info = read_run_info(paths.root, paths.run_id)
    if found is not None:
        path, state = found
        if state.get("run_id") not in (None, paths.run_id):
            raise CheckpointError(f"{path} belongs to run {state.get('run_id')!r}, not {paths.run_id!r}")
        # Hashed over the keys the run saved: fields added to the project since keep their defaults.
        current = config_hash(cfg, keys=flatten(saved_config(paths.root, paths.run_id)))
        if state.get("config_hash") != current:
            raise CheckpointError(
                f"{path} was written with a different configuration (config hash "
                f"{state.get('config_hash')} != {current}): {paths.run_dir / 'config.yaml'} "
                f"was changed since. Restore it, or fork the run instead: fork={paths.run_id}@{state['step']}")
        return found, {"mode": "resume", "checkpoint": str(path), "mlflow_run_id": state.get("mlflow_run_id")}
    if list_checkpoints(paths.checkpoints):
        warnings.warn(f"no checkpoint of {paths.run_id} verifies; restarting it from its start "
                      "(its stored rollouts are reused, not regenerated)")
    fork = info.get("fork")
    if fork:  # a fork that stopped before its first checkpoint: start again from the source's
        src = RunPaths.make(paths.root, fork["source_run"])
        found = latest_valid(src.checkpoints, at_step=int(fork["source_step"]))
        if found is None:
            raise CheckpointError(f"{paths.run_id} is a fork of {fork['source_run']}@{fork['source_step']} "
                                  "that stopped before its first checkpoint, and the source checkpoint is gone")
        return found, {"mode": "resume", "checkpoint": str(found[0]), "fork_restart": True, **fork,
                       "tag": found[1]["table_tag"], "learner_steps": int(found[1]["learner_steps"])}
    return None, {"mode": "resume", "checkpoint": None}


def open_tables(uri: str, mode: str, run_id: str, lineage: dict[str, Any],
                 storage_options: Any = None) -> tuple[RolloutStore, UsageStore]:
    """New run: create both tables. Resume: open them (a schema mismatch is refused and the
    table left untouched). Fork: shallow-clone the source's at the checkpoint's tag, then drop
    the source rows the tag holds beyond the fork point (the fork's own rows are kept, so an
    interrupted fork can be resumed). `storage_options`: buffer.storage_options, for an
    object-store uri."""
    opts = {"storage_options": storage_options}
    if mode == "new":
        return RolloutStore.create(uri, run_id, **opts), UsageStore.create(uri, run_id, **opts)
    if mode == "resume" and lineage.get("checkpoint") is None and not lineage.get("fork_restart"):
        # no checkpoint yet: the stopped process may have died before it created both tables
        return RolloutStore.open_or_create(uri, run_id, **opts), UsageStore.open_or_create(uri, run_id, **opts)
    if mode == "fork" or lineage.get("fork_restart"):
        source, step, tag = lineage["source_run"], lineage["source_step"], lineage["tag"]
        mine = f"run_id != {sql_str(run_id)}"
        store = RolloutStore.fork(uri, source, tag, run_id, drop_where=f"{mine} AND step >= {int(step)}", **opts)
        usage = UsageStore.fork(uri, source, tag, run_id,
                                drop_where=f"{mine} AND learner_step >= {int(lineage['learner_steps'])}", **opts)
        return store, usage
    return RolloutStore.open(uri, run_id, **opts), UsageStore.open(uri, run_id, **opts)


def check_resume_tables(store: RolloutStore, usage: UsageStore, state: dict[str, Any], async_loop: bool,
                        checkpoints: Path, log: Callable[[str], Any] = print, deep: bool = False) -> None:
    """Refuse (StoreError) a resume from the checkpoint whose `state` is given when its tables
    cannot continue the run exactly; run before the MLflow run is touched.

    * A damaged table (`DamagedTable`, with the repair command): every file must exist and
      open (`LanceTable.check_intact(deep=False)`: one small read a file) and, with `deep`
      (the CLI's check before Prefect starts, check_start_point), every page must decode (a
      full read of both tables: 11 ms for 40k small rollouts, 2.3 MB, on this 2-core
      machine). Without `deep` (build_run, after that check), damage inside a file's pages is
      found by the first read that meets it, which fails the run FAILED with the same message.
    * Rows a repair lost (replay_pipeline/buffer/repair.py): the rollouts numbered before the
      checkpoint (seq < its window end) and the usage records of its learner steps must all
      be stored, since the resumed run's first window and reuse counts are read from them;
      otherwise the resume is refused, naming the newest checkpoint whose rows are all stored
      (fork from it) if there is one. Rows lost after the checkpoint are generated again: the
      sync loop replays each step after it, deterministically, and stores a missing row back
      at its own seq. The async loop replays nothing, so there every seq must be stored.
    """
    for table in (store, usage):
        table.check_intact(deep=deep)
    holes = _lost_before(store, usage, state)
    if not holes and async_loop:
        n, top = store.count(), store.max_seq()
        holes = [f"{top + 1 - n} rollouts (seq below {top + 1})"] if top + 1 > n else []
    if holes:
        fork = next((c for c in reversed(list_checkpoints(checkpoints)) if checkpoint_step(c) < int(state["step"])
                     and not _lost_before(store, usage, _state_or_none(c) or {"step": -1})), None)
        advice = (f"fork it from the checkpoint at step {checkpoint_step(fork)}, whose rows are all stored: "
                  f"python -m flows.train fork={store.run_id}@{checkpoint_step(fork)}" if fork is not None else
                  "no earlier checkpoint of the run has all its rows; fork it from this checkpoint to go on "
                  f"with every readable row kept (a new run, its first window without the lost rows): "
                  f"python -m flows.train fork={store.run_id}@{state['step']}")
        raise StoreError(
            f"cannot resume {store.run_id} from step {state['step']} exactly: {' and '.join(holes)} it read "
            f"when it stopped are no longer stored (lost with damaged files: `python -m flows.query repair "
            f"{store.run_id}` said which), so its window and reuse counts would differ; {advice}")
    lost = store.max_seq() + 1 - store.count()
    if lost > 0:
        log(f"{lost} rollouts lost after the checkpoint at step {state['step']} will be generated again")


def _state_or_none(path: Path) -> dict[str, Any] | None:
    try:
        return read_state(path)
    except CheckpointError:
        return None


def _lost_before(store: RolloutStore, usage: UsageStore, state: dict[str, Any]) -> list[str]:
    """What of the rows the checkpoint's step read is no longer stored (empty: all of it)."""
    if int(state.get("step", -1)) < 0:
        return ["the checkpoint"]
    out = []
    end = int(state.get("sampler", {}).get("window_end", 0))
    held = store.count_where(f"seq < {end}") if end else 0
    if held < end:
        out.append(f"{end - held} rollouts (seq below {end})")
    if "usage_version" in state:
        had = int(usage.table.to_lance().checkout_version(int(state["usage_version"])).count_rows())
        now = usage.count_before(int(state["learner_steps"]))
        if now < had:
            out.append(f"{had - now} usage records (learner steps below {state['learner_steps']})")
    return out


def open_tracker(cfg: Any, mode: str, paths: RunPaths, store: RolloutStore, usage: UsageStore,
             uri: str, lineage: dict[str, Any]) -> MlflowTracker:
    mlflow_uri = cfg.tracking.mlflow_uri or paths.mlflow_uri
    if mode == "resume":
        run_id = read_run_info(paths.root, paths.run_id).get("mlflow_run_id") or lineage.get("mlflow_run_id")
        if run_id:
            return MlflowTracker.attach(mlflow_uri, run_id)
        if lineage.get("checkpoint") is not None:
            raise CheckpointError(f"{paths.run_dir / RUN_INFO} is missing, so the MLflow run of "
                                  f"{paths.run_id} is unknown; fork the run from a checkpoint instead")
        # stopped before its MLflow run was opened (and with no checkpoint): open it now
    tags = {"replay_pipeline.run_id": paths.run_id, "replay_pipeline.rollout_table": store.table_name,
            "replay_pipeline.usage_table": usage.table_name,
            "replay_pipeline.lancedb_uri": uri, "replay_pipeline.run_dir": str(paths.run_dir)}
    if mode == "fork":
        tags |= {"replay_pipeline.fork_of": lineage["source_run"],
                 "replay_pipeline.fork_step": str(lineage["source_step"]),
                 "replay_pipeline.fork_checkpoint": lineage["source_checkpoint"],
                 "replay_pipeline.fork_mlflow_run_id": str(lineage["source_mlflow_run_id"]),
                 "replay_pipeline.fork_table_tag": lineage["tag"]}
    if cfg.tracking.parent_run_id:
        tags["mlflow.parentRunId"] = str(cfg.tracking.parent_run_id)
    return MlflowTracker(uri=mlflow_uri, experiment=cfg.tracking.experiment,
                         artifact_location=artifact_location(cfg, paths, mlflow_uri),
                         run_name=paths.run_id, tags=tags)


# ---------------------------------------------------------------------------- run.json
def save_run_info(paths: RunPaths, info: dict[str, Any]) -> None:
    path = paths.run_dir / RUN_INFO
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json_dumps(info))
    tmp.replace(path)


def write_run_info(paths: RunPaths, mode: str, lineage: dict[str, Any], tracker: Any, store: RolloutStore,
                   usage: UsageStore, start_step: int) -> None:
    """<run_dir>/run.json: the MLflow run this run logs to, its tables, its fork lineage and
    its resumes (each also tagged on the MLflow run)."""
    info = read_run_info(paths.root, paths.run_id)
    info.update({"run_id": paths.run_id, "mlflow_run_id": tracker.run_id,
                 "mlflow_uri": tracker.uri, "rollout_table": store.table_name,
                 "usage_table": usage.table_name, "lancedb_uri": str(store.uri)})
    if mode == "fork":
        info["fork"] = {k: lineage[k] for k in ("source_run", "source_step", "source_checkpoint",
                                                 "source_mlflow_run_id")}
    if mode == "resume":
        info.setdefault("resumes", []).append(
            {"from_step": start_step, "at": datetime.now(timezone.utc).isoformat(),
             "checkpoint": lineage.get("checkpoint")})
        tracker.set_tags({"replay_pipeline.resumes": str(len(info["resumes"])),
                          f"replay_pipeline.resume_{len(info['resumes'])}_from_step": str(start_step)})
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    info.setdefault("created_at", now)
    info["last_started_at"] = now
    if info.get("prefect_flow_runs"):
        tracker.set_tags({"prefect.flow_run_id": info["prefect_flow_runs"][-1]})
    save_run_info(paths, info)


def note_flow_run(paths: RunPaths, flow_run_id: str) -> list[str]:
    """Add an orchestrator (Prefect) flow run id to run.json (before the run is built, so a
    run killed in its warm start is known too; write_run_info tags the MLflow run with it);
    returns the ones before it."""
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    info = read_run_info(paths.root, paths.run_id)
    previous = list(info.get("prefect_flow_runs", []))
    info["prefect_flow_runs"] = previous + [flow_run_id]
    save_run_info(paths, info)
    return previous


def note_end(paths: RunPaths, status: str, steps_done: int, accuracy: float | None) -> None:
    """How the process that drove the run ended, in run.json (what `flows.query runs` shows)."""
    info = read_run_info(paths.root, paths.run_id)
    info.update({"status": status, "ended_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "steps_done": int(steps_done), "heldout_accuracy": accuracy})
    save_run_info(paths, info)


#: run_status's `status`, from the lease and run.json.
STATUSES = {"running": "a live process holds the run's lease",
            "finished": "ended normally", "killed": "stopped by Ctrl-C or SIGTERM (resumable)",
            "failed": "ended with an error", "crashed": "ended without reporting (kill -9, power cut, "
                                                       "OOM): resume it"}


def run_status(root: str | Path, run_id: str) -> dict[str, Any]:
    """A run's state from its directory: status (STATUSES), holder (PID@host since, when
    running), steps_done (from run.json once ended, else through the newest checkpoint: where
    a resume would continue), steps_planned (config.yaml's loop.steps), heldout_accuracy (the
    last evaluation recorded there) and started_at."""
    paths = RunPaths.make(root, run_id)
    try:
        info = read_run_info(paths.root, run_id)
    except ConfigError:
        info = {}
    live = lease_holder(paths.run_dir)
    ended = info.get("status") if info.get("ended_at", "") >= info.get("last_started_at", "") else None
    if live is not None:
        status = "running"
    elif ended in ("FINISHED", "KILLED", "FAILED"):
        status = {"FINISHED": "finished", "KILLED": "killed", "FAILED": "failed"}[ended]
    else:
        status = "crashed"
    steps, accuracy = (info.get("steps_done"), info.get("heldout_accuracy")) if live is None and ended else (None, None)
    if steps is None:
        done = list_checkpoints(paths.checkpoints) if paths.checkpoints.is_dir() else []
        state = {}
        if done:
            try:
                state = read_state(done[-1])
            except CheckpointError:
                state = {}
        steps = int(state.get("step", 0))
        history = state.get("history", {}).get("eval/accuracy") or []
        accuracy = float(history[-1][1]) if history else None
    try:
        planned = int(saved_config(paths.root, run_id)["loop"]["steps"])
    except (ConfigError, KeyError, TypeError, ValueError):
        planned = None
    return {"status": status,
            "holder": f"PID {live['pid']} on {live['host']} since {live['since']}" if live else None,
            "steps_done": steps, "steps_planned": planned, "heldout_accuracy": accuracy,
            "started_at": info.get("created_at")}


# ---------------------------------------------------------------------------- checkpoints
def checkpoint_state(run: Any, tag: str, versions: dict[str, int]) -> dict[str, Any]:
    """A checkpoint's state.json: everything a bit-for-bit resume needs (step, policy version,
    learner steps, the RNG states, the sampler state: the window's end and the per-step seed
    rule, samplers keep no other state), the compute totals, the evaluation history, the table
    tags and versions, the MLflow run id and the config hash."""
    b = run.settings.buffer
    return {
        "run_id": run.run_id, "policy_version": run.policy_version,
        "learner_steps": run.learner.steps, "table_tag": tag,
        "rollout_table": run.store.table_name, "usage_table": run.usage.table_name,
        "table_version": versions[run.store.table_name], "usage_version": versions[run.usage.table_name],
        "lancedb_uri": str(run.store.uri), "mlflow_run_id": run.tracker.run_id,
        "config_hash": run.settings.config_hash, "seed": run.settings.seed,
        "rng": capture_rng(),
        "sampler": {"strategy": b.strategy, "window_end": run.window_end,
                    "capacity": b.capacity, "positive_bias": b.positive_bias,
                    "rng": "numpy default_rng(SeedSequence([seed, step, 2])) per step",
                    "reuse_counts": f"usage table, learner_step < {run.learner.steps}"},
        "compute": dict(run.ledger.totals),
        "history": {k: v for k, v in run.history.items() if k.startswith("eval/")},
        "lineage": run.lineage,
    }


def restore(learner: Any, generator: Any, ledger: ComputeLedger, algo: Any, path: Path,
            state: dict[str, Any], sharded: dict[str, Any] | None = None
            ) -> tuple[int, int, dict[str, list[tuple[int, float]]]]:
    """Load a verified checkpoint's weights, optimizer, RNG states and compute totals into a
    freshly built learner, generator and ledger (with `algo`, the run's own hyper-parameters:
    a fork's may differ, a resume's are the same, over the saved moments). A sharded learner
    (FSDP2) cannot take them alone: its weights and optimizer state go into `sharded` (the
    whole state LearnerRanks.begin then loads into every rank's shards) and the generator loads
    the checkpoint's weights. Returns (step, policy version, evaluation history)."""
    weights, _ = load_pretrained(path / "model")
    optimizer = load_optimizer_state(path)
    for group in optimizer["param_groups"]:
        group.update(lr=algo.lr, betas=(algo.adam_beta1, algo.adam_beta2), weight_decay=algo.weight_decay)
    learner.steps = int(state["learner_steps"])
    policy_version = int(state["policy_version"])
    if learner.sharded:
        sharded.update(model=weights.state_dict(), optimizer=optimizer)
        generator.load_weights(sharded["model"], policy_version)
    else:
        learner.model.load_state_dict(weights.state_dict())
        learner.optimizer.load_state_dict(optimizer)
        generator.load_weights(learner.state_dict(), policy_version)
    restore_rng(state["rng"])
    for key, value in state.get("compute", {}).items():
        if key in ledger.totals:
            ledger.totals[key] = float(value)
    history = {k: [(int(a), float(b)) for a, b in v] for k, v in state.get("history", {}).items()}
    return int(state["step"]), policy_version, history
