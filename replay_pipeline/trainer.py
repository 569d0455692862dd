"""One training run, phase by phase: the library side of flows/train.py.

`TrainingRun.setup(cfg)` builds everything a run needs (task, policy, generator, learner,
rollout table, MLflow run); each phase is one method, so the Prefect flow only wires them:

    generate(step) -> score(step, ...) -> append(table) -> sample(step) -> learn(step, ...)
    evaluate(step) every loop.eval_every steps, checkpoint(step) every loop.checkpoint_every

Determinism: every random draw is seeded from (seed, step, purpose), never from state
carried across steps, so the sync loop is reproducible and a resumed run can redraw the
same numbers from the step alone.

Resume and fork (`setup` with cfg.resume / cfg.fork, configuration rules in
replay_pipeline/resume.py): the run restores model, optimizer, RNG states, step, policy
version, compute totals and evaluation history from a verified checkpoint. Rollouts the
stopped process appended after that checkpoint are **kept as buffer data**: when the resumed
run reaches a step whose rollouts are already stored it reads them back instead of generating
(saving that generation compute), and the idempotent append adds nothing. The buffer window
(`window_end`) and the usage counts (`before=` the current learner step) are read as they
stood at each step, so rows and usage records that the stopped process wrote "ahead" do not
leak into earlier steps: in the sync loop a resumed run is bit-for-bit the run that was never
stopped. A fork clones the source's tables at the checkpoint's tag and deletes anything the
tag holds beyond the fork point, then continues as a new run.

Policy versions: the warm-start (or loaded) policy is version 0. Each generation step's
round of `updates_per_step` learner steps ends by publishing the new weights to the
generator, which increments the version; so rollouts of step s carry version s and a run
of S steps ends at version S.
"""

from __future__ import annotations

import platform
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import torch
from omegaconf import DictConfig, OmegaConf

from replay_pipeline.buffer import RolloutStore
from replay_pipeline.buffer.cache import WindowCache
from replay_pipeline.buffer.writer import WriteBehind
from replay_pipeline.buffer.sampling import SamplingRules, WindowInfo, draw, window_for
from replay_pipeline.buffer.lance_table import sql_str
from replay_pipeline.buffer.store import META_COLUMNS
from replay_pipeline.buffer.usage import USAGE_SCHEMA, UsageStore, make_usage_ids
from replay_pipeline.buffer.schema import columns_to_table, group_rollout_ids, make_rollout_id
from replay_pipeline import faults
from replay_pipeline.checkpoints import (CheckpointError, capture_rng, checkpoint_name, checkpoint_step,
                                         latest_valid, list_checkpoints, load_optimizer_state,
                                         remove_partial, restore_rng, save_checkpoint)
from replay_pipeline.compute import ComputeLedger
from replay_pipeline.config import Config, flatten
from replay_pipeline.evaluation import default_ks, evaluate_greedy, evaluate_pass1, evaluate_sampled
from replay_pipeline.generation import Sample, TransformersGenerator, build_generator
from replay_pipeline.learner import Learner
from replay_pipeline.models.device import resolve_device
from replay_pipeline.models.loading import load_pretrained, load_policy
from replay_pipeline.resume import RUN_INFO, config_hash, parse_fork, read_run_info, saved_config
from replay_pipeline.runs import RunPaths, new_run_id
from replay_pipeline.scoring import group_advantages, safe_reward, warn_flagged
from replay_pipeline.tasks import task_from_config
from replay_pipeline.tasks.base import Prompt
from replay_pipeline.tracking import MlflowTracker, NullTracker
from replay_pipeline.async_loop import AsyncDir
from replay_pipeline.weights import WeightStore

# Columns the learner needs from a stored rollout (a window read never loads the text).
LEARN_COLUMNS = ["rollout_id", "seq", "policy_version", "step", "prompt_ids", "completion_ids",
                 "behaviour_logprobs", "advantage", "reward", "group_reward_mean"]

# Offsets that separate the purposes of per-step random streams.
_PROMPTS, _SAMPLER, _GENERATE, _EVAL = 1, 2, 3, 4


def step_seed(seed: int, step: int, purpose: int, worker: int | None = None) -> int:
    """A 63-bit seed for one purpose at one step (of one async generator worker),
    independent across (seed, step, purpose, worker)."""
    keys = [seed, step, purpose] if worker is None else [seed, step, purpose, 1 + worker]
    return int(np.random.SeedSequence(keys).generate_state(1, np.uint64)[0] >> 1)


