"""The training flow: generate, score, append, sample, learn; evaluate and checkpoint.

    python -m flows.train                                  # embedded defaults, no server
    python -m flows.train buffer.capacity=512 algo.lr=3e-4 # Hydra overrides
    python -m flows.train experiment=no_buffer             # the on-policy baseline preset
    python -m flows.train --help | --cfg                   # groups and options | resolved config
    python -m flows.train resume=<run_id> [loop.steps=N]   # continue from the newest checkpoint
    python -m flows.train fork=<run_id>@<step> algo.lr=1e-4  # a new run from a checkpoint
    python -m flows.train resume=last                      # the newest run under tracking.root_dir
    python -m flows.train --config-dir ~/presets task=mine # your presets: DIR/<group>/<option>.yaml

The first line printed is the run id and the resume command. One process drives a run
(replay_pipeline/system/lease.py): a second `train` or `resume=` on a live run is refused before any
work (exit code 2), naming the holder. Stopping: Ctrl-C and SIGTERM ask the run to stop at its
next safe point (replay_pipeline/system/stopping.py): it ends within seconds with one line, exit code
128 + the signal, MLflow KILLED, the Prefect flow run CANCELLED, and `resume=<run_id>`
continues from the newest checkpoint without losing a stored rollout. Without PREFECT_API_URL
the flow talks to a temporary server of its own (flows/prefect_server.py) that a terminal's
Ctrl-C does not reach and that ends with the trainer.

The flow only wraps library calls in Prefect tasks: the loop and its schedule are
replay_pipeline/run/loop.py's (`train_loop`), the run is built by replay_pipeline/run/build.py,
and the configuration is checked (replay_pipeline/run/preflight.py) before Prefect starts.
Consecutive rounds run as one Prefect task (`rounds-FIRST-LAST`, at most loop.rounds_per_task = 10 rounds, ending
where a checkpoint falls due; the async loop adds one long `generator-W` task
per generator process). The evaluations that fall due among a task's rounds run inside it,
after the round that makes them due: the task is then named `rounds-FIRST-LAST+evaluate-vN`
(`+evaluate-vA,vB` for several) and logs what each found (`evaluated policy vN after step N:
held-out accuracy ... (... s)`); the starting policy's evaluation (`evaluate-v0`) and
checkpoints (`checkpoint-N`) are tasks of their own. So the UI shows the run's progress with its timing;
every round's per-phase timings (generate, score, append, sample, learn) and every
evaluation's seconds are MLflow metrics at their own step. A Prefect task run costs the
trainer and its private server together about as much CPU as a tenth of a default round
(`python -m replay_pipeline.benchmarks.orchestration` measures it; docs/performance.md,
"Prefect's cost per task run"), which is why a task covers several rounds
(loop.rounds_per_task=1: one per round) and why an evaluation neither has a task of its own
nor ends one: either would add a task run at every evaluation.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # answer --help and configuration errors before Prefect and torch load
    from replay_pipeline.system.heap import defer_full_collections

    defer_full_collections()  # no full collection walks the heap while the libraries load (heap.py)
    from flows.usage import answer_early as _answer_early, names_a_live_run as _names_a_live_run

    if not {"-h", "--help", "--cfg"} & set(sys.argv[1:]) and not _names_a_live_run(sys.argv[1:]):
        # Prefect's temporary server boots (5-9 s of CPU) on the other core while this process
        # checks the configuration (its validation loads torch, transformers and lancedb: ~5 s)
        # and builds the run. A command line that is then refused stops it again at exit; one
        # that names a live run of another process is refused for sure, and boots none.
        from flows.prefect_server import launch as _launch_server

        _launch_server()

    _code = _answer_early(sys.argv[1:])
    if _code is not None:
        sys.exit(_code)
    _ANSWERED_EARLY = list(sys.argv[1:])  # main() need not compose the command line a second time

import functools
import logging
import os
import shutil
import signal
import tempfile
import time
import traceback
from datetime import datetime, timezone
from typing import Any
from uuid import UUID

import flows  # noqa: F401  (sets Prefect's environment before prefect is imported)
from omegaconf import OmegaConf
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.exceptions import ExternalSignal, MissingContextError
from prefect.runtime import flow_run
from prefect.states import Cancelled, Crashed, State
from prefect.utilities.annotations import quote

from replay_pipeline.system import stopping
from replay_pipeline.buffer.lance_table import StoreError
from replay_pipeline.training.checkpoints import CheckpointError
from replay_pipeline.config import ConfigError
from replay_pipeline.run.resume import resolve_config
from replay_pipeline.system.lease import LeaseHeld, acquire
from replay_pipeline.run.build import build_run, run_mode
from replay_pipeline.run.loop import Evaluation, evaluate_start, generators_running, run_unit, train_loop
from replay_pipeline.run.lineage import note_flow_run
from replay_pipeline.run.phases import TrainingRun
from replay_pipeline.run.preflight import check_start_point, preflight
from replay_pipeline.run.ray_engine import run_ray_worker
from replay_pipeline.run.workers import run_worker_process
from replay_pipeline.reports.run_plots import run_plots
from replay_pipeline.system.runs import RunPaths
from flows.prefect_server import temporary_server
from flows.usage import answer_early, command_line, early_config, say
from flows.progress import UI_ONLY, Progress, filter_console, quiet_prefect_task_logs, summary_text

_task = dict(cache_policy=NO_CACHE, persist_result=False)


def _stoppable(body):
    """A task body that ends as a CANCELLED task run when the run is asked to stop inside it
    (replay_pipeline/system/stopping.py), instead of failing with a traceback; the loop then sees
    the request and the flow ends the run."""
    @functools.wraps(body)
    def wrapper(*args, **kwargs):
        try:
            return body(*args, **kwargs)
        except stopping.RunStopped as exc:
            return Cancelled(message=str(exc))
    return wrapper


def _say(message: str) -> None:
    """Set-up progress (the warm start's among it): printed for the terminal (task runs' INFO
    lines are kept off the console for the progress bar) and logged to the task run, so the
    Prefect UI shows it too."""
    print(message, flush=True)
    try:
        get_run_logger().info(message, extra=UI_ONLY)  # printed above for the terminal
    except MissingContextError:  # called outside a flow or task run
        pass


def _announce(run: TrainingRun) -> None:
    """The run's identity in the flow run's logs: run id, its MLflow run and how to resume."""
    tracker = run.tracker
    where = getattr(tracker, "uri", None)
    experiment = getattr(tracker, "experiment_id", None)
    link = (f"MLflow {where.rstrip('/')}/#/experiments/{experiment}/runs/{tracker.run_id}?workflowType=machine_learning"
            if where and where.startswith("http") and experiment else f"MLflow run {tracker.run_id} at {where}")
    get_run_logger().info(f"run {run.run_id} ({run.lineage.get('mode', 'new')}) under {run.paths.root}; {link}; "
                          f"{resume_hint(run.run_id)}", extra=UI_ONLY)  # the CLI printed its own first line


def _report(run: TrainingRun, summary: dict[str, Any]) -> None:
    """The closing summary in the flow run's logs, as a markdown artifact, and as the MLflow
    run's description (its one paragraph on the run page)."""
    text = summary_text(summary).strip()
    get_run_logger().info(text, extra=UI_ONLY)  # the CLI prints it at the end
    key = "summary-" + "".join(c if c.isalnum() else "-" for c in run.run_id.lower())
    create_markdown_artifact(markdown="```\n" + text + "\n```", key=key[:100],
                             description=f"run {run.run_id}: the summary flows.train prints")
    run.tracker.set_tags({"mlflow.note.content": text})
    client = getattr(run.tracker, "client", None)
    if client is not None:  # its own plots, on the run's page (a sweep's report compares runs)
        run.tracker.flush()
        with tempfile.TemporaryDirectory() as folder:
            if run_plots(client, run.tracker.run_id, folder, title=run.run_id):
                run.tracker.log_artifacts(folder, "plots")


