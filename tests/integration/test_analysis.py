"""replay_pipeline.reports.analysis against real LanceDB tables in tmp_path (no mocks).

The fixture database holds two runs:

* ``run-a``: 4 generation steps x 2 groups x 4 samples = 32 rollouts; policy version = step,
  so seq = 8 * step + 4 * group + sample. Sample i of step s is correct (reward 1) iff i < s:
  per-version accuracy 0, 0.25, 0.5, 0.75. Completion length is 1 + (i + s) % 3 tokens:
  per-version mean length 1.75, 2.0, 2.25, 1.75. A usage table (written here with pyarrow +
  lancedb, in the UsageStore contract's schema) records 6 learner steps, 22 uses (USES).
* ``run-b``: 8 rollouts and no usage table (a run from before the usage log).

Uses per rollout seq, worked by hand from USES:
  0: 5 (ls0, ls1 twice, ls2, ls5)   1: 2   8: 3   16: 2
  2, 3, 4, 5, 9, 10, 11, 12, 17, 24: 1 each   the other 18 rollouts: 0
Staleness (learner version - rollout version, rollout version = seq // 8):
  ls2 uses seq 0, 1 at version 1 -> 1, 1; ls4 uses seq 8 at version 2 -> 1;
  ls5 uses seq 16 at version 3 -> 1 and seq 0 -> 3; every other use -> 0 (17 uses).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import lancedb
import pandas as pd
import pyarrow as pa
import pytest

from replay_pipeline.reports import analysis
from replay_pipeline.buffer import RolloutStore
from replay_pipeline.buffer.schema import ROLLOUT_SCHEMA, make_rollout_id, rows_to_table

RUN_A, RUN_B = "run-a", "run-b"
T0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)

# (learner_step, generation step at use, learner's policy version, rollout seqs in minibatch order)
USES = [
    (0, 0, 0, [0, 1, 2, 3]),
    (1, 0, 0, [0, 0, 4, 5]),
    (2, 1, 1, [8, 9, 0, 1]),
    (3, 1, 1, [8, 10, 11, 12]),
    (4, 2, 2, [16, 8, 17]),
    (5, 3, 3, [24, 16, 0]),
]
REUSE = {0: 5, 1: 2, 8: 3, 16: 2, **{s: 1 for s in (2, 3, 4, 5, 9, 10, 11, 12, 17, 24)}}


def rollout_rows(run_id: str, step: int, n_groups: int = 2, group_size: int = 4) -> list[dict]:
    rows = []
    for g in range(n_groups):
        for i in range(group_size):
            length = 1 + (i + step) % 3
            rows.append(
                dict(
                    rollout_id=make_rollout_id(run_id, step, g, i),
                    run_id=run_id,
                    policy_version=step,
                    step=step,
                    prompt_id=f"p{g}",
                    group_id=f"{run_id}/s{step:06d}/g{g:04d}",
                    sample_index=i,
                    prompt=f"{g:03d}+{step:03d}=",
                    completion=f"completion {step}/{g}/{i} " + "x" * 60,
                    prompt_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                    completion_ids=list(range(10, 10 + length)),
                    behaviour_logprobs=[-0.1] * length,
                    reward=1.0 if i < step else 0.0,
                    correct=i < step,
                    advantage=0.125 * i,
                    group_reward_mean=min(step, group_size) / group_size,
                    finish_reason="stop",
                    num_tokens=length,
                    seed=1000 + step,
                    created_at=T0 + dt.timedelta(minutes=step),
                )
            )
    return rows


def usage_table(run_id: str) -> pa.Table:
    rows = []
    for learner_step, step, version, seqs in USES:
        for position, seq in enumerate(seqs):
            rollout_step = seq // 8
            rows.append(
                dict(
                    usage_id=f"{run_id}/l{learner_step:06d}/p{position:04d}",
                    run_id=run_id,
                    learner_step=learner_step,
                    step=step,
                    position=position,
                    rollout_id=make_rollout_id(run_id, rollout_step, (seq % 8) // 4, seq % 4),
                    rollout_seq=seq,
                    rollout_step=rollout_step,
                    rollout_policy_version=rollout_step,
                    policy_version=version,
                    staleness=version - rollout_step,
                    created_at=T0 + dt.timedelta(minutes=learner_step),
                )
            )
    return pa.Table.from_pylist(rows, schema=analysis.USAGE_SCHEMA)


def build_replay_db(root: Path) -> Path:
    """The two-run database described in the module docstring; returns its uri."""
    uri = root / "lancedb"
    store = RolloutStore.create(uri, RUN_A)
    for step in range(4):
        store.append(rows_to_table(rollout_rows(RUN_A, step)))
        if step == 1:
            store.tag("step-000002")
    lancedb.connect(str(uri)).create_table(analysis.USAGE_PREFIX + RUN_A, data=usage_table(RUN_A))
    RolloutStore.create(uri, RUN_B).append(rollout_rows(RUN_B, 0))
    return uri


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> str:
    return str(build_replay_db(tmp_path_factory.mktemp("analysis")))


@pytest.fixture
def usage_backend():
    """Reuse and usage figures come from the run's UsageStore."""
    return "UsageStore"


