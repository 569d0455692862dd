"""A character-level tokenizer and a tiny Llama, built in code (nothing is downloaded).

Both are real Hugging Face objects, so everything downstream (generation backends, trainers,
checkpoints) treats them like any pretrained model: `save_pretrained` then
`AutoTokenizer` / `AutoModelForCausalLM.from_pretrained` round-trips them.

Decisions:
- One token per character (WordLevel over single characters): the vocabulary is tiny (16 with
  the default characters) and a completion's token count equals its character count.
- Ids 0-3 are `<pad>`, `<bos>`, `<eos>`, `<unk>`; `<bos>` is prepended by the post-processor
  when `add_special_tokens=True`, `<eos>` is never added automatically (the model must learn
  to produce it; the verifier requires it).
- Padding is on the left, which batched generation needs; training code that builds its own
  tensors may pad however it likes.
"""

from __future__ import annotations

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
DEFAULT_CHARS = "0123456789+="
MAX_POSITIONS = 64
"""Longest sequence the tiny model supports; an addition prompt plus answer is under 20."""


def build_tokenizer(chars: str = DEFAULT_CHARS) -> PreTrainedTokenizerFast:
    """A fast tokenizer with one token per character of `chars` plus the four special tokens."""
    if not chars or len(set(chars)) != len(chars):
        raise ValueError(f"chars={chars!r} must be non-empty with no repeated character")
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    pad, bos, eos, unk = SPECIAL_TOKENS
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters back with no separator
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=pad,
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        padding_side="left",
        model_max_length=MAX_POSITIONS,
    )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 192,
    num_layers: int = 4,
    num_heads: int = 6,
    intermediate_size: int = 512,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A randomly initialised Llama (1.77M parameters at the defaults), tied embeddings.

    Initialisation is seeded with `seed` without disturbing the caller's global torch RNG.
    """
    if hidden_size % num_heads:
        raise ValueError(
            f"hidden_size={hidden_size} must be a multiple of num_heads={num_heads}; "
            "change one of them"
        )
    if (hidden_size // num_heads) % 2:
        raise ValueError(
            f"head size {hidden_size // num_heads} (hidden_size / num_heads) must be even "
            "for rotary embeddings"
        )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    gen = model.generation_config
    gen.pad_token_id = tokenizer.pad_token_id
    gen.bos_token_id = tokenizer.bos_token_id
    gen.eos_token_id = tokenizer.eos_token_id
    gen.do_sample = False
    return model
