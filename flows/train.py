"""The training flow: generate, score, append, sample, learn; evaluate and checkpoint.

    python -m flows.train                                  # embedded defaults, no server
    python -m flows.train buffer.capacity=512 algo.lr=3e-4 # Hydra overrides
    python -m flows.train experiment=no_buffer             # the on-policy baseline preset
    python -m flows.train --help | --cfg                   # groups and options | resolved config
    python -m flows.train resume=<run_id> [loop.steps=N]   # continue from the newest checkpoint
    python -m flows.train fork=<run_id>@<step> algo.lr=1e-4  # a new run from a checkpoint

Stopping: Ctrl-C marks the MLflow run KILLED; SIGTERM (what `kill`, Docker and Prefect send)
marks it KILLED and the Prefect flow run CRASHED (Prefect's own SIGTERM handler); either way
`resume=<run_id>` continues from the newest checkpoint without losing a stored rollout.

The flow only wires library calls (replay_pipeline.trainer.TrainingRun). Consecutive rounds
run as one Prefect task (`rounds-FIRST-LAST`, at most loop.rounds_per_task = 10 rounds, ending
where an evaluation or a checkpoint falls due; the async loop adds one long `generator-W` task
per generator process), and evaluations and checkpoints are tasks of their own, so the UI shows
the run's progress with its timing; every round's per-phase timings (generate, score, append,
sample, learn) are MLflow metrics at its own step. A Prefect task costs 4-11 ms here, 2-3% of
a default round, which is why a task covers several rounds (loop.rounds_per_task=1: one per
round; see the overhead benchmark in the README).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import flows  # noqa: F401  (sets Prefect's environment before prefect is imported)
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import ExternalSignal
from prefect.utilities.annotations import quote

from replay_pipeline.async_loop import (Heartbeat, any_alive, check_dask_scheduler, check_generators, dask_client,
                                        run_dask_worker, run_worker_process, wait_until_ready)
from replay_pipeline.buffer.lance_table import StoreError
from replay_pipeline.checkpoints import CheckpointError
from replay_pipeline.config import CONF_DIR, ConfigError
from replay_pipeline.resume import resolve_config
from replay_pipeline.runs import ensure_writable
from replay_pipeline.trainer import TrainingRun
from flows.progress import Progress, quiet_prefect_task_logs, summary_text

_task = dict(cache_policy=NO_CACHE, persist_result=False)


def _say(message: str) -> None:
    # Warm-start progress goes to the terminal: task-run INFO logs are silenced for the bar.
    print(message, flush=True)


@task(name="setup", **_task)
def setup_task(cfg) -> TrainingRun:
    return TrainingRun.setup(cfg, log=_say)


@task(name="rounds", task_run_name="rounds-{first}-{last}", **_task)
def rounds_task(run: TrainingRun, first: int, last: int, progress: Progress, alive=None,
                after_round=None) -> None:
    """Rounds `first`..`last` (inclusive), each logged at its own step with the compute ledger.
    Sync (`alive` None): generate, score, append, sample, learn (TrainingRun.round). Async: the
    learner's round, waiting for rollouts, sampling, K learner steps, publishing
    (TrainingRun.async_round), then `after_round()`."""
    for step in range(first, last + 1):
        metrics = run.round(step) if alive is None else run.async_round(step, alive)
        run.log(step, metrics | run.compute_metrics())  # before the checkpoint that covers this step
        progress.update(step)
        if after_round is not None:
            after_round()


@task(name="evaluate", task_run_name="evaluate-v{version}", **_task)
def evaluate_task(run: TrainingRun, version: int, sampled: bool = False) -> dict[str, float]:
    return run.evaluate(version, sampled=sampled)


@task(name="checkpoint", task_run_name="checkpoint-{step}", retries=1, **_task)
def checkpoint_task(run: TrainingRun, step: int) -> str:
    return str(run.checkpoint(step))


def _close_stale_flow_runs(run: TrainingRun) -> None:
    """Record this flow run in the run's run.json, and mark CRASHED the run's earlier flow runs
    that Prefect still shows RUNNING: a process killed with SIGKILL never reports its end, and a
    resume is the first moment anyone knows it is gone."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run
    from prefect.states import Crashed

    previous = run.note_flow_run(str(flow_run.id)) if flow_run.id else []
    if not previous:
        return
    with get_client(sync_client=True) as client:
        for flow_run_id in previous:
            try:
                state = client.read_flow_run(UUID(flow_run_id)).state
            except Exception:  # another Prefect server's run, or deleted: nothing to fix here
                continue
            if state is not None and state.is_running():
                client.set_flow_run_state(
                    UUID(flow_run_id), Crashed(message=f"the process stopped without reporting; run "
                                                       f"{run.run_id} was resumed by flow run {flow_run.id}"),
                    force=True)