@dataclass
class GeneratedBatch:
    step: int
    policy_version: int
    seed: int
    prompts: list[Prompt]
    samples: list[list[Sample]]
    seconds: float
    reused: bool = False
    """True when the rollouts were read back from the table (stored by a process that stopped
    after its last checkpoint) instead of generated."""


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
    start_step: int = 0
    """The first generation step this process runs (> 0 after a resume or fork)."""
    stored_through: int = -1
    """Newest generation step whose rollouts were already stored when this process started."""
    used_through: int = -1
    """Newest learner step whose usage records were already stored when this process started."""
    window_end: int = 0
    """One past the newest ``seq`` the buffer holds as of the current step."""
    lineage: dict[str, Any] = field(default_factory=dict)
    """How this process started: {"mode": "new" | "resume" | "fork", ...}."""
    weights: WeightStore | None = None
    """Async loop: where each policy version is published for the generator processes."""
    control: AsyncDir | None = None
    """Async loop: the STOP flag and the generator workers' stats."""
    loop_started: float | None = None
    """perf_counter() when this process began its first round (set by `start_loop`)."""
    scheduled_seconds: float = 0.0
    """Seconds of this process's rounds spent in scheduled extras (evaluation, checkpoints),
    which the overhead figure leaves out."""
    wait_seconds: float = 0.0
    """Async loop: seconds the learner waited for rollouts (or for the replay cap)."""
    _loop_base: dict[str, float] = field(default_factory=dict, repr=False)
    """Ledger totals when this process's rounds began (the overhead figure counts from them)."""
    _window_usage: tuple | None = field(default=None, repr=False)
    """(learner step, reuse counts, last uses, total uses) read by sample() for usage_metrics."""
    _compacted_at: int = field(default=0, repr=False)
    """Async loop: the rollout-table version of the last compaction."""
    _workers: dict[str, float] = field(default_factory=dict, repr=False)
    """Async loop: the generator workers' cumulative stats, read once per round."""
    cache: WindowCache | None = None
    """The in-memory mirror of the live window (buffer.read_cache; None: read the table)."""
    writes: WriteBehind = field(default_factory=WriteBehind, repr=False)
    """Table writes behind the learner (buffer.write_behind); `flush_writes()` waits for them."""
    settings: Any = field(default=None, repr=False)
    """`cfg` as plain dataclasses (replay_pipeline.config.Config), for the per-round code: an
    attribute of an OmegaConf node costs ~40 us, and a round read about forty of them."""

    def __post_init__(self) -> None:
        if self.settings is None:
            self.settings = OmegaConf.to_object(self.cfg)

    # ------------------------------------------------------------------ setup
    @classmethod
    def setup(cls, cfg: DictConfig, log: Callable[[str], Any] = print,
              tracker: MlflowTracker | NullTracker | None = None) -> "TrainingRun":
        """Build a run from a validated config: a new run, a resume (cfg.resume) or a fork
        (cfg.fork; see replay_pipeline/resume.py for the configuration they get). Nothing is
        written before the run directory is known to be writable, and a resume or fork finds
        its checkpoint before any model is built."""
        if cfg.resume is not None:
            mode, run_id = "resume", cfg.resume
        else:
            mode, run_id = ("fork" if cfg.fork is not None else "new"), cfg.run_id or new_run_id()
        paths = RunPaths.make(cfg.tracking.root_dir, run_id)
        paths.ensure()
        start, lineage = _start_point(cfg, mode, paths, log)
        _quiet_transformers()
        if cfg.model.torch_threads:
            torch.set_num_threads(cfg.model.torch_threads)
        torch.manual_seed(cfg.seed)

        task = task_from_config(OmegaConf.to_container(cfg.task, resolve=True))
        # The start policy (version 0) first, also on resume: it is the KL reference.
        model, tokenizer, policy_info = load_policy(cfg, task, paths, log=log)
        model.to(resolve_device(cfg.model.device))  # the learner's device; a transformers generator copies it there
        gen_cfg = cfg.generator
        # By generator.backend; a vLLM engine loads the checkpoint directory the policy came from.
        generator = build_generator(gen_cfg, model, tokenizer, checkpoint_dir=policy_info.get("path"))
        if callable(getattr(generator, "share_weights", None)):  # not across a separate engine (vLLM)
            generator.share_weights(model)  # the learner's updates are the generator's (no copy per round)
        a = cfg.algo
        learner = Learner(
            model, objective=a.objective, lr=a.lr,
            objective_params={"eps_low": a.eps_low, "eps_high": a.eps_high, "delta_v": a.delta_v,
                              "tis_cap": a.tis_cap},
            kl_coef=a.kl_coef, entropy_coef=a.entropy_coef, loss_agg=a.loss_agg, max_grad_norm=a.max_grad_norm, weight_decay=a.weight_decay,
            betas=(a.adam_beta1, a.adam_beta2), temperature=gen_cfg.temperature,
            pad_id=generator.pad_id)

        uri = cfg.buffer.uri or str(paths.lancedb)
        store, usage = _open_tables(uri, mode, run_id, lineage, cfg.buffer.storage_options)

        resolved = OmegaConf.to_container(cfg, resolve=True)
        resolved["run_id"] = run_id
        (paths.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
        if tracker is None:
            tracker = _tracker(cfg, mode, paths, store, usage, uri, lineage)
        if mode != "resume":
            tracker.log_params({**flatten(resolved), "policy.parameters": learner.num_parameters(),
                                **{f"policy.{k}": v for k, v in policy_info.items()}})
            tracker.log_text(OmegaConf.to_yaml(resolved), "config.yaml")
            tracker.set_tags({"host.python": platform.python_version(), "host.torch": torch.__version__})
        run = cls(cfg=cfg, paths=paths, task=task, tokenizer=tokenizer, generator=generator,
                  learner=learner, store=store, usage=usage, tracker=tracker,
                  ledger=ComputeLedger(parameters=learner.num_parameters()),
                  heldout=list(task.heldout_prompts()), policy_info=policy_info, lineage=lineage)
        if start is not None:
            run._restore(*start)
        if cfg.loop.mode == "async":
            run._start_async(mode)
        else:
            run.stored_through = store.max_step() if mode != "new" else -1
            run.used_through = usage.max_learner_step() if mode != "new" else -1
            run.window_end = store.seq_end(run.start_step - 1) if run.start_step > 0 else 0
        run.writes = WriteBehind(enabled=cfg.buffer.write_behind)
        if cfg.buffer.read_cache:
            size = window_for(cfg.buffer.strategy, cfg.buffer.capacity, run.rollouts_per_step)
            run.cache = WindowCache(store, usage, [*META_COLUMNS, *LEARN_COLUMNS],
                                    keep=size + 4 * run.rollouts_per_step, shared=cfg.loop.mode == "async",
                                    prefetch=cfg.loop.mode == "async" and cfg.buffer.read_ahead)
        run._write_run_info(mode)
        if mode != "new":
            log(f"{mode} {run_id} at step {run.start_step} (policy version {run.policy_version}); "
                f"{max(run.stored_through - run.start_step + 1, 0)} steps of rollouts already stored "
                f"will be reused, not regenerated")
        return run

    def _restore(self, path: Path, state: dict[str, Any]) -> None:
        """Load a verified checkpoint's weights, optimizer, counters, RNG states, compute
        totals and evaluation history into this freshly built run."""
        weights, _ = load_pretrained(path / "model")
        self.learner.model.load_state_dict(weights.state_dict())
        self.learner.optimizer.load_state_dict(load_optimizer_state(path))
        a = self.cfg.algo  # a fork's own hyper-parameters (a resume's are the same), saved moments
        for group in self.learner.optimizer.param_groups:
            group.update(lr=a.lr, betas=(a.adam_beta1, a.adam_beta2), weight_decay=a.weight_decay)
        self.learner.steps = int(state["learner_steps"])
        self.policy_version = int(state["policy_version"])
        self.generator.load_weights(self.learner.state_dict(), self.policy_version)
        restore_rng(state["rng"])
        for key, value in state.get("compute", {}).items():
            if key in self.ledger.totals:
                self.ledger.totals[key] = float(value)
        self.history = {k: [(int(a), float(b)) for a, b in v] for k, v in state.get("history", {}).items()}
        self.start_step = int(state["step"])

    def _start_async(self, mode: str) -> None:
        """Publish the starting weights for the generator processes and clear the STOP flag.
        On resume, the usage records of learner steps the checkpoint does not contain are
        deleted (they describe updates lost with the stopped learner; the async loop is not
        replayed step by step), while every stored rollout stays buffer data."""
        self.weights = WeightStore(self.paths.run_dir / "weights")
        self.weights.publish_base(self.learner.model, self.tokenizer)
        self.weights.publish(self.learner.state_dict(), self.policy_version)
        self.control = AsyncDir.of(self.paths.run_dir)
        self.control.reset()
        self._workers = self.control.totals(self.cfg.loop.workers)  # a resume's earlier batches
        if mode == "resume":
            self.usage.table.delete(f"learner_step >= {int(self.learner.steps)}")
        self.window_end = self.store.count()

    def wait_for_round(self, alive: Callable[[], bool], timeout: float = 600.0) -> float:
        """Async loop: block until the table holds a minibatch and a round of K learner steps
        stays within loop.replay_cap; returns the seconds waited. Raises if the generators
        have all stopped, or if no rollout arrives for `timeout` seconds."""
        loop = self.cfg.loop
        need = loop.updates_per_step * loop.minibatch_size
        start = last_change = time.perf_counter()
        self.writes.wait()  # the previous round's usage records count towards the cap
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
            time.sleep(0.01)
        self.window_end = rows
        waited = time.perf_counter() - start
        self.wait_seconds += waited
        return waited

    def note_flow_run(self, flow_run_id: str) -> list[str]:
        """Add an orchestrator (Prefect) flow run id to run.json; returns the ones before it."""
        info = read_run_info(self.paths.root, self.run_id)
        previous = list(info.get("prefect_flow_runs", []))
        info["prefect_flow_runs"] = previous + [flow_run_id]
        self._save_run_info(info)
        self.tracker.set_tags({"prefect.flow_run_id": flow_run_id})
        return previous

    def _save_run_info(self, info: dict[str, Any]) -> None:
        path = self.paths.run_dir / RUN_INFO
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json_dumps(info))
        tmp.replace(path)

    def _write_run_info(self, mode: str) -> None:
        """<run_dir>/run.json: the MLflow run this run logs to, its lineage and its resumes
        (a resume needs the MLflow run id even if the run stopped before its first checkpoint)."""
        info = read_run_info(self.paths.root, self.run_id)
        info.update({"run_id": self.run_id, "mlflow_run_id": self.tracker.run_id,
                     "mlflow_uri": self.tracker.uri, "rollout_table": self.store.table_name,
                     "usage_table": self.usage.table_name, "lancedb_uri": str(self.store.uri)})
        if mode == "fork":
            info["fork"] = {k: self.lineage[k] for k in ("source_run", "source_step", "source_checkpoint",
                                                          "source_mlflow_run_id")}
        if mode == "resume":
            info.setdefault("resumes", []).append(
                {"from_step": self.start_step, "at": datetime.now(timezone.utc).isoformat(),
                 "checkpoint": self.lineage.get("checkpoint")})
            self.tracker.set_tags({"replay_pipeline.resumes": str(len(info["resumes"])),
                                   f"replay_pipeline.resume_{len(info['resumes'])}_from_step": str(self.start_step)})
        self._save_run_info(info)

    @property
    def run_id(self) -> str:
        return self.paths.run_id

    @property
    def rollouts_per_step(self) -> int:
        return self.settings.loop.prompts_per_step * self.settings.loop.group_size

    # ------------------------------------------------------------------ phases
    def generate(self, step: int) -> GeneratedBatch:
        """Sample G completions for each of this step's prompts with the published policy."""
        if step <= self.stored_through:
            prompts, seed = step_prompts(self.task, self.settings, step)
            stored = self._stored_batch(step, seed, prompts)
            if stored is not None:
                return stored
        return generate_batch(self.task, self.generator, self.settings, step)

    def _stored_batch(self, step: int, seed: int, prompts: list[Prompt]) -> GeneratedBatch | None:
        """This step's rollouts as stored by a process that stopped after its last checkpoint
        (None unless all of them are stored, for these prompts)."""
        g = self.cfg.loop.group_size
        rows = self.store.rows_for_step(step, columns=["rollout_id", "policy_version", "prompt_id", "prompt_ids",
                                                       "completion_ids", "behaviour_logprobs", "completion",
                                                       "finish_reason"])
        if rows.num_rows != len(prompts) * g:
            return None
        data = rows.to_pydict()
        ids = [make_rollout_id(self.run_id, step, gi, si) for gi in range(len(prompts)) for si in range(g)]
        order = {rid: i for i, rid in enumerate(data["rollout_id"])}
        if set(order) != set(ids):
            return None
        samples: list[list[Sample]] = []
        for gi, prompt in enumerate(prompts):
            group = []
            for si in range(g):
                i = order[ids[gi * g + si]]
                if data["prompt_id"][i] != prompt.prompt_id:
                    return None  # not this configuration's prompts: generate afresh
                group.append(Sample(prompt_ids=list(data["prompt_ids"][i]),
                                    completion_ids=list(data["completion_ids"][i]),
                                    logprobs=list(data["behaviour_logprobs"][i]),
                                    text=data["completion"][i], finish_reason=data["finish_reason"][i]))
            samples.append(group)
        version = int(data["policy_version"][0])
        return GeneratedBatch(step, version, seed, prompts, samples, 0.0, reused=True)

    def score(self, batch: GeneratedBatch) -> tuple[pa.Table, dict[str, float]]:
        """Reward every completion with the task's verifier, freeze group advantages, and
        lay the rollouts out as rows of the rollout table.

        A reward that raises or is not finite scores 0.0 and is flagged (scoring.safe_reward):
        the reason goes to the row's `reward_error` (null otherwise), the count to
        `score/flagged`, and one warning per step to the `replay_pipeline.scoring` logger."""
        table, metrics = score_batch(self.task, batch, self.run_id, self.settings.loop.group_size)
        tokens = float(metrics["generate/tokens"])
        if batch.reused:  # generated (and paid for) by the stopped process: FLOPs yes, seconds unknown
            self.ledger.add(gen_tokens=tokens)
        else:
            # The verifier's time counts as generation, as in the paper's cost model (laying
            # the rows out for storage does not: that is the pipeline's own cost).
            self.ledger.add(gen_tokens=tokens, gen_seconds=batch.seconds + metrics["score/reward_seconds"],
                            gen_rollouts=table.num_rows)
            self.ledger.add(other_seconds=metrics["score/seconds"] - metrics["score/reward_seconds"])
        return table, metrics

    def append(self, table: pa.Table, step: int) -> dict[str, float]:
        """Persist the scored rollouts, and compact the tables every buffer.compact_every steps.

        A fresh step's rows are validated and given their ``seq`` here, then committed behind
        the learner (buffer.write_behind; the usage records of the learner steps that use them
        wait for that commit). A step whose rollouts a stopped process may have stored already
        (a resume's replayed steps) goes through the idempotent append at once: a retried
        append adds nothing."""
        start = time.perf_counter()
        self.writes.wait()  # the previous round's usage records (raises if that write failed)
        fresh = step > self.stored_through
        if fresh:
            # The sync loop is the table's only writer: its rows are numbered from the count it
            # tracks (window_end); the writer thread checks that count before committing.
            count = self.window_end if self.control is None else None
            stored = self.store.prepare(table, known_new=True, start=count)
            if stored is not None:
                self.window_end = int(stored.column("seq")[-1].as_py()) + 1
            self.writes.submit(lambda: self._commit_rollouts(stored, table, step, count))
        else:
            retry_storage(lambda attempt: self.store.append(table))
            stored = self.store.last_appended
            # The buffer as of this step: everything, unless rows of later steps are stored already.
            self.window_end = self.store.seq_end(step) if step < self.stored_through else self.store.count()
            faults.crash_point("after_append", step)
        if self.cache is not None and stored is not None:
            self.cache.appended(stored)
        seconds = time.perf_counter() - start
        out = {"buffer/appended": float(0 if stored is None else stored.num_rows),
               "buffer/total_rows": float(self.window_end), "buffer/append_seconds": seconds}
        if not fresh:  # a fresh step's compaction runs behind the learner; learn() reports it
            out["buffer/compact_seconds"] = self.compact_if_due(step)
        self.ledger.add(other_seconds=seconds + out.get("buffer/compact_seconds", 0.0))
        return out

    def _commit_rollouts(self, rows: pa.Table | None, table: pa.Table, step: int, count: int | None) -> float:
        """The writer thread's half of a fresh step's append (retried through the idempotent
        append); then the compaction when due. Returns the compaction's seconds."""
        if rows is not None:
            retry_storage(lambda attempt: self.store.insert(rows, expect_count=count) if attempt == 0
                   else self.store.append(table))
        faults.crash_point("after_append", step)
        return self.compact_if_due(step)

    def flush_writes(self) -> None:
        """Wait for the table write in flight (raising its error). Call it before reading the
        tables in the middle of a run; checkpoints and the end of the run call it."""
        self.writes.wait()

    def compact_if_due(self, step: int) -> float:
        """Compact both tables every buffer.compact_every rounds (async loop: every
        buffer.compact_every appends, as every generator batch is one); returns the seconds."""
        every = self.settings.buffer.compact_every
        if not every:
            return 0.0
        if self.control is not None:
            if self.store.version - self._compacted_at < every:
                return 0.0
        elif (step + 1) % every:
            return 0.0
        start = time.perf_counter()
        self.store.compact()
        self.usage.compact()
        self._compacted_at = self.store.version
        return time.perf_counter() - start

    def round(self, step: int) -> dict[str, float]:
        """One sync round: generate, score, append, sample and learn."""
        table, metrics = self.score(self.generate(step))
        metrics |= self.append(table, step)
        minibatches, sampled = self.sample(step)
        return metrics | sampled | self.learn(minibatches, step)

    def async_round(self, step: int, alive: Callable[[], bool]) -> dict[str, float]:
        """One round of the async learner: wait for rollouts (wait_for_round), compact when
        due (the learner compacts for every writer; on the writer thread, while it samples and
        trains), sample, learn and publish; plus what the
        generators added since the previous round, from their stats (read once per round)."""
        metrics = {"learn/wait_seconds": self.wait_for_round(alive)}
        # Behind the learner, as the sync loop's (learn() waits for it and reports its seconds).
        self.writes.submit(lambda: self.compact_if_due(step))
        minibatches, sampled = self.sample(step)
        metrics |= sampled | self.learn(minibatches, step)
        seen, self._workers = self._workers, self.control.totals(self.cfg.loop.workers)
        new = self._workers.get("gen_rollouts", 0.0) - seen.get("gen_rollouts", 0.0)
        reward = self._workers.get("reward_sum", 0.0) - seen.get("reward_sum", 0.0)
        return metrics | {"generate/rollouts": new, "generate/batches_total": self._workers.get("batches", 0.0),
                          "score/reward_mean": reward / new if new else float("nan")}

    def sample(self, step: int) -> tuple[list[dict[str, list]], dict[str, float]]:
        """Read the window's light columns and the usage counts, let the strategy choose,
        then read only the chosen rows' token data."""
        start = time.perf_counter()
        b, loop = self.settings.buffer, self.settings.loop
        size = window_for(b.strategy, b.capacity, self.rollouts_per_step)
        before = self._usage_bound(self.learner.steps)
        mirrored = self._mirrored_window(size) if before is None and b.positive_bias == 0 else None
        if mirrored is not None:
            meta, counts, last, total = mirrored
        else:
            self.writes.wait()  # the table must hold this round's rows before it is read
            if b.positive_bias > 0:  # validation keeps it off the fresh baseline
                meta = self.store.positive_bias_window(size, b.positive_bias, columns=list(META_COLUMNS),
                                                       end=self.window_end)
            else:
                meta = self.store.window_meta(size, end=self.window_end)
            seqs = meta.column("seq").to_numpy()
            # One read of the window's usage records gives the sampler its reuse counts and the
            # learner's metrics their last uses (usage_metrics), both as of this learner step.
            counts, last = self.usage.uses(int(seqs.min()), int(seqs.max()), before=before) if len(seqs) else ({}, {})
            total = self.usage.count() if before is None else self.usage.count_before(before)
        seqs = meta.column("seq").to_numpy()
        self._window_usage = (self.learner.steps, counts, last, total)
        info = WindowInfo(
            policy_version=meta.column("policy_version").to_numpy(), seq=seqs,
            correct=meta.column("correct").to_numpy(zero_copy_only=False),
            advantage=meta.column("advantage").to_numpy(),
            reuse_count=np.asarray([counts.get(int(q), 0) for q in seqs], dtype=np.int64),
            current_version=self.policy_version)
        rng = np.random.default_rng(step_seed(self.settings.seed, step, _SAMPLER))
        picks = draw(b.strategy, info, loop.minibatch_size, loop.updates_per_step, rng,
                     sampling_rules(b))
        picks = [p for p in picks if len(p)]  # eligibility ran out: skip, and say so below
        minibatches = []
        if picks:
            chosen = seqs[np.concatenate(picks)]
            rows = self.cache.take(chosen, LEARN_COLUMNS) if mirrored is not None else None
            if rows is None:
                self.writes.wait()
                rows = self.store.take_seqs(chosen, columns=LEARN_COLUMNS)
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

    def _mirrored_window(self, size: int) -> tuple[pa.Table, dict, dict, int] | None:
        """The live window from the in-memory mirror (filled from the tables on a miss);
        None without a mirror, or if it cannot hold the window (the caller reads LanceDB)."""
        if self.cache is None:
            return None
        if self.cache.shared:
            self.cache.refresh()
        got = self.cache.window(size, self.window_end)
        if got is None:
            self.writes.wait()  # the table must hold this round's rows before it is read
            self.cache.fill(self.window_end)
            got = self.cache.window(size, self.window_end)
        return got

    def learn(self, minibatches: list[dict[str, list]], step: int) -> dict[str, float]:
        """One learner step per minibatch, then publish the weights (version + 1), then a
        durable record of the rollouts each step used. (Publishing first: its copy of the
        weights then does not compete with the usage records' commit on the writer thread.)"""
        start = time.perf_counter()
        first_learner_step = self.learner.steps
        per_step = [self.learner.step(mb) for mb in minibatches]
        train_seconds = time.perf_counter() - start
        publish_start = time.perf_counter()
        trained = self.policy_version  # the version these learner steps started from
        self.policy_version += 1
        if self.generator.shares_weights:  # the optimizer's in-place update is already there
            self.generator.policy_version = self.policy_version
        else:
            self.generator.load_weights(self.learner.state_dict(), self.policy_version)
        if self.weights is not None:  # async: to the generator processes (written off-thread)
            self.weights.publish_copy_in_background(self.learner.model.state_dict(), self.policy_version)
        publish_seconds = time.perf_counter() - publish_start
        record_start = time.perf_counter()
        compacted = self.writes.wait()  # the rollouts these records name are stored first
        used = usage_table(self.run_id, step, first_learner_step, trained, minibatches)
        metrics = self.usage_metrics(used) if used.num_rows else {}
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
        self.ledger.add(train_tokens=metrics.get("learn/tokens", 0.0), train_seconds=train_seconds,
                        train_rollouts=sum(len(mb["rollout_id"]) for mb in minibatches),
                        other_seconds=publish_seconds + record_seconds)
        return metrics

    def usage_metrics(self, used: pa.Table) -> dict[str, float]:
        """Record this round's uses, then derive reuse, staleness and steps-since-last-use
        from the usage table (durable records, not counters kept in memory): the records
        before this round, read once by sample() (or here), plus this round's own."""
        used_seq = used.column("rollout_seq").to_pylist()
        used_step = used.column("learner_step").to_pylist()
        seqs = sorted(set(used_seq))
        first = min(used_step)
        cached = self._window_usage
        if cached is not None and cached[0] == first:  # read by sample() for this learner step
            _, counts, previous, total = cached
            previous = {q: previous[q] for q in seqs if q in previous}
        else:
            before = self._usage_bound(first)
            counts, previous = self.usage.uses(seqs[0], seqs[-1], before=before)
            total = self.usage.count() if before is None else self.usage.count_before(before)
        self._window_usage = None
        if first > self.used_through:  # validated here, committed behind the next round's work
            prepared = self.usage.prepare(used, known_new=True)
            self.writes.submit(lambda: retry_storage(
                lambda attempt: self.usage.insert(prepared) if attempt == 0 else self.usage.record(used)))
        else:  # a replayed round's records are already stored: the idempotent append, at once
            retry_storage(lambda attempt: self.usage.record(used))
        if self.cache is not None:
            self.cache.used(used)
        since, last = [], dict(previous)
        for q, ls in zip(used_seq, used_step):  # rows are in learner-step order
            if q in last and last[q] < ls:
                since.append(ls - last[q])
            last[q] = ls
        staleness = used.column("staleness").to_numpy().astype(np.float64)
        this_round = Counter(used_seq)
        uses_of_used = np.asarray([counts.get(q, 0) + this_round[q] for q in seqs], dtype=np.float64)
        total_uses = total + used.num_rows
        return {
            "buffer/staleness_mean": float(staleness.mean()),
            "buffer/staleness_max": float(staleness.max()),
            "buffer/unique_frac": len(seqs) / len(used),
            "buffer/reuse_mean": float(uses_of_used.mean()),
            "buffer/reuse_max": float(uses_of_used.max()),
            "buffer/first_use_frac": float(np.mean([q not in previous for q in seqs])),
            "buffer/steps_since_last_use_mean": float(np.mean(since)) if since else 0.0,
            "buffer/replay_ratio": total_uses / max(self.window_end, 1),
            "buffer/usage_records": float(total_uses),
        }

    def _usage_bound(self, learner_step: int) -> int | None:
        """`before=` for usage reads at `learner_step`: None (read everything, the fast path)
        unless records of this or later learner steps were stored by a stopped process."""
        return learner_step if learner_step <= self.used_through else None

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
        tokens = sum(metrics.get(k, 0.0) for k in ("eval/greedy_tokens", "eval/sample_tokens", "eval/pass1_tokens"))
        self.ledger.add(eval_seconds=time.perf_counter() - start, eval_tokens=tokens)
        metrics["eval/policy_version"] = float(self.policy_version)
        return metrics

    def checkpoint(self, step: int) -> Path:
        """Tag the table versions this checkpoint saw, then save model, optimizer and state
        atomically (checkpoints.save_checkpoint), then tell MLflow. `step` = steps done.

        The state holds everything a bit-for-bit resume needs: step, policy version, learner
        steps, the RNG states, the sampler state (the window's end and the per-step seed rule:
        samplers keep no other state), the compute totals, the evaluation history, the tags,
        the MLflow run id and the config hash."""
        self.writes.wait()  # a checkpoint never covers a write still in flight
        tag = checkpoint_name(step)
        versions = {}
        for table in (self.store, self.usage):
            # A tag left by a process that stopped before finishing this checkpoint names the
            # same step's data (the sync loop is deterministic): keep it, never move it.
            if tag not in table.tags():
                table.tag(tag)
            versions[table.table_name] = table.tags()[tag]
        b = self.cfg.buffer
        state = {
            "run_id": self.run_id, "policy_version": self.policy_version,
            "learner_steps": self.learner.steps, "table_tag": tag,
            "rollout_table": self.store.table_name, "usage_table": self.usage.table_name,
            "table_version": versions[self.store.table_name], "usage_version": versions[self.usage.table_name],
            "lancedb_uri": str(self.store.uri), "mlflow_run_id": self.tracker.run_id,
            "config_hash": config_hash(self.cfg), "seed": self.cfg.seed,
            "rng": capture_rng(),
            "sampler": {"strategy": b.strategy, "window_end": self.window_end,
                        "capacity": b.capacity, "positive_bias": b.positive_bias,
                        "rng": "numpy default_rng(SeedSequence([seed, step, 2])) per step",
                        "reuse_counts": f"usage table, learner_step < {self.learner.steps}"},
            "compute": dict(self.ledger.totals),
            "history": {k: v for k, v in self.history.items() if k.startswith("eval/")},
            "lineage": self.lineage,
        }
        self.tracker.flush()  # the metrics of the steps this checkpoint covers are stored first
        if self.weights is not None:
            self.weights.flush()
        path = save_checkpoint(self.paths.checkpoints, step, self.learner.model, self.tokenizer,
                               self.learner.optimizer, state, keep=self.cfg.loop.keep_checkpoints,
                               before_rename=lambda tmp: faults.crash_point("checkpoint_write", step))
        faults.crash_point("after_checkpoint", step)
        self.tracker.set_tags({"checkpoint.latest": str(path), "checkpoint.latest_step": str(step)})
        self.tracker.log_text(json_dumps({k: v for k, v in state.items() if k != "rng"} | {"step": step, "path": str(path)}),
                              f"checkpoints/{tag}.json")
        return path

    # ------------------------------------------------------------------ bookkeeping
    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.tracker.log_metrics(metrics, step=step)
        for k, v in metrics.items():
            self.history.setdefault(k, []).append((step, float(v)))

    def compute_metrics(self) -> dict[str, float]:
        if self.control is not None:  # async: generation happens in the worker processes
            for key in ("gen_tokens", "gen_seconds", "gen_rollouts"):
                self.ledger.totals[key] = self._workers.get(key, 0.0)
        return {**self.ledger.metrics(), **self.overhead_metrics(),
                "compute/wall_seconds": time.perf_counter() - self.started}

    def start_loop(self) -> None:
        self.loop_started = time.perf_counter()
        self._loop_base = dict(self.ledger.totals)

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
        if self.control is None:
            useful += t["gen_seconds"] - base["gen_seconds"]
        else:
            rounds -= self.wait_seconds
        overhead = max(rounds - useful, 0.0)
        out = {"compute/round_seconds": rounds, "compute/overhead_seconds": overhead,
               "compute/overhead_frac": overhead / rounds if rounds > 0 else float("nan")}
        if self.control is not None:
            w = self._workers
            busy = w.get("gen_seconds", 0.0) + w.get("other_seconds", 0.0)
            out["compute/generator_overhead_frac"] = w.get("other_seconds", 0.0) / busy if busy else float("nan")
        return out

    def last(self, key: str, default: float = float("nan")) -> float:
        values = self.history.get(key)
        return values[-1][1] if values else default

    def _settle_writes(self, close: bool = False) -> bool:
        """Wait for the table write in flight (and stop the writer thread if `close`); False,
        with a warning, if it failed: at the end of a run, which then ends FAILED."""
        try:
            self.writes.close() if close else self.writes.wait()
            return True
        except Exception as exc:  # the checkpoint raised it already, or the run fails now
            warnings.warn(f"the last table write of {self.run_id} failed: {exc!r}")
            return False

    def summary(self, status: str = "FINISHED") -> dict[str, Any]:
        self._settle_writes()  # the counts below include the last round's writes
        return _summary(self, status)

    def log_final_model(self) -> None:
        """The newest checkpoint's Hugging Face model directory, as the run's `model/` artifact."""
        from replay_pipeline.checkpoints import list_checkpoints

        done = list_checkpoints(self.paths.checkpoints)
        if done:
            self.tracker.log_artifacts(done[-1] / "model", "model")

    def finish(self, status: str = "FINISHED") -> None:
        """End the run (`_finish`: writes, published weights, the MLflow run's `status`), then
        close the generator (a vLLM engine's GPU memory) even if that failed."""
        try:
            self._finish(status)
        finally:
            self.generator.close()

    def _finish(self, status: str) -> None:
        if self.cache is not None:
            self.cache.close()
        if not self._settle_writes(close=True) and status == "FINISHED":
            status = "FAILED"
        if self.weights is not None:
            self.weights.flush()
        self.tracker.finish(status)


