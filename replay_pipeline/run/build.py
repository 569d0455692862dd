"""Building a run: from a validated configuration to a `TrainingRun` ready for its first round.

`build_run(cfg)` makes a new run, a resume (cfg.resume) or a fork (cfg.fork; which keys they
may change is replay_pipeline/run/resume.py's): the pre-flight checks first, then the run
directory, the start point (a verified checkpoint, found before any model is built), the
settings, the task, the policy (version 0, also on resume: it is the KL reference), the
generator and learner, the tables, the MLflow run, the checkpoint's state restored, and for
the async loop the published starting weights. Nothing is written before the run directory
is known to be writable.
"""

from __future__ import annotations

import platform
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf

from replay_pipeline.system import stopping
from replay_pipeline.buffer.cache import WindowCache
from replay_pipeline.buffer.store import META_COLUMNS
from replay_pipeline.buffer.tables import RunTables
from replay_pipeline.algo.compute import ComputeLedger
from replay_pipeline.config import TASK_DEFAULTS, flatten
from replay_pipeline.config.rules import toy_default_warnings
from replay_pipeline.generation import build_generator
from replay_pipeline.system.lease import acquire
from replay_pipeline.models.device import auto_threads, resolve_device
from replay_pipeline.models.packaged import ensure_prepared
from replay_pipeline.models.policy import load_policy
from replay_pipeline.run.accounting import Accounting
from replay_pipeline.run.batches import LEARN_COLUMNS, quiet_transformers, reward_terms
from replay_pipeline.run.files import AsyncDir
from replay_pipeline.run.handover import snapshot, start_state
from replay_pipeline.run.lineage import (RUN_INFO, check_resume_tables, note_end, open_tables, open_tracker,
                                        restore, start_point, write_run_info)
from replay_pipeline.run.phases import TrainingRun
from replay_pipeline.run.preflight import preflight
from replay_pipeline.run.ranks import LearnerRanks, launch_processes, learner_kwargs, make_learner
from replay_pipeline.run.ray_ranks import ActorLauncher
from replay_pipeline.run.replay import ReplaySampler
from replay_pipeline.run.settings import Settings, build_settings
from replay_pipeline.system.runs import RunPaths, new_run_id
from replay_pipeline.algo.scoring import set_reward_timeout
from replay_pipeline.tasks import task_from_config
from replay_pipeline.tasks.custom import absolute_target
from replay_pipeline.tracking.tracker import MlflowTracker, NullTracker
from replay_pipeline.training.weights import WeightStore


def run_mode(cfg: DictConfig) -> tuple[str, str]:
    """(mode, run id) of a configuration: resume keeps its run id, a new run or a fork takes
    cfg.run_id or a fresh one."""
    if cfg.resume is not None:
        return "resume", str(cfg.resume)
    return ("fork" if cfg.fork is not None else "new"), str(cfg.run_id or new_run_id())