def seqs(table: pa.Table) -> list[int]:
    return table.column("seq").to_pylist()


# ------------------------------------------------------------------ runs
def test_list_runs(db):
    runs = analysis.list_runs(db)
    assert runs.column("run_id").to_pylist() == [RUN_A, RUN_B]
    a, b = runs.to_pylist()
    assert (a["rollouts"], a["usage_records"]) == (32, 22)
    assert (a["min_policy_version"], a["max_policy_version"]) == (0, 3)
    assert (a["first_created_at"], a["last_created_at"]) == (T0, T0 + dt.timedelta(minutes=3))
    assert a["tags"] == ["step-000002"] and a["version"] >= 5
    assert (b["rollouts"], b["usage_records"], b["tags"]) == (8, 0, [])
    assert isinstance(analysis.list_runs(db, as_pandas=True), pd.DataFrame)
    assert analysis.run_info(db, RUN_B)["rollouts"] == 8


def test_missing_database_is_not_created(tmp_path):
    missing = tmp_path / "nowhere" / "lancedb"
    with pytest.raises(ValueError, match=r"no LanceDB database at .*nowhere.*tracking.root_dir"):
        analysis.list_runs(missing)
    assert not missing.exists()
    (tmp_path / "empty").mkdir()
    assert analysis.list_runs(tmp_path / "empty").num_rows == 0


# ------------------------------------------------------------------ rollout filters
def test_rollouts_all_columns_sorted_with_reuse_count(db, usage_backend):
    t = analysis.rollouts(db, RUN_A)
    assert t.column_names == [*ROLLOUT_SCHEMA.names, "reuse_count"]
    assert seqs(t) == list(range(32))
    assert t.column("reuse_count").to_pylist() == [REUSE.get(s, 0) for s in range(32)]
    df = t.to_pandas()
    assert list(df["completion_ids"].iloc[9]) == [10, 11, 12]


@pytest.mark.parametrize(
    "filters, expected",
    [
        (dict(versions=(1, 2)), list(range(8, 24))),
        (dict(versions=(3, None)), list(range(24, 32))),
        (dict(versions=(None, 0)), list(range(0, 8))),
        (dict(steps=(2, 2)), list(range(16, 24))),
        (dict(versions=(0, 3), steps=(1, 1)), list(range(8, 16))),
        # step s: samples i < s correct; seq = 8s + 4g + i
        (dict(correct=True), [8, 12, 16, 17, 20, 21, 24, 25, 26, 28, 29, 30]),
        (dict(reward_min=0.5, versions=(1, 2)), [8, 12, 16, 17, 20, 21]),
        (dict(correct=False, steps=(3, 3)), [27, 31]),
        (dict(reward_max=0.0, versions=(2, 2)), [18, 19, 22, 23]),
        (dict(reward_min=2.0), []),  # matches nothing: empty, not an error
        (dict(versions=(7, 9)), []),
    ],
)
def test_rollout_filters(db, filters, expected):
    t = analysis.rollouts(db, RUN_A, **filters)
    assert seqs(t) == expected
    assert t.column_names[-1] == "reuse_count"
    assert analysis.count_rollouts(db, RUN_A, **filters) == len(expected)


@pytest.mark.parametrize(
    "filters, expected",
    [
        (dict(min_reuse=2), [0, 1, 8, 16]),
        (dict(min_reuse=3), [0, 8]),
        (dict(min_reuse=1, max_reuse=1), [2, 3, 4, 5, 9, 10, 11, 12, 17, 24]),
        (dict(max_reuse=0, versions=(0, 1)), [6, 7, 13, 14, 15]),
        (dict(min_reuse=1, versions=(2, 3), correct=True), [16, 17, 24]),
    ],
)
def test_reuse_filters(db, usage_backend, filters, expected):
    t = analysis.rollouts(db, RUN_A, columns=["seq", "reuse_count"], **filters)
    assert seqs(t) == expected
    assert t.column("reuse_count").to_pylist() == [REUSE.get(s, 0) for s in expected]
    assert analysis.count_rollouts(db, RUN_A, **filters) == len(expected)


