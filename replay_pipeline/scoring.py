"""Rewards and group-normalised advantages, computed once at generation and frozen.

A = (r - mean_group(r)) / (std_group(r) + eps). The std is the population std (ddof=0);
a group whose rewards are all equal gets advantage 0 for every member (no learning signal,
and no division blow-up). These advantages are stored with the rollouts and never
recomputed when a rollout is replayed, as in the paper.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np


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


def safe_reward(fn: Callable[[], float]) -> tuple[float, bool]:
    """Run a verifier; a raise or a non-finite value scores 0 and is flagged (False)."""
    try:
        value = float(fn())
    except Exception:
        return 0.0, False
    if not math.isfinite(value):
        return 0.0, False
    return value, True
