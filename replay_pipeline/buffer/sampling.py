"""How the learner steps of one generation step (a *round*) draw their minibatches from the
buffer window.

The window itself (the newest N rollouts, FIFO, or the store's positive-bias composition) is
a query on the rollout table; this module only chooses row positions inside it, from what
`WindowInfo` tells about those rows. Everything here is a pure function of numpy arrays and a
numpy Generator (seeded per run and step, so a run is reproducible): no I/O, no config
objects, tested on its statistics.

`draw(strategy, window, batch_size, updates, rng, rules)` returns `updates` index arrays, one
per learner step, of positions into the window. It applies the `SamplingRules` to every
strategy, then lets the strategy (one function each in `SAMPLERS`) choose:

- staleness bound: a row with current_version - policy_version > max_staleness is not
  eligible;
- reuse cap: a row may be drawn at most reuse_cap - reuse_count more times in this round
  (its *budget*); the minibatches are drawn one after another against that budget, so after
  the round no row has been used more than reuse_cap times in total, and a with-replacement
  strategy respects it inside a minibatch too.

Differences from the paper, and why:
1. The paper's buffer is `uniform` alone (with replacement, the default here). The other
   strategies and both rules are offered to study the staleness/diversity trade-off the
   paper describes (a bigger window is staler; a smaller one reuses the same rollouts soon).
2. When the eligible rows (or their budgets) run out, a minibatch comes back SHORTER,
   possibly empty, instead of raising: the trainer skips an empty minibatch and logs it
   (`buffer/skipped_updates`). A rule that starves the learner then shows in the metrics
   rather than killing the run. `fresh`, the no-buffer baseline, keeps its error: a fresh
   batch too small for its disjoint minibatches is a configuration mistake.
3. Positive-bias sampling is a composition of the window (done by the store), not a sampler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from replay_pipeline.algo.bounds import Bound


@dataclass(frozen=True)
class WindowInfo:
    """What a sampler may know about the rows of the current window (position i = i-th row,
    oldest first). Arrays are converted to the dtypes below on construction."""

    policy_version: np.ndarray   # (n,) int64, policy version that generated each rollout
    seq: np.ndarray              # (n,) int64, append order in the run's table (increasing)
    correct: np.ndarray          # (n,) bool
    advantage: np.ndarray        # (n,) float32, frozen group-normalised advantage
    reuse_count: np.ndarray      # (n,) int64, learner uses so far (from the durable usage records)
    current_version: int         # the learner's policy version now

    def __post_init__(self) -> None:
        dtypes = {"policy_version": np.int64, "seq": np.int64, "correct": np.bool_,
                  "advantage": np.float32, "reuse_count": np.int64}
        for name, dtype in dtypes.items():
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=dtype))
        object.__setattr__(self, "current_version", int(self.current_version))
        shapes = {name: getattr(self, name).shape for name in dtypes}
        if any(len(s) != 1 for s in shapes.values()) or len(set(shapes.values())) != 1:
            raise ValueError(f"WindowInfo arrays must all be 1-D with one entry per row; got shapes {shapes}")
        if (self.reuse_count < 0).any():
            raise ValueError("WindowInfo.reuse_count must be >= 0")
        if not np.isfinite(self.advantage).all():
            raise ValueError("WindowInfo.advantage must be finite (advantages are frozen at scoring)")

    @property
    def size(self) -> int:
        return int(self.policy_version.shape[0])

    @property
    def age(self) -> np.ndarray:
        """(n,) int64, policy versions between each row's generator and the learner now."""
        return self.current_version - self.policy_version

    @classmethod
    def uniform_only(cls, n: int, current_version: int = 0) -> "WindowInfo":
        """A window of `n` fresh, never-used rows with zero advantage (tests, benchmarks)."""
        return cls(policy_version=np.full(n, current_version), seq=np.arange(n),
                   correct=np.zeros(n, bool), advantage=np.zeros(n, np.float32),
                   reuse_count=np.zeros(n, np.int64), current_version=current_version)


@dataclass(frozen=True)
class SamplingRules:
    """Rules `draw` applies to every strategy, and the strategies' own parameters.
    Invalid values raise ValueError on construction (at start-up, not mid-run)."""

    reuse_cap: int | None = None
    """A rollout is never used more than this many times in total (None: no cap)."""
    max_staleness: int | None = None
    """Only rows with current_version - policy_version <= this are eligible (None: all)."""
    recency_half_life: float = 2.0
    """`recency`: a row's weight halves every this many policy versions of age."""
    priority_alpha: float = 1.0
    """`prioritized`: weight = (|advantage| + priority_eps) ** priority_alpha (0: uniform)."""
    priority_eps: float = 1e-3
    """`prioritized`: keeps zero-advantage rows (groups with equal rewards) drawable, rarely."""

    def __post_init__(self) -> None:
        for name, bound in RULE_BOUNDS.items():
            bound.check(name, getattr(self, name))


