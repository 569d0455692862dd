"""pass@k: the product form against the binomial formula and a brute-force count of
k-subsets; the vectorised mean against a plain loop; evaluate_sampled/pass1 on a fake
generator whose correctness and log-probs are known."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from replay_pipeline.training.evaluation import (default_ks, evaluate_pass1, evaluate_sampled,
                                        mean_pass_at_k, pass_at_k)
from replay_pipeline.generation.base import Sample
from replay_pipeline.tasks.base import Prompt


def comb_formula(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 16, 33, 100])
def test_matches_binomial_formula(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(comb_formula(n, c, k), abs=1e-12)


@pytest.mark.parametrize("n", [1, 2, 4, 6, 7])
def test_matches_brute_force_over_k_subsets(n):
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            expected = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_edge_cases():
    for n in (1, 4, 16, 200):
        for k in range(1, n + 1):
            assert pass_at_k(n, 0, k) == 0.0
            assert pass_at_k(n, n, k) == 1.0
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-12)
    # n - c < k: every k-subset holds a correct sample
    assert pass_at_k(16, 13, 4) == 1.0


def test_stable_for_large_n():
    # C(1000, 500) overflows float64; the product form does not need it.
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5, abs=1e-12)
    assert 0.0 < pass_at_k(1000, 3, 2) < 1.0


@pytest.mark.parametrize("n, c, k, match", [
    (4, 0, 5, r"k=5 must be in \[1, n=4\]"), (4, 0, 0, "k=0"), (4, -1, 1, "c=-1"),
    (4, 5, 1, "c=5"), (0, 0, 1, "n=0"),
])
def test_rejects_bad_arguments(n, c, k, match):
    with pytest.raises(ValueError, match=match):
        pass_at_k(n, c, k)


def test_mean_matches_plain_loop_and_is_monotone_in_k():
    rng = np.random.default_rng(0)
    n = 16
    counts = rng.integers(0, n + 1, size=200)
    ks = range(1, n + 1)
    got = mean_pass_at_k(counts, n, ks)
    for k in ks:
        assert got[k] == pytest.approx(np.mean([pass_at_k(n, int(c), k) for c in counts]), abs=1e-12)
    values = [got[k] for k in ks]
    assert all(a <= b + 1e-12 for a, b in zip(values, values[1:]))
    assert got[1] == pytest.approx(counts.mean() / n)


def test_mean_rejects_bad_counts_and_k():
    with pytest.raises(ValueError, match=r"\[0, n=4\]"):
        mean_pass_at_k(np.array([0, 5]), 4, [1])
    with pytest.raises(ValueError, match="k=8"):
        mean_pass_at_k(np.array([0, 1]), 4, [1, 8])
    with pytest.raises(ValueError, match="non-empty"):
        mean_pass_at_k(np.array([]), 4, [1])


def test_default_ks():
    assert default_ks(16) == (1, 2, 4, 8, 16)
    assert default_ks(5) == (1, 2, 4, 5)
    assert default_ks(1) == (1,)


# ------------------------------------------------------------------ evaluate_* on a fake generator
class ScriptedGenerator:
    """Prompt i's sample j has text "ok" when scripted[i][j], log-probs from `logprobs`."""

    def __init__(self, scripted: list[list[bool]], logprobs: list[float]):
        self.scripted, self.logprobs, self.calls = scripted, logprobs, []

    def generate(self, prompts, n, seed, *, greedy=False, temperature=None, top_p=None,
                 max_new_tokens=None):
        self.calls.append(dict(n=n, seed=seed, temperature=temperature, top_p=top_p))
        return [[Sample([1], [5] * len(self.logprobs), list(self.logprobs), "ok" if ok else "no",
                        "stop") for ok in row[:n]] for row in self.scripted[:len(prompts)]]


class OkTask:
    name = "ok"

    def reward(self, prompt, completion, finish_reason):
        return float(completion == "ok")


PROMPTS = [Prompt(f"p{i}", f"{i}=", "ok") for i in range(3)]


def test_evaluate_sampled_counts_and_entropy():
    scripted = [[True] * 4, [False] * 4, [True, False, False, False]]
    gen = ScriptedGenerator(scripted, logprobs=[-0.5, -1.5])
    m = evaluate_sampled(gen, OkTask(), PROMPTS, n=4, ks=(1, 2, 4), seed=7)
    # prompt pass@k: 1 | 0 | 1 - C(3,k)/C(4,k) = k/4
    assert m["eval/pass_at_1"] == pytest.approx((1 + 0 + 0.25) / 3)
    assert m["eval/pass_at_2"] == pytest.approx((1 + 0 + 0.5) / 3)
    assert m["eval/pass_at_4"] == pytest.approx((1 + 0 + 1) / 3)
    assert m["eval/sample_entropy"] == pytest.approx(1.0)  # mean of 0.5 and 1.5
    assert m["eval/sample_length"] == 2.0
    assert gen.calls == [dict(n=4, seed=7, temperature=1.0, top_p=1.0)]


def test_evaluate_sampled_rejects_k_above_n_before_generating():
    gen = ScriptedGenerator([[True] * 4] * 3, [-1.0])
    with pytest.raises(ValueError, match="k=8"):
        evaluate_sampled(gen, OkTask(), PROMPTS, n=4, ks=(1, 8))
    assert gen.calls == []


def test_evaluate_pass1_uses_paper_settings():
    gen = ScriptedGenerator([[True, True], [False, True], [False, False]], [-1.0])
    m = evaluate_pass1(gen, OkTask(), PROMPTS, n=2)
    assert m["eval/pass_at_1_t01"] == pytest.approx(3 / 6)
    assert gen.calls == [dict(n=2, seed=0, temperature=0.1, top_p=0.95)]
