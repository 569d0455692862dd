"""The training loop on one screen: a round, an async round, and the schedule of evaluations
and checkpoints around them. Read it top to bottom; everything it calls is a phase of the run
(replay_pipeline/run/phases.py).

    evaluate(0) ─► [ round(step) ... ] ─► evaluate / checkpoint when due ─► [ rounds ... ] ─► ...

A **sync round** generates R rollouts with the current policy, scores them, appends them to
the rollout table, draws K minibatches of B from the buffer's window and takes K learner steps
(then publishes the weights: policy version + 1). An **async round** is the learner's half
only: the generator workers (replay_pipeline/run/workers.py) generate, score and append on
their own, so the round waits for rollouts, draws, learns and publishes.

Consecutive rounds run as one unit (`segments`: at most loop.rounds_per_task, ending where a
checkpoint falls due, so a unit's rounds are never split by one). The evaluations that fall due
inside a unit are part of it (`Evaluation`, run after the round that makes them due): one
Prefect task holds them all, since a task run costs about as much CPU as a tenth of a default
round, on the cores torch is using (docs/performance.md, "Prefect's cost per task run"). How a
unit and a checkpoint are run is the caller's: `train_loop` calls them directly unless given
wrappers (flows/train.py makes each a Prefect task, so the UI shows the run's progress).
Evaluations and checkpoints are timed as scheduled extras, outside the overhead figure. A
stop request (Ctrl-C, SIGTERM: replay_pipeline/system/stopping.py) raises RunStopped before the
next round, never inside one's writes. This module must not import Prefect, MLflow or the flows.
"""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from replay_pipeline.system import faults, stopping
from replay_pipeline.system.heap import freeze_startup_heap
from replay_pipeline.run.files import Heartbeat
from replay_pipeline.run.phases import TrainingRun
from replay_pipeline.run.ray_engine import ray_generators
from replay_pipeline.run.workers import any_alive, check_generators, wait_until_ready, worker_config


def sync_round(run: TrainingRun, step: int) -> dict[str, float]:
    """Generate, score, append, sample and learn."""
    table, metrics = run.score(run.generate(step))
    metrics |= run.append(table, step)
    minibatches, sampled = run.sample(step)
    return metrics | sampled | run.learn(minibatches, step)


def async_round(run: TrainingRun, step: int, alive: Callable[[], bool]) -> dict[str, float]:
    """Wait for rollouts (and the replay cap), compact when due (the learner compacts for
    every writer, on the writer thread while it samples and trains), sample, learn and
    publish; plus what the generators added since the previous round."""
    metrics = {"learn/wait_seconds": run.wait_for_rollouts(alive)}
    run.tables.compact_behind(step)
    minibatches, sampled = run.sample(step)
    metrics |= sampled | run.learn(minibatches, step)
    return metrics | run.generators_report()


def run_rounds(run: TrainingRun, first: int, last: int, progress: Callable[[int], Any] | None = None,
               alive: Callable[[], bool] | None = None, after_round: Callable[[], Any] | None = None) -> None:
    """Rounds `first`..`last` (inclusive), each logged at its own step with the compute ledger
    (before the checkpoint that covers it). Sync unless `alive` (the async generators'
    liveness) is given; `after_round` runs after each (the async loop's generator check)."""
    for step in range(first, last + 1):
        stopping.check(f"the rounds, before step {step}")
        metrics = sync_round(run, step) if alive is None else async_round(run, step, alive)
        run.log(step, metrics | run.compute_metrics())
        if progress is not None:
            progress(step)
        if after_round is not None:
            after_round()


def due(every: int, done: int, total: int) -> bool:
    return done == total or (every > 0 and done % every == 0)


def extras_due(loop: Any, done: int) -> tuple[bool, bool, bool]:
    """After `done` rounds: (evaluate, sampled evaluation, checkpoint) due."""
    sampled = loop.passk_every > 0 and due(loop.passk_every, done, loop.steps)
    return (sampled or due(loop.eval_every, done, loop.steps), sampled,
            due(loop.checkpoint_every, done, loop.steps))