@task(name="setup", task_run_name="setup", **_task)
@_stoppable
def setup_task(cfg) -> TrainingRun:
    return build_run(cfg, log=_say)


def _unit_name(parameters: dict[str, Any]) -> str:
    """`rounds-FIRST-LAST`, then `+evaluate-vN` (or `+evaluate-vA,vB,...`) for the policy
    versions evaluated among them."""
    name = f"rounds-{parameters['first']}-{parameters['last']}"
    versions = ",".join(f"v{evaluation.version}" for evaluation in parameters.get("evaluations") or ())
    return f"{name}+evaluate-{versions}" if versions else name


@task(name="rounds", task_run_name=_unit_name, **_task)
@_stoppable
def rounds_task(run: TrainingRun, first: int, last: int, evaluations: list[Evaluation], progress: Progress,
                alive=None, after_round=None) -> None:
    """Rounds `first`..`last` with the evaluations due among them (replay_pipeline.run.loop.run_unit):
    sync, or the async learner's rounds when `alive` (the generators' liveness) is given. Each
    evaluation leaves a line in the task's log (the Prefect UI's) saying what it found."""
    def evaluated(evaluation: Evaluation, metrics: dict[str, float]) -> None:
        get_run_logger().info(f"evaluated policy v{evaluation.version} after step {evaluation.done}: held-out "
                              f"accuracy {metrics['eval/accuracy']:.3f} ({metrics['eval/seconds']:.1f} s)")

    run_unit(run, first, last, evaluations, progress.update, alive, after_round, evaluated)


