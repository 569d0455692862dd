"""A run's fingerprint: SHA-256 of its rollout rows, usage records, losses and final weights, to
show that a change of code left a run's behaviour as it was.

    python infra/fingerprint.py ROOT RUN_ID [ROOT2 RUN_ID2]

Tables are read as stored (directly, so a table from before a schema change reads too). Rows
are read in `seq` order without `created_at` (a wall-clock time) and without the columns added
to the schema later (ADDED_LATER: `temperature`, `top_p`, hashed apart as `sampling_sha256`, or
null when the table predates them), so runs from before and after such a change compare; the
usage records in `learner_step`, `position` order without `created_at`; the losses are the MLflow history of
`learn/loss` (step, value); the weights are the newest checkpoint's `model/model.safetensors`.
With two runs, prints both and whether each part is identical (exit 1 if any differs).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import lancedb
from mlflow.tracking import MlflowClient

from replay_pipeline.buffer import RolloutStore
from replay_pipeline.buffer.schema import ADDED_LATER
from replay_pipeline.buffer.usage import UsageStore
from replay_pipeline.training.checkpoints import list_checkpoints
from replay_pipeline.system.runs import RunPaths


def _digest(rows: list) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


def fingerprint(root: str, run_id: str) -> dict[str, object]:
    paths = RunPaths.make(root, run_id)
    db = lancedb.connect(str(paths.lancedb))
    table = db.open_table(RolloutStore.table_name_for(run_id)).to_arrow().sort_by("seq")
    later = [c for c in ADDED_LATER if c in table.schema.names]
    sampling = _digest(table.select(later).to_pylist()) if later else None
    rollouts = table.drop_columns(["created_at", *later]).to_pylist()
    usage = db.open_table(UsageStore.table_name_for(run_id)).to_arrow().drop_columns(["created_at"])
    usage = usage.sort_by([("learner_step", "ascending"), ("position", "ascending")]).to_pylist()
    info = json.loads((paths.run_dir / "run.json").read_text())
    client = MlflowClient(tracking_uri=info["mlflow_uri"])
    losses = [(m.step, m.value) for m in sorted(client.get_metric_history(info["mlflow_run_id"], "learn/loss"),
                                                 key=lambda m: m.step)]
    final = list_checkpoints(paths.checkpoints)[-1] / "model" / "model.safetensors"
    return {"rollouts": len(rollouts), "rollouts_sha256": _digest(rollouts), "sampling_sha256": sampling,
            "usage": len(usage),
            "usage_sha256": _digest(usage), "losses": len(losses), "losses_sha256": _digest(losses),
            "final_checkpoint": final.parent.parent.name,
            "weights_sha256": hashlib.sha256(final.read_bytes()).hexdigest()}


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 4):
        print(__doc__, file=sys.stderr)
        return 2
    runs = [fingerprint(argv[i], argv[i + 1]) for i in range(0, len(argv), 2)]
    for (root, run_id), fp in zip(zip(argv[::2], argv[1::2]), runs):
        print(json.dumps({"root": str(Path(root)), "run_id": run_id, **fp}, indent=2))
    if len(runs) == 2:
        same = {k: runs[0][k] == runs[1][k] for k in runs[0] if k != "sampling_sha256" or None not in
                (runs[0][k], runs[1][k])}
        print(json.dumps({"identical": same}, indent=2))
        return 0 if all(same.values()) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
