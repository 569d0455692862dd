"""learner.collate: the rows laid out as one right-padded Batch, worked by hand, and the same
layout as a row-by-row construction on ragged rows (empty completions included)."""

from __future__ import annotations

import random

import pytest
import torch

from replay_pipeline.training.learner import collate


def test_two_rows_by_hand():
    b = collate([[5, 6], [7]], [[1, 2, 3], [4]], [[-0.5, -0.25, -1.0], [-2.0]], [1.0, -1.0], pad_id=0,
                rewards=[1.0, 0.0])
    assert b.input_ids.tolist() == [[5, 6, 1, 2, 3], [7, 4, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # column t predicts token t + 1: row 0's completion (columns 2-4) is predicted by columns 1-3
    assert b.completion_mask.tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]
    assert b.behaviour_logprobs.tolist() == [[0, -0.5, -0.25, -1.0], [-2.0, 0, 0, 0]]
    assert b.advantages.tolist() == [1.0, -1.0] and b.rewards.tolist() == [1.0, 0.0]
    assert b.group_reward_mean is None
    assert (b.input_ids.dtype, b.attention_mask.dtype, b.completion_mask.dtype, b.behaviour_logprobs.dtype) == (
        torch.long, torch.long, torch.float32, torch.float32)


def _row_by_row(prompts, completions, logprobs, pad_id):
    rows = [list(p) + list(c) for p, c in zip(prompts, completions)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width - 1))
    old = torch.zeros((len(rows), width - 1))
    for i, (p, c, lp) in enumerate(zip(prompts, completions, logprobs)):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(rows[i], dtype=torch.long)
        att[i, :n] = 1
        mask[i, len(p) - 1:n - 1] = 1.0
        old[i, len(p) - 1:n - 1] = torch.tensor(list(lp), dtype=torch.float32)
    return ids, att, mask, old


def test_ragged_rows_match_the_row_by_row_layout_exactly():
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 50) for _ in range(rng.randint(1, 14))] for _ in range(64)]
    completions = [[rng.randrange(1, 50) for _ in range(rng.randint(0, 9))] for _ in range(64)]
    logprobs = [[-rng.random() * 3 for _ in c] for c in completions]
    got = collate(prompts, completions, logprobs, [0.5] * 64, pad_id=99)
    for g, want in zip((got.input_ids, got.attention_mask, got.completion_mask, got.behaviour_logprobs),
                       _row_by_row(prompts, completions, logprobs, 99)):
        assert g.dtype == want.dtype and torch.equal(g, want)


def test_bad_rows_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="row 1: 2 completion tokens but 1 behaviour log-probs"):
        collate([[1], [2]], [[3], [4, 5]], [[-1.0], [-1.0]], [0.0, 0.0], pad_id=0)
    with pytest.raises(ValueError, match="a prompt of at least one token"):
        collate([[1], []], [[3], [4]], [[-1.0], [-1.0]], [0.0, 0.0], pad_id=0)
    with pytest.raises(ValueError, match="no rows"):
        collate([], [], [], [], pad_id=0)
