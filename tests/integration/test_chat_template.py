"""Chat-formatted prompts (generator.chat_template, issue 23 item 1): with a Hugging Face
model directory whose tokenizer has a chat template, every prompt goes to the model as one
user message through the template, in training and in evaluation; the rollouts keep the
task's text in `prompt` and what the model saw in `prompt_ids`. A tokenizer without a template,
or the built-in model, is refused before any work."""

from __future__ import annotations

import pytest

from replay_pipeline.config import ConfigError, load_config
from replay_pipeline.training.evaluation import evaluate_greedy
from replay_pipeline.models.tiny import build_tiny_model, build_tokenizer
from replay_pipeline.run.build import build_run
from replay_pipeline.run.loop import sync_round
from replay_pipeline.run.preflight import preflight
from replay_pipeline.tracking.tracker import NullTracker
from tests.conftest import TINY_OVERRIDES

#: A template in the tiny tokenizer's characters: BOS, the message, then "+" opens the answer.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}+{% endif %}")


def _model_dir(path, template):
    tokenizer = build_tokenizer()
    if template:
        tokenizer.chat_template = template
    build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer


def _overrides(root, path):
    return [f"tracking.root_dir={root}", *TINY_OVERRIDES, "model=hf", f"model.path={path}",
            "generator.chat_template=true", "run_id=chat", "loop.steps=1"]


def test_prompts_go_through_the_chat_template_in_training_and_evaluation(tmp_path):
    tokenizer = _model_dir(tmp_path / "model", TEMPLATE)
    run = build_run(load_config(_overrides(tmp_path, tmp_path / "model")), log=lambda _: None,
                    tracker=NullTracker())
    sync_round(run, 0)
    run.flush_writes()
    rows = run.store.window(1000, columns=["prompt", "prompt_ids"])
    for text, ids in zip(rows.column("prompt").to_pylist(), rows.column("prompt_ids").to_pylist()):
        assert text.endswith("=") and "+" in text  # the task's own text
        assert ids == [tokenizer.bos_token_id, *tokenizer(text + "+", add_special_tokens=False)["input_ids"]]
    assert evaluate_greedy(run.generator, run.task, run.heldout[:4])["eval/prompts"] == 4.0
    (sample,), = run.generator.generate([run.heldout[0].text], n=1, seed=0, greedy=True)  # evaluation's path
    assert sample.prompt_ids == [tokenizer.bos_token_id,
                                 *tokenizer(run.heldout[0].text + "+", add_special_tokens=False)["input_ids"]]
    run.finish()


def test_a_tokenizer_without_a_template_and_the_built_in_model_are_refused_before_work(tmp_path):
    _model_dir(tmp_path / "plain", None)
    with pytest.raises(ConfigError, match=r"has no chat template .*generator.chat_template=false"):
        preflight(load_config(_overrides(tmp_path, tmp_path / "plain")))
    with pytest.raises(ConfigError, match=r"generator.chat_template=true needs a Hugging Face model"):
        load_config(["generator.chat_template=true"])


def test_a_system_prompt_goes_first_through_the_template(tmp_path):
    """generator.system_prompt is a system message before each prompt (the template renders
    every message's content in order here), in the rollouts' prompt_ids; without the chat
    template it is refused at validation."""
    tokenizer = _model_dir(tmp_path / "model", TEMPLATE)
    cfg = load_config([*_overrides(tmp_path, tmp_path / "model"), "generator.system_prompt=12"])
    run = build_run(cfg, log=lambda _: None, tracker=NullTracker())
    sync_round(run, 0)
    run.flush_writes()
    rows = run.store.window(1000, columns=["prompt", "prompt_ids"])
    for text, ids in zip(rows.column("prompt").to_pylist(), rows.column("prompt_ids").to_pylist()):
        assert ids == [tokenizer.bos_token_id, *tokenizer("12" + text + "+", add_special_tokens=False)["input_ids"]]
    run.finish()
    with pytest.raises(ConfigError, match="generator.system_prompt is set but generator.chat_template=false"):
        load_config([*TINY_OVERRIDES, "generator.system_prompt=12"])
