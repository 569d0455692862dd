"""What the rollout viewer (flows/view.py) reads: runs under a root, a run's per-step series,
a step's groups, one rollout with its uses, a filtered page of rollouts, all from the run's
LanceDB tables (and its MLflow store for held-out accuracy), as plain Python data.

Decisions:

* **Pushed down, paged.** Every read names its columns and, where it can, a SQL filter Lance
  answers from the table's indexes (`step = s`, `rollout_id = '...'`, `seq >= lo AND seq < hi`,
  the usage table's `rollout_id`); a page of rollouts is a `seq` range of at most `page` rows,
  not a scan. The per-step series read three light columns of every row (once a request).
* **As of a checkpoint.** `tag` (a checkpoint's tag, `step-000100`) reads the tables at the
  version that tag names, so the page shows the buffer a checkpoint saw.
* **Live runs.** Each request opens the tables at their newest version, so a run still being
  written shows what has been committed so far.
* **Errors are data.** A missing or damaged table raises `ViewError` with the message the page
  shows (the damaged file named, replay_pipeline/buffer/lance_table.py), never a traceback.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replay_pipeline.reports.analysis import rollout_where
from replay_pipeline.buffer import RolloutStore
from replay_pipeline.buffer.lance_table import DamagedTable, StoreError, read_rows, sql_str
from replay_pipeline.buffer.usage import UsageStore
from replay_pipeline.run.lineage import read_run_info, run_status
from replay_pipeline.system.runs import RunPaths, list_runs

#: Rollouts on one page of a filtered listing.
PAGE = 50
LIGHT = ["seq", "step", "policy_version", "reward", "correct", "advantage", "rollout_id", "group_id",
         "sample_index", "num_tokens", "reward_error"]


class ViewError(Exception):
    """What a page shows instead of its content (a missing run, a damaged table: `damaged`)."""

    def __init__(self, message: str, damaged: bool = False):
        super().__init__(message)
        self.damaged = damaged


def runs(root: str | Path) -> list[dict[str, Any]]:
    """Every run under `root`: status, steps, held-out accuracy, lineage (fork source, resumes)."""
    out = []
    for run_id in list_runs(root):
        try:
            status = run_status(root, run_id)
            info = read_run_info(root, run_id)
        except Exception as exc:  # noqa: BLE001 - one unreadable run must not hide the others
            out.append({"run_id": run_id, "status": f"unreadable: {exc}"})
            continue
        out.append({"run_id": run_id, "status": status.get("status"), "steps_done": status.get("steps_done"),
                    "steps_planned": status.get("steps_planned"), "accuracy": status.get("heldout_accuracy"),
                    "started_at": status.get("started_at"), "fork_of": info.get("fork_of") or info.get("source_run"),
                    "fork_step": info.get("fork_step") or info.get("source_step"),
                    "resumes": len(info.get("resumes", []))})
    return out


def tables(root: str | Path, run_id: str) -> tuple[RolloutStore, UsageStore | None]:
    paths = RunPaths.make(root, run_id)
    info = read_run_info(root, run_id) if paths.run_dir.is_dir() else {}
    uri = info.get("lancedb_uri") or str(paths.lancedb)
    try:
        store = RolloutStore.open(uri, run_id)
    except (StoreError, ValueError, FileNotFoundError) as exc:
        raise ViewError(f"run {run_id}: its rollout table cannot be opened at {uri}: {exc}") from exc
    try:
        usage = UsageStore.open(uri, run_id)
    except (StoreError, ValueError, FileNotFoundError):
        usage = None
    return store, usage


def read(store: Any, where: str | None, columns: list[str] | None, tag: str | None) -> pa.Table:
    """Rows of the table (at `tag`'s version if given) matching the Lance SQL `where`, only
    `columns`, sorted by seq when it has one; ViewError naming what is wrong."""
    try:
        dataset = store._dataset()
        if tag is not None:
            versions = store.tags()
            if tag not in versions:
                raise ViewError(f"{store.table_name} has no tag {tag!r}; its tags: {sorted(versions) or 'none'}")
            dataset = dataset.checkout_version(versions[tag])
        rows = read_rows(dataset, where, columns, table=store.table_name, run_id=store.run_id, uri=store.uri)
    except StoreError as exc:  # DamagedTable among them: the file and the repair command
        raise ViewError(str(exc), damaged=isinstance(exc, DamagedTable)) from exc
    except (RuntimeError, OSError, ValueError) as exc:
        raise ViewError(f"{store.table_name}: {exc}") from exc
    order = [c for c in ("seq", "learner_step", "position") if c in rows.column_names]
    return rows.sort_by([(c, "ascending") for c in order]) if order else rows


def tags(root: str | Path, run_id: str) -> dict[str, int]:
    store, _ = tables(root, run_id)
    return store.tags()


def series(root: str | Path, run_id: str, tag: str | None = None) -> dict[str, Any]:
    """Per generation step: rollouts, mean reward, fraction correct; per step of use: mean
    staleness and mean reuse so far; held-out accuracy by step from MLflow (when it has it)."""
    store, usage = tables(root, run_id)
    rows = read(store, None, ["step", "reward", "correct"], tag)
    by = rows.group_by("step").aggregate([("reward", "mean"), ("correct", "mean"), ("step", "count")]).sort_by("step")
    out: dict[str, Any] = {"steps": by["step"].to_pylist(), "reward": by["reward_mean"].to_pylist(),
                           "correct": [float(v) for v in by["correct_mean"].to_pylist()],
                           "rollouts": int(rows.num_rows), "version": store.version if tag is None else store.tags()[tag]}
    if usage is not None:
        used = read(usage, None, ["step", "staleness", "rollout_seq"], tag)
        if used.num_rows:
            st = used.group_by("step").aggregate([("staleness", "mean"), ("step", "count")]).sort_by("step")
            out["use_steps"] = st["step"].to_pylist()
            out["staleness"] = st["staleness_mean"].to_pylist()
            # Mean uses per used rollout through each step: cumulative uses over cumulative
            # distinct rollouts used (each counted from the step of its first use), vectorised.
            steps = np.asarray(out["use_steps"], dtype=np.int64)
            uses = np.cumsum(st["step_count"].to_numpy())
            first = used.group_by("rollout_seq").aggregate([("step", "min")]).column("step_min").to_numpy()
            firsts = np.cumsum(np.bincount(np.searchsorted(steps, first), minlength=len(steps)))
            out["reuse"] = (uses / np.maximum(firsts, 1)).tolist()
        out["usage_records"] = int(used.num_rows)
    out["accuracy"] = _heldout(root, run_id)
    return out


def _heldout(root: str | Path, run_id: str) -> list[tuple[int, float]]:
    """Held-out accuracy by step, from the run's MLflow store ([] if it has none)."""
    info = read_run_info(root, run_id)
    uri, mlflow_run = info.get("mlflow_uri"), info.get("mlflow_run_id")
    if not uri or not mlflow_run:
        return []
    try:
        # start-up cost: mlflow, only for a run page
        from mlflow.tracking import MlflowClient

        history = MlflowClient(tracking_uri=uri).get_metric_history(mlflow_run, "eval/accuracy")
    except Exception:  # noqa: BLE001 - an unreachable store: the page shows the tables' series only
        return []
    return sorted((int(m.step), float(m.value)) for m in history if math.isfinite(m.value))


def groups(root: str | Path, run_id: str, step: int, tag: str | None = None) -> list[dict[str, Any]]:
    """Generation step `step`'s groups: each member's reward, frozen advantage, correctness."""
    store, _ = tables(root, run_id)
    rows = read(store, f"step = {int(step)}", [*LIGHT, "prompt", "completion"], tag)
    out: dict[str, dict[str, Any]] = {}
    for r in rows.to_pylist():
        g = out.setdefault(r["group_id"], {"group_id": r["group_id"], "prompt": r["prompt"], "members": []})
        g["members"].append(r)
    for g in out.values():
        g["members"].sort(key=lambda m: m["sample_index"])
        g["mean_reward"] = float(np.mean([m["reward"] for m in g["members"]]))
    return list(out.values())


def rollout(root: str | Path, run_id: str, rollout_id: str, tokenizer: Any = None) -> dict[str, Any]:
    """One rollout: its row, its completion as tokens with behaviour log-probs, and its uses."""
    store, usage = tables(root, run_id)
    rows = read(store, f"rollout_id = {sql_str(rollout_id)}", None, None)
    if rows.num_rows == 0:
        raise ViewError(f"run {run_id} has no rollout {rollout_id!r}")
    row = rows.to_pylist()[0]
    ids, lps = row["completion_ids"] or [], row["behaviour_logprobs"] or []
    texts = [tokenizer.decode([t]) for t in ids] if tokenizer is not None else [str(t) for t in ids]
    row["tokens"] = [{"id": t, "text": x, "logprob": lp, "p": math.exp(lp)} for t, x, lp in zip(ids, texts, lps)]
    uses = read(usage, f"rollout_id = {sql_str(rollout_id)}", ["learner_step", "step", "policy_version", "staleness"],
                 None).to_pylist() if usage is not None else []
    row["uses"] = sorted(uses, key=lambda u: u["learner_step"])
    row["reuse_count"] = len(uses)
    return row


def page(root: str | Path, run_id: str, *, versions: tuple[int | None, int | None] = (None, None),
         correct: bool | None = None, min_reuse: int | None = None, start: int = 0, tag: str | None = None,
         size: int = PAGE) -> dict[str, Any]:
    """A page of at most `size` rollouts with seq >= `start` that pass the filters (policy
    version range, correctness pushed down; reuse counted from the usage table for the page's
    candidates), and where the next page starts."""
    store, usage = tables(root, run_id)
    try:
        chosen = rollout_where(versions if versions != (None, None) else None, None, None, None, correct)
    except ValueError as exc:
        raise ViewError(str(exc)) from exc
    where = [f"seq >= {int(start)}", *([chosen] if chosen else [])]
    clause = " AND ".join(where)
    # The matching seqs first (one light column, the filter pushed down), then their rows a
    # chunk at a time, until the page is full after the reuse filter.
    candidates = np.sort(read(store, clause, ["seq"], tag).column("seq").to_numpy())
    found: list[dict[str, Any]] = []
    chunk = max(4 * size, 256)
    for at in range(0, len(candidates), chunk):
        part = candidates[at:at + chunk]
        rows = read(store, f"{clause} AND seq >= {int(part[0])} AND seq <= {int(part[-1])}", LIGHT, tag)
        counts = _reuse(usage, rows.column("seq").to_pylist(), tag) if rows.num_rows else {}
        for r in rows.to_pylist():
            r["reuse_count"] = counts.get(r["seq"], 0)
            if min_reuse is None or r["reuse_count"] >= min_reuse:
                found.append(r)
                if len(found) == size:
                    break
        if len(found) == size:
            break
    nxt = found[-1]["seq"] + 1 if len(found) == size else None
    return {"rows": found, "next": nxt, "matching": int(len(candidates))}


def _reuse(usage: UsageStore | None, seqs: list[int], tag: str | None) -> dict[int, int]:
    if usage is None or not seqs:
        return {}
    used = read(usage, f"rollout_seq >= {min(seqs)} AND rollout_seq <= {max(seqs)}", ["rollout_seq"], tag)
    values, counts = np.unique(used.column("rollout_seq").to_numpy(), return_counts=True)
    return dict(zip(values.tolist(), counts.tolist()))


def tokenizer_of(root: str | Path, run_id: str) -> Any:
    """The run's tokenizer (its newest checkpoint's model directory), or None."""
    paths = RunPaths.make(root, run_id)
    dirs = sorted(paths.checkpoints.glob("step-*/model"))
    if not dirs:
        return None
    try:
        from replay_pipeline.models.loading import load_tokenizer  # start-up cost: transformers, once a run

        return load_tokenizer(dirs[-1])
    except Exception:  # noqa: BLE001 - token ids are shown instead
        return None


def as_json(data: Any) -> str:
    return json.dumps(data, default=str)
