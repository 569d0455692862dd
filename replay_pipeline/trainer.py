"""One training run, phase by phase: the library side of flows/train.py.

`TrainingRun.setup(cfg)` builds everything a run needs (task, policy, generator, learner,
rollout table, MLflow run); each phase is one method, so the Prefect flow only wires them:

    generate(step) -> score(step, ...) -> append(table) -> sample(step) -> learn(step, ...)
    evaluate(step) every loop.eval_every steps, checkpoint(step) every loop.checkpoint_every

Determinism: every random draw is seeded from (seed, step, purpose), never from state
carried across steps, so the sync loop is reproducible and a resumed run can redraw the
same numbers from the step alone.

Policy versions: the warm-start (or loaded) policy is version 0. Each generation step's
round of `updates_per_step` learner steps ends by publishing the new weights to the
generator, which increments the version; so rollouts of step s carry version s and a run
of S steps ends at version S.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import torch
from omegaconf import DictConfig, OmegaConf

from replay_pipeline.buffer import RolloutStore
from replay_pipeline.buffer.sampling import SamplingRules, WindowInfo, draw, window_for
from replay_pipeline.buffer.store import META_COLUMNS
from replay_pipeline.buffer.usage import UsageStore, make_usage_id
from replay_pipeline.buffer.schema import make_rollout_id, rows_to_table
from replay_pipeline.checkpoints import checkpoint_name, save_checkpoint
from replay_pipeline.compute import ComputeLedger
from replay_pipeline.config import flatten
from replay_pipeline.evaluation import default_ks, evaluate_greedy, evaluate_pass1, evaluate_sampled
from replay_pipeline.generation import Sample, TransformersGenerator
from replay_pipeline.learner import Learner
from replay_pipeline.models.loading import load_policy
from replay_pipeline.runs import RunPaths, new_run_id
from replay_pipeline.scoring import group_advantages, safe_reward
from replay_pipeline.tasks import task_from_config
from replay_pipeline.tasks.base import Prompt
from replay_pipeline.tracking import MlflowTracker, NullTracker

# Columns the learner needs from a stored rollout (a window read never loads the text).
LEARN_COLUMNS = ["rollout_id", "seq", "policy_version", "step", "prompt_ids", "completion_ids",
                 "behaviour_logprobs", "advantage", "reward", "group_reward_mean"]

# Offsets that separate the purposes of per-step random streams.
_PROMPTS, _SAMPLER, _GENERATE, _EVAL = 1, 2, 3, 4


def step_seed(seed: int, step: int, purpose: int) -> int:
    """A 63-bit seed for one purpose at one step, independent across (seed, step, purpose)."""
    return int(np.random.SeedSequence([seed, step, purpose]).generate_state(1, np.uint64)[0] >> 1)


@dataclass
class GeneratedBatch:
    step: int
    policy_version: int
    seed: int
    prompts: list[Prompt]
    samples: list[list[Sample]]
    seconds: float


@dataclass
class TrainingRun:
    cfg: DictConfig
    paths: RunPaths
    task: Any
    tokenizer: Any
    generator: TransformersGenerator
    learner: Learner
    store: RolloutStore
    usage: UsageStore
    tracker: MlflowTracker | NullTracker
    ledger: ComputeLedger
    heldout: list[Prompt]
    policy_info: dict[str, Any]
    policy_version: int = 0
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    # ------------------------------------------------------------------ setup
    @classmethod
    def setup(cls, cfg: DictConfig, log: Callable[[str], Any] = print,
              tracker: MlflowTracker | NullTracker | None = None) -> "TrainingRun":
        """Build a run from a validated config. Nothing is written before the run directory
        is known to be writable."""
        run_id = cfg.run_id or new_run_id()
        paths = RunPaths.make(cfg.tracking.root_dir, run_id)
        paths.ensure()
        _quiet_transformers()
        if cfg.model.torch_threads:
            torch.set_num_threads(cfg.model.torch_threads)
        torch.manual_seed(cfg.seed)

        task = task_from_config(OmegaConf.to_container(cfg.task, resolve=True))
        model, tokenizer, policy_info = load_policy(cfg, task, paths, log=log)
        gen_cfg = cfg.generator
        generator = TransformersGenerator.from_config(model, tokenizer, gen_cfg)
        a = cfg.algo
        learner = Learner(
            model, objective=a.objective, lr=a.lr,
            objective_params={"eps_low": a.eps_low, "eps_high": a.eps_high, "delta_v": a.delta_v,
                              "tis_cap": a.tis_cap},
            kl_coef=a.kl_coef, loss_agg=a.loss_agg, max_grad_norm=a.max_grad_norm, weight_decay=a.weight_decay,
            betas=(a.adam_beta1, a.adam_beta2), temperature=gen_cfg.temperature,
            pad_id=generator.pad_id)

        uri = cfg.buffer.uri or str(paths.lancedb)
        store = RolloutStore.create(uri, run_id)
        usage = UsageStore.create(uri, run_id)

        resolved = OmegaConf.to_container(cfg, resolve=True)
        resolved["run_id"] = run_id
        (paths.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
        if tracker is None:
            tracker = MlflowTracker(
                uri=cfg.tracking.mlflow_uri or paths.mlflow_uri,
                experiment=cfg.tracking.experiment,
                artifact_location=cfg.tracking.artifact_location or paths.artifact_location,
                run_name=run_id,
                tags={"replay_pipeline.run_id": run_id, "replay_pipeline.rollout_table": store.table_name,
                      "replay_pipeline.usage_table": usage.table_name,
                      "replay_pipeline.lancedb_uri": uri, "replay_pipeline.run_dir": str(paths.run_dir)})
        tracker.log_params({**flatten(resolved), "policy.parameters": learner.num_parameters(),
                            **{f"policy.{k}": v for k, v in policy_info.items()}})
        tracker.log_text(OmegaConf.to_yaml(resolved), "config.yaml")
        tracker.set_tags({"host.python": platform.python_version(), "host.torch": torch.__version__})

        return cls(cfg=cfg, paths=paths, task=task, tokenizer=tokenizer, generator=generator,
                   learner=learner, store=store, usage=usage, tracker=tracker,
                   ledger=ComputeLedger(parameters=learner.num_parameters()),
                   heldout=list(task.heldout_prompts()), policy_info=policy_info)

    @property
    def run_id(self) -> str:
        return self.paths.run_id

    @property
    def rollouts_per_step(self) -> int:
        return self.cfg.loop.prompts_per_step * self.cfg.loop.group_size

    # ------------------------------------------------------------------ phases
    def generate(self, step: int) -> GeneratedBatch:
        """Sample G completions for each of this step's prompts with the published policy."""
        loop = self.cfg.loop
        rng = np.random.default_rng(step_seed(self.cfg.seed, step, _PROMPTS))
        prompts = list(self.task.train_prompts(loop.prompts_per_step, rng))
        seed = step_seed(self.cfg.seed, step, _GENERATE)
        start = time.perf_counter()
        samples = self.generator.generate([p.text for p in prompts], n=loop.group_size, seed=seed)
        seconds = time.perf_counter() - start
        return GeneratedBatch(step, self.generator.policy_version, seed, prompts, samples, seconds)

    def score(self, batch: GeneratedBatch) -> tuple[pa.Table, dict[str, float]]:
        """Reward every completion with the task's verifier, freeze group advantages, and
        lay the rollouts out as rows of the rollout table."""
        start = time.perf_counter()
        rewards, flagged = [], 0
        for prompt, group in zip(batch.prompts, batch.samples):
            for s in group:
                value, ok = safe_reward(lambda: self.task.reward(prompt, s.text, s.finish_reason))
                rewards.append(value)
                flagged += not ok
        g = self.cfg.loop.group_size
        advantages = group_advantages(rewards, g)
        group_means = np.asarray(rewards, dtype=np.float64).reshape(-1, g).mean(axis=1)
        created = datetime.now(timezone.utc)
        rows = []
        i = 0
        for gi, (prompt, group) in enumerate(zip(batch.prompts, batch.samples)):
            group_id = f"{self.run_id}/s{batch.step:06d}/g{gi:04d}"
            for si, s in enumerate(group):
                rows.append({
                    "rollout_id": make_rollout_id(self.run_id, batch.step, gi, si),
                    "run_id": self.run_id, "policy_version": batch.policy_version,
                    "step": batch.step, "prompt_id": prompt.prompt_id, "group_id": group_id,
                    "sample_index": si, "prompt": prompt.text, "completion": s.text,
                    "prompt_ids": s.prompt_ids, "completion_ids": s.completion_ids,
                    "behaviour_logprobs": s.logprobs, "reward": rewards[i],
                    "correct": rewards[i] > 0, "advantage": float(advantages[i]),
                    "group_reward_mean": float(group_means[gi]),
                    "finish_reason": s.finish_reason, "num_tokens": len(s.completion_ids),
                    "seed": batch.seed, "created_at": created,
                })
                i += 1
        table = rows_to_table(rows)
        r = np.asarray(rewards, dtype=np.float64)
        groups = r.reshape(-1, g)
        lengths = np.asarray([len(s.completion_ids) for grp in batch.samples for s in grp])
        metrics = {
            "score/reward_mean": float(r.mean()),
            "score/reward_std": float(r.std()),
            "score/accuracy": float((r > 0).mean()),
            "score/zero_signal_group_frac": float((groups.std(axis=1) == 0).mean()),
            "score/flagged": float(flagged),
            "score/seconds": time.perf_counter() - start,
            "generate/seconds": batch.seconds,
            "generate/rollouts": float(len(r)),
            "generate/tokens": float(lengths.sum()),
            "generate/mean_length": float(lengths.mean()),
            "generate/stop_frac": float(np.mean([s.finish_reason == "stop"
                                                 for grp in batch.samples for s in grp])),
            "generate/tokens_per_second": float(lengths.sum() / max(batch.seconds, 1e-9)),
            "generate/policy_version": float(batch.policy_version),
        }
        self.ledger.add(gen_tokens=lengths.sum(), gen_seconds=batch.seconds, gen_rollouts=len(r))
        return table, metrics

    def append(self, table: pa.Table, step: int) -> dict[str, float]:
        """Persist the scored rollouts (idempotent: a retried append adds nothing), and
        compact the table every buffer.compact_every steps."""
        start = time.perf_counter()
        inserted = self.store.append(table)
        seconds = time.perf_counter() - start
        every = self.cfg.buffer.compact_every
        compact_seconds = 0.0
        if every and (step + 1) % every == 0:
            t0 = time.perf_counter()
            self.store.compact()
            self.usage.compact()
            compact_seconds = time.perf_counter() - t0
        self.ledger.add(other_seconds=seconds + compact_seconds)
        return {"buffer/appended": float(inserted), "buffer/total_rows": float(self.store.count()),
                "buffer/append_seconds": seconds, "buffer/compact_seconds": compact_seconds}

    def sample(self, step: int) -> tuple[list[dict[str, list]], dict[str, float]]:
        """Read the window's light columns and the usage counts, let the strategy choose,
        then read only the chosen rows' token data."""
        start = time.perf_counter()
        b, loop = self.cfg.buffer, self.cfg.loop
        size = window_for(b.strategy, b.capacity, self.rollouts_per_step)
        if b.positive_bias > 0:  # validation keeps it off the fresh baseline
            meta = self.store.positive_bias_window(size, b.positive_bias, columns=list(META_COLUMNS))
        else:
            meta = self.store.window_meta(size)
        seqs = meta.column("seq").to_numpy()
        counts = self.usage.reuse_counts(int(seqs.min()), int(seqs.max())) if len(seqs) else {}
        info = WindowInfo(
            policy_version=meta.column("policy_version").to_numpy(), seq=seqs,
            correct=meta.column("correct").to_numpy(zero_copy_only=False),
            advantage=meta.column("advantage").to_numpy(),
            reuse_count=np.asarray([counts.get(int(q), 0) for q in seqs], dtype=np.int64),
            current_version=self.policy_version)
        rng = np.random.default_rng(step_seed(self.cfg.seed, step, _SAMPLER))
        picks = draw(b.strategy, info, loop.minibatch_size, loop.updates_per_step, rng,
                     sampling_rules(b))
        picks = [p for p in picks if len(p)]  # eligibility ran out: skip, and say so below
        minibatches = []
        if picks:
            rows = self.store.take_seqs(seqs[np.concatenate(picks)], columns=LEARN_COLUMNS)
            offset = 0
            for p in picks:
                minibatches.append(rows.slice(offset, len(p)).to_pydict())
                offset += len(p)
        seconds = time.perf_counter() - start
        self.ledger.add(other_seconds=seconds)
        return minibatches, {
            "buffer/window_rows": float(info.size),
            "buffer/window_correct_frac": float(info.correct.mean()) if info.size else 0.0,
            "buffer/window_staleness_mean": float((self.policy_version - info.policy_version).mean())
            if info.size else 0.0,
            "buffer/replay_ratio_target": loop.updates_per_step * loop.minibatch_size / self.rollouts_per_step,
            "buffer/skipped_updates": float(loop.updates_per_step - len(picks)),
            "buffer/sample_seconds": seconds,
        }

    def learn(self, minibatches: list[dict[str, list]], step: int) -> dict[str, float]:
        """One learner step per minibatch, a durable record of the rollouts each used, then
        publish the weights (version + 1)."""
        start = time.perf_counter()
        first_learner_step = self.learner.steps
        per_step = [self.learner.step(mb) for mb in minibatches]
        train_seconds = time.perf_counter() - start
        record_start = time.perf_counter()
        used = usage_rows(self.run_id, step, first_learner_step, self.policy_version, minibatches)
        metrics = self.usage_metrics(used) if used else {}
        publish_start = time.perf_counter()
        self.policy_version += 1
        self.generator.load_weights(self.learner.state_dict(), self.policy_version)
        publish_seconds = time.perf_counter() - publish_start
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
            "buffer/record_seconds": publish_start - record_start,
        })
        self.ledger.add(train_tokens=metrics.get("learn/tokens", 0.0), train_seconds=train_seconds,
                        train_rollouts=sum(len(mb["rollout_id"]) for mb in minibatches),
                        other_seconds=publish_seconds + publish_start - record_start)
        return metrics

    def usage_metrics(self, used: list[dict[str, Any]]) -> dict[str, float]:
        """Record this round's uses, then derive reuse, staleness and steps-since-last-use
        from the usage table (durable records, not counters kept in memory)."""
        seqs = sorted({u["rollout_seq"] for u in used})
        previous = self.usage.last_use(seqs)  # before this round's records land
        self.usage.record(used)
        since, last = [], dict(previous)
        for u in used:  # rows are in learner-step order
            q = u["rollout_seq"]
            if q in last and last[q] < u["learner_step"]:
                since.append(u["learner_step"] - last[q])
            last[q] = u["learner_step"]
        staleness = np.asarray([u["staleness"] for u in used], dtype=np.float64)
        counts = self.usage.reuse_counts(seqs[0], seqs[-1])
        uses_of_used = np.asarray([counts.get(q, 0) for q in seqs], dtype=np.float64)
        total_uses = self.usage.count()
        return {
            "buffer/staleness_mean": float(staleness.mean()),
            "buffer/staleness_max": float(staleness.max()),
            "buffer/unique_frac": len(seqs) / len(used),
            "buffer/reuse_mean": float(uses_of_used.mean()),
            "buffer/reuse_max": float(uses_of_used.max()),
            "buffer/first_use_frac": float(np.mean([q not in previous for q in seqs])),
            "buffer/steps_since_last_use_mean": float(np.mean(since)) if since else 0.0,
            "buffer/replay_ratio": total_uses / max(self.store.count(), 1),
            "buffer/usage_records": float(total_uses),
        }

    def evaluate(self, step: int, sampled: bool = False) -> dict[str, float]:
        """Greedy held-out accuracy; with `sampled`, also the paper's pass@1 (temperature
        0.1, top-p 0.95), pass@k at temperature 1 and the sampled entropy and length."""
        start = time.perf_counter()
        metrics = evaluate_greedy(self.generator, self.task, self.heldout, seed=self.cfg.seed)
        if sampled:
            seed = step_seed(self.cfg.seed, self.policy_version, _EVAL)
            n = self.cfg.loop.eval_samples
            metrics |= evaluate_pass1(self.generator, self.task, self.heldout, seed=seed)
            metrics |= evaluate_sampled(self.generator, self.task, self.heldout, n=n,
                                        ks=default_ks(n), seed=seed)
        self.ledger.add(eval_seconds=time.perf_counter() - start)
        metrics["eval/policy_version"] = float(self.policy_version)
        return metrics

    def checkpoint(self, step: int) -> Path:
        """Save model, optimizer and state atomically, tag the table version it saw."""
        tag = checkpoint_name(step)
        self.store.tag(tag)
        self.usage.tag(tag)
        state = {
            "policy_version": self.policy_version, "learner_steps": self.learner.steps,
            "table_tag": tag, "table_version": self.store.version,
            "rollout_table": self.store.table_name, "usage_table": self.usage.table_name,
            "usage_version": self.usage.version, "mlflow_run_id": self.tracker.run_id,
            "run_id": self.run_id, "seed": self.cfg.seed,
        }
        path = save_checkpoint(self.paths.checkpoints, step, self.learner.model, self.tokenizer,
                               self.learner.optimizer, state, keep=self.cfg.loop.keep_checkpoints)
        self.tracker.set_tags({"checkpoint.latest": str(path), "checkpoint.latest_step": str(step)})
        self.tracker.log_text(json_dumps({**state, "step": step, "path": str(path)}),
                              f"checkpoints/{tag}.json")
        return path

    # ------------------------------------------------------------------ bookkeeping
    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.tracker.log_metrics(metrics, step=step)
        for k, v in metrics.items():
            self.history.setdefault(k, []).append((step, float(v)))

    def compute_metrics(self) -> dict[str, float]:
        return {**self.ledger.metrics(), "compute/wall_seconds": time.perf_counter() - self.started}

    def last(self, key: str, default: float = float("nan")) -> float:
        values = self.history.get(key)
        return values[-1][1] if values else default

    def summary(self, status: str = "FINISHED") -> dict[str, Any]:
        return _summary(self, status)

    def log_final_model(self) -> None:
        """The newest checkpoint's Hugging Face model directory, as the run's `model/` artifact."""
        from replay_pipeline.checkpoints import list_checkpoints

        done = list_checkpoints(self.paths.checkpoints)
        if done:
            self.tracker.log_artifacts(done[-1] / "model", "model")

    def finish(self, status: str = "FINISHED") -> None:
        self.tracker.finish(status)


