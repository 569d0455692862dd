"""A run's accounting: the compute ledger's totals as metrics, the pipeline's own overhead,
and the summary printed and logged at the end.

`Accounting` holds the ledger (replay_pipeline/algo/compute.py) and the clocks of this process:
when it started, when its rounds began, the seconds spent in scheduled extras (evaluations,
checkpoints) and waiting for rollouts, and the async generators' cumulative stats. It reads
nothing else of the run; the phases add to the ledger as they spend.

Start-up (`startup/seconds`, logged once at the first round's step): wall seconds from the
operating system's start of this process (its creation time, so the interpreter's own start
and every import count) to the start of its first round, less the starting policy's
evaluation (`startup/eval_seconds`: work the run was asked to do, not a fixed cost). It holds
building the run (configuration, task, model and warm start or cache, tables, MLflow run) and
reaching Prefect's API (the temporary server's start, in the background).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from replay_pipeline.algo.compute import ComputeLedger


def process_started() -> float:
    """This process's creation time (seconds since the epoch), as the operating system keeps it."""
    return psutil.Process().create_time()


@dataclass
class Accounting:
    ledger: ComputeLedger
    async_loop: bool = False
    started: float = field(default_factory=time.perf_counter)
    loop_started: float | None = None
    """perf_counter() when this process began its first round (`start_loop`)."""
    start_eval_seconds: float = 0.0
    """Seconds this process spent evaluating the starting policy before its first round."""
    startup_seconds: float | None = None
    """Process creation to the first round, less `start_eval_seconds` (set by `start_loop`)."""
    scheduled_seconds: float = 0.0
    """Seconds of this process's rounds spent in scheduled extras (evaluation, checkpoints),
    which the overhead figure leaves out."""
    wait_seconds: float = 0.0
    """Async loop: seconds the learner waited for rollouts (or for the replay cap)."""
    workers: dict[str, float] = field(default_factory=dict)
    """Async loop: the generator workers' cumulative stats, read once per round."""
    _loop_base: dict[str, float] = field(default_factory=dict, repr=False)
    """Ledger totals when this process's rounds began (the overhead figure counts from them)."""

    frozen_objects: int = 0
    """Objects frozen at the first round (replay_pipeline/system/heap.py; 0 where none were)."""

    def start_loop(self, frozen_objects: int = 0) -> None:
        self.frozen_objects = frozen_objects
        self.loop_started = time.perf_counter()
        self._loop_base = dict(self.ledger.totals)
        self.startup_seconds = time.time() - process_started() - self.start_eval_seconds

    def startup_metrics(self) -> dict[str, float]:
        """`startup/seconds`, `startup/eval_seconds` and, where the start-up heap was frozen,
        `startup/frozen_objects` (empty before `start_loop`)."""
        if self.startup_seconds is None:
            return {}
        frozen = {"startup/frozen_objects": float(self.frozen_objects)} if self.frozen_objects else {}
        return {"startup/seconds": self.startup_seconds, "startup/eval_seconds": self.start_eval_seconds, **frozen}

    def fold_workers(self, totals: dict[str, float]) -> dict[str, float]:
        """Async loop: take the generators' new cumulative stats; returns what they added
        since the previous call (`generate/...`, `score/reward_mean` metrics)."""
        seen, self.workers = self.workers, totals
        new = totals.get("gen_rollouts", 0.0) - seen.get("gen_rollouts", 0.0)
        reward = totals.get("reward_sum", 0.0) - seen.get("reward_sum", 0.0)
        return {"generate/rollouts": new, "generate/batches_total": totals.get("batches", 0.0),
                "score/reward_mean": reward / new if new else float("nan")}

    def compute_metrics(self) -> dict[str, float]:
        """The ledger's `compute/...` metrics, the overhead and the wall clock."""
        if self.async_loop:  # generation happens in the worker processes
            for key in ("gen_tokens", "gen_seconds", "gen_rollouts"):
                self.ledger.totals[key] = self.workers.get(key, 0.0)
        return {**self.ledger.metrics(), **self.overhead_metrics(),
                "compute/wall_seconds": time.perf_counter() - self.started}

    def overhead_metrics(self) -> dict[str, float]:
        """The pipeline's own cost (orchestration, storage, tracking) in this process's rounds.

        Sync: round seconds minus generation and training. Async learner: round seconds
        minus training and waiting for rollouts; each generator's own share is
        other / (generation + other) from its stats. Evaluations and checkpoints are
        scheduled extras, left out of the round seconds."""
        if self.loop_started is None:
            return {}
        t, base = self.ledger.totals, self._loop_base
        rounds = time.perf_counter() - self.loop_started - self.scheduled_seconds
        useful = t["train_seconds"] - base["train_seconds"]
        if not self.async_loop:
            useful += t["gen_seconds"] - base["gen_seconds"]
        else:
            rounds -= self.wait_seconds
        overhead = max(rounds - useful, 0.0)
        out = {"compute/round_seconds": rounds, "compute/overhead_seconds": overhead,
               "compute/overhead_frac": overhead / rounds if rounds > 0 else float("nan")}
        if self.async_loop:
            w = self.workers
            busy = w.get("gen_seconds", 0.0) + w.get("other_seconds", 0.0)
            out["compute/generator_overhead_frac"] = w.get("other_seconds", 0.0) / busy if busy else float("nan")
        return out

    def summary(self, history: dict[str, list[tuple[int, float]]], **run: Any) -> dict[str, Any]:
        """The end-of-run summary: accuracies from the evaluation history, the compute spent,
        and what `run` says of the run (id, status, tables, MLflow run, paths)."""
        evals = history.get("eval/accuracy", [])
        t = self.ledger.totals
        return {
            **run,
            "accuracy_before": evals[0][1] if evals else float("nan"),
            "accuracy_after": evals[-1][1] if evals else float("nan"),
            "accuracy_best": max((v for _, v in evals), default=float("nan")),
            "wall_seconds": time.perf_counter() - self.started,
            "gen_tokens": t["gen_tokens"], "train_tokens": t["train_tokens"],
            "gen_seconds": t["gen_seconds"], "train_seconds": t["train_seconds"], "mu": self.ledger.mu(),
            "startup_seconds": self.startup_seconds,
        }
