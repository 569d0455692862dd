"""Grouped commits (buffer.commit_seconds, replay_pipeline/buffer/tables.py): a sync run that
holds its rounds' rows and usage records and commits them a group at a time trains exactly
as one that commits every round, stores exactly the same rows and records, in fewer table
versions; the held rows reach the tables at a read of the tables, a checkpoint and the end of
the run (a failed one too), and another process sees them only then."""

from __future__ import annotations

import pytest
import torch

from replay_pipeline.buffer import RolloutStore, UsageStore
from replay_pipeline.config import load_config
from replay_pipeline.run.build import build_run
from replay_pipeline.run.loop import sync_round
from replay_pipeline.tracking.tracker import NullTracker
from tests.conftest import TINY_OVERRIDES

HOLD_ALL = "buffer.commit_seconds=1e9"  # nothing commits until the tables are read or the run settles
ALL = 10**6  # a window wider than any table here: every row, by seq
# The stored columns compared (the ids and run_id name the run, and differ by design).
STORED = ["seq", "step", "policy_version", "prompt_id", "completion", "reward", "advantage",
          "behaviour_logprobs"]


def build(root, run_id, *overrides):
    cfg = load_config([f"tracking.root_dir={root}", *TINY_OVERRIDES, f"run_id={run_id}", "loop.steps=8",
                       *overrides])
    return build_run(cfg, log=lambda _: None, tracker=NullTracker())


def rounds(run, steps):
    return [{k: v for k, v in sync_round(run, step).items() if "second" not in k} for step in steps]


def other_process_view(run):
    """The tables as a second process opening them now sees them."""
    store = RolloutStore.open(run.store.uri, run.run_id)
    usage = UsageStore.open(run.store.uri, run.run_id)
    return store.count(), usage.count()


@pytest.mark.parametrize("compact_every", [0, 3])
def test_a_grouped_run_equals_one_committing_every_round(tmp_path, compact_every):
    every = f"buffer.compact_every={compact_every}"
    # Two roots: the runs of one root share its tables, and their versions.
    grouped = build(tmp_path / "grouped", "grouped", HOLD_ALL, every)
    plain = build(tmp_path / "plain", "per-round", "buffer.commit_seconds=0", every)
    assert grouped.tables.commit_seconds == 1e9 and plain.tables.commit_seconds == 0
    # The first round fills the empty mirror from the tables, which commits what it holds.
    assert rounds(grouped, [0]) == rounds(plain, [0])
    began_grouped, began_plain = grouped.store.version, plain.store.version
    assert rounds(grouped, range(1, 7)) == rounds(plain, range(1, 7))  # every metric of every round, exactly
    for a, b in zip(grouped.learner.model.state_dict().values(), plain.learner.model.state_dict().values()):
        assert torch.equal(a, b)
    assert grouped.store.version == began_grouped  # nothing committed yet
    grouped.flush_writes()
    plain.flush_writes()
    assert grouped.store.window(ALL, columns=STORED).equals(plain.store.window(ALL, columns=STORED))
    used = ["learner_step", "step", "position", "rollout_seq", "rollout_step", "policy_version", "staleness"]
    assert grouped.usage.rows(columns=used).sort_by([("learner_step", "ascending"), ("position", "ascending")]).equals(
        plain.usage.rows(columns=used).sort_by([("learner_step", "ascending"), ("position", "ascending")]))
    if not compact_every:  # one commit for six rounds against one a round
        assert grouped.store.version - began_grouped == 1
        assert plain.store.version - began_plain == 6
    for run in (grouped, plain):
        run.finish()


def test_held_rounds_reach_the_tables_at_a_checkpoint_and_at_the_end(tmp_path):
    run = build(tmp_path, "held", HOLD_ALL, "buffer.compact_every=0")
    used = run.settings.loop.updates_per_step * run.settings.loop.minibatch_size  # records a round
    rounds(run, range(3))
    rows = run.window_end
    assert rows == 3 * 16 and run.cache.hi == rows  # the mirror holds them ...
    # ... the tables only the first round's rows (committed to fill the empty mirror), no record
    assert other_process_view(run) == (16, 0)
    run.checkpoint(3)
    assert other_process_view(run) == (rows, 3 * used)
    rounds(run, range(3, 5))
    assert other_process_view(run) == (rows, 3 * used)
    run.finish("FAILED")  # a failed run commits what it holds too
    assert other_process_view(run) == (5 * 16, 5 * used)


def test_a_group_commits_once_its_time_has_passed(tmp_path):
    run = build(tmp_path, "timed", "buffer.commit_seconds=1e-9", "buffer.compact_every=0")
    start = run.store.version
    rounds(run, range(3))
    run.tables.wait_in_flight()
    used = run.settings.loop.updates_per_step * run.settings.loop.minibatch_size
    assert other_process_view(run) == (3 * 16, 3 * used)  # every round is a group of its own here
    assert run.store.version == start + 3
    run.finish()


def test_grouping_needs_the_mirror(tmp_path):
    run = build(tmp_path, "no-mirror", "buffer.read_cache=false")
    assert run.tables.commit_seconds == 0  # the sampler reads the tables every round
    run.finish()


def test_a_bad_commit_seconds_is_refused_before_any_work(tmp_path):
    from replay_pipeline.config import ConfigError
    with pytest.raises(ConfigError, match="buffer.commit_seconds"):
        build(tmp_path, "bad", "buffer.commit_seconds=-1")
    assert not list(tmp_path.rglob("*.lance"))


def test_numbering_continues_across_groups(tmp_path):
    run = build(tmp_path, "numbered", "buffer.commit_seconds=1e9", "buffer.compact_every=0")
    rounds(run, range(2))
    run.flush_writes()
    rounds(run, range(2, 4))
    run.flush_writes()
    assert run.store.window(ALL, columns=["seq"]).column("seq").to_pylist() == list(range(4 * 16))
    run.finish()
