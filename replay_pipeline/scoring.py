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
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Sequence

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


def safe_reward(fn: Callable[[], float]) -> tuple[float, str | None]:
    """Run a verifier: ``(value, None)`` for a finite reward, else ``(0.0, reason)``.

    The reason is a short string for the rollout's ``reward_error`` column:
    ``"reward raised ValueError: boom"`` when the verifier raised (the message is cut to
    :data:`MAX_ERROR_CHARS`), ``"reward was nan"`` / ``"reward was inf"`` / ``"reward was -inf"``
    for a non-finite value, ``"reward raised TypeError: ..."`` for a value that is not a number
    (``None``, a string ``float()`` cannot read). Only ``Exception`` is caught: a
    ``KeyboardInterrupt`` still stops the run.
    """
    try:
        value = float(fn())
    except Exception as exc:  # noqa: BLE001 - any verifier failure is flagged, not fatal
        message = f": {exc}" if str(exc) else ""
        return 0.0, _cut(f"reward raised {type(exc).__name__}{message}")
    if not math.isfinite(value):
        return 0.0, f"reward was {value}"
    return value, None


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