def sampling_rules(buffer_cfg) -> SamplingRules:
    return SamplingRules(reuse_cap=buffer_cfg.reuse_cap, max_staleness=buffer_cfg.max_staleness,
                         recency_half_life=buffer_cfg.recency_half_life,
                         priority_alpha=buffer_cfg.priority_alpha)


def usage_rows(run_id: str, step: int, first_learner_step: int, policy_version: int,
               minibatches: list[dict[str, list]]) -> list[dict[str, Any]]:
    """One usage record per row of every minibatch of this round (rows of the usage table)."""
    now = datetime.now(timezone.utc)
    rows = []
    for k, mb in enumerate(minibatches):
        learner_step = first_learner_step + k
        for position, (rid, seq, version, rstep) in enumerate(
                zip(mb["rollout_id"], mb["seq"], mb["policy_version"], mb["step"])):
            rows.append({
                "usage_id": make_usage_id(run_id, learner_step, position), "run_id": run_id,
                "learner_step": learner_step, "step": step, "position": position,
                "rollout_id": rid, "rollout_seq": seq, "rollout_step": rstep,
                "rollout_policy_version": version, "policy_version": policy_version,
                "staleness": policy_version - version, "created_at": now,
            })
    return rows


def _quiet_transformers() -> None:
    """Per-file progress bars of save/load would scroll the run's own progress bar away."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def json_dumps(data: dict[str, Any]) -> str:
    import json

    return json.dumps(data, indent=2, sort_keys=True, default=str)


def _summary(run: TrainingRun, status: str) -> dict[str, Any]:
    evals = run.history.get("eval/accuracy", [])
    t = run.ledger.totals
    return {
        "run_id": run.run_id, "status": status,
        "steps_done": int(run.history.get("learn/policy_version", [(0, 0.0)])[-1][1]),
        "policy_version": run.policy_version,
        "accuracy_before": evals[0][1] if evals else float("nan"),
        "accuracy_after": evals[-1][1] if evals else float("nan"),
        "accuracy_best": max((v for _, v in evals), default=float("nan")),
        "heldout_prompts": len(run.heldout),
        "rollouts_stored": run.store.count(), "rollout_table": run.store.table_name,
        "lancedb_uri": str(run.store.uri), "mlflow_run_id": run.tracker.run_id,
        "mlflow_uri": run.tracker.uri or "", "experiment": run.cfg.tracking.experiment,
        "checkpoint_dir": str(run.paths.checkpoints), "run_dir": str(run.paths.run_dir),
        "wall_seconds": time.perf_counter() - run.started,
        "gen_tokens": t["gen_tokens"], "train_tokens": t["train_tokens"],
        "gen_seconds": t["gen_seconds"], "train_seconds": t["train_seconds"], "mu": run.ledger.mu(),
        "policy": run.policy_info,
    }
