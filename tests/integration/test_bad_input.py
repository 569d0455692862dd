"""Bad input, end to end: NaN, infinite and raising rewards, empty and over-long completions, a
rollout table whose schema does not match, an unwritable run directory.

Each case gets a clear error or a documented, logged handling, and the rollouts already stored
stay intact (same rows, same ids, same table version where nothing should have been written).
Everything is real: LanceDB tables in tmp_path, the tiny Llama of replay_pipeline.models.tiny,
the TrainingRun phases as the Prefect flow calls them (generate, score, append, sample, learn),
no mocks of project components.

Decisions:
- Edge completions are produced by the real generator from a real model whose weights were
  fitted for a few dozen supervised steps to answer every prompt of the task with a chosen
  token sequence (<eos> first, or "1" forever), then published to the generator with
  ``load_weights`` as the learner does. That makes the edge case certain (p > 0.999 per
  token, and the draw is seeded) without mocking the model.
- A truly empty completion (zero tokens) is what the transformers backend returns for
  ``max_new_tokens=0``; the run's config refuses 0, so the test sets it on the generator.
  An <eos>-first completion is the one token <eos> with text "".
- The run directory tests use a path below a regular file: mkdir fails there even for root,
  which ignores permission bits (a chmod-based variant runs only when not root).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import math
import os
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone

import lancedb
import numpy as np
import pyarrow as pa
import pytest
import torch

from replay_pipeline.buffer import ROLLOUT_SCHEMA, RolloutStore, StoreError
from replay_pipeline.buffer.schema import make_rollout_id, rows_to_table
from replay_pipeline.config import load_config
from replay_pipeline.training.learner import Learner
from replay_pipeline.system.runs import ensure_writable
from replay_pipeline.algo.scoring import RewardFailure
from replay_pipeline.tasks.addition import AdditionTask
from replay_pipeline.run.batches import LEARN_COLUMNS
from replay_pipeline.run.build import build_run
from replay_pipeline.run.phases import TrainingRun
from replay_pipeline.tracking.tracker import NullTracker
from tests.conftest import ROOT, TINY_OVERRIDES

ROLLOUTS = 16  # TINY_OVERRIDES: 4 prompts x 4 completions per step


# ------------------------------------------------------------------ helpers
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """One run root for the module, so the tiny warm start is built once and then cached."""
    return tmp_path_factory.mktemp("bad-input")


def make_run(root, run_id: str, *overrides: str) -> TrainingRun:
    # Writes finish before append() returns, as these tests read the table right after it
    # (prepare-time validation, what they test, is the same with write-behind).
    cfg = load_config([f"tracking.root_dir={root}", *TINY_OVERRIDES, f"run_id={run_id}",
                       "loop.steps=2", "buffer.write_behind=false", *overrides])
    return build_run(cfg, log=lambda _: None, tracker=NullTracker())


def fitted_policy(run: TrainingRun, completion: str | None, *, steps: int = 30) -> dict:
    """Weights of a copy of the run's policy fitted to answer every prompt of the task with
    ``completion`` (None: <eos> immediately); the run's own learner is left untouched."""
    tok = run.tokenizer
    digits = run.task.digits
    prompts = [run.task.prompt(a, b).text for a in range(10 ** digits) for b in range(10 ** digits)]
    target = [tok.eos_token_id] if completion is None else tok(completion, add_special_tokens=False)["input_ids"]
    encoded = [tok(p)["input_ids"] for p in prompts]
    x = torch.tensor([e + target for e in encoded])
    labels = x.clone()
    labels[:, : len(encoded[0])] = -100  # learn the completion only
    model = copy.deepcopy(run.learner.model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2)
    for _ in range(steps):
        loss = model(input_ids=x, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    nll = float(loss.detach())
    assert math.exp(-nll) > 0.999, f"fit too weak: mean token NLL {nll}"
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def stored(run: TrainingRun, columns=None) -> pa.Table:
    run.flush_writes()  # appends are committed behind the learner
    return run.store.window(100_000, columns=columns)


def learner_for(run: TrainingRun, **kw) -> Learner:
    """A fresh learner on a copy of the run's policy, as build_run builds it."""
    return Learner(copy.deepcopy(run.learner.model), lr=1e-3, temperature=1.0,
                   pad_id=run.generator.pad_id, **kw)


def all_grads_finite(model) -> bool:
    return all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters())


def weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same_weights(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


class FlakyAddition(AdditionTask):
    """The addition task with a verifier that misbehaves by call number (scoring calls it once
    per rollout, in row order): call i raises when i % 4 == 0, returns nan when 1, inf when 2,
    and a finite reward (the completion's length / 10, so groups have varied rewards) when 3."""

    def reward(self, prompt, completion, finish_reason):
        i = next(self._calls)
        if i % 4 == 0:
            raise ValueError(f"boom {i}")
        if i % 4 == 1:
            return float("nan")
        if i % 4 == 2:
            return float("inf")
        return len(completion) / 10


def flaky(task: AdditionTask) -> FlakyAddition:
    out = FlakyAddition(**dataclasses.asdict(task))
    object.__setattr__(out, "_calls", itertools.count())  # the dataclass is frozen
    return out


# ------------------------------------------------------------------ NaN / inf / raising reward
def test_raising_and_non_finite_rewards_are_flagged_stored_and_trained_on(root, caplog):
    """Issue case "NaN or infinite reward, a reward function that raises": each flagged
    rollout scores 0.0, is stored with its reason in reward_error, counted in score/flagged
    and named in one warning; advantages and the learner step stay finite; stored rows stay
    as written."""
    run = make_run(root, "flaky")
    run.task = flaky(run.task)
    batch = run.generate(0)
    with caplog.at_level(logging.WARNING, logger="replay_pipeline.algo.scoring"):
        table, metrics = run.score(batch)
    warnings = [r for r in caplog.records if r.name == "replay_pipeline.algo.scoring"]
    assert len(warnings) == 1  # once per step, not once per rollout
    assert "step 0: 12 of 16 rollouts flagged" in warnings[0].getMessage()
    assert "first: reward raised ValueError: boom 0" in warnings[0].getMessage()
    assert metrics["score/flagged"] == 12.0

    errors = table.column("reward_error").to_pylist()
    expected = [("reward raised ValueError: boom %d" % i, "reward was nan", "reward was inf", None)[i % 4]
                for i in range(ROLLOUTS)]
    assert errors == expected
    rewards = table.column("reward").to_pylist()
    texts = table.column("completion").to_pylist()
    for i, (r, e, text) in enumerate(zip(rewards, errors, texts)):
        assert r == (0.0 if e else pytest.approx(len(text) / 10)), i
    assert not any(c for c, e in zip(table.column("correct").to_pylist(), errors) if e)
    for column in ("reward", "advantage", "group_reward_mean"):
        assert np.isfinite(table.column(column).to_numpy()).all(), column
    assert np.abs(table.column("advantage").to_numpy()).max() > 0  # still a learning signal

    run.append(table, 0)
    before = stored(run)
    assert before.num_rows == ROLLOUTS
    assert before.column("rollout_id").to_pylist() == table.column("rollout_id").to_pylist()
    assert before.column("reward_error").to_pylist() == expected  # round-trips through Lance

    minibatches, _ = run.sample(0)
    learned = run.learn(minibatches, 0)
    assert all(math.isfinite(v) for v in learned.values()), learned
    assert learned["learn/tokens"] > 0 and all_grads_finite(run.learner.model)
    assert all(bool(torch.isfinite(p).all()) for p in run.learner.model.parameters())
    after = stored(run)
    assert after.equals(before) and run.store.count() == ROLLOUTS


def test_a_step_without_bad_rewards_stores_null_reward_error_and_logs_nothing(root, caplog):
    run = make_run(root, "clean")
    with caplog.at_level(logging.WARNING, logger="replay_pipeline.algo.scoring"):
        table, metrics = run.score(run.generate(0))
    assert not [r for r in caplog.records if r.name == "replay_pipeline.algo.scoring"]
    assert metrics["score/flagged"] == 0.0
    assert table.column("reward_error").null_count == ROLLOUTS
    run.append(table, 0)
    assert stored(run, ["reward_error"]).column("reward_error").null_count == ROLLOUTS


# ------------------------------------------------------------------ empty completions
def test_eos_first_completion_is_one_eos_token_with_empty_text_and_is_stored(root):
    run = make_run(root, "eos-first")
    run.generator.load_weights(fitted_policy(run, None), run.policy_version)
    batch = run.generate(0)
    eos = run.generator.eos_id
    for s in (s for group in batch.samples for s in group):
        assert s.completion_ids == [eos] and len(s.logprobs) == 1 and s.logprobs[0] <= 0
        assert s.text == "" and s.finish_reason == "stop"
    table, metrics = run.score(batch)
    assert metrics["score/flagged"] == 0 and metrics["generate/mean_length"] == 1.0
    assert table.column("reward").to_pylist() == [0.0] * ROLLOUTS  # "" is never the answer
    run.append(table, 0)
    rows = stored(run, ["completion", "completion_ids", "num_tokens", "finish_reason"]).to_pydict()
    assert rows["completion"] == [""] * ROLLOUTS and rows["completion_ids"] == [[eos]] * ROLLOUTS
    assert rows["num_tokens"] == [1] * ROLLOUTS and rows["finish_reason"] == ["stop"] * ROLLOUTS


@pytest.fixture(scope="module")
def empty_run(root):
    """A run whose step 0 stored 16 zero-token completions (max_new_tokens=0 on the
    generator) and whose step 1 stored 16 ordinary ones."""
    run = make_run(root, "empty")
    run.generator.max_new_tokens = 0
    batch = run.generate(0)
    assert all(s.completion_ids == [] and s.logprobs == [] and s.text == "" and s.finish_reason == "length"
               for group in batch.samples for s in group)
    table, metrics = run.score(batch)
    assert metrics["generate/tokens"] == 0 and metrics["score/flagged"] == 0
    run.append(table, 0)
    run.generator.max_new_tokens = run.settings.generator.max_new_tokens
    table, _ = run.score(run.generate(1))
    run.append(table, 1)
    return run


def test_zero_token_completions_are_stored_as_empty_lists(empty_run):
    rows = stored(empty_run, ["step", "completion_ids", "behaviour_logprobs", "num_tokens",
                              "finish_reason", "reward"]).to_pydict()
    empty = [i for i, s in enumerate(rows["step"]) if s == 0]
    assert len(empty) == ROLLOUTS and len(rows["step"]) == 2 * ROLLOUTS
    for i in empty:
        assert rows["completion_ids"][i] == [] and rows["behaviour_logprobs"][i] == []
        assert rows["num_tokens"][i] == 0 and rows["finish_reason"][i] == "length"
        assert rows["reward"][i] == 0.0


def _minibatch(run: TrainingRun, steps: set[int]) -> dict[str, list]:
    """Every stored rollout of ``steps``, read back as the learner's columns (as sample() does)."""
    seqs = [q for q, s in zip(*stored(run, ["seq", "step"]).to_pydict().values()) if s in steps]
    return run.store.take_seqs(np.asarray(seqs), columns=LEARN_COLUMNS).to_pydict()


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_learner_on_a_minibatch_with_empty_completions_is_finite_and_ignores_them(
        empty_run, loss_agg, kl_coef):
    """Empty completions add nothing: the step on (empty + ordinary) rollouts gives the same
    loss and gradient as on the ordinary ones alone (seq_mean does not count empty rows)."""
    mixed, ordinary = _minibatch(empty_run, {0, 1}), _minibatch(empty_run, {1})
    assert any(len(c) == 0 for c in mixed["completion_ids"])
    a = learner_for(empty_run, loss_agg=loss_agg, kl_coef=kl_coef)
    b = learner_for(empty_run, loss_agg=loss_agg, kl_coef=kl_coef)
    ma, mb = a.step(mixed), b.step(ordinary)
    assert all(math.isfinite(v) for v in ma.values()), ma
    assert all_grads_finite(a.model)
    assert ma["tokens"] == mb["tokens"] > 0
    for key in ("loss", "grad_norm", "entropy", "ratio_mean", "ratio_max", "kl_behaviour",
                "kl_behaviour_k3", *(["kl_ref"] if kl_coef else [])):
        assert ma[key] == pytest.approx(mb[key], rel=1e-4, abs=1e-6), key
    for pa_, pb_ in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(pa_.grad, pb_.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_learner_on_only_empty_completions_takes_no_optimizer_step(empty_run, loss_agg, kl_coef):
    """Nothing to learn: loss 0, every diagnostic finite (0), weights unchanged (no AdamW
    momentum-only update either, so a previous step is made first), and the learner step is
    still counted so usage records keep their numbering."""
    learner = learner_for(empty_run, loss_agg=loss_agg, kl_coef=kl_coef)
    learner.step(_minibatch(empty_run, {1}))  # gives AdamW some momentum
    before = weights(learner.model)
    metrics = learner.step(_minibatch(empty_run, {0}))
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["tokens"] == 0 and metrics["loss"] == 0 and metrics["grad_norm"] == 0
    assert metrics["ratio_max"] == 0 and metrics["entropy"] == 0
    assert learner.steps == 2 and same_weights(before, weights(learner.model))


def test_the_loop_trains_through_a_window_holding_empty_completions(empty_run):
    """sample() and learn() as the flow calls them, on a window that holds both kinds."""
    count, version = empty_run.store.count(), empty_run.store.version
    minibatches, _ = empty_run.sample(1)
    metrics = empty_run.learn(minibatches, 1)
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert empty_run.store.count() == count and empty_run.store.version == version


# ------------------------------------------------------------------ over-long completions
def test_completion_cut_at_max_new_tokens_is_stored_as_length_and_scores_zero(root):
    run = make_run(root, "too-long")
    run.generator.load_weights(fitted_policy(run, "1" * 10), run.policy_version)
    batch = run.generate(0)
    max_new = run.settings.generator.max_new_tokens
    for s in (s for group in batch.samples for s in group):
        assert s.finish_reason == "length" and run.generator.eos_id not in s.completion_ids
        assert len(s.completion_ids) == len(s.logprobs) == max_new and s.text == "1" * max_new
    table, _ = run.score(batch)
    run.append(table, 0)
    rows = stored(run, ["finish_reason", "num_tokens", "reward", "reward_error"]).to_pydict()
    assert rows["finish_reason"] == ["length"] * ROLLOUTS and rows["num_tokens"] == [max_new] * ROLLOUTS
    assert rows["reward"] == [0.0] * ROLLOUTS and rows["reward_error"] == [None] * ROLLOUTS
    # The addition task's documented rule: only a completion that ended with <eos> counts,
    # so even the right digits score 0 when they were cut off.
    p = run.task.prompt(3, 4)
    assert run.task.reward(p, p.answer, "length") == 0.0 and run.task.reward(p, p.answer, "stop") == 1.0


def test_generator_refuses_a_max_new_tokens_the_model_cannot_hold(root):
    run = make_run(root, "gen-positions")
    limit = run.generator.model.config.max_position_embeddings
    prompt = run.task.prompt(3, 4).text
    prompt_tokens = len(run.tokenizer(prompt)["input_ids"])
    with pytest.raises(ValueError, match=rf"max_position_embeddings={limit}.*generator.max_new_tokens "
                                         rf"to at most {limit - prompt_tokens}.*more positions"):
        run.generator.generate([prompt], n=2, seed=0, max_new_tokens=limit)
    assert len(run.generator.generate([prompt], n=2, seed=0, max_new_tokens=limit - prompt_tokens)[0]) == 2


def test_learner_refuses_a_stored_rollout_longer_than_the_model_before_training(root):
    """A rollout from elsewhere (another backend, another tool) that does not fit the model's
    positions is stored (the store does not know the model) but refused by the learner with
    the rollout's id, the limit and the fix; no weight moves, no usage is recorded, and the
    stored rows stay as they were."""
    run = make_run(root, "long-row")
    table, _ = run.score(run.generate(0))
    run.append(table, 0)
    limit = run.learner.model.config.max_position_embeddings
    row = {k: v for k, v in stored(run).to_pylist()[0].items() if k != "seq"}
    extra = limit - len(row["prompt_ids"]) - len(row["completion_ids"]) + 1
    long_id = make_rollout_id(run.run_id, 1, 0, 0)
    row |= {"rollout_id": long_id, "step": 1,
            "completion_ids": row["completion_ids"] + [row["completion_ids"][0]] * extra,
            "behaviour_logprobs": row["behaviour_logprobs"] + [-0.5] * extra}
    row["num_tokens"] = len(row["completion_ids"])
    assert run.store.append([row]) == 1
    before, version = stored(run), run.store.version
    weights_before, steps_before = weights(run.learner.model), run.learner.steps

    minibatch = run.store.take_seqs(np.arange(ROLLOUTS + 1), columns=LEARN_COLUMNS).to_pydict()
    with pytest.raises(ValueError, match=rf"rollout '{long_id}' \(row {ROLLOUTS} of the minibatch\) has "
                                         rf".* = {limit + 1} tokens, more than the model's "
                                         rf"max_position_embeddings={limit}.*generator.max_new_tokens.*"
                                         "more positions"):
        run.learn([minibatch], 1)
    assert run.learner.steps == steps_before and same_weights(weights_before, weights(run.learner.model))
    assert run.usage.count() == 0 and run.policy_version == 0
    assert stored(run).equals(before) and run.store.version == version


@pytest.mark.parametrize("column, value, message", [
    ("advantage", float("nan"), "advantage=nan"),
    ("reward", float("inf"), "reward=inf"),
    ("behaviour_logprobs", None, "non-finite behaviour log-prob"),
])
def test_learner_refuses_non_finite_stored_numbers_naming_the_rollout(root, column, value, message):
    """Numbers written by something other than the scorer (which never stores them) would make
    every weight NaN; the learner refuses them with the rollout's id instead."""
    run = make_run(root, f"nonfinite-{column.replace('_', '-')}")
    table, _ = run.score(run.generate(0))
    run.append(table, 0)
    run.flush_writes()  # the round's rows may be held for a grouped commit
    mb = run.store.take_seqs(np.arange(ROLLOUTS), columns=LEARN_COLUMNS).to_pydict()
    if column == "behaviour_logprobs":
        mb[column][5] = [float("-inf")] * len(mb[column][5])
    else:
        mb[column][5] = value
    before = weights(run.learner.model)
    with pytest.raises(ValueError, match=rf"rollout '{mb['rollout_id'][5]}' \(row 5 .*{message}"):
        run.learner.step(mb)
    assert run.learner.steps == 0 and same_weights(before, weights(run.learner.model))


# ------------------------------------------------------------------ schema mismatches
T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)
OLD_SCHEMA = pa.schema([f for f in ROLLOUT_SCHEMA if f.name != "reward_error"])
"""The rollout schema before reward_error existed: what a table of an older run has."""


def plain_rows(run_id: str, step: int, n: int = 4) -> list[dict]:
    """Hand-made rollout row dicts without reward_error (as code older than the column writes them)."""
    return [dict(rollout_id=make_rollout_id(run_id, step, 0, i), run_id=run_id, policy_version=step,
                 step=step, prompt_id="p0", group_id=f"{run_id}/s{step:06d}/g0000", sample_index=i,
                 prompt="1+2=", completion="3", prompt_ids=[1, 5, 14, 6, 15], completion_ids=[7, 2],
                 behaviour_logprobs=[-0.1, -0.2], reward=float(i % 2), correct=bool(i % 2),
                 advantage=float(i % 2) - 0.5, group_reward_mean=0.5, finish_reason="stop",
                 num_tokens=2, seed=step, created_at=T0) for i in range(n)]


def stored_table(run_id: str, schema: pa.Schema, n: int = 8) -> pa.Table:
    """Rows as a table of another schema would hold them (seq filled in)."""
    t = rows_to_table(plain_rows(run_id, 0, n))
    t = t.set_column(t.schema.get_field_index("seq"), "seq", pa.array(range(n), pa.int64()))
    cols = {f.name: (t.column(f.name).cast(f.type) if f.name in t.column_names
                     else pa.array(range(n), f.type)) for f in schema}
    return pa.table(cols, schema=schema)


@pytest.mark.parametrize("schema, problem", [
    (OLD_SCHEMA, r"missing columns \['reward_error'\]"),
    (pa.schema([f if f.name != "reward_error" else pa.field("reward_error", pa.int64())
                for f in ROLLOUT_SCHEMA]), "column 'reward_error' has type int64, expected string"),
    (pa.schema([f if f.name != "reward" else pa.field("reward", pa.float64())
                for f in ROLLOUT_SCHEMA]), "column 'reward' has type double, expected float"),
], ids=["older-run", "wrong-reward-error-type", "wrong-reward-type"])
def test_open_refuses_a_mismatching_table_and_leaves_its_rollouts_intact(tmp_path, schema, problem):
    """test_store covers an empty mismatching table; this one holds rollouts, and every one of
    them, the version and the schema must survive the refused open."""
    db = lancedb.connect(tmp_path / "db")
    db.create_table("rollouts_old", data=stored_table("old", schema))
    before = db.open_table("rollouts_old").to_arrow()
    version = db.open_table("rollouts_old").version
    with pytest.raises(StoreError, match=rf"'rollouts_old'.*does not match ROLLOUT_SCHEMA: .*{problem}"
                                         r".*left unchanged"):
        RolloutStore.open(tmp_path / "db", "old")
    with pytest.raises(StoreError, match=problem):
        RolloutStore.open_or_create(tmp_path / "db", "old")
    after = lancedb.connect(tmp_path / "db").open_table("rollouts_old")
    assert after.version == version and after.count_rows() == 8
    assert after.schema.equals(schema) and after.to_arrow().equals(before)


def test_appending_a_batch_without_reward_error_writes_nothing(tmp_path):
    """A *table* from an old writer (no reward_error) is refused whole, and row dicts with a
    reward_error that is not a string too; row dicts that just leave it out are accepted with
    a null reward_error."""
    store = RolloutStore.create(tmp_path / "db", "run-a")
    assert store.append(plain_rows("run-a", 0)) == 4  # dicts without reward_error: stored as null
    before, version = stored_rows(store), store.version
    assert before.column("reward_error").null_count == 4

    old_batch = rows_to_table(plain_rows("run-a", 1)).drop_columns(["seq", "reward_error"])
    with pytest.raises(StoreError, match=r"missing columns \['reward_error'\].*nothing was written"):
        store.append(old_batch)
    bad = plain_rows("run-a", 1)
    bad[2]["reward_error"] = 3.5
    with pytest.raises(StoreError, match="'reward_error' cannot be converted to string"):
        store.append(bad)
    assert stored_rows(store).equals(before) and store.version == version and store.count() == 4

    good = plain_rows("run-a", 1)
    good[1]["reward_error"] = "reward was nan"
    assert store.append(good) == 4
    assert stored_rows(store).column("reward_error").to_pylist()[4:] == [None, "reward was nan", None, None]


def stored_rows(store: RolloutStore) -> pa.Table:
    return store.window(100_000)


# ------------------------------------------------------------------ unwritable run directory
def test_ensure_writable_names_the_directory_and_the_fix_even_for_root(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for target in (blocker, blocker / "runs"):
        with pytest.raises(PermissionError, match=rf"cannot write under {target}.*tracking.root_dir="):
            ensure_writable(target)
    assert blocker.read_text() == "not a directory" and sorted(tmp_path.iterdir()) == [blocker]


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root writes into a read-only directory anyway; the test below a "
                           "regular file covers root")
def test_ensure_writable_refuses_a_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match=r"Permission denied.*tracking.root_dir="):
            ensure_writable(ro / "runs")
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