def step_prompts(task, cfg: DictConfig | Config, step: int, worker: int | None = None) -> tuple[list[Prompt], int]:
    """This step's prompts and generation seed (a pure function of seed, step and worker)."""
    rng = np.random.default_rng(step_seed(cfg.seed, step, _PROMPTS, worker))
    prompts = list(task.train_prompts(cfg.loop.prompts_per_step, rng))
    return prompts, step_seed(cfg.seed, step, _GENERATE, worker)


def generate_batch(task, generator, cfg: DictConfig | Config, step: int, worker: int | None = None) -> GeneratedBatch:
    """Sample G completions for each of this step's prompts with the generator's policy."""
    prompts, seed = step_prompts(task, cfg, step, worker)
    start = time.perf_counter()
    samples = generator.generate([p.text for p in prompts], n=cfg.loop.group_size, seed=seed)
    faults.crash_point("generate", step)
    seconds = time.perf_counter() - start
    return GeneratedBatch(step, generator.policy_version, seed, prompts, samples, seconds)


def score_batch(task, batch: GeneratedBatch, run_id: str, g: int,
                worker: int | None = None) -> tuple[pa.Table, dict[str, float]]:
    """Reward every completion with the task's verifier, freeze group advantages, and lay the
    rollouts out as rows of the rollout table (see TrainingRun.score)."""
    start = time.perf_counter()
    rewards, errors = [], []
    for prompt, group in zip(batch.prompts, batch.samples):
        for s in group:
            value, error = safe_reward(lambda: task.reward(prompt, s.text, s.finish_reason))
            rewards.append(value)
            errors.append(error)
    reward_seconds = time.perf_counter() - start
    flagged = warn_flagged(batch.step, errors)
    advantages = group_advantages(rewards, g)
    group_means = np.asarray(rewards, dtype=np.float64).reshape(-1, g).mean(axis=1)
    samples = [s for group in batch.samples for s in group]
    g_index = [gi for gi, group in enumerate(batch.samples) for _ in group]
    per_group = [group_rollout_ids(run_id, batch.step, gi, len(group), worker)
                 for gi, group in enumerate(batch.samples)]
    ids = [rid for group in per_group for rid in group]
    group_ids = [group[0].rsplit("/", 1)[0] if group else "" for group in per_group]
    table = columns_to_table({
        "rollout_id": ids, "worker": worker, "run_id": run_id, "policy_version": batch.policy_version,
        "step": batch.step, "prompt_id": [batch.prompts[gi].prompt_id for gi in g_index],
        "group_id": [group_ids[gi] for gi in g_index],
        "sample_index": [si for group in batch.samples for si in range(len(group))],
        "prompt": [batch.prompts[gi].text for gi in g_index], "completion": [s.text for s in samples],
        "prompt_ids": [s.prompt_ids for s in samples], "completion_ids": [s.completion_ids for s in samples],
        "behaviour_logprobs": [s.logprobs for s in samples], "reward": rewards, "reward_error": errors,
        "correct": [r > 0 for r in rewards], "advantage": np.asarray(advantages, dtype=np.float64),
        "group_reward_mean": group_means[g_index], "finish_reason": [s.finish_reason for s in samples],
        "num_tokens": [len(s.completion_ids) for s in samples], "seed": batch.seed,
        "created_at": datetime.now(timezone.utc),
    }, len(samples))
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
        "score/reward_seconds": reward_seconds,
        "generate/seconds": batch.seconds,
        "generate/rollouts": float(len(r)),
        "generate/tokens": float(lengths.sum()),
        "generate/mean_length": float(lengths.mean()),
        "generate/stop_frac": float(np.mean([s.finish_reason == "stop"
                                             for grp in batch.samples for s in grp])),
        "generate/tokens_per_second": float(lengths.sum() / max(batch.seconds, 1e-9)),
        "generate/policy_version": float(batch.policy_version),
        "generate/reused_from_store": float(batch.reused),
    }
    return table, metrics


