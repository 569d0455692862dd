"""What the rollout viewer (flows/view.py) reads: runs under a root, a run's per-step series,
a step's groups, one rollout with its uses, a filtered page of rollouts, all from the run's
LanceDB tables (and its MLflow store for held-out accuracy and the learner's loss), as plain
Python data, and the geometry of the charts that show them.

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
* **Numbers here, markup in templates.** Everything a page shows is computed here as plain data
  (the per-step series, the paged step table, reuse counts, and each chart's geometry: its ticks,
  their labels and every point's position and hover text), so it is tested without a browser
  (tests/integration/test_viewer_data.py); flows/view.py only renders the Jinja2 templates in
  templates/ with it.
* **Charts are SVG drawn on the server, not a chart library.** A chart is an inline `<svg>` from
  templates/macros.html over `chart()`'s geometry: axes, ticks at round values (`nice_ticks`: 1, 2
  or 5 times a power of ten), axis labels, a legend when several series share a chart, and one
  point per value carrying an SVG `<title>` (the browser shows it on hover; CSS enlarges the
  point) and a link to its step. Why not a JavaScript chart library served from an installed
  package: none is in the dependency tree (one more to pin, vendor and keep), the pages would
  need script to show anything, so what a page shows could no longer be read from its HTML by
  the tests or `curl`, and the charts a run needs are few and simple (lines against step). Why
  not matplotlib's SVG (a dependency already, for the sweep report): importing it costs about a
  second, and its SVG has no per-point hover text or links. The cost of our own: no zoom or
  pan, and a point a step in each series (about 150 bytes each): a 500-step run's page is about
  half a megabyte, served from this machine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from replay_pipeline.reports.analysis import rollout_where
from replay_pipeline.buffer import RolloutStore
from replay_pipeline.buffer.lance_table import DamagedTable, StoreError, read_rows, sql_str
from replay_pipeline.buffer.usage import UsageStore
from replay_pipeline.run.lineage import read_run_info, run_status
from replay_pipeline.system.runs import RunPaths, list_runs

#: Rollouts on one page of a filtered listing.
PAGE = 50
#: Steps on one page of a run page's step table.
STEPS_PAGE = 50
#: The MLflow metrics a run page charts: held-out accuracy and the learner's loss, by step.
ACCURACY, LOSS = "eval/accuracy", "learn/loss"
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
    """A run's per-step figures.

    Per generation step (`steps`, from the rollout table): `counts` (rollouts), mean `reward`,
    fraction `correct`. Per step of use (`use_steps`, from the usage table's `step`, the
    generation step during which the learner used them): `uses` (usage records), mean and
    most `staleness` (`staleness`, `staleness_max`: learner version minus rollout version),
    and through that step the mean uses per used rollout (`reuse`: uses so far over the
    rollouts used so far) and the most uses of one rollout (`reuse_max`). From the run's MLflow
    store, (step, value) pairs: held-out `accuracy` and the learner's `loss` ([] without one)."""
    store, usage = tables(root, run_id)
    rows = read(store, None, ["step", "reward", "correct"], tag)
    by = rows.group_by("step").aggregate([("reward", "mean"), ("correct", "mean"), ("step", "count")]).sort_by("step")
    out: dict[str, Any] = {"steps": by["step"].to_pylist(), "counts": by["step_count"].to_pylist(),
                           "reward": by["reward_mean"].to_pylist(),
                           "correct": [float(v) for v in by["correct_mean"].to_pylist()],
                           "rollouts": int(rows.num_rows), "version": store.version if tag is None else store.tags()[tag],
                           "use_steps": [], "uses": [], "staleness": [], "staleness_max": [], "reuse": [],
                           "reuse_max": [], "usage_records": 0}
    if usage is not None:
        used = read(usage, None, ["step", "staleness", "rollout_seq"], tag)
        if used.num_rows:
            out.update(_use_series(used))
        out["usage_records"] = int(used.num_rows)
    history = _mlflow_history(root, run_id, (ACCURACY, LOSS))
    out["accuracy"], out["loss"] = history[ACCURACY], history[LOSS]
    return out


