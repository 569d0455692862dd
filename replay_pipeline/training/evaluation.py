"""Held-out evaluation: greedy accuracy, the paper's pass@1 at temperature 0.1, and pass@k
and sampling entropy at temperature 1.

What the paper reports (PAPER.md): pass@1 at temperature 0.1 (top_p 0.95) and pass@k at
temperature 1, with n samples per prompt and the unbiased estimator of Chen et al. (2021).

Differences from the paper, and why:
1. The training loop's periodic `eval/accuracy` is greedy (argmax), the deterministic limit
   of pass@1 at temperature 0.1: it needs no samples and no seed, so curves from different
   runs compare without sampling noise. `evaluate_pass1` gives the paper's number.
2. `eval/sample_entropy` is a Monte-Carlo estimate from the sampled tokens (mean of
   -log p over completion tokens), not the exact entropy of each next-token distribution;
   the generator does not return full distributions.
"""

from __future__ import annotations

import time
from typing import Iterable, Sequence

import numpy as np

from replay_pipeline.algo.scoring import rewards_of
from replay_pipeline.tasks.base import Prompt

DEFAULT_KS = (1, 2, 4, 8, 16)
#: The paper's sampled evaluation (its appendix on evaluation): pass@k at temperature 1 with
#: top_p 0.95, pass@1 at temperature 0.1 (top_p 0.95) over several samples a prompt.
PAPER_TOP_P = 0.95
PASS1_SAMPLES = 4


