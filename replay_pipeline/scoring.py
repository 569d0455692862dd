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
``replay_pipeline.scoring`` logger (:func:`warn_flagged`). The run goes on: one bad
completion must not stop a long job, and the stored reason makes every flagged rollout
findable afterwards. A flagged rollout stays in its group with reward 0, so it enters the
group's mean and std like any other 0-reward rollout.

The same holds in every evaluation (held-out accuracy, pass@k, the warm start's stopping
rule): a flagged completion counts as wrong, and the evaluation reports how many it flagged.
A reward call that does not return within `reward.timeout` seconds (`set_reward_timeout`; 30
by default) is flagged "reward timed out after N s": it runs on a daemon worker thread, which
is abandoned (Python cannot stop a thread) and replaced. A training batch whose flagged share
is above `reward.max_flagged_fraction` raises :class:`RewardFailure` before it is stored.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from typing import Any, Callable, Sequence

import numpy as np

logger = logging.getLogger(__name__)  # "replay_pipeline.scoring"

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


def _run_batch(calls: Sequence[Callable[[], Any]], results: queue.SimpleQueue, cancelled: threading.Event) -> None:
    """Worker thread: each call in order, its (ok, value) put on `results`, until cancelled."""
    for fn in calls:
        if cancelled.is_set():
            return
        try:
            results.put((True, float(fn())))
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            results.put((False, exc))


def _judged(ok: bool, value: Any) -> tuple[float, str | None]:
    if not ok:
        if not isinstance(value, Exception):
            raise value
        message = f": {value}" if str(value) else ""
        return 0.0, _cut(f"reward raised {type(value).__name__}{message}")
    if not math.isfinite(value):
        return 0.0, f"reward was {value}"
    return value, None


def safe_rewards(calls: Sequence[Callable[[], float]], timeout: float | None | str = "default"
                 ) -> list[tuple[float, str | None]]:
    """:func:`safe_reward` for a batch of calls, in order. With a timeout they run one after
    the other on one daemon thread per batch (one hand-off for the batch, not one per call:
    about 50 us a call otherwise); the caller waits at most `timeout` for each result, so a
    call that hangs is flagged, its thread abandoned, and the calls after it run on a fresh one."""
    timeout = _timeout if timeout == "default" else timeout
    if timeout is None:
        out = []
        for fn in calls:
            try:
                out.append(_judged(True, float(fn())))
            except Exception as exc:  # noqa: BLE001 - any verifier failure is flagged, not fatal
                out.append(_judged(False, exc))
        return out
    out, pending = [], list(calls)
    while pending:
        results: queue.SimpleQueue = queue.SimpleQueue()
        cancelled = threading.Event()
        threading.Thread(target=_run_batch, args=(pending, results, cancelled), name="reward-calls",
                         daemon=True).start()
        for i in range(len(pending)):
            try:
                ok, value = results.get(timeout=timeout)
            except queue.Empty:
                cancelled.set()  # stuck in call i: the rest go to a fresh thread
                out.append((0.0, f"reward timed out after {timeout:g} s"))
                pending = pending[i + 1:]
                break
            out.append(_judged(ok, value))
        else:
            pending = []
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
    """The task's rewards for (prompt, completion, finish_reason) items, through :func:`safe_rewards`."""
    return safe_rewards([(lambda p=p, t=t, f=f: task.reward(p, t, f)) for p, t, f in items])


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