#: Each rule's bound, stated once: buffer.* configuration fields of the same name refer to these.
RULE_BOUNDS = {
    "reuse_cap": Bound(ge=1, integer=True, null="for no cap", hint="0 would never use a rollout"),
    "max_staleness": Bound(ge=0, integer=True, null="for no bound", hint="0: only rollouts of the current policy"),
    "recency_half_life": Bound(gt=0, finite=True),
    "priority_alpha": Bound(ge=0, finite=True, hint="0: uniform"),
    "priority_eps": Bound(gt=0, finite=True, hint="so that rows with zero advantage keep a (small) chance"),
}


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


# A strategy: (window, budget, batch_size, updates, rng, rules) -> `updates` index arrays.
# budget[i] is how many more times row i may be drawn this round, with the rules already
# applied (0: not eligible).
Sampler = Callable[[WindowInfo, np.ndarray, int, int, np.random.Generator, SamplingRules], list[np.ndarray]]


def round_budget(window: WindowInfo, rules: SamplingRules, round_size: int) -> np.ndarray:
    """(n,) int64: how many times each row may still be drawn in a round of `round_size` draws.
    0 for a row older than max_staleness or already used reuse_cap times; without a cap,
    `round_size` (no round can use a row more often)."""
    budget = np.full(window.size, round_size, dtype=np.int64)
    if rules.reuse_cap is not None:
        # clip: a row used more than the cap (the cap was lowered on resume) is simply spent
        budget = np.minimum(budget, np.maximum(rules.reuse_cap - window.reuse_count, 0))
    if rules.max_staleness is not None:
        budget[window.age > rules.max_staleness] = 0
    return budget


