"""How the learner steps of one generation step draw their minibatches from the buffer
window: pure functions of (window size, batch size, updates, rng), in a registry keyed by
`buffer.strategy`.

The window itself (the newest N rollouts, FIFO) is a query on the rollout table
(RolloutStore.window); these functions only choose row positions inside it, so they are
tested on their statistics without any I/O. Each returns `updates` index arrays, one per
learner step, drawn from the numpy Generator it is given (seeded per run, so a run is
reproducible).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

Sampler = Callable[[int, int, int, np.random.Generator], list[np.ndarray]]


def uniform(window_size: int, batch_size: int, updates: int, rng: np.random.Generator) -> list[np.ndarray]:
    """The paper's vanilla buffer: each minibatch is B positions drawn uniformly at random
    with replacement (a rollout can appear twice in one minibatch, as in the paper)."""
    _check(window_size, batch_size)
    return [rng.integers(0, window_size, size=batch_size) for _ in range(updates)]


def fresh(window_size: int, batch_size: int, updates: int, rng: np.random.Generator) -> list[np.ndarray]:
    """No-buffer baseline: one random permutation of the fresh batch cut into `updates`
    disjoint minibatches, so every fresh rollout is used exactly once."""
    _check(window_size, batch_size)
    if window_size < batch_size * updates:
        raise ValueError(f"the fresh window of {window_size} rollouts cannot feed {updates} "
                         f"disjoint minibatches of {batch_size}")
    order = rng.permutation(window_size)
    return [order[i * batch_size:(i + 1) * batch_size] for i in range(updates)]


def _check(window_size: int, batch_size: int) -> None:
    if window_size < 1:
        raise ValueError("cannot draw a minibatch from an empty window")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")


SAMPLERS: dict[str, Sampler] = {
    "uniform": uniform,
    "fresh": fresh,
}


def window_for(strategy: str, capacity: int, fresh_rows: int) -> int:
    """Rows of the table the strategy reads: the newest `capacity` (FIFO), or for the
    no-buffer baseline exactly the fresh batch."""
    return fresh_rows if strategy == "fresh" else capacity
