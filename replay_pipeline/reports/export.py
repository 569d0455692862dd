"""Curated data sets from runs' rollout tables, each with a manifest that reproduces it.

Kinds (`export(kind=...)`):
* ``sft``: the correct rollouts as (prompt, completion) pairs. Besides `question` (the prompt
  text) and `answer` (the completion) each row has `reference` = "#### <completion>", so the
  file loads back as a task data set: `task=math task.path=FILE task.format=gsm8k
  task.answer_field=reference "task.prompt_template='{question}'"` trains on the rollouts' prompts
  with their correct completions as references (rollouts reused across runs);
* ``preference``: per group (one prompt's samples) whose best and worst rewards differ by at
  least `gap`: `prompt`, `chosen` (the best completion), `rejected` (the worst), their
  rewards, the group id;
* ``rows``: the rows the filters select, the chosen columns.

Filters (all kinds): policy versions and generation steps (inclusive ranges), correctness,
reward bounds, pushed down to Lance as one SQL filter (replay_pipeline/reports/analysis.py
rollout_where). `tag` reads each run's table as of a checkpoint tag; otherwise its current
version, which the manifest records, so the same rows can be read again (`read` at that
version). The manifest (`manifest.json` beside the data) names the kind, runs, table versions
and tags, filters, counts, the output files and when and how it was made.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from replay_pipeline.reports.analysis import rollout_where
from replay_pipeline.reports.viewer import read, tables

KINDS = ("sft", "preference", "rows")
FORMATS = ("jsonl", "parquet")
#: Columns an `sft` or `preference` export reads.
SOURCE = ["seq", "rollout_id", "run_id", "step", "policy_version", "group_id", "sample_index", "prompt",
          "completion", "reward", "correct"]


def _rows(root: str | Path, run_id: str, where: str | None, columns: Sequence[str] | None,
          tag: str | None) -> tuple[pa.Table, int]:
    store, _ = tables(root, run_id)
    version = store.tags()[tag] if tag is not None and tag in store.tags() else store.version
    return read(store, where, list(columns) if columns else None, tag), int(version)


def _sft(rows: pa.Table) -> pa.Table:
    correct = rows.filter(rows.column("correct"))
    completions = correct.column("completion").to_pylist()
    return pa.table({"question": correct.column("prompt"), "answer": correct.column("completion"),
                     "reference": [f"#### {c.strip()}" for c in completions], "reward": correct.column("reward"),
                     "run_id": correct.column("run_id"), "rollout_id": correct.column("rollout_id"),
                     "policy_version": correct.column("policy_version")})


def _preference(rows: pa.Table, gap: float) -> pa.Table:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows.to_pylist():
        groups.setdefault(r["group_id"], []).append(r)
    out = []
    for group_id, members in sorted(groups.items()):
        best = max(members, key=lambda m: (m["reward"], -m["sample_index"]))
        worst = min(members, key=lambda m: (m["reward"], m["sample_index"]))
        if best["reward"] - worst["reward"] >= gap:
            out.append({"prompt": best["prompt"], "chosen": best["completion"], "rejected": worst["completion"],
                        "chosen_reward": best["reward"], "rejected_reward": worst["reward"], "group_id": group_id,
                        "run_id": best["run_id"], "chosen_id": best["rollout_id"], "rejected_id": worst["rollout_id"]})
    return pa.Table.from_pylist(out) if out else pa.table({k: pa.array([], pa.string()) for k in (
        "prompt", "chosen", "rejected", "group_id", "run_id", "chosen_id", "rejected_id")})


def _write(table: pa.Table, path: Path, fmt: str) -> None:
    if fmt == "parquet":
        pq.write_table(table, path)
        return
    with path.open("w", encoding="utf-8") as out:
        for row in table.to_pylist():
            out.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")


def export(root: str | Path, run_ids: Sequence[str], out_dir: str | Path, *, kind: str = "sft", fmt: str = "jsonl",
           versions: tuple[int | None, int | None] | None = None, steps: tuple[int | None, int | None] | None = None,
           correct: bool | None = None, reward_min: float | None = None, reward_max: float | None = None,
           gap: float = 1.0, columns: Sequence[str] | None = None, tag: str | None = None,
           command: str | None = None) -> dict[str, Any]:
    """Write `<out_dir>/<kind>.<fmt>` and `<out_dir>/manifest.json` from the runs' tables; the
    manifest. ValueError for a bad kind, format or filter (before anything is written)."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {list(KINDS)}")
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {list(FORMATS)}")
    if not run_ids:
        raise ValueError("name at least one run to export from")
    if kind == "sft" and correct is False:
        raise ValueError("an sft export holds correct rollouts; drop correct=False or use kind=rows")
    where = rollout_where(versions, steps, reward_min, reward_max, True if kind == "sft" else correct)
    parts, sources = [], []
    for run_id in run_ids:
        rows, version = _rows(root, run_id, where, columns if kind == "rows" else SOURCE, tag)
        sources.append({"run_id": run_id, "table": f"rollouts_{run_id}", "version": version, "tag": tag,
                        "rows_selected": rows.num_rows})
        parts.append(rows)
    rows = pa.concat_tables(parts, promote_options="default") if len(parts) > 1 else parts[0]
    data = _sft(rows) if kind == "sft" else _preference(rows, gap) if kind == "preference" else rows
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{kind}.{fmt}"
    _write(data, path, fmt)
    manifest = {"kind": kind, "format": fmt, "file": path.name, "rows": data.num_rows, "sources": sources,
                "filters": {"versions": versions, "steps": steps, "correct": correct, "reward_min": reward_min,
                            "reward_max": reward_max, "sql": where},
                "gap": gap if kind == "preference" else None, "columns": list(data.column_names),
                "root": str(Path(root).expanduser().resolve()), "created_at": datetime.now(timezone.utc).isoformat(),
                "command": command}
    if kind == "sft":
        manifest["load_as_task"] = (f"task=math task.path={path} task.format=gsm8k task.answer_field=reference "
                                    "\"task.prompt_template='{question}'\"")  # quoted: braces are Hydra grammar
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