def _use_series(used: pa.Table) -> dict[str, list]:
    """The usage table's per-step series (see `series`), vectorised over its records."""
    st = used.group_by("step").aggregate([("staleness", "mean"), ("staleness", "max"), ("step", "count")]
                                         ).sort_by("step")
    steps = st["step"].to_numpy()
    record_step = used.column("step").to_numpy()
    record_seq = used.column("rollout_seq").to_numpy()
    at = np.searchsorted(steps, record_step)  # each record's index among the steps of use
    # Mean uses per used rollout through each step: cumulative uses over cumulative distinct
    # rollouts used (each counted from the step of its first use).
    uses = np.cumsum(st["step_count"].to_numpy())
    first = used.group_by("rollout_seq").aggregate([("step", "min")]).column("step_min").to_numpy()
    firsts = np.cumsum(np.bincount(np.searchsorted(steps, first), minlength=len(steps)))
    # Most uses of one rollout through each step: number each rollout's records in step order
    # (1, 2, ...), take the highest number at each step, then the running maximum.
    order = np.lexsort((record_step, record_seq))
    sorted_seq = record_seq[order]
    group_start = np.r_[0, np.flatnonzero(sorted_seq[1:] != sorted_seq[:-1]) + 1]
    running = np.arange(len(order)) - np.repeat(group_start, np.diff(np.r_[group_start, len(order)])) + 1
    nth = np.empty(len(order), dtype=np.int64)
    nth[order] = running
    most = np.zeros(len(steps), dtype=np.int64)
    np.maximum.at(most, at, nth)
    return {"use_steps": steps.tolist(), "uses": st["step_count"].to_pylist(),
            "staleness": st["staleness_mean"].to_pylist(), "staleness_max": st["staleness_max"].to_pylist(),
            "reuse": (uses / np.maximum(firsts, 1)).tolist(), "reuse_max": np.maximum.accumulate(most).tolist()}