def _due(every: int, done: int, total: int) -> bool:
    return done == total or (every > 0 and done % every == 0)


def _extras_due(loop, done: int) -> tuple[bool, bool, bool]:
    """After `done` rounds: (evaluate, sampled evaluation, checkpoint) due."""
    sampled = _due(loop.passk_every, done, loop.steps)
    return (sampled or _due(loop.eval_every, done, loop.steps), sampled,
            _due(loop.checkpoint_every, done, loop.steps))


def segments(loop, start: int) -> list[tuple[int, int]]:
    """The rounds from `start` as (first, last) runs of at most loop.rounds_per_task rounds,
    each ending where an evaluation or a checkpoint falls due (so a task's rounds are never
    split by one)."""
    out, first = [], start
    while first < loop.steps:
        last = first
        while last + 1 < loop.steps and last + 1 - first < loop.rounds_per_task and not any(_extras_due(loop, last + 1)):
            last += 1
        out.append((first, last))
        first = last + 1
    return out


def _rounds(run: TrainingRun, progress: Progress, alive=None, after_round=None) -> None:
    """The loop's rounds as `rounds-FIRST-LAST` Prefect tasks (segments), with evaluations and
    checkpoints between them (timed as scheduled extras, outside the overhead figure)."""
    loop = run.settings.loop
    run.start_loop()
    for first, last in segments(loop, run.start_step):
        # quote(): Prefect would otherwise walk every element of `run` on each task call to
        # look for upstream futures (measured: 2/3 of a step's wall time).
        rounds_task(quote(run), first, last, quote(progress), alive, quote(after_round))
        done = last + 1
        extras = time.perf_counter()
        evaluate, sampled, checkpoint = _extras_due(loop, done)
        if evaluate:
            run.log(done, evaluate_task(quote(run), run.policy_version, sampled=sampled))
        if checkpoint:
            checkpoint_task(quote(run), done)
        run.scheduled_seconds += time.perf_counter() - extras


@task(name="generator", task_run_name="generator-{worker}", **_task)
def generator_task(run: TrainingRun, cfg_container: dict, worker: int, registry: dict, client=None,
                   session: str | None = None) -> dict[str, float]:
    """One generator of the async loop, alive as long as the learner runs: a child process
    (loop.engine=local) or a task on the Dask cluster of `client` (loop.engine=dask) that this
    Prefect task supervises from the flow's process (replay_pipeline/async_loop.py says why)."""
    if client is None:
        return run_worker_process(cfg_container, run.run_id, worker, run.control, registry, session)
    return run_dask_worker(client, cfg_container, run.run_id, worker, run.control, registry, session)


def _worker_config(run: TrainingRun) -> dict[str, Any]:
    """The resolved configuration the generators rebuild themselves from, with the run root
    (and a local buffer.uri) made absolute: a Dask worker's working directory is its own."""
    from pathlib import Path

    from omegaconf import OmegaConf

    container = OmegaConf.to_container(run.cfg, resolve=True)
    container["run_id"] = run.run_id
    container["tracking"]["root_dir"] = str(run.paths.root)
    uri = container["buffer"].get("uri")
    if uri and "://" not in str(uri):
        container["buffer"]["uri"] = str(Path(str(uri)).expanduser().resolve())
    return container


def _stop_generators(run: TrainingRun, futures: list, registry: dict[int, Any]) -> None:
    run.control.stop()
    for future in futures:
        future.wait(timeout=120)
    for proc in registry.values():  # a worker that ignored STOP for 2 minutes
        if proc.is_alive():
            proc.kill()


def _async_rounds(run: TrainingRun, progress: Progress) -> None:
    """The learner's side of the async loop; the generators run as concurrent Prefect tasks,
    each supervising one generator process or Dask task (replay_pipeline/async_loop.py),
    while a heartbeat thread tells them the learner is alive."""
    from contextlib import ExitStack

    loop = run.cfg.loop
    container = _worker_config(run)
    registry: dict[int, Any] = {}
    with ExitStack() as stack:  # closed in reverse: generators stopped, cluster closed, heartbeat ended
        heartbeat = stack.enter_context(Heartbeat(run.control, loop.heartbeat_timeout))
        client = stack.enter_context(dask_client(loop.workers, loop.dask_address, log=_say)) \
            if loop.engine == "dask" else None
        futures = [generator_task.submit(quote(run), quote(container), w, quote(registry), quote(client),
                                         heartbeat.session) for w in range(loop.workers)]
        stack.callback(_stop_generators, run, futures, registry)
        alive = quote(lambda: any_alive(registry, loop.workers))
        try:
            wait_until_ready(run.control, registry, loop.workers)
            # After each round: a crashed generator ends the run now.
            _rounds(run, progress, alive, after_round=lambda: check_generators(run.control, registry))
        except Exception:
            # The learner stopped on an error; when a generator failed first (which is why the
            # learner found none alive), fail with the generator's own error instead.
            _stop_generators(run, futures, registry)
            for future in futures:
                if future.state.is_failed():
                    future.result()
            raise
    for future in futures:
        future.result()  # a generator that crashed mid-run fails the flow