def _start_point(cfg: DictConfig, mode: str, paths: RunPaths, log: Callable[[str], Any]
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
        return found, {"mode": "resume", "checkpoint": str(path)}
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


def _open_tables(uri: str, mode: str, run_id: str, lineage: dict[str, Any],
                 storage_options: Any = None) -> tuple[RolloutStore, UsageStore]:
    """New run: create both tables. Resume: open them (a schema mismatch is refused and the
    table left untouched). Fork: shallow-clone the source's at the checkpoint's tag, then drop
    the source rows the tag holds beyond the fork point (the fork's own rows are kept, so an
    interrupted fork can be resumed). `storage_options`: buffer.storage_options, for an
    object-store uri."""
    opts = {"storage_options": storage_options}
    if mode == "new":
        return RolloutStore.create(uri, run_id, **opts), UsageStore.create(uri, run_id, **opts)
    if mode == "fork" or lineage.get("fork_restart"):
        source, step, tag = lineage["source_run"], lineage["source_step"], lineage["tag"]
        mine = f"run_id != {sql_str(run_id)}"
        store = RolloutStore.fork(uri, source, tag, run_id, drop_where=f"{mine} AND step >= {int(step)}", **opts)
        usage = UsageStore.fork(uri, source, tag, run_id,
                                drop_where=f"{mine} AND learner_step >= {int(lineage['learner_steps'])}", **opts)
        return store, usage
    return RolloutStore.open(uri, run_id, **opts), UsageStore.open(uri, run_id, **opts)


def _tracker(cfg: DictConfig, mode: str, paths: RunPaths, store: RolloutStore, usage: UsageStore,
             uri: str, lineage: dict[str, Any]) -> MlflowTracker:
    mlflow_uri = cfg.tracking.mlflow_uri or paths.mlflow_uri
    if mode == "resume":
        run_id = read_run_info(paths.root, paths.run_id).get("mlflow_run_id")
        if not run_id:
            raise CheckpointError(f"{paths.run_dir / RUN_INFO} is missing, so the MLflow run of "
                                  f"{paths.run_id} is unknown; fork the run from a checkpoint instead")
        return MlflowTracker.attach(mlflow_uri, run_id)
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


def artifact_location(cfg: DictConfig, paths: RunPaths, mlflow_uri: str) -> str | None:
    """Where a new MLflow experiment keeps its artifacts: tracking.artifact_location if set;
    else a tracking server decides (its --artifacts-destination), and a local store keeps
    them under the run root."""
    if cfg.tracking.artifact_location:
        return str(cfg.tracking.artifact_location)
    remote = str(mlflow_uri).startswith(("http://", "https://", "databricks"))
    return None if remote else str(paths.artifact_location)


def retry_storage(fn: Callable[[int], Any], attempts: int = 3, delay: float = 1.0) -> Any:
    """fn(attempt) until it returns, for storage calls that may fail transiently (safe for
    idempotent writes: a retry after a commit whose outcome was lost inserts nothing)."""
    for attempt in range(attempts):
        try:
            return fn(attempt)
        except (OSError, RuntimeError) as exc:
            if attempt == attempts - 1:
                raise
            warnings.warn(f"retrying after a storage error: {exc}")
            time.sleep(delay)


def sampling_rules(buffer_cfg) -> SamplingRules:
    return SamplingRules(reuse_cap=buffer_cfg.reuse_cap, max_staleness=buffer_cfg.max_staleness,
                         recency_half_life=buffer_cfg.recency_half_life,
                         priority_alpha=buffer_cfg.priority_alpha)


def usage_table(run_id: str, step: int, first_learner_step: int, policy_version: int,
                minibatches: list[dict[str, list]]) -> pa.Table:
    """One usage record per row of every minibatch of this round (rows of the usage table),
    built column by column."""
    sizes = [len(mb["rollout_id"]) for mb in minibatches]
    learner_steps = np.repeat(np.arange(first_learner_step, first_learner_step + len(sizes), dtype=np.int64), sizes)
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in sizes]) if sizes else np.zeros(0, np.int64)
    versions = np.asarray([v for mb in minibatches for v in mb["policy_version"]], dtype=np.int64)
    return columns_to_table({
        "usage_id": make_usage_ids(run_id, learner_steps, positions),
        "run_id": run_id, "learner_step": learner_steps, "step": step, "position": positions.astype(np.int32),
        "rollout_id": [r for mb in minibatches for r in mb["rollout_id"]],
        "rollout_seq": [q for mb in minibatches for q in mb["seq"]],
        "rollout_step": [t for mb in minibatches for t in mb["step"]],
        "rollout_policy_version": versions, "policy_version": policy_version,
        "staleness": policy_version - versions, "created_at": datetime.now(timezone.utc),
    }, int(sum(sizes)), USAGE_SCHEMA, noun="usage")


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
        "steps_done": int(run.history.get("learn/policy_version", [(0, float(run.start_step))])[-1][1]),
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
