"""One training run's state and its phases: generate, score, append, sample, learn; evaluate
and checkpoint. replay_pipeline/run/loop.py calls them in order; replay_pipeline/run/build.py
makes the run.

    generate(step) -> score(batch) -> append(table, step) -> sample(step) -> learn(minibatches, step)
    evaluate(step) every loop.eval_every steps, checkpoint(step) every loop.checkpoint_every

Each phase adds what it spent to the ledger (replay_pipeline/run/accounting.py) and returns
its metrics, grouped by phase (`generate/`, `score/`, `buffer/`, `learn/`, `eval/`). Tables are
written only through the door of replay_pipeline/buffer/tables.py, the window is chosen by
replay_pipeline/run/replay.py, checkpoints and run.json are replay_pipeline/run/lineage.py's.
This module must not import the loop, the build, the workers or anything of Prefect.

Resume: rollouts the stopped process appended after its last checkpoint are **kept as buffer
data**: a resumed run that reaches a step whose rollouts are stored reads them back instead
of generating (saving that generation compute), and the idempotent append adds nothing. The
window (`window_end`) and the usage counts (`before=` the current learner step) are read as
they stood at each step, so rows and usage records written "ahead" do not leak into earlier
steps: in the sync loop a resumed run is bit for bit the run that was never stopped.

Policy versions: the warm-start (or loaded) policy is version 0. Each generation step's round
of `updates_per_step` learner steps ends by publishing the new weights to the generator, which
increments the version; so rollouts of step s carry version s and a run of S steps ends at
version S.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from replay_pipeline.system import faults, stopping
from replay_pipeline.buffer import RolloutStore
from replay_pipeline.buffer.tables import RunTables
from replay_pipeline.buffer.usage import UsageStore
from replay_pipeline.training.checkpoints import checkpoint_name, checkpoint_step, list_checkpoints, save_checkpoint
from replay_pipeline.algo.compute import ComputeLedger
from replay_pipeline.training.evaluation import default_ks, evaluate_greedy, evaluate_pass1, evaluate_sampled
from replay_pipeline.training.learner import Learner
from replay_pipeline.models.loading import load_pretrained
from replay_pipeline.algo.reuse import apply_updates
from replay_pipeline.run.accounting import Accounting
from replay_pipeline.run.batches import (SEED_EVAL, GeneratedBatch, generate_batch, score_batch, step_prompts,
                                         step_seed, stored_batch, usage_table)
from replay_pipeline.run.files import AsyncDir
from replay_pipeline.run.lineage import checkpoint_state, json_dumps, note_end
from replay_pipeline.run.ranks import LearnerRanks
from replay_pipeline.run.replay import ReplaySampler
from replay_pipeline.run.settings import Settings
from replay_pipeline.system.runs import RunPaths
from replay_pipeline.tasks.base import Prompt
from replay_pipeline.training.weights import WeightStore


@dataclass
class TrainingRun:
    settings: Settings
    paths: RunPaths
    task: Any
    tokenizer: Any
    generator: Any
    learner: Learner
    tables: RunTables
    sampler: ReplaySampler
    tracker: Any
    accounting: Accounting
    heldout: list[Prompt]
    policy_info: dict[str, Any]
    lineage: dict[str, Any] = field(default_factory=dict)
    """How this process started: {"mode": "new" | "resume" | "fork", ...}."""
    policy_version: int = 0
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    start_step: int = 0
    """The first generation step this process runs (> 0 after a resume or fork)."""
    stored_through: int = -1
    """Newest generation step whose rollouts were already stored when this process started."""
    window_end: int = 0
    """One past the newest ``seq`` the buffer holds as of the current step."""
    weights: WeightStore | None = None
    """Async loop: where each policy version is published for the generator processes."""
    control: AsyncDir | None = None
    """Async loop: the STOP flag and the generator workers' stats."""
    lease: Any = None
    """The run lease this process holds (replay_pipeline/system/lease.py), given back by `finish`."""
    last_stop_reason: str | None = None
    """Adaptive reuse: why the last round stopped taking updates ("cap": it took every one drawn)."""
    reward_terms: list[Any] = field(default_factory=list)
    """The weighted reward terms added to the verifier in training (reward.terms; scoring.RewardTerm)."""
    ranks: LearnerRanks | None = None
    """learner.world_size > 1: the other data-parallel ranks (run/ranks.py), given each round
    (learner.shard=fsdp2: also asked for the whole state, run/handover.py)."""

    @property
    def run_id(self) -> str:
        return self.paths.run_id

    @property
    def store(self) -> RolloutStore:
        return self.tables.store

    @property
    def usage(self) -> UsageStore:
        return self.tables.usage

    @property
    def cache(self):
        return self.tables.cache

    @property
    def ledger(self) -> ComputeLedger:
        return self.accounting.ledger

    # ------------------------------------------------------------------ phases
    def generate(self, step: int) -> GeneratedBatch:
        """Sample G completions for each of this step's prompts with the published policy."""
        if step <= self.stored_through:
            prompts, seed = step_prompts(self.task, self.settings, step)
            stored = stored_batch(self.store, self.run_id, self.settings, step, seed, prompts)
            if stored is not None:
                return stored
        return generate_batch(self.task, self.generator, self.settings, step)

    def score(self, batch: GeneratedBatch) -> tuple[pa.Table, dict[str, float]]:
        """Reward every completion with the task's verifier, freeze group advantages, and
        lay the rollouts out as rows of the rollout table.

        A reward that raises or is not finite scores 0.0 and is flagged (scoring.safe_reward):
        the reason goes to the row's `reward_error` (null otherwise), the count to
        `score/flagged`, and one warning per step to the `replay_pipeline.algo.scoring` logger."""
        table, metrics = score_batch(self.task, batch, self.run_id, self.settings.loop.group_size,
                                     max_flagged_fraction=self.settings.reward.max_flagged_fraction,
                                     terms=self.reward_terms, verifier_weight=self.settings.reward.verifier_weight)
        tokens = float(metrics["generate/tokens"])
        if batch.reused:  # generated (and paid for) by the stopped process: counted, its seconds unknown here
            self.ledger.add(gen_tokens=tokens, gen_rollouts=table.num_rows, gen_untimed_rollouts=table.num_rows)
        else:
            # The verifier's time counts as generation, as in the paper's cost model (laying
            # the rows out for storage does not: that is the pipeline's own cost).
            self.ledger.add(gen_tokens=tokens, gen_seconds=batch.seconds + metrics["score/reward_seconds"],
                            gen_rollouts=table.num_rows)
            self.ledger.add(other_seconds=metrics["score/seconds"] - metrics["score/reward_seconds"])
        return table, metrics

    def append(self, table: pa.Table, step: int) -> dict[str, float]:
        """Persist the scored rollouts (replay_pipeline/buffer/tables.py): a fresh step's rows
        are validated and numbered here and committed behind the learner (their compaction,
        when due, too: learn() reports it); a step a stopped process may have stored already
        (a resume's replayed steps) goes through the idempotent append at once."""
        start = time.perf_counter()
        fresh = step > self.stored_through
        if fresh:
            # The sync loop is the table's only writer: its rows are numbered from the count it
            # tracks (window_end); the writer thread checks that count before committing.
            stored = self.tables.append_fresh(table, step, count=self.window_end if self.control is None else None)
            if stored is not None:
                self.window_end = int(stored.column("seq")[-1].as_py()) + 1
        else:
            stored = self.tables.append_replayed(table, step)
            # The buffer as of this step: everything, unless rows of later steps are stored already.
            self.window_end = self.store.seq_end(step) if step < self.stored_through else self.store.count()
        seconds = time.perf_counter() - start
        out = {"buffer/appended": float(0 if stored is None else stored.num_rows),
               "buffer/total_rows": float(self.window_end), "buffer/append_seconds": seconds}
        if not fresh:
            out["buffer/compact_seconds"] = self.tables.compact_if_due(step)
        self.ledger.add(other_seconds=seconds + out.get("buffer/compact_seconds", 0.0))
        return out

    def sample(self, step: int) -> tuple[list[dict[str, list]], dict[str, float]]:
        """This round's minibatches from the window (replay_pipeline/run/replay.py)."""
        minibatches, metrics = self.sampler.sample(step, self.learner.steps, self.policy_version, self.window_end)
        self.ledger.add(other_seconds=metrics["buffer/sample_seconds"])
        return minibatches, metrics | {"buffer/replay_ratio_target": self.settings.replay_ratio}

    def learn(self, minibatches: list[dict[str, list]], step: int) -> dict[str, float]:
        """One learner step per minibatch, then publish the weights (version + 1), then a
        durable record of the rollouts each step used. (Publishing first: its copy of the
        weights then does not compete with the usage records' commit on the writer thread.)"""
        start = time.perf_counter()
        first_learner_step = self.learner.steps
        updates = apply_updates if self.ranks is None else self.ranks.round  # all ranks apply them
        per_step, refused = updates(self.learner, minibatches, self.settings.reuse_policy)
        minibatches = minibatches[:len(per_step)]  # the applied ones: their rollouts were used
        train_seconds = time.perf_counter() - start
        publish_start = time.perf_counter()
        trained = self.policy_version  # the version these learner steps started from
        self.policy_version += 1
        whole = self.ranks.gather(self.learner)[0] if self.learner.sharded else None  # FSDP2: onto rank 0
        if self.generator.shares_weights:  # the optimizer's in-place update is already there
            self.generator.policy_version = self.policy_version
        else:
            self.generator.load_weights(self.learner.state_dict() if whole is None else whole, self.policy_version)
        if self.weights is not None and whole is not None:  # async: to the generator processes (off-thread)
            self.weights.publish_in_background(whole, self.policy_version)  # (a copy already)
        elif self.weights is not None:
            self.weights.publish_copy_in_background(self.learner.model.state_dict(), self.policy_version)
        publish_seconds = time.perf_counter() - publish_start
        record_start = time.perf_counter()
        compacted = self.tables.wait_in_flight()  # the rollouts these records name are stored first
        used = usage_table(self.run_id, step, first_learner_step, trained, minibatches)
        metrics = self.sampler.usage_metrics(used, self.window_end) if used.num_rows else {}
        record_seconds = time.perf_counter() - record_start
        if per_step:
            metrics |= {f"learn/{k}": float(np.mean([m[k] for m in per_step])) for k in per_step[0]}
            metrics["learn/ratio_max"] = float(max(m["ratio_max"] for m in per_step))
            metrics["learn/tokens"] = float(sum(m["tokens"] for m in per_step))
            versions = np.concatenate([np.asarray(mb["policy_version"]) for mb in minibatches])
            metrics["learn/staleness_mean"] = float(np.mean(self.policy_version - 1 - versions))
        metrics.update({
            "learn/seconds": train_seconds, "learn/publish_seconds": publish_seconds,
            "learn/policy_version": float(self.policy_version),
            "learn/learner_steps": float(self.learner.steps),
            "buffer/record_seconds": record_seconds,
        })
        if compacted is not None:
            metrics["buffer/compact_seconds"] = float(compacted)
        metrics.pop("learn/applied", None)
        if self.settings.reuse_policy.adaptive:
            metrics["reuse/updates"] = float(len(per_step))
            metrics["reuse/stopped_by_rule"] = float(refused is not None)
            metrics["reuse/refused_tokens"] = refused["tokens"] if refused is not None else 0.0
            self.last_stop_reason = self.learner.refused if refused is not None else "cap"
        # A refused update's forward and backward pass was computed too: training compute.
        extra = refused["tokens"] if refused is not None else 0.0
        self.ledger.add(train_tokens=metrics.get("learn/tokens", 0.0) + extra, train_seconds=train_seconds,
                        train_rollouts=sum(len(mb["rollout_id"]) for mb in minibatches),
                        other_seconds=publish_seconds + record_seconds)
        return metrics

    def wait_for_rollouts(self, alive: Callable[[], bool], timeout: float = 600.0) -> float:
        """Async loop: block until the table holds a minibatch and a round of K learner steps
        stays within loop.replay_cap; returns the seconds waited. Raises if the generators
        have all stopped, or if no rollout arrives for `timeout` seconds."""
        loop = self.settings.loop
        need = self.settings.updates_drawn * loop.minibatch_size
        start = last_change = time.perf_counter()
        self.tables.wait()  # the previous round's usage records count towards the cap
        last_rows = -1
        mirror = self.cache if self.cache is not None and self.cache.rows is not None else None
        while True:
            rows = self.cache.stored() if self.cache is not None else self.store.count()
            if rows >= loop.minibatch_size and (loop.replay_cap is None or (
                    (mirror.total if mirror is not None else self.usage.count()) + need) / rows <= loop.replay_cap):
                break
            now = time.perf_counter()
            if rows != last_rows:
                last_rows, last_change = rows, now
            if not alive():
                raise RuntimeError(f"every generator worker of {self.run_id} has stopped; their output is "
                                   f"above, their stats in {self.control.path if self.control else '?'}")
            if now - last_change > timeout:
                raise RuntimeError(f"no new rollout for {timeout:.0f} s; the generators are stuck")
            stopping.check("the wait for rollouts")
            time.sleep(0.01)
        self.window_end = rows
        waited = time.perf_counter() - start
        self.accounting.wait_seconds += waited
        return waited

    def generators_report(self) -> dict[str, float]:
        """Async loop: what the generator processes added since the previous round, from their
        stats (read once per round)."""
        return self.accounting.fold_workers(self.control.totals(self.settings.loop.workers))

    def evaluate(self, step: int, sampled: bool = False) -> dict[str, float]:
        """Greedy held-out accuracy; with `sampled`, also the paper's pass@1 (temperature
        0.1, top-p 0.95, loop.pass1_samples a prompt), pass@k at temperature 1 and top-p
        loop.eval_top_p, and the sampled entropy and length."""
        start = time.perf_counter()
        metrics = evaluate_greedy(self.generator, self.task, self.heldout, seed=self.settings.seed)
        faults.crash_point("evaluate", step)
        if sampled:
            seed = step_seed(self.settings.seed, self.policy_version, SEED_EVAL)
            loop = self.settings.loop
            metrics |= evaluate_pass1(self.generator, self.task, self.heldout, n=loop.pass1_samples, seed=seed)
            metrics |= evaluate_sampled(self.generator, self.task, self.heldout, n=loop.eval_samples,
                                        ks=default_ks(loop.eval_samples), top_p=loop.eval_top_p, seed=seed)
        tokens = sum(metrics.get(k, 0.0) for k in ("eval/greedy_tokens", "eval/sample_tokens", "eval/pass1_tokens"))
        self.ledger.add(eval_seconds=time.perf_counter() - start, eval_tokens=tokens)
        metrics["eval/policy_version"] = float(self.policy_version)
        return metrics

    def checkpoint(self, step: int) -> Path:
        """Tag the table versions this checkpoint saw, then save model, optimizer and state
        (replay_pipeline/run/lineage.py says what it holds) atomically, then tell MLflow.
        `step` = steps done."""
        self.tables.wait()  # a checkpoint never covers a write still in flight
        tag = checkpoint_name(step)
        versions = {}
        for table in (self.store, self.usage):
            # A tag left by a process that stopped before finishing this checkpoint names the
            # same step's data (the sync loop is deterministic): keep it, never move it.
            if tag not in table.tags():
                table.tag(tag)
            versions[table.table_name] = table.tags()[tag]
        state = checkpoint_state(self, tag, versions)
        self.tracker.flush()  # the metrics of the steps this checkpoint covers are stored first
        if self.weights is not None:
            self.weights.flush()
        whole = self.ranks.gather(self.learner, optimizer=True) if self.learner.sharded else None  # FSDP2
        path = save_checkpoint(self.paths.checkpoints, step, self.learner.model, self.tokenizer,
                               self.learner.optimizer, state, keep=self.settings.loop.keep_checkpoints,
                               before_rename=lambda tmp: faults.crash_point("checkpoint_write", step), whole=whole)
        faults.crash_point("after_checkpoint", step)
        self.tracker.set_tags({"checkpoint.latest": str(path), "checkpoint.latest_step": str(step)})
        # The buffer this checkpoint saw, as the run's dataset input (source: Lance URI and version).
        self.tracker.log_dataset(self.store.table_name, self.store.uri, versions[self.store.table_name], self.window_end)
        self.tracker.log_text(json_dumps({k: v for k, v in state.items() if k != "rng"} | {"step": step, "path": str(path)}),
                              f"checkpoints/{tag}.json")
        return path

    # ------------------------------------------------------------------ bookkeeping
    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.tracker.log_metrics(metrics, step=step)
        for k, v in metrics.items():
            self.history.setdefault(k, []).append((step, float(v)))

    def last(self, key: str, default: float = float("nan")) -> float:
        values = self.history.get(key)
        return values[-1][1] if values else default

    def compute_metrics(self) -> dict[str, float]:
        return self.accounting.compute_metrics()

    def flush_writes(self) -> None:
        """Commit the rounds held (``buffer.commit_seconds``), wait for the write in flight (raising
        its error). Call it before reading ``store``/``usage`` mid-run; checkpoints and the end do."""
        self.tables.wait()

    def summary(self, status: str = "FINISHED") -> dict[str, Any]:
        self.tables.settle(run_id=self.run_id)  # the counts below include the last round's writes
        return self.accounting.summary(
            self.history, run_id=self.run_id, status=status,
            steps_done=int(self.history.get("learn/policy_version", [(0, float(self.start_step))])[-1][1]),
            policy_version=self.policy_version, heldout_prompts=len(self.heldout),
            rollouts_stored=self.store.count(), rollout_table=self.store.table_name,
            lancedb_uri=str(self.store.uri), mlflow_run_id=self.tracker.run_id,
            mlflow_uri=self.tracker.uri or "", experiment=self.settings.tracking.experiment,
            experiment_id=str(getattr(self.tracker, "experiment_id", "") or ""),
            checkpoint_dir=str(self.paths.checkpoints), run_dir=str(self.paths.run_dir),
            policy=self.policy_info)

    def log_final_model(self) -> str | None:
        """The newest checkpoint's policy as the run's MLflow model (tracking.log_model), loaded
        on the CPU; its models:/ URI, or None when there is none or it is not wanted."""
        done = list_checkpoints(self.paths.checkpoints)
        if not done or not self.settings.tracking.log_model:
            return None
        model, tokenizer = load_pretrained(done[-1] / "model")
        return self.tracker.log_model(model, tokenizer, step=checkpoint_step(done[-1]), tags={"run_id": self.run_id},
                                      max_new_tokens=self.settings.generator.max_new_tokens)

    def finish(self, status: str = "FINISHED") -> None:
        """End the run: the mirror and the writer thread (a failed last write turns FINISHED
        into FAILED), the published weights, the MLflow run's `status`; then close the
        generator (a vLLM engine's GPU memory) and the other ranks, and give the run lease back."""
        try:
            if not self.tables.close(run_id=self.run_id) and status == "FINISHED":
                status = "FAILED"
            if self.weights is not None:
                self.weights.flush()
            self.tracker.finish(status)
            accuracy = self.history.get("eval/accuracy") or [(0, None)]
            note_end(self.paths, status, self.policy_version, accuracy[-1][1])
        finally:
            try:
                self.generator.close()
                if self.ranks is not None:
                    self.ranks.close()
            finally:
                if self.lease is not None:
                    self.lease.release()
                    self.lease = None