def test_run_without_usage_table_reads_as_never_used(db):
    t = analysis.rollouts(db, RUN_B, columns=["rollout_id", "reuse_count"])
    assert t.column("reuse_count").to_pylist() == [0] * 8
    assert analysis.rollouts(db, RUN_B, min_reuse=1).num_rows == 0
    assert analysis.rollouts(db, RUN_B, max_reuse=0).num_rows == 8
    assert analysis.usage(db, RUN_B).num_rows == 0
    assert analysis.usage(db, RUN_B).schema.equals(analysis.USAGE_SCHEMA)
    assert analysis.count_usage(db, RUN_B) == 0
    assert analysis.staleness_histogram(db, RUN_B).num_rows == 0
    assert analysis.reuse_histogram(db, RUN_B).to_pylist() == [{"reuse_count": 0, "rollouts": 8}]


def test_columns_and_limit(db, usage_backend):
    t = analysis.rollouts(db, RUN_A, columns=["reward", "rollout_id"], versions=(1, 1), limit=3)
    assert t.column_names == ["reward", "rollout_id"]
    assert t.column("rollout_id").to_pylist() == [make_rollout_id(RUN_A, 1, 0, i) for i in range(3)]
    assert seqs(analysis.rollouts(db, RUN_A, limit=5, columns=["seq"])) == [0, 1, 2, 3, 4]
    # with the reuse filter the limit applies after it
    assert seqs(analysis.rollouts(db, RUN_A, min_reuse=1, limit=3, columns=["seq"])) == [0, 1, 2]
    empty = analysis.rollouts(db, RUN_A, versions=(9, 9), columns=["seq", "completion_ids"])
    assert empty.num_rows == 0 and empty.column_names == ["seq", "completion_ids"]
    assert empty.schema.field("completion_ids").type == pa.list_(pa.int32())


def test_filters_are_pushed_down_to_lance(db, monkeypatch):
    calls = []
    real_scan = analysis._scan

    def recording_scan(table, where, columns, limit=None):
        calls.append((table.name, where, columns, limit))
        return real_scan(table, where, columns, limit)

    monkeypatch.setattr(analysis, "_scan", recording_scan)
    t = analysis.rollouts(db, RUN_A, versions=(1, 2), steps=(2, None), reward_min=0.5, correct=True,
                          columns=["seq", "reward", "reuse_count"], limit=2)
    assert seqs(t) == [16, 17] and t.column("reuse_count").to_pylist() == [2, 1]
    table, where, columns, limit = calls[0]
    assert table == "rollouts_" + RUN_A
    assert where == ("policy_version >= 1 AND policy_version <= 2 AND step >= 2 "
                     "AND reward >= 0.5 AND correct = true")
    assert set(columns) == {"seq", "reward", "rollout_id"} and limit == 2
    # (the usage side goes through UsageStore, whose pushed-down reads test_usage.py covers)


# ------------------------------------------------------------------ usage records
def test_usage_records(db, usage_backend):
    all_rows = analysis.usage(db, RUN_A)
    assert all_rows.num_rows == 22
    assert all_rows.column_names == analysis.USAGE_SCHEMA.names
    pairs = list(zip(all_rows.column("learner_step").to_pylist(), all_rows.column("position").to_pylist()))
    assert pairs == sorted(pairs)
    t = analysis.usage(db, RUN_A, learner_steps=(2, 3), columns=["learner_step", "rollout_seq", "staleness"])
    assert t.column_names == ["learner_step", "rollout_seq", "staleness"]
    assert t.column("rollout_seq").to_pylist() == [8, 9, 0, 1, 8, 10, 11, 12]
    assert t.column("staleness").to_pylist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert analysis.usage(db, RUN_A, steps=(2, 3)).column("rollout_seq").to_pylist() == [16, 8, 17, 24, 16, 0]
    assert analysis.usage(db, RUN_A, versions=(3, 3), limit=2).column("position").to_pylist() == [0, 1]
    assert analysis.usage(db, RUN_A, learner_steps=(10, 20)).num_rows == 0
    assert analysis.count_usage(db, RUN_A) == 22
    assert analysis.count_usage(db, RUN_A, learner_steps=(0, 1)) == 8
    assert isinstance(analysis.usage(db, RUN_A, as_pandas=True), pd.DataFrame)