def _mlflow_history(root: str | Path, run_id: str, names: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    """Each metric's (step, value) pairs from the run's MLflow store ([] where it has none)."""
    out: dict[str, list[tuple[int, float]]] = {name: [] for name in names}
    info = read_run_info(root, run_id)
    uri, mlflow_run = info.get("mlflow_uri"), info.get("mlflow_run_id")
    if not uri or not mlflow_run:
        return out
    try:
        # start-up cost: mlflow, only for a run page
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        for name in names:
            history = client.get_metric_history(mlflow_run, name)
            out[name] = sorted((int(m.step), float(m.value)) for m in history if math.isfinite(m.value))
    except Exception:  # noqa: BLE001 - an unreachable store: the page shows the tables' series only
        pass
    return out


def step_table(data: dict[str, Any], start: int | None = None, size: int = STEPS_PAGE) -> dict[str, Any]:
    """One page of a run's step table from its `series`: the `size` generation steps from the
    first >= `start` (the first step if None), each with its rollouts, mean reward, fraction
    correct, uses and mean staleness (None where nothing was used at it); past the last step,
    the last page. `prev` and `next`: the first step of the pages before and after (None at
    either end), `first` and `last` those of the first and last pages, `index`: the page's
    first row among `total` steps."""
    steps = data["steps"]
    used = dict(zip(data["use_steps"], zip(data["uses"], data["staleness"])))
    total = len(steps)
    at = 0 if start is None else int(np.searchsorted(steps, start))
    if at >= total:  # past the last step: the last page
        at = ((total - 1) // size) * size if total else 0
    rows = [{"step": s, "rollouts": n, "reward": r, "correct": c, "uses": used.get(s, (0, None))[0],
             "staleness": used.get(s, (0, None))[1]}
            for s, n, r, c in zip(steps[at:at + size], data["counts"][at:at + size], data["reward"][at:at + size],
                                  data["correct"][at:at + size])]
    return {"rows": rows, "index": at, "total": total, "size": size,
            "prev": steps[max(at - size, 0)] if at > 0 else None,
            "next": steps[at + size] if at + size < total else None,
            "first": steps[0] if total else None, "last": steps[((total - 1) // size) * size] if total else None}


def groups(root: str | Path, run_id: str, step: int, tag: str | None = None) -> list[dict[str, Any]]:
    """Generation step `step`'s groups: each member's reward, frozen advantage, correctness and
    `reuse_count` (its records in the usage table, at `tag`'s version if given)."""
    store, usage = tables(root, run_id)
    rows = read(store, f"step = {int(step)}", [*LIGHT, "prompt", "completion"], tag)
    counts = _reuse(usage, rows.column("seq").to_pylist(), tag) if rows.num_rows else {}
    out: dict[str, dict[str, Any]] = {}
    for r in rows.to_pylist():
        r["reuse_count"] = counts.get(r["seq"], 0)
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
         steps: tuple[int | None, int | None] = (None, None), correct: bool | None = None,
         min_reuse: int | None = None, start: int = 0, tag: str | None = None, size: int = PAGE) -> dict[str, Any]:
    """A page of at most `size` rollouts with seq >= `start` that pass the filters (policy
    version and generation step ranges, both inclusive, and correctness pushed down; reuse
    counted from the usage table for the page's candidates, `min_reuse` uses or more), where
    the next page starts (`next`, None on the last) and how many rollouts from `start` pass
    the pushed-down filters (`matching`)."""
    store, usage = tables(root, run_id)
    try:
        chosen = rollout_where(versions if versions != (None, None) else None,
                               steps if steps != (None, None) else None, None, None, correct)
    except ValueError as exc:
        raise ViewError(str(exc)) from exc
    where = [f"seq >= {int(start)}", *([chosen] if chosen else [])]
    clause = " AND ".join(where)
    # The matching seqs first (one light column, the filter pushed down), then their rows a
    # chunk at a time, until the page is full after the reuse filter and one row beyond it is
    # found (the next page's first: without it there is no next page).
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
                if len(found) > size:
                    break
        if len(found) > size:
            break
    nxt = found[size]["seq"] if len(found) > size else None
    return {"rows": found[:size], "next": nxt, "matching": int(len(candidates))}


def _reuse(usage: UsageStore | None, seqs: list[int], tag: str | None) -> dict[int, int]:
    if usage is None or not seqs:
        return {}
    used = read(usage, f"rollout_seq >= {min(seqs)} AND rollout_seq <= {max(seqs)}", ["rollout_seq"], tag)
    values, counts = np.unique(used.column("rollout_seq").to_numpy(), return_counts=True)
    return dict(zip(values.tolist(), counts.tolist()))


#: A chart's width and height in pixels, and its plot area's margins: left for the y ticks and
#: label, bottom for the x ticks and label; the legend, one row a series, goes above the plot.
CHART_SIZE = (400, 250)
MARGIN = {"left": 58, "right": 14, "top": 10, "bottom": 42}
LEGEND_ROW = 16
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
#: A series of at most this many points draws them as dots; a longer one only on hover.
DOTS = 60


def nice_ticks(lo: float, hi: float, count: int = 5, integer: bool = False) -> list[float]:
    """Axis ticks at round values covering lo..hi: a spacing of 1, 2 or 5 times a power of ten
    giving about `count` intervals (whole numbers if `integer`), from the largest multiple of
    it <= lo to the smallest >= hi. A range of one value is widened: 0 to 0..1, v to v +- 10%."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"nice_ticks: the range must be finite, got {lo}..{hi}")
    lo, hi = min(lo, hi), max(lo, hi)
    if lo == hi:
        pad = abs(lo) * 0.1
        lo, hi = (0.0, 1.0) if pad == 0 else (lo - pad, hi + pad)
    raw = (hi - lo) / max(count, 1)
    power = 10.0 ** math.floor(math.log10(raw))
    error = raw / power
    step = power * (10 if error >= math.sqrt(50) else 5 if error >= math.sqrt(10) else 2 if error >= math.sqrt(2) else 1)
    if integer:
        step = max(step, 1.0)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [float(f"{k * step:.12g}") + 0.0 for k in range(first, last + 1)]


def tick_label(value: float, ticks: list[float]) -> str:
    """`value` with as many decimals as the ticks' spacing needs (0.2 apart: one)."""
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    return f"{value + 0.0:.{decimals}f}"  # + 0.0: never "-0.0"


def value_label(value: float) -> str:
    """A value as a point's hover text shows it: four significant digits (0.4375, 1.333, 12)."""
    return f"{value:.4g}"


def chart(key: str, title: str, y_label: str, lines: list[dict[str, Any]], *, x_label: str = "step",
          y_include: tuple[float, ...] = (), size: tuple[int, int] = CHART_SIZE) -> dict[str, Any]:
    """A line chart's geometry, in pixels, for templates/macros.html to draw as SVG.

    `lines`: dicts with `name`, `x` and `y` (equal lengths; None or non-finite values left
    out) and optionally `run` and `linked` (the steps that have a page: a point at one of them
    links to it). `y_include`: values the y axis always covers (0 for counts, 0 and 1 for
    fractions). Returns the ticks of both axes (`value`, `label`, `pos`), the plot box, the
    legend (when there are several lines) and each line's colour, `path` (SVG polyline
    points) and points (`x`, `y`, `px`, `py`, `label`: the hover text, `step`, `link`)."""
    width, height = size
    series = []
    for i, line in enumerate(lines):
        pairs = [(float(x), float(y)) for x, y in zip(line["x"], line["y"])
                 if y is not None and math.isfinite(float(y))]
        series.append({"name": line["name"], "colour": COLOURS[i % len(COLOURS)], "pairs": pairs,
                       "run": line.get("run"), "linked": line.get("linked")})
    out: dict[str, Any] = {"key": key, "title": title, "x_label": x_label, "y_label": y_label, "width": width,
                           "height": height, "legend": len(series) > 1, "empty": not any(s["pairs"] for s in series)}
    top = MARGIN["top"] + (LEGEND_ROW * len(series) + 8 if out["legend"] else 0)
    box = {"x0": MARGIN["left"], "x1": width - MARGIN["right"], "y0": top, "y1": height - MARGIN["bottom"]}
    out["box"] = box
    out["legend_rows"] = [{"name": s["name"] + ("" if s["pairs"] else " (no data)"), "colour": s["colour"],
                           "y": MARGIN["top"] + LEGEND_ROW * i + LEGEND_ROW // 2} for i, s in enumerate(series)]
    if out["empty"]:
        out.update(x_ticks=[], y_ticks=[], lines=[])
        return out
    xs = [x for s in series for x, _ in s["pairs"]]
    ys = [y for s in series for _, y in s["pairs"]] + list(y_include)
    xt = nice_ticks(min(xs), max(xs), count=6, integer=True)
    yt = nice_ticks(min(ys), max(ys), count=4)

    def px(x: float) -> float:
        return round(box["x0"] + (x - xt[0]) / (xt[-1] - xt[0]) * (box["x1"] - box["x0"]), 1)

    def py(y: float) -> float:
        return round(box["y1"] - (y - yt[0]) / (yt[-1] - yt[0]) * (box["y1"] - box["y0"]), 1)

    out["x_ticks"] = [{"value": v, "label": tick_label(v, xt), "pos": px(v)} for v in xt]
    out["y_ticks"] = [{"value": v, "label": tick_label(v, yt), "pos": py(v)} for v in yt]
    out["lines"] = []
    for s in series:
        linked = s["linked"]
        points = [{"x": x, "y": y, "px": px(x), "py": py(y), "step": int(x),
                   "label": f"{s['name']}: {value_label(y)} at step {x:g}",
                   "link": s["run"] is not None and (linked is None or int(x) in linked)} for x, y in s["pairs"]]
        out["lines"].append({"name": s["name"], "colour": s["colour"], "run": s["run"], "points": points,
                             "dots": len(points) <= DOTS,
                             "path": " ".join(f"{p['px']},{p['py']}" for p in points)})
    return out


def run_charts(data: dict[str, Any], run_id: str) -> list[dict[str, Any]]:
    """A run page's charts from its `series`: accuracy (held-out and the rollouts'), mean
    reward, the learner's loss, staleness (mean and most) and reuse (mean and most)."""
    linked = set(data["steps"])

    def line(name: str, x: list, y: list) -> dict[str, Any]:
        return {"name": name, "x": x, "y": y, "run": run_id, "linked": linked}

    acc, loss = data["accuracy"], data["loss"]
    return [
        chart("accuracy", "accuracy by step", "fraction correct",
              [line("held-out (greedy)", [s for s, _ in acc], [v for _, v in acc]),
               line("the step's rollouts", data["steps"], data["correct"])], y_include=(0.0, 1.0)),
        chart("reward", "mean reward of the step's rollouts", "reward",
              [line("mean reward", data["steps"], data["reward"])], y_include=(0.0,)),
        chart("loss", "learner loss by step", "loss", [line("loss", [s for s, _ in loss], [v for _, v in loss])]),
        chart("staleness", "staleness of the rollouts used at each step", "policy versions behind",
              [line("mean", data["use_steps"], data["staleness"]),
               line("most", data["use_steps"], data["staleness_max"])], y_include=(0.0,)),
        chart("reuse", "uses per rollout, through each step", "uses",
              [line("mean, of the rollouts used so far", data["use_steps"], data["reuse"]),
               line("most, of one rollout", data["use_steps"], data["reuse_max"])], y_include=(0.0,)),
    ]


def compare_charts(runs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The compare page's charts: each run's main series of each run-page chart, one line a run."""
    def lines(xkey: str | None, ykey: str) -> list[dict[str, Any]]:
        out = []
        for run_id, data in runs:
            pairs = data[ykey] if xkey is None else list(zip(data[xkey], data[ykey]))
            out.append({"name": run_id, "x": [s for s, _ in pairs], "y": [v for _, v in pairs], "run": run_id,
                        "linked": set(data["steps"])})
        return out

    return [chart("accuracy", "held-out accuracy by step", "fraction correct", lines(None, "accuracy"),
                  y_include=(0.0, 1.0)),
            chart("reward", "mean reward of the step's rollouts", "reward", lines("steps", "reward"), y_include=(0.0,)),
            chart("loss", "learner loss by step", "loss", lines(None, "loss")),
            chart("staleness", "mean staleness of the rollouts used", "policy versions behind",
                  lines("use_steps", "staleness"), y_include=(0.0,)),
            chart("reuse", "mean uses per used rollout, through each step", "uses", lines("use_steps", "reuse"),
                  y_include=(0.0,))]


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