def build_run(cfg: DictConfig, log: Callable[[str], Any] = print,
              tracker: MlflowTracker | NullTracker | None = None) -> TrainingRun:
    """A run ready for its first round (see the module docstring)."""
    preflight(cfg)
    for line in toy_default_warnings(cfg):
        log(f"warning: {line}")
    ensure_prepared(cfg.model, log)  # a packaged model's directory, made once (models/packaged.py)
    if cfg.task.get("target") or cfg.reward.terms:  # file targets recorded absolute: workers elsewhere,
        cfg = cfg.copy()                              # a resume from elsewhere
        if cfg.task.get("target"):
            cfg.task.target = absolute_target(cfg.task.target)
        for term in cfg.reward.terms.values():
            term.target = absolute_target(term.target)
    if not cfg.model.torch_threads:  # auto: chosen once, and recorded in config.yaml as chosen
        cfg = cfg.copy()
        cfg.model.torch_threads, why = auto_threads()
        log(f"torch threads: {cfg.model.torch_threads} (model.torch_threads=0: {why})")
    mode, run_id = run_mode(cfg)
    paths = RunPaths.make(cfg.tracking.root_dir, run_id)
    paths.ensure()
    lease = acquire(paths.run_dir)  # LeaseHeld: another live process drives this run
    opened, start = tracker, None
    try:
        start, lineage = start_point(cfg, mode, paths, log)
        settings = build_settings(cfg, run_id, mode)
        # The run's identity first, before the warm start and the first round, so that a run
        # killed at any later point can be resumed: its configuration, tables, MLflow run and
        # run.json (restarting from step 0, every stored row kept, when it has no checkpoint).
        resolved = settings.container()
        (paths.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
        uri = settings.buffer.uri or str(paths.lancedb)
        store, usage = open_tables(uri, mode, run_id, lineage, dict(settings.buffer.storage_options or {}))
        if mode == "resume" and start is not None and not lineage.get("fork_restart"):
            # before the MLflow run is set RUNNING again: a damaged table or lost rows refuse here
            check_resume_tables(store, usage, start[1], settings.async_loop, paths.checkpoints, log=log)
        if tracker is None:
            tracker = opened = open_tracker(settings, mode, paths, store, usage, uri, lineage)
        start_step = int(start[1]["step"]) if start is not None else 0
        write_run_info(paths, mode, lineage, tracker, store, usage, start_step)
        run = _build(settings, mode, paths, start, lineage, store, usage, tracker, log)
    except BaseException:
        status = "KILLED" if stopping.requested() else "FAILED"  # stopped (Ctrl-C, SIGTERM) or failed while built
        try:
            if opened is not None:
                opened.finish(status)
            if (paths.run_dir / RUN_INFO).is_file():
                note_end(paths, status, int(start[1]["step"]) if start is not None else 0, None)
        finally:
            lease.release()
        raise
    run.lease = lease
    return run


def _build(settings: Settings, mode: str, paths: RunPaths, start: Any, lineage: dict[str, Any],
           store: Any, usage: Any, tracker: Any, log: Callable[[str], Any]) -> TrainingRun:
    """The model side of build_run, once the run's identity is stored."""
    quiet_transformers()
    set_reward_timeout(settings.reward.timeout)  # every reward call of this process, evaluations too
    if settings.model.torch_threads:
        torch.set_num_threads(settings.model.torch_threads)
    torch.manual_seed(settings.seed)

    task = task_from_config(settings.container()["task"], TASK_DEFAULTS)
    terms, _ = reward_terms(settings.container()["reward"])
    model, tokenizer, policy_info = load_policy(settings, task, paths, log=log)
    model.to(resolve_device(settings.model.device))  # the learner's device; a transformers generator copies it there
    # By generator.backend; a vLLM engine loads the checkpoint directory the policy came from.
    generator = build_generator(settings.generator, model, tokenizer, checkpoint_dir=policy_info.get("path"))
    sharded = settings.learner.shard is not None  # FSDP2: the generator keeps its own whole copy (run/handover.py)
    if callable(getattr(generator, "share_weights", None)) and not sharded:  # nor across an engine (vLLM)
        generator.share_weights(model)  # the learner's updates are the generator's (no copy per round)
    kwargs = learner_kwargs(settings, generator.pad_id)
    watch = settings.reuse.group if settings.reuse.rule == "grad_spike" else None  # grad_spike's signal
    ranks = _start_ranks(settings, log) if settings.learner.world_size > 1 else None
    try:  # the other ranks stopped if the build fails
        whole = snapshot(model) if sharded else None  # version 0, whole, before the learner shards it in place
        learner = make_learner(model, kwargs, watch, None if ranks is None else ranks.group)
        whole = None if whole is None else start_state(learner, whole)

        resolved = settings.container()
        if mode != "resume" or not tracker.params():  # a resume of a run stopped in its warm start too
            tracker.log_params({**flatten(resolved), "policy.parameters": learner.num_parameters(),
                                **{f"policy.{k}": v for k, v in policy_info.items()}})
            tracker.log_text(OmegaConf.to_yaml(resolved), "config.yaml")
            tracker.set_tags({"host.python": platform.python_version(), "host.torch": torch.__version__})

        accounting = Accounting(ComputeLedger(parameters=learner.num_parameters()), async_loop=settings.async_loop)
        policy_version, start_step, history = 0, 0, {}
        if start is not None:
            start_step, policy_version, history = restore(learner, generator, accounting.ledger, settings.algo, *start,
                                                          sharded=whole)
        b = settings.buffer
        cache = WindowCache(store, usage, [*META_COLUMNS, *LEARN_COLUMNS],
                            keep=settings.window_size + 4 * settings.rollouts_per_step, shared=settings.async_loop,
                            prefetch=settings.async_loop and b.read_ahead) if b.read_cache else None
        tables = RunTables(store, usage, compact_every=b.compact_every, shared=settings.async_loop,
                           write_behind=b.write_behind, cache=cache,
                           commit_seconds=b.commit_seconds)
        run = TrainingRun(settings=settings, paths=paths, task=task, tokenizer=tokenizer, generator=generator,
                          learner=learner, tables=tables, tracker=tracker, accounting=accounting,
                          sampler=ReplaySampler(tables, b, settings.loop, settings.seed, settings.window_size,
                                                settings.sampling_rules, updates=settings.updates_drawn),
                          heldout=list(task.heldout_prompts()), policy_info=policy_info, lineage=lineage,
                          policy_version=policy_version, start_step=start_step, history=history, reward_terms=terms)
        if settings.async_loop:
            _start_async(run, mode, None if whole is None else whole["model"])
        else:
            run.stored_through = store.max_step() if mode != "new" else -1
            run.sampler.used_through = usage.max_learner_step() if mode != "new" else -1
            run.window_end = store.seq_end(run.start_step - 1) if run.start_step > 0 else 0
        if ranks is not None:  # after the restore: every rank starts from rank 0's state
            ranks.begin(learner, model.config.to_dict(), kwargs, watch, whole)
            run.ranks = ranks
        if mode != "new":
            log(f"{mode} {run.run_id} at step {run.start_step} (policy version {run.policy_version}): "
                + _kept(run))
        return run
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise


def _start_ranks(settings: Settings, log: Callable[[str], Any]) -> LearnerRanks:
    """The learner's other data-parallel ranks (learner.world_size - 1), started by
    loop.engine (child processes, or Ray actors in their placement group) and joined in one
    process group with this process as rank 0."""
    ln, device = settings.learner, resolve_device(settings.model.device)
    launch, host, close = launch_processes, "127.0.0.1", None
    if settings.loop.engine == "ray":
        actors = ActorLauncher(settings, device.type, log)
        launch, host, close = actors.launch, actors.host, actors.close
    return LearnerRanks.start(ln.world_size, ln.timeout, ln.backend, device, settings.model.torch_threads, launch,
                              host=host, log=log, on_close=close)


def _kept(run: TrainingRun) -> str:
    """What a resume or fork keeps, in its own words: the sync loop replays the stored steps
    without generating them again; the async loop keeps every stored rollout as buffer data."""
    if run.settings.async_loop:
        return (f"{run.window_end:,} stored rollouts kept as buffer data (the async loop does not "
                "replay steps: its generators go on from the newest weights)")
    steps = max(run.stored_through - run.start_step + 1, 0)
    return f"{steps} steps of rollouts already stored will be reused, not regenerated"


def _start_async(run: TrainingRun, mode: str, whole: dict[str, Any] | None) -> None:
    """Publish the starting weights for the generator processes (`whole`: a sharded learner's,
    as one process holds them) and clear the STOP flag. On resume, the usage records of learner
    steps the checkpoint does not contain are deleted (they describe updates lost with the
    stopped learner; the async loop is not replayed step by step), while every stored rollout
    stays buffer data."""
    run.weights = WeightStore(run.paths.run_dir / "weights")
    run.weights.publish_base(run.learner.model, run.tokenizer, whole)
    run.weights.publish(run.learner.state_dict() if whole is None else whole, run.policy_version)
    run.control = AsyncDir.of(run.paths.run_dir)
    run.control.reset()
    run.accounting.workers = run.control.totals(run.settings.loop.workers)  # a resume's earlier batches
    if mode == "resume":
        run.usage.table.delete(f"learner_step >= {int(run.learner.steps)}")
    run.window_end = run.store.count()