@task(name="evaluate", task_run_name="evaluate-v{version}", **_task)
@_stoppable
def evaluate_task(run: TrainingRun, version: int, sampled: bool = False) -> dict[str, float]:
    """The starting policy's evaluation (the later ones run inside the rounds tasks)."""
    return run.evaluate(version, sampled=sampled)


@task(name="checkpoint", task_run_name="checkpoint-{step}", retries=1, **_task)
def checkpoint_task(run: TrainingRun, step: int) -> str:
    return str(run.checkpoint(step))


@task(name="generator", task_run_name="generator-{worker}", **_task)
def generator_task(run: TrainingRun, cfg_container: dict, worker: int, registry: dict, client=None,
                   session: str | None = None) -> dict[str, float]:
    """One generator of the async loop, alive as long as the learner runs: a child process
    (loop.engine=local) or an actor in its bundle of the Ray placement group `client`
    (loop.engine=ray, replaced when it dies), that this Prefect task supervises from the
    flow's process (replay_pipeline/run/ray_engine.py says why)."""
    if client is None:
        return run_worker_process(cfg_container, run.run_id, worker, run.control, registry, session)
    return run_ray_worker(client, cfg_container, run.run_id, worker, run.control, registry, session)


def _close_stale_flow_runs(cfg) -> None:
    """Record this flow run in the run's run.json (before the warm start, so a run killed
    there is known), and mark CRASHED the run's earlier flow runs that Prefect still shows
    RUNNING: a process killed with SIGKILL never reports its end, and a resume is the first
    moment anyone knows it is gone."""
    if not flow_run.id:
        return
    paths = RunPaths.make(cfg.tracking.root_dir, run_mode(cfg)[1])
    previous = note_flow_run(paths, str(flow_run.id))
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
                                                       f"{paths.run_id} was resumed by flow run {flow_run.id}"),
                    force=True)


def _loop(run: TrainingRun, progress: Progress, alive=None, after_round=None) -> None:
    """replay_pipeline.run.loop.train_loop with its units as Prefect tasks. quote(): Prefect
    would otherwise walk every element of `run` on each task call to look for upstream
    futures (measured: 2/3 of a step's wall time)."""
    train_loop(run,
               unit=lambda first, last, evaluations: rounds_task(quote(run), first, last, quote(evaluations),
                                                                 quote(progress), quote(alive), quote(after_round)),
               checkpoint=lambda done: checkpoint_task(quote(run), done))


def _async_loop(run: TrainingRun, progress: Progress) -> None:
    """The learner's side of the async loop; the generators run as concurrent Prefect tasks,
    each supervising one generator process or Ray actor (replay_pipeline/run/loop.py,
    generators_running)."""
    def supervise(worker, container, registry, client, session):
        return generator_task.submit(quote(run), quote(container), worker, quote(registry), quote(client), session)

    with generators_running(run, supervise, log=_say) as (alive, check):
        _loop(run, progress, alive, after_round=check)  # a crashed generator ends the run after its round


def resume_hint(run_id: str) -> str:
    return f"resume with: python -m flows.train resume={run_id}"