def segments(loop: Any, start: int) -> list[tuple[int, int]]:
    """The rounds from `start` as (first, last) runs of at most loop.rounds_per_task rounds,
    each ending where a checkpoint falls due."""
    out, first = [], start
    while first < loop.steps:
        last = first
        while last + 1 < loop.steps and last + 1 - first < loop.rounds_per_task and not extras_due(loop, last + 1)[2]:
            last += 1
        out.append((first, last))
        first = last + 1
    return out


@dataclass(frozen=True)
class Evaluation:
    """An evaluation due inside a unit, run by the unit after the round that makes `done`
    rounds: `evaluation(run)` evaluates the policy then current, logs the metrics at step
    `done` and returns them, timed as a scheduled extra. `version` is the policy version it
    will see; a unit's wrapper names itself after its evaluations."""
    done: int
    sampled: bool
    version: int

    def __call__(self, run: TrainingRun) -> dict[str, float]:
        began = time.perf_counter()
        metrics = run.evaluate(run.policy_version, self.sampled)
        run.accounting.scheduled_seconds += time.perf_counter() - began
        _log_evaluation(run, self.done, metrics)
        return metrics


def evaluations_due(loop: Any, first: int, last: int, version: int) -> list[Evaluation]:
    """The evaluations due after rounds `first`..`last` of a unit starting at policy version
    `version` (each round publishes one), in order."""
    out = []
    for done in range(first + 1, last + 2):
        evaluate, sampled, _ = extras_due(loop, done)
        if evaluate:
            out.append(Evaluation(done, sampled, version + done - first))
    return out


def evaluate_start(run: TrainingRun, evaluate: Callable[[int, bool], dict] | None = None) -> None:
    """The starting policy's evaluation (greedy and sampled), for a run at step 0."""
    if run.start_step == 0:
        loop, sampled = run.settings.loop, run.settings.loop.passk_every > 0
        print(f"evaluating the starting policy: {evaluation_size(loop, len(run.heldout), sampled)}", flush=True)
        began = time.perf_counter()
        metrics = (evaluate or run.evaluate)(0, sampled)
        run.accounting.start_eval_seconds += time.perf_counter() - began
        print(f"starting evaluation done in {time.perf_counter() - began:.0f} s", flush=True)
        _log_evaluation(run, 0, metrics)


def evaluation_size(loop: Any, prompts: int, sampled: bool) -> str:
    """What an evaluation generates, in words: greedy on the held-out prompts, and with
    `sampled` loop.pass1_samples and loop.eval_samples completions of each."""
    if not sampled:
        return f"greedy on {prompts} held-out prompts ({prompts} completions; loop.passk_every=0: no pass@k)"
    total = prompts * (1 + loop.pass1_samples + loop.eval_samples)
    return (f"greedy, pass@1 ({loop.pass1_samples} a prompt) and pass@k ({loop.eval_samples} a prompt) on {prompts} "
            f"held-out prompts ({total} completions; fewer: task.heldout_size, loop.eval_samples, loop.passk_every=0)")


def _log_evaluation(run: TrainingRun, done: int, metrics: Any) -> None:
    """Log an evaluation's metrics, unless it was stopped (a wrapper's stopped evaluation
    returns no metrics: then RunStopped, in the caller)."""
    if isinstance(metrics, dict):
        run.log(done, metrics)
    stopping.check("the evaluation")