# ------------------------------------------------------------------ pass@k (pure)
def _check_n_k(n: int, k: int) -> None:
    if n < 1:
        raise ValueError(f"n={n} samples per prompt must be >= 1")
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be in [1, n={n}]; draw at least k samples per prompt "
                         "(raise n) or drop that k")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from `c` correct out of `n` samples: 1 - C(n-c, k) / C(n, k).

    Product form (Chen et al. 2021): C(n-c, k)/C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i),
    every factor in [0, 1), so no huge binomials and no cancellation."""
    _check_n_k(n, k)
    if not 0 <= c <= n:
        raise ValueError(f"c={c} correct samples must be in [0, n={n}]")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(correct_counts: np.ndarray, n: int, ks: Iterable[int]) -> dict[int, float]:
    """Mean over prompts of pass@k, for each k; `correct_counts[i]` = correct samples of prompt i.

    Vectorised: for each k, a table of pass@k over every possible c in 0..n (one cumprod),
    indexed by the counts."""
    counts = np.asarray(correct_counts)
    if counts.ndim != 1 or counts.size == 0:
        raise ValueError(f"correct_counts must be a non-empty 1-D array, got shape {counts.shape}")
    if not np.issubdtype(counts.dtype, np.integer):
        if not np.all(counts == np.round(counts)):
            raise ValueError("correct_counts must be whole numbers")
        counts = counts.astype(np.int64)
    if counts.min() < 0 or counts.max() > n:
        raise ValueError(f"correct_counts must lie in [0, n={n}], got [{counts.min()}, {counts.max()}]")
    out = {}
    for k in ks:
        _check_n_k(n, int(k))
        # factors[j] = 1 - k/(n-j), j = 0..n-1; ratio[c] = prod of the first c (ratio[0] = 1).
        # Once n-c < k a factor is exactly 0 and the product stays 0 (pass@k = 1).
        factors = 1.0 - k / np.arange(n, 0, -1, dtype=np.float64)
        ratio = np.concatenate([[1.0], np.cumprod(factors)])
        table = 1.0 - ratio
        table[n - k + 1:] = 1.0  # exact, and clears the -0.0 / sign noise of factors below 0
        out[int(k)] = float(table[counts].mean())
    return out


def default_ks(n: int) -> tuple[int, ...]:
    """Powers of two up to n, plus n itself: (1, 2, 4, 8, 16) for n = 16, (1, 2, 4, 5) for 5."""
    ks = [k for k in (2 ** i for i in range(max(n, 1).bit_length())) if k <= n]
    return tuple(ks + ([n] if n not in ks else []))


# ------------------------------------------------------------------ evaluations
def _require_prompts(prompts: Sequence[Prompt]) -> None:
    if len(prompts) == 0:
        raise ValueError("no prompts to evaluate; pass the task's held-out prompts")


def evaluate_greedy(generator, task, prompts: Sequence[Prompt], seed: int = 0) -> dict[str, float]:
    start = time.perf_counter()
    samples = generator.generate([p.text for p in prompts], n=1, seed=seed, greedy=True)
    correct = 0
    lengths = 0
    stops = 0
    flagged = 0
    scored = rewards_of(task, [(prompt, sample.text, sample.finish_reason) for prompt, (sample,) in zip(prompts, samples)])
    for (value, error), (sample,) in zip(scored, samples):
        correct += value > 0
        flagged += error is not None
        lengths += len(sample.completion_ids)
        stops += sample.finish_reason == "stop"
    n = max(len(prompts), 1)
    return {
        "eval/accuracy": correct / n,
        "eval/mean_length": lengths / n,
        "eval/stop_frac": stops / n,
        "eval/prompts": float(len(prompts)),
        "eval/greedy_tokens": float(lengths),
        "eval/flagged": float(flagged),
        "eval/seconds": time.perf_counter() - start,
    }


def _correct_counts(task, prompts: Sequence[Prompt], samples) -> tuple[np.ndarray, int]:
    """Correct samples per prompt, and how many were flagged (scored 0: the reward raised,
    was not a number or timed out; replay_pipeline/algo/scoring.py)."""
    flat = rewards_of(task, [(p, s.text, s.finish_reason) for p, group in zip(prompts, samples) for s in group])
    counts, i = [], 0
    for group in samples:
        counts.append(sum(value > 0 for value, _ in flat[i:i + len(group)]))
        i += len(group)
    return np.asarray(counts, dtype=np.int64), sum(error is not None for _, error in flat)


def evaluate_sampled(generator, task, prompts: Sequence[Prompt], *, n: int = 16,
                     ks: Iterable[int] = DEFAULT_KS, temperature: float = 1.0,
                     top_p: float = 1.0, seed: int = 0) -> dict[str, float]:
    """pass@k at `temperature` from `n` samples per prompt, plus sampling statistics.

    Keys: `eval/pass_at_{k}` for each k (MLflow names cannot hold '@'); `eval/sample_entropy`,
    an estimate of the sampling policy's per-token entropy from the sampled tokens (mean of
    -logprob over every sampled completion token; the log-probs are those of
    softmax(logits / temperature), without top-p truncation); `eval/sample_length` (mean
    completion tokens); `eval/sample_seconds`."""
    _require_prompts(prompts)
    ks = tuple(int(k) for k in ks)
    for k in ks:
        _check_n_k(n, k)  # before generating: a bad k should not cost a generation pass
    start = time.perf_counter()
    samples = generator.generate([p.text for p in prompts], n=n, seed=seed,
                                 temperature=temperature, top_p=top_p)
    counts, flagged = _correct_counts(task, prompts, samples)
    neg_logp = [-lp for group in samples for s in group for lp in s.logprobs]
    lengths = [len(s.completion_ids) for group in samples for s in group]
    metrics = {f"eval/pass_at_{k}": v for k, v in mean_pass_at_k(counts, n, ks).items()}
    metrics |= {
        "eval/sample_entropy": float(np.mean(neg_logp)) if neg_logp else 0.0,
        "eval/sample_length": float(np.mean(lengths)),
        "eval/sample_tokens": float(np.sum(lengths)),
        "eval/sample_flagged": float(flagged),
        "eval/sample_seconds": time.perf_counter() - start,
    }
    return metrics


def evaluate_pass1(generator, task, prompts: Sequence[Prompt], *, temperature: float = 0.1,
                   top_p: float = 0.95, n: int = 1, seed: int = 0) -> dict[str, float]:
    """The paper's pass@1: mean correctness of `n` samples per prompt at temperature 0.1,
    top_p 0.95. Key `eval/pass_at_1_t01` (whatever the temperature passed)."""
    _require_prompts(prompts)
    if n < 1:
        raise ValueError(f"n={n} samples per prompt must be >= 1")
    start = time.perf_counter()
    samples = generator.generate([p.text for p in prompts], n=n, seed=seed,
                                 temperature=temperature, top_p=top_p)
    counts, flagged = _correct_counts(task, prompts, samples)
    return {"eval/pass_at_1_t01": float(counts.mean() / n), "eval/pass1_flagged": float(flagged),
            "eval/pass1_tokens": float(sum(len(s.completion_ids) for group in samples for s in group)),
            "eval/pass1_seconds": time.perf_counter() - start}


def evaluate_all(generator, task, prompts: Sequence[Prompt], *, n: int = 16,
                 ks: Iterable[int] | None = None, seed: int = 0, top_p: float = PAPER_TOP_P,
                 pass1_samples: int = PASS1_SAMPLES) -> dict[str, float]:
    """Greedy accuracy + the paper's pass@1 (T = 0.1, `pass1_samples` a prompt) + pass@k and
    entropy (T = 1, `top_p`). `ks` defaults to the powers of two up to n (and n)."""
    ks = default_ks(n) if ks is None else tuple(ks)
    return {**evaluate_greedy(generator, task, prompts, seed=seed),
            **evaluate_pass1(generator, task, prompts, n=pass1_samples, seed=seed),
            **evaluate_sampled(generator, task, prompts, n=n, ks=ks, top_p=top_p, seed=seed)}