class _NoTracebacksOnTheConsole(logging.Filter):
    """Prefect's console lines without the tracebacks of failed task and flow runs: a failure
    ends in one line naming the error and the file that holds its traceback (`_failed`). The
    Prefect API (the UI) still receives the full records: its handlers sit on Prefect's own
    loggers and run before the record reaches the console handler on the root logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.name.startswith("prefect"):
            record.exc_info = record.exc_text = None  # the line stays, its traceback goes
        return True


def _failed(paths: RunPaths, exc: BaseException, where: str, tracker: Any = None) -> BaseException:
    """An unexpected error: its traceback appended to <run_dir>/errors.log (and the MLflow run's
    artifacts), and the one line the CLI prints added to it as a note (`failure_line`); the
    error itself is raised on, so the flow run FAILS with it and a caller of the flow gets it."""
    text = "".join(traceback.format_exception(exc))
    log = paths.run_dir / "errors.log"
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a", encoding="utf-8") as out:
            out.write(f"--- {stamp} run {paths.run_id}, {where} (pid {os.getpid()})\n{text}\n")
        shown = str(log)
    except OSError as write_error:  # a full disk: the traceback goes to the console after all
        shown = f"(not written: {write_error})\n{text}"
    if tracker is not None:
        try:
            tracker.log_text(text, "errors.log")
        except Exception:  # noqa: BLE001 - the tracking store may be what failed
            pass
    message = " ".join(f"{type(exc).__name__}: {exc}".split())
    if len(message) > 300:
        message = message[:297] + "..."
    exc.add_note(f"{FAILURE}run {paths.run_id} failed {where}: {message}. The traceback is in {shown}; "
                 f"the MLflow run is FAILED; {resume_hint(paths.run_id)} once the cause is fixed")
    return exc


#: The start of the note `_failed` adds.
FAILURE = "replay-pipeline: "


def failure_line(exc: BaseException) -> str | None:
    """The one line `_failed` noted on an error (None if it did not see it)."""
    notes = [n for n in getattr(exc, "__notes__", ()) if n.startswith(FAILURE)]
    return notes[-1][len(FAILURE):] if notes else None


def flow_run_name() -> str:
    """A train flow run's name in the Prefect UI: the run id its overrides give (`run_id=`, or
    `resume=`; the CLI always adds one, a sweep's child carries its configuration and seed),
    else "train" plus the time."""
    named = {}
    for override in (flow_run.parameters or {}).get("overrides") or []:
        key, _, value = str(override).lstrip("+").partition("=")
        if key in ("run_id", "resume") and value and value != "null":
            named[key] = value
    return named.get("run_id") or (f"resume-{named['resume']}" if "resume" in named else
                                   "train-" + datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"))


@flow(name="train", flow_run_name=flow_run_name)
def train(overrides: list[str] | None = None) -> dict[str, Any] | State:
    """Train with experience replay; `overrides` are Hydra overrides (`algo.lr=3e-5`,
    `resume=<run_id>`, `fork=<run_id>@<step>`). A stop request (Ctrl-C, SIGTERM,
    replay_pipeline/system/stopping.py) ends it at the next safe point: MLflow KILLED, and the flow
    run CANCELLED (the returned state) with what to type to resume it."""
    cfg = resolve_config(overrides)
    if cfg.resume is None and cfg.run_id is None:
        cfg.run_id = run_mode(cfg)[1]  # one id for run.json's flow runs and the run itself
    with stopping.installed():  # over Prefect's own SIGTERM handler, for the flow's body
        quiet_prefect_task_logs()
        filter_console(_NoTracebacksOnTheConsole)
        _close_stale_flow_runs(cfg)
        try:
            run = setup_task(cfg) if stopping.requested() is None else Cancelled(message="stopped before the start")
        except Exception as exc:  # build_run marked the MLflow run FAILED
            raise _failed(RunPaths.make(cfg.tracking.root_dir, cfg.resume or cfg.run_id), exc,
                          "while it was being built")
        if isinstance(run, State):  # stopped while it was being built: nothing to finish
            return Cancelled(message=f"{run.message}; {resume_hint(cfg.resume or cfg.run_id)}")
        _announce(run)
        loop = run.settings.loop
        status = "FAILED"
        progress = Progress(run, enabled=run.settings.tracking.progress)
        stopped: stopping.RunStopped | None = None
        failure: Exception | None = None
        try:
            evaluate_start(run, lambda version, sampled: evaluate_task(quote(run), version, sampled=sampled))
            if run.start_step >= loop.steps:
                print(f"run {run.run_id} already has {run.start_step} steps (loop.steps={loop.steps}); "
                      "raise loop.steps to train it further", flush=True)
            progress.start()
            (_async_loop if run.settings.async_loop else _loop)(run, progress)
            status = "FINISHED"
        except stopping.RunStopped as exc:
            status, stopped = "KILLED", exc
        except (KeyboardInterrupt, ExternalSignal):  # a second Ctrl-C: at once
            status = "KILLED"
            raise
        except Exception as exc:  # status stays FAILED: the MLflow run is marked so below
            failure = exc
            raise
        finally:
            progress.close()
            summary = run.summary(status)
            if status == "FINISHED":
                summary["mlflow_model_uri"] = run.log_final_model()
            run.tracker.log_dict(summary, "summary.json")
            _report(run, summary)
            if failure is not None:  # before finish(): the artifact goes to the open MLflow run
                _failed(run.paths, failure, f"at step {run.policy_version} of {loop.steps}", run.tracker)
            run.finish(status)
    if stopped is not None:
        return Cancelled(message=f"{stopped}, with {run.policy_version} of {loop.steps} steps done "
                                 f"(MLflow run KILLED); {resume_hint(run.run_id)}", data=summary)
    print(summary_text(summary))
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv != globals().get("_ANSWERED_EARLY"):  # not yet answered above (main called directly)
        early = answer_early(argv)  # --help, unknown flags, configuration errors
        if early is not None:
            return early
    try:
        overrides, show_cfg = command_line(argv)  # --config-dir DIR: a search-path override
        cfg = early_config(argv) or resolve_config(overrides)  # fail before Prefect, MLflow or any model
        preflight(cfg)
    except (ConfigError, PermissionError, CheckpointError, StoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if show_cfg:
        say(OmegaConf.to_yaml(cfg))  # `--cfg | head` ends quietly
        return 0
    mode, run_id = run_mode(cfg)
    if cfg.resume is not None:  # resume=last, resolved once
        overrides = [o for o in overrides if not o.lstrip("+").startswith("resume=")] + [f"resume={run_id}"]
    elif cfg.run_id is None:
        overrides.append(f"run_id={run_id}")  # the id is decided here, so it can be shown and leased now
    run_dir = RunPaths.make(cfg.tracking.root_dir, run_id).run_dir
    created = not run_dir.exists()
    try:  # the lease first: the start-point check tidies the run's checkpoints
        lease = acquire(run_dir)
    except LeaseHeld as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if cfg.resume is not None or cfg.fork is not None:
            check_start_point(cfg, log=_say)
    except (ConfigError, PermissionError, CheckpointError, StoreError) as exc:
        lease.release()
        if created:  # a refused fork leaves no empty run directory behind
            shutil.rmtree(run_dir, ignore_errors=True)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"run {run_id} ({mode}) under {RunPaths.make(cfg.tracking.root_dir, run_id).root}; "
          f"{resume_hint(run_id)}", flush=True)
    start = time.perf_counter()
    try:
        with stopping.installed(), temporary_server():
            stopping.check("the start")
            state = train(overrides, return_state=True)
        if state.is_cancelled():
            print(f"{state.message} ({time.perf_counter() - start:.0f} s)", flush=True)
            return 128 + _signal_number(stopping.requested())
        try:
            state.result()  # a failed run raises its own error here
        except Exception as exc:
            line = failure_line(exc)
            if line is None:  # not seen by the flow's handlers: as it came
                raise
            print(f"error: {line}", file=sys.stderr, flush=True)
            return 1
    except stopping.RunStopped as exc:
        print(f"{exc} before the run began; {resume_hint(run_id)}", flush=True)
        return 128 + _signal_number(exc.signame)
    except KeyboardInterrupt:
        print(f"stopped at once (a second signal); {resume_hint(run_id)}", flush=True)
        return 130
    finally:
        lease.release()
    print(f"total time {time.perf_counter() - start:.0f} s")
    return 0


def _signal_number(name: str | None) -> int:
    return int(getattr(signal, name or "SIGINT", signal.SIGINT))


if __name__ == "__main__":
    sys.exit(main())
