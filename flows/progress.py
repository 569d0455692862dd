"""What the person at the terminal sees: a progress bar with live reward and accuracy, and
a closing summary that says where everything went."""

from __future__ import annotations

import logging
import sys
from typing import Any


#: `extra` of a log call whose line is for the Prefect UI only (the terminal prints its own).
UI_ONLY = {"replay_pipeline_ui_only": True}


class _TaskInfoOffTheConsole(logging.Filter):
    """Drops task runs' INFO lines, and lines logged with `extra=UI_ONLY`, from the console
    only: the Prefect API (the UI) still gets them, since its handlers sit on Prefect's own
    loggers, ahead of the root's console one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "replay_pipeline_ui_only", False):
            return False
        return not (record.name.startswith("prefect.task_runs") and record.levelno < logging.WARNING)


def quiet_prefect_task_logs() -> None:
    """One INFO line per task run would bury the progress bar: the console shows task runs'
    warnings and errors only, while the flow run's logs in the UI keep every line (the warm
    start's progress among them: flows/train.py `_say`)."""
    filter_console(_TaskInfoOffTheConsole)


def filter_console(kind: type[logging.Filter]) -> None:
    """Add a filter of class `kind` to Prefect's console handler (on the root logger), once:
    it shapes what the terminal shows, never what the Prefect API (the UI) receives."""
    for handler in logging.getLogger().handlers:
        if type(handler).__name__ == "PrefectConsoleHandler" and not any(isinstance(f, kind) for f in handler.filters):
            handler.addFilter(kind())


class Progress:
    def __init__(self, run, enabled: bool = True):
        self.run = run
        self.enabled = enabled
        self.bar = None

    def start(self) -> None:
        if not self.enabled:
            return
        # start-up cost: only when the bar is shown
        from tqdm import tqdm

        self.bar = tqdm(total=self.run.settings.loop.steps, initial=self.run.start_step,
                        desc=f"train {self.run.run_id}", unit="step", file=sys.stderr, dynamic_ncols=True)
        self.bar.set_postfix_str(self._postfix())

    def update(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(self._postfix())

    def _postfix(self) -> str:
        r = self.run
        return (f"reward {r.last('score/reward_mean'):.3f} | eval acc {r.last('eval/accuracy'):.3f}"
                f" | clip {r.last('learn/clip_frac'):.3f} | v{r.policy_version}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def summary_text(s: dict[str, Any]) -> str:
    lines = [
        "",
        f"Run {s['run_id']} {s['status'].lower()}: {s['steps_done']} steps, policy version {s['policy_version']}, "
        f"{s['wall_seconds']:.0f} s" + (f" (start-up to the first round {s['startup_seconds']:.1f} s)"
                                        if s.get("startup_seconds") is not None else ""),
        f"  held-out accuracy   {s['accuracy_before']:.3f} before -> {s['accuracy_after']:.3f} after "
        f"(best {s['accuracy_best']:.3f}, {s['heldout_prompts']} prompts, greedy)",
        f"  rollouts            {s['rollouts_stored']} rows in LanceDB table {s['rollout_table']} at {s['lancedb_uri']}",
        f"  MLflow              run {s['mlflow_run_id']} in experiment '{s['experiment']}' at {s['mlflow_uri']}",
        *([f"  MLflow model        {s['mlflow_model_uri']} (mlflow.transformers.load_model or "
             "mlflow.pyfunc.load_model)"] if s.get("mlflow_model_uri") else []),
        f"  checkpoints         {s['checkpoint_dir']}",
        f"  compute             {s['gen_tokens']:.0f} generated tokens, {s['train_tokens']:.0f} trained tokens, "
        f"generation {s['gen_seconds']:.0f} s + training {s['train_seconds']:.0f} s, mu {s['mu']:.2f}",
    ]
    if s.get("mlflow_uri", "").startswith("sqlite:///"):
        # MLflow 3 opens on its GenAI view unless told the workflow (the experiment's tag alone
        # does not switch it): the link says so.
        lines.append(f"  open the MLflow UI: mlflow ui --backend-store-uri {s['mlflow_uri']}, then "
                     f"http://127.0.0.1:5000/#/experiments/{s.get('experiment_id', '0')}/runs/{s['mlflow_run_id']}"
                     f"?workflowType=machine_learning")
    return "\n".join(lines)
