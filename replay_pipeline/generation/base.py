"""What every generation backend returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Sample:
    """One completion of one prompt, as the policy that generated it saw it."""

    prompt_ids: list[int]
    completion_ids: list[int]        # generated tokens, up to and including <eos> if produced
    logprobs: list[float]            # behaviour log-prob of each completion token
    text: str                        # decoded completion, special tokens removed
    finish_reason: str               # "stop" (emitted <eos>) or "length" (hit max_new_tokens)


def call_settings(gen, temperature: float | None, top_p: float | None,
                  max_new_tokens: int | None) -> tuple[float, float, int]:
    """A generate() call's temperature, top_p and max_new_tokens: the arguments given, else the
    generator's own settings; a negative max_new_tokens is refused."""
    temperature = gen.temperature if temperature is None else temperature
    top_p = gen.top_p if top_p is None else top_p
    max_new = gen.max_new_tokens if max_new_tokens is None else max_new_tokens
    if max_new < 0:
        raise ValueError(f"max_new_tokens={max_new} must be >= 0")
    return temperature, top_p, max_new


def encode_prompts(tokenizer, prompts: Sequence[str], chat_template: bool = False,
                   system_prompt: str | None = None) -> list[list[int]]:
    """The token ids a backend feeds the model for each prompt: the text with the tokenizer's
    special tokens (its BOS), or with `chat_template` the prompt as one user message through
    the tokenizer's chat template with the assistant's turn opened (the template writes its
    own special tokens, so none are added again), after `system_prompt` as a system message
    when given. The stored `prompt` column keeps the task's text; `prompt_ids` hold what the
    model saw."""
    if not chat_template:
        return [tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("generator.chat_template=true, but the tokenizer has no chat template; use a model "
                         "directory whose tokenizer_config.json (or chat_template.jinja) holds one, or set "
                         "generator.chat_template=false")
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    texts = [tokenizer.apply_chat_template([*system, {"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in prompts]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def check_positions(prompts: Sequence[str], encoded: list[list[int]], max_new: int, limit: int | None,
                    what: str) -> None:
    """Refuse, before generating, a batch whose longest prompt plus `max_new` tokens would pass
    the model's `limit` positions (`what` names that limit in the message)."""
    if not limit or not encoded:
        return
    i = max(range(len(encoded)), key=lambda k: len(encoded[k]))
    if len(encoded[i]) >= limit:
        raise ValueError(
            f"prompt {i} ({prompts[i][:40]!r}) has {len(encoded[i])} tokens, which alone fill {what}: "
            "no room is left for a completion. Shorten the prompts (or drop the longest) or use a model "
            "with more positions")
    if len(encoded[i]) + max_new > limit:
        raise ValueError(
            f"prompt {i} ({prompts[i][:40]!r}) has {len(encoded[i])} tokens; with "
            f"max_new_tokens={max_new} a sequence could reach {len(encoded[i]) + max_new} "
            f"positions, more than {what}. Lower generator.max_new_tokens to at most "
            f"{max(limit - len(encoded[i]), 0)}, shorten the prompts, or use a model with more positions")
