"""Rewards and group-normalised advantages, computed once at generation and frozen.

A = (r - mean_group(r)) / (std_group(r) + eps). The std is the population std (ddof=0);
a group whose rewards are all equal gets advantage 0 for every member (no learning signal,
and no division blow-up). These advantages are stored with the rollouts and never
recomputed when a rollout is replayed, as in the paper.

Bad rewards (documented handling, not an error): a verifier that raises, or returns something
that is not a finite number (nan, inf, a value ``float()`` refuses), scores 0.0 and the
rollout is *flagged*: :func:`safe_reward` returns the reason, the trainer stores it in the
rollout's ``reward_error`` column (null for a rollout scored normally), counts the step's
flagged rollouts in ``score/flagged`` and logs one warning per step on the
``replay_pipeline.algo.scoring`` logger (:func:`warn_flagged`). The run goes on: one bad
completion must not stop a long job, and the stored reason makes every flagged rollout
findable afterwards. A flagged rollout stays in its group with reward 0, so it enters the
group's mean and std like any other 0-reward rollout.

The same holds in every evaluation (held-out accuracy, pass@k, the warm start's stopping
rule): a flagged completion counts as wrong, and the evaluation reports how many it flagged.
A reward call that does not return within `reward.timeout` seconds (`set_reward_timeout`; 30
by default) is flagged "reward timed out after N s": it runs on a daemon worker thread, which
is abandoned (Python cannot stop a thread) and replaced. A training batch whose flagged share
is above `reward.max_flagged_fraction` raises :class:`RewardFailure` before it is stored.

A task with a ``reward_batch(prompts, completions, finish_reasons)`` method is scored by one
call a batch (:func:`safe_batch`, guarded alike). In training the reward may be shaped by
weighted terms (`reward.terms`, :class:`RewardTerm`, :func:`score_items`): the stored reward is
their weighted sum with the verifier's, while correctness (the ``correct`` column, every
accuracy) stays the verifier's alone.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from replay_pipeline.system.threadnames import os_named

logger = logging.getLogger(__name__)  # "replay_pipeline.algo.scoring"

#: Longest ``reward_error`` string stored; longer exception messages are cut with "...".
MAX_ERROR_CHARS = 200


def group_advantages(rewards: Sequence[float], group_size: int, eps: float = 1e-6) -> np.ndarray:
    """Group-normalised advantages for rewards laid out group by group ([g0 s0..sG-1, g1 ...])."""
    r = np.asarray(rewards, dtype=np.float64)
    if group_size < 1 or r.size % group_size != 0:
        raise ValueError(f"{r.size} rewards do not split into groups of {group_size}")
    groups = r.reshape(-1, group_size)
    mean = groups.mean(axis=1, keepdims=True)
    std = groups.std(axis=1, keepdims=True)
    adv = (groups - mean) / (std + eps)
    adv[np.broadcast_to(std, groups.shape) < eps] = 0.0
    return adv.reshape(-1).astype(np.float32)


class RewardFailure(RuntimeError):
    """Too many rollouts of one batch were flagged: the reward itself is broken."""


#: Seconds a reward call may take (None: no limit); set from `reward.timeout` by each process.
_timeout: float | None = 30.0


def set_reward_timeout(seconds: float | None) -> None:
    global _timeout
    _timeout = None if seconds is None else float(seconds)


class _Batch:
    """One batch of reward calls handed to the worker thread: the results so far, the call
    running now and since when, and whether the caller gave the batch up."""

    def __init__(self, calls: Sequence[Callable[[], Any]], convert: Callable[[Any], Any]):
        self.calls, self.convert = calls, convert
        self.results: list[tuple[bool, Any]] = []
        self.current: tuple[int, float] = (0, time.monotonic())
        self.done = threading.Event()
        self.cancelled = False


class _RewardWorker:
    """A daemon thread that runs one calling thread's batches of reward calls, one batch at a
    time (a worker per calling thread, so that no batch waits behind another caller's and has
    its first call's time run out in the queue); abandoned, and a fresh one started, when a
    call overruns the timeout. It ends once its calling thread has ended."""

    _mine = threading.local()

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.owner = threading.current_thread()
        threading.Thread(target=os_named(self._serve), name="reward-calls", daemon=True).start()

    @classmethod
    def get(cls) -> "_RewardWorker":
        worker = getattr(cls._mine, "worker", None)
        if worker is None:
            worker = cls._mine.worker = cls()
        return worker

    @classmethod
    def abandon(cls) -> None:
        cls._mine.worker = None

    def _serve(self) -> None:
        while True:
            try:
                batch: _Batch = self.jobs.get(timeout=5.0)
            except queue.Empty:
                if not self.owner.is_alive():
                    return
                continue
            for i, fn in enumerate(batch.calls):
                if batch.cancelled:
                    break
                batch.current = (i, time.monotonic())
                try:
                    batch.results.append((True, batch.convert(fn())))
                except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                    batch.results.append((False, exc))
            batch.done.set()
            if batch.cancelled:  # given up while a call hung: a fresh worker serves the rest
                return


def _judged(ok: bool, value: Any) -> tuple[float, str | None]:
    if not ok:
        if not isinstance(value, Exception):
            raise value
        message = f": {value}" if str(value) else ""
        return 0.0, _cut(f"reward raised {type(value).__name__}{message}")
    if not math.isfinite(value):
        return 0.0, f"reward was {value}"
    return value, None


def _outcomes(calls: Sequence[Callable[[], Any]], timeout: float | None, convert: Callable[[Any], Any] = float
              ) -> list[tuple[bool | None, Any]]:
    """(True, converted value), (False, exception) or (None, None) for a call that timed out,
    for each call in order. With a timeout they run one after the other on a daemon worker
    thread that serves the calling thread's batches (one hand-off a batch: 0.030 ms for 64
    trivial calls, against 0.074 ms for a thread started a batch and a queue get a call).
    Each call is given at most `timeout` from its own start: the caller sleeps until the
    batch is done or the running call's time is up; then that call is given up, its thread
    abandoned, and the calls after it run on a fresh one."""
    if timeout is None:
        out = []
        for fn in calls:
            try:
                out.append((True, convert(fn())))
            except Exception as exc:  # noqa: BLE001 - any verifier failure is flagged, not fatal
                out.append((False, exc))
        return out
    out, pending = [], list(calls)
    while pending:
        batch = _Batch(pending, convert)
        _RewardWorker.get().jobs.put(batch)
        while True:
            index, started = batch.current
            if batch.done.wait(timeout=max(started + timeout - time.monotonic(), 0.0)):
                out.extend(batch.results)
                pending = []
                break
            if batch.current == (index, started) and len(batch.results) == index:  # call `index` overran
                batch.cancelled = True
                _RewardWorker.abandon()
                out.extend(batch.results[:index])
                out.append((None, None))
                pending = pending[index + 1:]
                break
    return out


def _timed_out(seconds: float) -> str:
    return f"reward timed out after {seconds:g} s"


def safe_rewards(calls: Sequence[Callable[[], float]], timeout: float | None | str = "default"
                 ) -> list[tuple[float, str | None]]:
    """:func:`safe_reward` for a batch of calls, in order, each given at most `timeout`
    (:func:`_outcomes`)."""
    timeout = _timeout if timeout == "default" else timeout
    return [(0.0, _timed_out(timeout)) if ok is None else _judged(ok, value)
            for ok, value in _outcomes(calls, timeout)]


def safe_batch(fn: Callable[[], Sequence[Any]], n: int, timeout: float | None | str = "default"
               ) -> list[tuple[float, str | None]]:
    """One call that scores `n` completions at once (a task's optional ``reward_batch``): a
    (value, reason) for each, judged like :func:`safe_reward`'s one by one. The call may take
    `timeout` seconds a completion; if it raises, times out or returns other than `n` values,
    every completion is flagged with that reason."""
    timeout = _timeout if timeout == "default" else timeout
    limit = None if timeout is None else timeout * max(n, 1)
    ((ok, value),) = _outcomes([fn], limit, convert=list)
    if ok is None:
        return [(0.0, _timed_out(limit))] * n
    if not ok:
        return [_judged(False, value)] * n
    if len(value) != n:
        return [(0.0, f"reward_batch returned {len(value)} values for {n} completions")] * n
    out = []
    for v in value:
        try:
            out.append(_judged(True, float(v)))
        except (TypeError, ValueError) as exc:
            out.append(_judged(False, exc))
    return out


def safe_reward(fn: Callable[[], float], timeout: float | None | str = "default") -> tuple[float, str | None]:
    """Run a verifier: ``(value, None)`` for a finite reward, else ``(0.0, reason)``.

    The reason is a short string for the rollout's ``reward_error`` column:
    ``"reward raised ValueError: boom"`` when the verifier raised (the message is cut to
    :data:`MAX_ERROR_CHARS`), ``"reward was nan"`` / ``"reward was inf"`` / ``"reward was -inf"``
    for a non-finite value, ``"reward raised TypeError: ..."`` for a value that is not a number
    (``None``, a string ``float()`` cannot read), ``"reward timed out after 30 s"`` for a call
    slower than ``timeout`` (default: the process's `reward.timeout`). Only ``Exception`` is
    caught: a ``KeyboardInterrupt`` still stops the run.
    """
    return safe_rewards([fn], timeout)[0]


def check_flagged(step: int, errors: Sequence[str | None], max_fraction: float) -> None:
    """RewardFailure when more than `max_fraction` of a batch's rollouts were flagged."""
    flagged = [e for e in errors if e is not None]
    if errors and len(flagged) / len(errors) > max_fraction:
        raise RewardFailure(
            f"step {step}: {len(flagged)} of {len(errors)} rollouts flagged (first: {flagged[0]}), above "
            f"reward.max_flagged_fraction={max_fraction:g}: the reward function is broken, not the "
            "completions. Nothing of this step was stored; fix the reward and resume the run, or raise "
            "reward.max_flagged_fraction (1: never stop)")


def rewards_of(task: Any, items: Sequence[tuple[Any, str, str]]) -> list[tuple[float, str | None]]:
    """The task's rewards for (prompt, completion, finish_reason) items: one
    ``task.reward_batch(prompts, completions, finish_reasons)`` call when the task has one
    (:func:`safe_batch`; a reward model scores a batch faster than one by one), else
    ``task.reward`` for each (:func:`safe_rewards`)."""
    batch = getattr(task, "reward_batch", None)
    if callable(batch) and items:
        prompts, texts, reasons = (list(column) for column in zip(*items))
        return safe_batch(lambda: batch(prompts, texts, reasons), len(items))
    return safe_rewards([(lambda p=p, t=t, f=f: task.reward(p, t, f)) for p, t, f in items])


@dataclass(frozen=True)
class RewardTerm:
    """One weighted term added to the task's verifier in training: ``fn(prompt, completion,
    finish_reason, **args)`` -> float, its metric ``score/term/<name>``."""
    name: str
    weight: float
    fn: Callable[..., float]
    args: Mapping[str, Any]


@dataclass(frozen=True)
class Scored:
    """A training batch's rewards: the total (``verifier_weight`` x the task's verifier plus
    each term's weight x its value; 0 when flagged), whether the verifier judged it correct,
    the reason it was flagged (None: scored normally), and each term's mean over the batch's
    unflagged completions."""
    rewards: list[float]
    correct: list[bool]
    errors: list[str | None]
    term_means: dict[str, float]


def score_items(task: Any, items: Sequence[tuple[Any, str, str]], terms: Sequence[RewardTerm] = (),
                verifier_weight: float = 1.0) -> Scored:
    """Score a training batch: the task's verifier (:func:`rewards_of`) and each reward term,
    all guarded alike. A completion that any of them flags is flagged (the first reason, named
    by its term) and scores 0 in total; ``correct`` is the verifier's judgement alone, so
    accuracies mean the task's accuracy whatever shaping the terms add."""
    verified = rewards_of(task, items)
    errors = [error for _, error in verified]
    totals = [verifier_weight * value for value, _ in verified]
    values: dict[str, list[float]] = {}
    for term in terms:
        scored = safe_rewards([(lambda p=p, t=t, f=f, term=term: term.fn(p, t, f, **term.args))
                               for p, t, f in items])
        values[term.name] = [value for value, _ in scored]
        for i, (value, error) in enumerate(scored):
            if error is not None and errors[i] is None:
                errors[i] = _cut(f"term {term.name}: {error}")
            totals[i] += term.weight * value
    flagged = [error is not None for error in errors]
    means = {name: float(np.mean([v for v, bad in zip(vs, flagged) if not bad])) if not all(flagged) else 0.0
             for name, vs in values.items()}
    return Scored(rewards=[0.0 if bad else float(t) for t, bad in zip(totals, flagged)],
                  correct=[not bad and value > 0 for (value, _), bad in zip(verified, flagged)],
                  errors=errors, term_means=means)


def warn_flagged(step: int, errors: Sequence[str | None]) -> int:
    """Log one warning for a step whose rewards had flagged rollouts; returns how many.

    ``errors`` holds each rollout's ``reward_error`` (None when it scored normally). Nothing
    is logged when none is flagged; otherwise one line names the count and the first reason.
    """
    flagged = [e for e in errors if e is not None]
    if flagged:
        logger.warning(
            "step %d: %d of %d rollouts flagged (reward raised or was not finite; scored 0, "
            "reason in the reward_error column); first: %s",
            step, len(flagged), len(errors), flagged[0])
    return len(flagged)


def _cut(text: str) -> str:
    text = " ".join(text.split())  # one line, whatever the exception message held
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."
