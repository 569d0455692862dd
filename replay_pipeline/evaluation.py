"""Held-out evaluation: greedy accuracy of the generator's current weights.

Greedy decoding (argmax) is the deterministic limit of the paper's pass@1 at temperature
0.1; pass@k at temperature 1 arrives with the objectives/evaluation issue.
"""

from __future__ import annotations

import time
from typing import Sequence

from replay_pipeline.tasks.base import Prompt


def evaluate_greedy(generator, task, prompts: Sequence[Prompt], seed: int = 0) -> dict[str, float]:
    start = time.perf_counter()
    samples = generator.generate([p.text for p in prompts], n=1, seed=seed, greedy=True)
    correct = 0
    lengths = 0
    stops = 0
    for prompt, (sample,) in zip(prompts, samples):
        correct += task.reward(prompt, sample.text, sample.finish_reason) > 0
        lengths += len(sample.completion_ids)
        stops += sample.finish_reason == "stop"
    n = max(len(prompts), 1)
    return {
        "eval/accuracy": correct / n,
        "eval/mean_length": lengths / n,
        "eval/stop_frac": stops / n,
        "eval/prompts": float(len(prompts)),
        "eval/seconds": time.perf_counter() - start,
    }
