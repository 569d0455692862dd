"""One run's plots, from its MLflow metric histories: held-out accuracy against generated
tokens (the project's headline axis) and reward and policy entropy against generation step.
A sweep's report (replay_pipeline/reports/report.py) compares runs; these are logged with every run
(flows/train.py, as the MLflow run's `plots/` artifacts) so a single run's page shows its story.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from replay_pipeline.reports.report import ACCURACY, LEARN_ENTROPY, _figure, eval_table, metric_frame

REWARD = "score/reward_mean"
KEYS = [ACCURACY, "compute/gen_tokens", "compute/gen_rollouts", "compute/train_rollouts",
        "compute/gen_train_seconds", REWARD, LEARN_ENTROPY]


def run_plots(client: Any, mlflow_run_id: str, out_dir: str | Path, title: str = "") -> list[Path]:
    """accuracy_vs_tokens.png and reward_entropy.png of the run under `out_dir` (those it has
    the metrics for); the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    history = metric_frame(client, mlflow_run_id, KEYS)
    written = []
    evals = eval_table(history) if history[ACCURACY].notna().any() else None
    if evals is not None:
        fig, (ax,) = _figure()
        ax.plot(evals["tokens"], evals[ACCURACY], marker="o", markersize=3)
        ax.set(xlabel="generated tokens", ylabel="held-out accuracy (greedy)", title=f"{title} accuracy".strip())
        path = out / "accuracy_vs_tokens.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    steps = history[[REWARD, LEARN_ENTROPY]].dropna(how="all")
    if len(steps):
        fig, (left, right) = _figure(2, width=5.0)
        left.plot(steps.index, steps[REWARD])
        left.set(xlabel="generation step", ylabel=REWARD, title="reward of each step's rollouts")
        right.plot(steps.index, steps[LEARN_ENTROPY], color="tab:orange")
        right.set(xlabel="generation step", ylabel=LEARN_ENTROPY, title="policy entropy on the trained batches")
        path = out / "reward_entropy.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    return written
