"""replay_pipeline.run.loop.segments and evaluations_due: which rounds share one unit (one
Prefect task in the flow) and which evaluations run inside it; pure logic, tested without Prefect."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from replay_pipeline.run.loop import evaluations_due, extras_due, segments


def loop(steps, rounds_per_task=10, eval_every=0, passk_every=0, checkpoint_every=0):
    return SimpleNamespace(steps=steps, rounds_per_task=rounds_per_task, eval_every=eval_every,
                           passk_every=passk_every, checkpoint_every=checkpoint_every)


@pytest.mark.parametrize("cfg, start, expected", [
    (loop(25, eval_every=10), 0, [(0, 9), (10, 19), (20, 24)]),
    (loop(10, eval_every=4), 0, [(0, 9)]),  # evaluations run inside a unit: they do not end it
    (loop(7, rounds_per_task=3), 0, [(0, 2), (3, 5), (6, 6)]),
    (loop(4, rounds_per_task=1), 0, [(0, 0), (1, 1), (2, 2), (3, 3)]),
    (loop(30, eval_every=25, checkpoint_every=8), 0, [(0, 7), (8, 15), (16, 23), (24, 29)]),
    (loop(20, eval_every=10, checkpoint_every=10), 7, [(7, 9), (10, 19)]),  # a resume at step 7
    (loop(5), 5, []),  # nothing left to run
])
def test_segments(cfg, start, expected):
    assert segments(cfg, start) == expected


def test_segments_cover_every_round_once_and_end_at_every_checkpoint():
    rng = random.Random(0)
    for _ in range(500):
        cfg = loop(rng.randint(1, 60), rng.randint(1, 12), rng.randint(0, 9), rng.randint(0, 20), rng.randint(0, 15))
        start = rng.randint(0, cfg.steps)
        got = segments(cfg, start)
        assert [s for first, last in got for s in range(first, last + 1)] == list(range(start, cfg.steps))
        assert all(last - first + 1 <= cfg.rounds_per_task for first, last in got)
        ends = {last + 1 for _, last in got}
        due = {done for done in range(start + 1, cfg.steps + 1) if extras_due(cfg, done)[2]}
        assert due <= ends  # a checkpoint never falls inside a task
        # every evaluation runs once, inside the unit whose rounds make it due, seeing the
        # version those rounds published (one a round, from version `start` here)
        evaluations = [e for first, last in got for e in evaluations_due(cfg, first, last, first)]
        assert [e.done for e in evaluations] == [d for d in range(start + 1, cfg.steps + 1) if extras_due(cfg, d)[0]]
        assert all(e.version == e.done and e.sampled == extras_due(cfg, e.done)[1] for e in evaluations)