def run_unit(run: TrainingRun, first: int, last: int, evaluations: Sequence[Evaluation] = (),
             progress: Callable[[int], Any] | None = None, alive: Callable[[], bool] | None = None,
             after_round: Callable[[], Any] | None = None,
             evaluated: Callable[[Evaluation, dict[str, float]], Any] | None = None) -> None:
    """A unit: rounds `first`..`last` (run_rounds), each of `evaluations` after the round that
    makes it due, then `evaluated(evaluation, metrics)` when given."""
    step = first
    for evaluation in evaluations:
        run_rounds(run, step, evaluation.done - 1, progress, alive, after_round)
        metrics = evaluation(run)
        if evaluated is not None:
            evaluated(evaluation, metrics)
        step = evaluation.done
    run_rounds(run, step, last, progress, alive, after_round)


def train_loop(run: TrainingRun, unit: Callable[[int, int, list[Evaluation]], Any] | None = None,
               checkpoint: Callable[[int], Any] | None = None) -> None:
    """Every round from run.start_step to loop.steps, with the evaluations and checkpoints
    that fall due. `unit(first, last, evaluations)` (rounds first..last with the evaluations
    due among them: run_unit) and `checkpoint(done)` default to running them here."""
    unit = unit or (lambda first, last, evaluations: run_unit(run, first, last, evaluations))
    checkpoint = checkpoint or run.checkpoint
    loop = run.settings.loop
    # a command's libraries and the built run: never walked by the collector again (heap.py)
    run.accounting.start_loop(frozen_objects=freeze_startup_heap())
    if run.start_step < loop.steps:
        run.log(run.start_step, run.accounting.startup_metrics())
    for first, last in segments(loop, run.start_step):
        stopping.check(f"the rounds, before step {first}")
        unit(first, last, evaluations_due(loop, first, last, run.policy_version))
        stopping.check("the rounds")  # a wrapper's stopped unit returns (its state says where)
        faults.crash_point("between_tasks", last)
        if extras_due(loop, last + 1)[2]:
            extras = time.perf_counter()
            checkpoint(last + 1)
            run.accounting.scheduled_seconds += time.perf_counter() - extras


@contextmanager
def generators_running(run: TrainingRun, supervise: Callable[..., Any], log: Callable[[str], Any] = print
                       ) -> Iterator[tuple[Callable[[], bool], Callable[[], None]]]:
    """The async loop's generators, alive for the body of the `with`: a heartbeat thread, the
    Ray connection and placement group (loop.engine=ray: `RayGenerators`), one supervisor per generator started with
    `supervise(worker, container, registry, client, session)` (it returns a future with
    `wait(timeout)`, `result()` and `state`: flows/train.py submits a Prefect task), all
    generators ready before the first round. Yields (alive, check): whether any generator is
    alive, and a check that raises if one ended. On leaving, STOP is written and the
    generators are waited for (killed after 2 minutes); a generator that failed fails the run
    with its own error, also when the learner failed because none was left alive."""
    loop = run.settings.loop
    container = worker_config(run.settings, run.paths)
    registry: dict[int, Any] = {}
    futures: list = []
    with ExitStack() as stack:  # closed in reverse: generators stopped, cluster closed, heartbeat ended
        heartbeat = stack.enter_context(Heartbeat(run.control, loop.heartbeat_timeout))
        client = stack.enter_context(ray_generators(run.settings, log=log)) if loop.engine == "ray" else None
        futures += [supervise(w, container, registry, client, heartbeat.session) for w in range(loop.workers)]
        stack.callback(_stop_generators, run, futures, registry)
        try:
            wait_until_ready(run.control, registry, loop.workers)
            yield (lambda: any_alive(registry, loop.workers)), (lambda: check_generators(run.control, registry))
        except Exception:
            _stop_generators(run, futures, registry)
            for future in futures:
                if future.state.is_failed():
                    future.result()
            raise
    for future in futures:
        future.result()  # a generator that crashed mid-run fails the run


def _stop_generators(run: TrainingRun, futures: list, registry: dict[int, Any]) -> None:
    run.control.stop()
    for future in futures:
        future.wait(timeout=120)
    for proc in registry.values():  # a worker that ignored STOP for 2 minutes
        if proc.is_alive():
            proc.kill()