def draw(strategy: str, window: WindowInfo, batch_size: int, updates: int,
         rng: np.random.Generator, rules: SamplingRules = SamplingRules()) -> list[np.ndarray]:
    """The round's `updates` minibatches: int64 arrays of positions into `window`.

    Applies the staleness bound and the reuse cap (see the module docstring), then the
    strategy. A minibatch is full (batch_size) while eligible rows with budget remain;
    after that it is shorter, then empty (the trainer skips those). Only `fresh` raises
    instead. Raises ValueError for an unknown strategy or a batch size or update count < 1.
    """
    if strategy not in SAMPLERS:
        raise ValueError(f"unknown sampling strategy {strategy!r}; known: {', '.join(sorted(SAMPLERS))}")
    for name, value in (("batch_size", batch_size), ("updates", updates)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    if not isinstance(window, WindowInfo):
        raise ValueError(f"window must be a WindowInfo (WindowInfo.uniform_only(n) for a plain "
                         f"window of n rows); got {type(window).__name__}")
    if not isinstance(rules, SamplingRules):
        raise ValueError(f"rules must be a SamplingRules; got {type(rules).__name__}")
    budget = round_budget(window, rules, batch_size * updates)
    return SAMPLERS[strategy](window, budget, batch_size, updates, rng, rules)


# ---------------------------------------------------------------------------- strategies

def uniform(window: WindowInfo, budget: np.ndarray, batch_size: int, updates: int,
            rng: np.random.Generator, rules: SamplingRules) -> list[np.ndarray]:
    """The paper's vanilla buffer (the default): each draw picks an eligible row uniformly
    at random, with replacement (a rollout can appear twice in one minibatch, as in the
    paper). Under a reuse cap, each draw is uniform over the rows whose budget is not spent."""
    return _cut(weighted_stream(np.zeros(window.size), budget, batch_size * updates, rng), batch_size, updates)


def without_replacement(window: WindowInfo, budget: np.ndarray, batch_size: int, updates: int,
                        rng: np.random.Generator, rules: SamplingRules) -> list[np.ndarray]:
    """A uniformly random ordering of the eligible rows, cut into the round's minibatches:
    no row is drawn twice within a round, and every eligible row is drawn once when
    updates x batch_size equals the number of eligible rows.

    When the round needs more rows than are eligible, there is no refill: the minibatches
    run out (the last non-empty one shorter, the rest empty) rather than repeat a row. The
    guarantee "never twice in a round" is then unconditional, checkable from the usage
    records, and the shortfall shows in `buffer/skipped_updates` (e.g. early in a run, when
    the window is still smaller than a round)."""
    return _cut(_permuted_eligible(budget, rng)[:batch_size * updates], batch_size, updates)


def fresh(window: WindowInfo, budget: np.ndarray, batch_size: int, updates: int,
          rng: np.random.Generator, rules: SamplingRules) -> list[np.ndarray]:
    """The no-buffer baseline: one uniformly random permutation of the window (the fresh
    batch, see `window_for`) cut into `updates` disjoint minibatches of `batch_size`, so each
    fresh rollout is used at most once. Unlike the other strategies it never returns a short
    minibatch: ValueError when fewer than batch_size x updates rows are eligible."""
    order = _permuted_eligible(budget, rng)
    if order.size < batch_size * updates:
        ineligible = window.size - order.size
        raise ValueError(f"the fresh window of {window.size} rollouts"
                         f"{f' ({ineligible} not eligible under the rules)' if ineligible else ''}"
                         f" cannot feed {updates} disjoint minibatches of {batch_size}")
    return _cut(order[:batch_size * updates], batch_size, updates)


def recency(window: WindowInfo, budget: np.ndarray, batch_size: int, updates: int,
            rng: np.random.Generator, rules: SamplingRules) -> list[np.ndarray]:
    """With replacement; each draw picks eligible row i with probability proportional to
    0.5 ** (age_i / recency_half_life), age = current_version - policy_version: a rollout
    one half-life older is drawn half as often. Under a reuse cap, each draw is over the rows
    whose budget is not spent."""
    log_w = -math.log(2.0) * window.age / rules.recency_half_life
    return _cut(weighted_stream(log_w, budget, batch_size * updates, rng), batch_size, updates)


def prioritized(window: WindowInfo, budget: np.ndarray, batch_size: int, updates: int,
                rng: np.random.Generator, rules: SamplingRules) -> list[np.ndarray]:
    """With replacement; each draw picks eligible row i with probability proportional to
    (|advantage_i| + priority_eps) ** priority_alpha. Rows of equal-reward groups (advantage
    0, no gradient under GRPO) are drawn only eps-rarely; alpha = 0 is uniform. Under a reuse
    cap, each draw is over the rows whose budget is not spent."""
    log_w = rules.priority_alpha * np.log(np.abs(window.advantage.astype(np.float64)) + rules.priority_eps)
    return _cut(weighted_stream(log_w, budget, batch_size * updates, rng), batch_size, updates)


SAMPLERS: dict[str, Sampler] = {
    "uniform": uniform,
    "without_replacement": without_replacement,
    "fresh": fresh,
    "recency": recency,
    "prioritized": prioritized,
}


def window_for(strategy: str, capacity: int, fresh_rows: int) -> int:
    """Rows of the table the strategy reads: the newest `capacity` (FIFO), or for the
    no-buffer baseline exactly the fresh batch."""
    return fresh_rows if strategy == "fresh" else capacity


# ---------------------------------------------------------------------------- mechanics

def weighted_stream(log_weights: np.ndarray, budget: np.ndarray, size: int,
                    rng: np.random.Generator) -> np.ndarray:
    """Up to `size` draws, one after another: each picks row i with probability proportional
    to exp(log_weights[i]) among the rows whose budget is not yet spent (budget[i] minus
    earlier draws of i). Shorter than `size` only when every budget is spent.

    Vectorised by rejection: draw all the missing candidates at once from the rows available
    now, keep each candidate while its row still has budget (in draw order), and redraw the
    shortfall from the rows still available. A kept candidate is distributed exactly as a
    one-at-a-time draw over the rows available at its turn, and every rejection spends a
    row, so the loop runs at most once per row that runs out (once when nothing does)."""
    left = np.asarray(budget, dtype=np.int64).copy()
    picks: list[np.ndarray] = []
    need = size
    while need > 0:
        rows = np.flatnonzero(left > 0)
        if rows.size == 0:
            break
        lw = log_weights[rows]
        if (lw == lw[0]).all():
            p = None  # uniform: rng.integers, cheaper than an inverse-cdf draw
        else:
            w = np.exp(lw - lw.max())  # scaled so no weight underflows when all are tiny
            p = w / w.sum()
        cand = rows[rng.choice(rows.size, size=need, p=p)]
        cand = cand[within_budget(cand, left)]
        picks.append(cand)
        left -= np.bincount(cand, minlength=left.size)
        need -= cand.size
    return np.concatenate(picks) if picks else np.empty(0, np.int64)


def within_budget(candidates: np.ndarray, budget: np.ndarray) -> np.ndarray:
    """(m,) bool: which candidates, taken in order, fit their row's budget: the k-th
    occurrence of row r (k = 0, 1, ...) fits iff k < budget[r]."""
    m = candidates.size
    if m == 0:
        return np.zeros(0, bool)
    order = np.argsort(candidates, kind="stable")  # stable: occurrences stay in draw order
    sorted_rows = candidates[order]
    run_starts = np.flatnonzero(np.r_[True, sorted_rows[1:] != sorted_rows[:-1]])
    run_lengths = np.diff(np.r_[run_starts, m])
    occurrence = np.empty(m, np.int64)
    occurrence[order] = np.arange(m) - np.repeat(run_starts, run_lengths)
    return occurrence < budget[candidates]


def _permuted_eligible(budget: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    eligible = np.flatnonzero(budget > 0)
    return eligible[rng.permutation(eligible.size)]


def _cut(stream: np.ndarray, batch_size: int, updates: int) -> list[np.ndarray]:
    """`updates` consecutive slices of `batch_size`: full ones first, then at most one
    shorter, then empty ones when the stream runs out."""
    stream = stream.astype(np.int64, copy=False)
    return [stream[i * batch_size:(i + 1) * batch_size] for i in range(updates)]