def test_training_run_setup_writes_nothing_under_an_unwritable_root(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    cfg = load_config([f"tracking.root_dir={blocker / 'runs'}", *TINY_OVERRIDES, "run_id=nope"])
    with pytest.raises(PermissionError, match="tracking.root_dir="):
        build_run(cfg, log=lambda _: None, tracker=NullTracker())
    assert sorted(tmp_path.iterdir()) == [blocker]


def test_train_cli_exits_2_before_any_work_when_the_root_is_unwritable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_HOME"}  # the CLI's own default
    proc = subprocess.run([sys.executable, "-m", "flows.train", f"tracking.root_dir={blocker / 'runs'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"error: cannot write under {blocker / 'runs'}" in proc.stderr
    assert "set tracking.root_dir to a writable directory" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert sorted(tmp_path.iterdir()) == [blocker] and blocker.read_text() == "x"


class HangingAddition(AdditionTask):
    """The addition task whose verifier hangs on every fifth call (a reward that never
    returns: a stuck HTTP call, an infinite loop) and raises on every seventh."""

    def reward(self, prompt, completion, finish_reason):
        i = next(self._calls)
        if i % 5 == 0:
            threading.Event().wait(3600)
        if i % 7 == 3:
            raise RuntimeError(f"bad {i}")
        return super().reward(prompt, completion, finish_reason)


def test_rewards_that_raise_or_hang_are_flagged_in_evaluation_too_and_a_timeout_bounds_them(root):
    """Issue 23 item 2: a reward that raises during held-out evaluation does not crash the
    run, and one that never returns is cut off by reward.timeout (a flagged 0, as in training)."""
    run = make_run(root, "hang", "reward.timeout=0.2", "loop.eval_samples=2", "loop.pass1_samples=1")
    task = HangingAddition(**dataclasses.asdict(run.task))
    object.__setattr__(task, "_calls", itertools.count())
    run.task = task
    start = time.perf_counter()
    metrics = run.evaluate(0, sampled=True)
    prompts = len(run.heldout)
    calls = prompts * (1 + 1 + 2)  # greedy, pass@1 (1 sample), pass@k (2 samples)
    hung, raised = len(range(0, calls, 5)), sum(1 for i in range(calls) if i % 7 == 3 and i % 5)
    assert metrics["eval/flagged"] + metrics["eval/pass1_flagged"] + metrics["eval/sample_flagged"] == hung + raised
    assert time.perf_counter() - start < hung * 0.2 + 30  # each hang cost its timeout, not forever
    assert 0.0 <= metrics["eval/accuracy"] <= 1.0
    batch = run.generate(0)  # training: the same containment, with the reason stored
    table, scored = run.score(batch)
    assert scored["score/flagged"] > 0
    assert any(e and e.startswith("reward timed out after 0.2 s") for e in table.column("reward_error").to_pylist())
    run.finish()


def test_a_batch_with_too_many_flagged_rewards_stops_the_run_before_it_is_stored(root):
    run = make_run(root, "broken-reward", "reward.max_flagged_fraction=0.5")
    run.task = flaky(run.task)  # 12 of 16 flagged
    batch = run.generate(0)
    with pytest.raises(RewardFailure, match=r"step 0: 12 of 16 rollouts flagged .*above reward.max_flagged_fraction=0.5"):
        run.score(batch)
    assert run.store.count() == 0  # nothing of the step was stored
    run.finish()


def test_cfg_piped_into_head_ends_quietly():
    """`python -m flows.train --cfg | head -1`: the reader leaves early; no BrokenPipeError traceback."""
    shell = f"{sys.executable} -m flows.train --cfg | head -1"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", shell], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout == "seed: 0\n" and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("args, code", [(["--help"], 0), (["loop.stepz=4"], 2), (["+loop.setps=5"], 2),
                                        (["algo.lr=abc"], 2), (["--bogus"], 2)])
def test_help_and_config_errors_answer_before_prefect_and_torch_are_imported(args, code):
    """Issue 23: --help and configuration errors are answered with Hydra and the schema only,
    before Prefect and torch are imported, in well under a second (docs/reliability.md)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "flows.train", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert not {"torch", "prefect", "lancedb", "mlflow", "transformers"} & imported
    assert ("usage: python -m flows.train" in done.stdout) if code == 0 else done.stderr.count("error:") >= 1


def test_the_preflight_refuses_a_model_without_tokenizer_a_reused_run_id_and_a_silent_mlflow_server(root, tmp_path):
    """Issue 23 item 3: what failed only after Prefect had started, with long tracebacks, is
    refused before any work, each with the file or setting and the fix."""
    import socket

    from replay_pipeline.config import ConfigError
    from replay_pipeline.run.preflight import preflight

    run = make_run(root, "saved-model")
    model_dir = tmp_path / "model-only"
    run.learner.model.save_pretrained(model_dir)  # weights and config, no tokenizer
    run.finish()
    with pytest.raises(ConfigError, match="holds no tokenizer .*tokenizer.save_pretrained"):
        preflight(load_config(["model=hf", f"model.path={model_dir}", f"tracking.root_dir={root}"]))
    from replay_pipeline.models.tiny import build_tokenizer

    build_tokenizer("0123456789+=abcdefghij").save_pretrained(model_dir)  # ten letters the model never saw
    with pytest.raises(ConfigError, match=r"the tokenizer has 26 tokens but the model's embedding only 16 rows "
                                          r"\(config.json vocab_size\), so token ids 16..25"):
        preflight(load_config(["model=hf", f"model.path={model_dir}", f"tracking.root_dir={root}"]))
    build_tokenizer().save_pretrained(model_dir)  # the model's own: accepted
    preflight(load_config(["model=hf", f"model.path={model_dir}", f"tracking.root_dir={root}", "run_id=fresh"]))
    with pytest.raises(ConfigError, match="run_id=saved-model is a run that exists .*resume=saved-model"):
        preflight(load_config([*TINY_OVERRIDES, "run_id=saved-model", f"tracking.root_dir={root}"]))
    with socket.socket() as sock:  # a port where nothing listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=f"tracking.mlflow_uri=http://127.0.0.1:{port} does not answer"):
        preflight(load_config([*TINY_OVERRIDES, f"tracking.mlflow_uri=http://127.0.0.1:{port}",
                               f"tracking.root_dir={root}"]))
    assert time.perf_counter() - started < 10  # not minutes of retries, then a long traceback


def test_a_prompt_that_fills_the_models_positions_alone_is_told_so():
    from replay_pipeline.generation.base import check_positions

    with pytest.raises(ValueError, match="alone fill the model's 8 positions: no room is left for a completion"):
        check_positions(["x" * 10], [list(range(10))], 4, 8, "the model's 8 positions")


def test_a_run_too_large_for_the_disk_under_its_root_is_refused_before_any_work(root):
    import shutil as _shutil

    from replay_pipeline.config import ConfigError
    from replay_pipeline.run.preflight import planned_bytes, preflight

    cfg = load_config([*TINY_OVERRIDES, "loop.steps=2000000000", f"tracking.root_dir={root}"])
    assert planned_bytes(cfg) > _shutil.disk_usage(root).free  # more than any disk here holds
    with pytest.raises(ConfigError, match=r"GB free; the planned run needs about .* lower loop.steps"):
        preflight(cfg)
    preflight(load_config([*TINY_OVERRIDES, f"tracking.root_dir={root}"]))  # a small run passes
