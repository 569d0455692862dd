"""The built-in tokenizer and tiny Llama, greedy accuracy, and the cached warm start."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from replay_pipeline.models.tiny import build_tiny_model, build_tokenizer
from replay_pipeline.models.warmstart import greedy_accuracy, load_warm_start, warm_start
from replay_pipeline.tasks import AdditionTask, Prompt

SMALL = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


def test_tokenizer_round_trips_through_save_pretrained(tmp_path):
    build_tokenizer().save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 16
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = tok("007+110=")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 9
    assert tok("007+110=", add_special_tokens=False)["input_ids"] == ids[1:]
    assert tok.decode(ids, skip_special_tokens=True) == "007+110="
    assert tok.decode(tok("117", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
                      skip_special_tokens=True) == "117"
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<eos>"
    assert tok("1a")["input_ids"][-1] == tok.unk_token_id


def test_tokenizer_pads_on_the_left_for_generation():
    enc = build_tokenizer()(["1+2=", "11+22="], padding=True)
    assert enc["input_ids"][0][:2] == [0, 0] and enc["attention_mask"][0][:2] == [0, 0]


def test_default_model_size_and_round_trip(tmp_path):
    tok = build_tokenizer()
    model = build_tiny_model(tok)
    n = sum(p.numel() for p in model.parameters())
    assert 1_700_000 < n < 1_850_000  # CPU-DEMO: 1.77M
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.eos_token_id == tok.eos_token_id
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    x = torch.tensor([tok("007+110=")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model.eval()(x).logits, loaded.eval()(x).logits)


def test_model_init_is_seeded():
    tok = build_tokenizer()
    a, b, c = (build_tiny_model(tok, seed=s, **SMALL) for s in (0, 0, 1))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_model_rejects_heads_that_do_not_divide_hidden():
    with pytest.raises(ValueError, match="num_heads"):
        build_tiny_model(build_tokenizer(), hidden_size=32, num_heads=6)


def _plain_greedy(model, tok, text, max_new_tokens):
    """One prompt, no padding, no KV cache: argmax of a full forward pass per token."""
    ids = tok(text)["input_ids"]
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                return tok.decode(out, skip_special_tokens=True), "stop"
            out.append(nxt)
    return tok.decode(out, skip_special_tokens=True), "length"


class _MatchesPlainLoop(AdditionTask):
    """Rewards exactly the (completion, finish_reason) a plain decoding loop produced."""

    def __init__(self, expected):
        super().__init__(digits=1, heldout_size=2, validation_size=2)
        object.__setattr__(self, "expected", expected)

    def reward(self, prompt, completion, finish_reason):
        return float(self.expected[prompt.prompt_id] == (completion, finish_reason))


def test_greedy_accuracy_matches_a_plain_loop_on_mixed_lengths():
    tok = build_tokenizer()
    model = build_tiny_model(tok, seed=23, **SMALL).eval()
    with torch.no_grad():  # sharpen the random model: varied completions, two end with <eos>
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8)
    texts = ["1+2=", "12+34=", "123+456=", "9+9=", "5+55="]  # mixed lengths: left padding
    prompts = [Prompt(f"p{i}", t, "") for i, t in enumerate(texts)]
    expected = {p.prompt_id: _plain_greedy(model, tok, p.text, 4) for p in prompts}
    assert {reason for _, reason in expected.values()} == {"stop", "length"}
    task = _MatchesPlainLoop(expected)
    assert greedy_accuracy(model, tok, task, prompts, max_new_tokens=4, batch_size=3) == 1.0


def _tiny_warm_start(task, cache_dir, **overrides):
    kwargs = dict(SMALL, warmup_steps=5, batch_size=16, max_steps=30, eval_every=10,
                  target_accuracy=0.0, log=lambda _: None)
    return warm_start(task, cache_dir, **{**kwargs, **overrides})


def test_warm_start_caches_and_rebuilds_incomplete_directories(tmp_path):
    task = AdditionTask(digits=1, heldout_size=20, validation_size=20)
    first = _tiny_warm_start(task, tmp_path)
    assert not first.cached and first.steps == 10  # target 0.0: stops at the first evaluation
    assert first.path.parent == tmp_path and first.path.name.startswith("warmstart-")
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name]  # no temp dir left
    stored = json.loads((first.path / "warmstart.json").read_text())
    assert stored["steps"] == 10 and stored["heldout_accuracy"] == first.heldout_accuracy
    model, tok = load_warm_start(first.path)
    assert model.config.hidden_size == 32 and tok.eos_token_id == 2

    second = _tiny_warm_start(task, tmp_path)
    assert second.cached and second.path == first.path and second.steps == first.steps

    # Another setting is another cache entry.
    assert _tiny_warm_start(task, tmp_path, seed=1).path != first.path

    # A directory without warmstart.json (a crash mid-write) is rebuilt, never reused.
    shutil.rmtree(first.path)
    first.path.mkdir()
    (first.path / "config.json").write_text("{half written")
    rebuilt = _tiny_warm_start(task, tmp_path)
    assert not rebuilt.cached and rebuilt.path == first.path
    assert (first.path / "warmstart.json").exists()
    assert json.loads((first.path / "config.json").read_text())["hidden_size"] == 32


def test_warm_start_is_deterministic(tmp_path):
    task = AdditionTask(digits=1, heldout_size=20, validation_size=20)
    a = _tiny_warm_start(task, tmp_path / "a")
    b = _tiny_warm_start(task, tmp_path / "b")
    (ma, _), (mb, _) = load_warm_start(a.path), load_warm_start(b.path)
    assert all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters()))


def test_warm_start_that_misses_its_target_raises_and_leaves_nothing(tmp_path):
    task = AdditionTask(digits=1, heldout_size=20, validation_size=20)
    with pytest.raises(RuntimeError, match="max_steps"):
        _tiny_warm_start(task, tmp_path, target_accuracy=1.0, max_steps=2, eval_every=1)
    assert list(tmp_path.iterdir()) == []


def test_warm_start_trains_at_the_threads_it_is_given_and_keys_them(tmp_path):
    task = AdditionTask(digits=1, heldout_size=20, validation_size=20)
    seen = []
    before = torch.get_num_threads()
    one = _tiny_warm_start(task, tmp_path, threads=1, log=lambda _: seen.append(torch.get_num_threads()))
    assert seen and set(seen) == {1}  # it trained at one thread (issue 22: no hard-coded 2)
    assert torch.get_num_threads() == before  # and gave the caller's count back
    assert json.loads((one.path / "warmstart.json").read_text())["key"]["threads"] == 1
    assert _tiny_warm_start(task, tmp_path, threads=2).path != one.path  # other sums, other entry


def test_a_stop_request_ends_the_warm_start_between_steps_and_caches_nothing(tmp_path):
    from replay_pipeline.system import stopping
    task = AdditionTask(digits=1, heldout_size=20, validation_size=20)

    def stop_at_first_evaluation(_):
        stopping.request("SIGINT")
    try:
        with pytest.raises(stopping.RunStopped, match="SIGINT during the warm start"):
            _tiny_warm_start(task, tmp_path, target_accuracy=1.0, log=stop_at_first_evaluation)
    finally:
        stopping.reset()
    assert list(tmp_path.iterdir()) == []
