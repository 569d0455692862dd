"""What the learner and the generator workers share: a step's prompts and seeds, generating
a batch, scoring it into rows of the rollout table, and laying a round's uses out as rows of
the usage table.

Determinism: every random draw is seeded from (seed, step, purpose[, worker]), never from state
carried across steps, so the sync loop is reproducible and a resumed run can redraw the same
numbers from the step alone. These functions read the configuration and the task they are
handed and write nothing; the tables are written by replay_pipeline/buffer/tables.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from replay_pipeline.system import faults
from replay_pipeline.buffer.schema import columns_to_table, group_rollout_ids, make_rollout_id
from replay_pipeline.buffer.usage import USAGE_SCHEMA, make_usage_ids
from replay_pipeline.generation.base import Sample
from replay_pipeline.algo.scoring import RewardTerm, check_flagged, group_advantages, score_items, warn_flagged
from replay_pipeline.tasks.custom import load_target
from replay_pipeline.tasks.base import Prompt

# Columns the learner needs from a stored rollout (a window read never loads the text).
LEARN_COLUMNS = ["rollout_id", "seq", "policy_version", "step", "prompt_ids", "completion_ids",
                 "behaviour_logprobs", "advantage", "reward", "group_reward_mean", "temperature"]

# Offsets that separate the purposes of per-step random streams.
SEED_PROMPTS, SEED_SAMPLER, SEED_GENERATE, SEED_EVAL = 1, 2, 3, 4


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
    temperature: float | None = None
    """The sampling temperature the completions were drawn at (stored with every rollout)."""
    top_p: float | None = None
    """The nucleus top_p they were drawn with."""


def step_prompts(task, cfg: Any, step: int, worker: int | None = None) -> tuple[list[Prompt], int]:
    """This step's prompts and generation seed (a pure function of seed, step and worker)."""
    rng = np.random.default_rng(step_seed(cfg.seed, step, SEED_PROMPTS, worker))
    prompts = list(task.train_prompts(cfg.loop.prompts_per_step, rng))
    return prompts, step_seed(cfg.seed, step, SEED_GENERATE, worker)


def generate_batch(task, generator, cfg: Any, step: int, worker: int | None = None) -> GeneratedBatch:
    """Sample G completions for each of this step's prompts with the generator's policy."""
    prompts, seed = step_prompts(task, cfg, step, worker)
    start = time.perf_counter()
    samples = generator.generate([p.text for p in prompts], n=cfg.loop.group_size, seed=seed)
    faults.crash_point("generate", step)
    seconds = time.perf_counter() - start
    return GeneratedBatch(step, generator.policy_version, seed, prompts, samples, seconds,
                          temperature=float(cfg.generator.temperature), top_p=float(cfg.generator.top_p))


def reward_terms(reward_cfg: Any) -> tuple[list[RewardTerm], float]:
    """The weighted reward terms of a config's `reward` section (`reward.terms.NAME.target`,
    `.weight`, `.args`), their functions imported, and the verifier's weight."""
    terms = [RewardTerm(name=str(name), weight=float(term.get("weight", 1.0)),
                        fn=load_target(str(term["target"]), key=f"reward.terms.{name}.target"),
                        args=dict(term.get("args") or {}))
             for name, term in sorted(dict(reward_cfg.get("terms") or {}).items())]
    return terms, float(reward_cfg.get("verifier_weight", 1.0))


def score_batch(task, batch: GeneratedBatch, run_id: str, g: int, worker: int | None = None,
                max_flagged_fraction: float = 1.0, terms: Sequence[RewardTerm] = (),
                verifier_weight: float = 1.0) -> tuple[pa.Table, dict[str, float]]:
    """Reward every completion (the task's verifier, plus the weighted `terms` if any; see
    replay_pipeline/algo/scoring.py score_items), freeze group advantages, and lay the rollouts out
    as rows of the rollout table (see TrainingRun.score). RewardFailure, before anything is
    stored, when more than `max_flagged_fraction` of them were flagged."""
    start = time.perf_counter()
    scored = score_items(task, [(prompt, s.text, s.finish_reason)
                                for prompt, group in zip(batch.prompts, batch.samples) for s in group],
                         terms, verifier_weight)
    rewards, errors = scored.rewards, scored.errors
    reward_seconds = time.perf_counter() - start
    flagged = warn_flagged(batch.step, errors)
    check_flagged(batch.step, errors, max_flagged_fraction)
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
        "correct": scored.correct, "advantage": np.asarray(advantages, dtype=np.float64),
        "group_reward_mean": group_means[g_index], "finish_reason": [s.finish_reason for s in samples],
        "num_tokens": [len(s.completion_ids) for s in samples], "seed": batch.seed,
        "temperature": batch.temperature, "top_p": batch.top_p, "created_at": datetime.now(timezone.utc),
    }, len(samples))
    r = np.asarray(rewards, dtype=np.float64)
    groups = r.reshape(-1, g)
    lengths = np.asarray([len(s.completion_ids) for grp in batch.samples for s in grp])
    metrics = {
        "score/reward_mean": float(r.mean()),
        "score/reward_std": float(r.std()),
        "score/accuracy": float(np.mean(scored.correct)),
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
    if terms:  # score/accuracy is the verifier's, score/reward_mean the weighted total
        metrics.update({f"score/term/{name}": mean for name, mean in scored.term_means.items()})
    return table, metrics


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


def quiet_transformers() -> None:
    """Per-file progress bars of save/load would scroll the run's own progress bar away."""
    from transformers.utils import logging as hf_logging  # transformers' own logging switch

    hf_logging.disable_progress_bar()


def stored_batch(store: Any, run_id: str, settings: Any, step: int, seed: int, prompts: list[Prompt]
                 ) -> GeneratedBatch | None:
    """Step `step`'s rollouts of run `run_id` as stored by a process that stopped after its last
    checkpoint (None unless all of them are stored, for these prompts): what a resumed sync run
    reads back instead of generating them again."""
    g = settings.loop.group_size
    rows = store.rows_for_step(step, columns=["rollout_id", "policy_version", "prompt_id", "prompt_ids",
                                                   "completion_ids", "behaviour_logprobs", "completion",
                                                   "finish_reason"])
    if rows.num_rows != len(prompts) * g:
        return None
    data = rows.to_pydict()
    ids = [make_rollout_id(run_id, step, gi, si) for gi in range(len(prompts)) for si in range(g)]
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
    gen = settings.generator  # a resume's generation settings are the stopped run's
    return GeneratedBatch(step, version, seed, prompts, samples, 0.0, reused=True,
                          temperature=float(gen.temperature), top_p=float(gen.top_p))
