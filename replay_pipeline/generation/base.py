"""What every generation backend returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Sample:
    """One completion of one prompt, as the policy that generated it saw it."""

    prompt_ids: list[int]
    completion_ids: list[int]        # generated tokens, up to and including <eos> if produced
    logprobs: list[float]            # behaviour log-prob of each completion token
    text: str                        # decoded completion, special tokens removed
    finish_reason: str               # "stop" (emitted <eos>) or "length" (hit max_new_tokens)