# ------------------------------------------------------------------ summaries
def test_per_version_summary(db):
    t = analysis.per_version_summary(db, RUN_A)
    assert t.column_names == ["policy_version", "rollouts", "mean_reward", "accuracy", "mean_length"]
    assert t.to_pydict() == {
        "policy_version": [0, 1, 2, 3],
        "rollouts": [8, 8, 8, 8],
        "mean_reward": [0.0, 0.25, 0.5, 0.75],
        "accuracy": [0.0, 0.25, 0.5, 0.75],
        # lengths 1 + (i + s) % 3 for i = 0..3: s=0 -> 1,2,3,1; s=1 -> 2,3,1,2; s=2 -> 3,1,2,3
        "mean_length": [1.75, 2.0, 2.25, 1.75],
    }
    df = analysis.per_version_summary(db, RUN_A, as_pandas=True)
    assert df["accuracy"].tolist() == [0.0, 0.25, 0.5, 0.75]


def test_staleness_histogram(db, usage_backend):
    assert analysis.staleness_histogram(db, RUN_A).to_pydict() == {"staleness": [0, 1, 3], "uses": [17, 4, 1]}


def test_reuse_histogram_counts_never_used_rollouts(db, usage_backend):
    t = analysis.reuse_histogram(db, RUN_A)
    assert t.to_pydict() == {"reuse_count": [0, 1, 2, 3, 5], "rollouts": [18, 10, 2, 1, 1]}
    assert sum(t.column("rollouts").to_pylist()) == 32


def test_steps_since_last_use_histogram(db, usage_backend):
    # Every use per rollout, from USES: seq 0 at 0, 1, 1, 2, 5 (twice at 1: the repeat counts 0,
    # as the paper counts it) -> gaps 1, 0, 1, 3; seq 1 at 0, 2 -> 2; seq 8 at 2, 3, 4 -> 1, 1;
    # seq 16 at 4, 5 -> 1.
    t = analysis.steps_since_last_use_histogram(db, RUN_A)
    assert t.to_pydict() == {"steps_since_last_use": [0, 1, 2, 3], "uses": [1, 5, 1, 1]}
    assert analysis.steps_since_last_use_histogram(db, RUN_B).num_rows == 0  # no usage table
    assert list(analysis.steps_since_last_use_histogram(db, RUN_A, as_pandas=True).columns) == [
        "steps_since_last_use", "uses"]


# ------------------------------------------------------------------ errors that say how to fix them
def test_unknown_run_lists_the_runs(db):
    with pytest.raises(ValueError, match=r"unknown run id 'nope'.*runs there: \['run-a', 'run-b'\]"):
        analysis.rollouts(db, "nope")
    with pytest.raises(ValueError, match="unknown run id"):
        analysis.per_version_summary(db, "nope")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(versions=(5, 2)), r"versions=\(5, 2\) is an empty range: lo must be <= hi.*versions=\(2, 5\)"),
        (dict(steps=(3, 1)), r"steps=\(3, 1\) is an empty range"),
        (dict(versions=5), r"versions must be an inclusive \(lo, hi\) pair.*versions=\(0, 10\)"),
        (dict(versions=(0, 1.5)), r"both ends must be integers"),
        (dict(reward_min=1, reward_max=0), r"reward_min=1.0 > reward_max=0.0"),
        (dict(min_reuse=3, max_reuse=1), r"min_reuse=3 > max_reuse=1"),
        (dict(min_reuse=-1), r"min_reuse must be a non-negative integer"),
        (dict(correct="yes"), r"correct must be True, False or None"),
        (dict(limit=0), r"limit must be a positive integer"),
        (dict(columns=["seq", "bogus"]), r"unknown rollout columns \['bogus'\]; valid columns: \[.*'reuse_count'\]"),
    ],
)
def test_bad_rollout_arguments(db, kwargs, message):
    with pytest.raises(ValueError, match=message):
        analysis.rollouts(db, RUN_A, **kwargs)


def test_bad_usage_arguments(db):
    with pytest.raises(ValueError, match=r"learner_steps=\(4, 1\) is an empty range"):
        analysis.usage(db, RUN_A, learner_steps=(4, 1))
    with pytest.raises(ValueError, match=r"unknown usage columns \['reward'\].*'staleness'"):
        analysis.usage(db, RUN_A, columns=["reward"])
    with pytest.raises(ValueError, match=r"unknown usage columns"):  # also for a run without usage
        analysis.usage(db, RUN_B, columns=["reward"])