@flow(name="train")
def train(overrides: list[str] | None = None) -> dict[str, Any]:
    """Train with experience replay; `overrides` are Hydra overrides (`algo.lr=3e-5`,
    `resume=<run_id>`, `fork=<run_id>@<step>`)."""
    cfg = resolve_config(overrides)
    quiet_prefect_task_logs()
    run = setup_task(cfg)
    _close_stale_flow_runs(run)
    loop = cfg.loop
    status = "FAILED"
    progress = Progress(run, enabled=cfg.tracking.progress)
    try:
        if run.start_step == 0:
            run.log(0, evaluate_task(quote(run), 0, sampled=True))
        elif run.start_step >= loop.steps:
            print(f"run {run.run_id} already has {run.start_step} steps (loop.steps={loop.steps}); "
                  "raise loop.steps to train it further", flush=True)
        progress.start()
        (_async_rounds if loop.mode == "async" else _rounds)(run, progress)
        status = "FINISHED"
    except (KeyboardInterrupt, ExternalSignal):  # Ctrl-C, or SIGTERM via Prefect's handler
        status = "KILLED"
        raise
    finally:
        progress.close()
        summary = run.summary(status)
        if status == "FINISHED":
            run.log_final_model()
        run.tracker.log_dict(summary, "summary.json")
        run.finish(status)
    print(summary_text(summary))
    return summary


def _usage() -> str:
    groups = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())
    lines = ["usage: python -m flows.train [--help] [--cfg] [key=value ...] [group=option ...]", "",
             "Config groups (select with group=option):"]
    for g in groups:
        options = sorted(f.stem for f in (CONF_DIR / g).glob("*.yaml"))
        lines.append(f"  {g:<11} {', '.join(options)}")
    lines += ["", "Every key, its default and its meaning: replay_pipeline/config.py "
              "(or --cfg to print the resolved values).",
              "Examples:", "  python -m flows.train buffer.capacity=512 algo.lr=3e-4",
              "  python -m flows.train experiment=no_buffer loop.steps=100",
              "  python -m flows.train model=hf model.path=/path/to/hf/checkpoint",
              "  python -m flows.train resume=RUN_ID loop.steps=800   # continue (and extend) a run",
              "  python -m flows.train fork=RUN_ID@100 algo.lr=1e-4   # new run from a checkpoint"]
    return "\n".join(lines)


def _check_start_point(cfg) -> None:
    """Find (and verify) the checkpoint a resume or fork needs, and check the tables it will
    open, before Prefect starts."""
    from replay_pipeline.buffer import RolloutStore
    from replay_pipeline.buffer.usage import UsageStore
    from replay_pipeline.runs import RunPaths
    from replay_pipeline.trainer import _start_point

    mode = "resume" if cfg.resume else "fork"
    paths = RunPaths.make(cfg.tracking.root_dir, cfg.resume or cfg.run_id or "pending-fork")
    _start_point(cfg, mode, paths, log=_say)
    table_run = cfg.resume if mode == "resume" else cfg.fork.partition("@")[0]
    uri = cfg.buffer.uri or str(paths.lancedb)
    opts = cfg.buffer.storage_options  # an unreachable object store was refused by validate
    RolloutStore.open(uri, table_run, storage_options=opts)  # a missing table or a schema mismatch is refused here
    UsageStore.open(uri, table_run, storage_options=opts)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(_usage())
        return 0
    show_cfg = "--cfg" in argv
    overrides = [a for a in argv if a != "--cfg"]
    bad = [a for a in overrides if a.startswith("-")]
    if bad:
        print(f"error: unknown flag(s) {bad}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        cfg = resolve_config(overrides)  # fail before Prefect, MLflow or any model is touched
        ensure_writable(cfg.tracking.root_dir)
        if cfg.resume is not None or cfg.fork is not None:
            _check_start_point(cfg)
        if cfg.loop.mode == "async" and cfg.loop.engine == "dask" and cfg.loop.dask_address:
            check_dask_scheduler(cfg.loop.dask_address)  # an unreachable scheduler fails here
    except (ConfigError, PermissionError, CheckpointError, StoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if show_cfg:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(cfg))
        return 0
    start = time.perf_counter()
    train(overrides)
    print(f"total time {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
