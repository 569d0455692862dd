"""UsageStore against real LanceDB tables in tmp_path (no mocks)."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pyarrow as pa
import pytest

from replay_pipeline.buffer import RolloutStore, StoreError
from replay_pipeline.buffer.schema import rows_to_table
from replay_pipeline.buffer.usage import USAGE_SCHEMA, UsageStore, make_usage_id, make_usage_ids

RUN = "run-a"
T0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)


def uses(learner_step: int, seqs: list[int], *, policy_version: int | None = None, run_id: str = RUN):
    """The records of one learner step that used the rollouts ``seqs`` (rollout seq s was
    generated at step s // 8 by policy version s // 8)."""
    version = learner_step // 2 if policy_version is None else policy_version
    return [
        dict(
            usage_id=make_usage_id(run_id, learner_step, position), run_id=run_id,
            learner_step=learner_step, step=learner_step // 2, position=position,
            rollout_id=f"{run_id}/s{seq // 8:06d}/g0000/i{seq % 8:03d}", rollout_seq=seq,
            rollout_step=seq // 8, rollout_policy_version=seq // 8, policy_version=version,
            staleness=version - seq // 8, created_at=T0,
        )
        for position, seq in enumerate(seqs)
    ]


@pytest.fixture
def usage(tmp_path):
    return UsageStore.create(tmp_path / "db", RUN)


def test_make_usage_id_is_deterministic_and_padded():
    assert make_usage_id("r1", 12, 3) == "r1/l00000012/p00003"
    with pytest.raises(ValueError, match="position"):
        make_usage_id("r1", 1, -1)


def test_make_usage_ids_equals_one_id_at_a_time_and_checks_the_values():
    assert make_usage_ids("r1", np.array([12, 12, 13]), np.array([0, 1, 0])) == [
        make_usage_id("r1", 12, 0), make_usage_id("r1", 12, 1), make_usage_id("r1", 13, 0)]
    assert make_usage_ids("r1", [], []) == []
    with pytest.raises(ValueError, match="position must be non-negative integers"):
        make_usage_ids("r1", [1, 2], [0, -1])
    with pytest.raises(ValueError, match="learner_step must be non-negative integers"):
        make_usage_ids("r1", [1.5], [0])


def test_record_count_and_idempotent_retry(usage):
    assert usage.table_name == "usage_run-a"
    assert usage.count() == 0
    assert usage.record(uses(0, [0, 1, 2, 1])) == 4  # a rollout may appear twice in a minibatch
    version = usage.version
    assert usage.record(uses(0, [0, 1, 2, 1])) == 0  # retry of a committed batch
    assert usage.version == version  # and no empty commit
    table = rows_to_table(uses(0, [0, 1, 2, 1]) + uses(1, [3, 4]), USAGE_SCHEMA, noun="usage")
    assert usage.record(table) == 2  # a table works too; only the new rows are added
    assert usage.count() == 6
    rows = usage.rows()
    assert rows.schema.equals(USAGE_SCHEMA)
    assert list(zip(rows.column("learner_step").to_pylist(), rows.column("position").to_pylist())) == [
        (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    assert rows.column("created_at")[0].as_py() == T0


def test_record_validates_and_writes_nothing_on_error(usage):
    bad = uses(0, [0, 1])
    bad[1]["staleness"] = 5
    with pytest.raises(StoreError, match=r"staleness.*run-a/l00000000/p00001"):
        usage.record(bad)
    with pytest.raises(StoreError, match="run_id"):
        usage.record(uses(0, [0], run_id="other"))
    with pytest.raises(StoreError, match="duplicate usage_id"):
        usage.record(uses(0, [0, 1]) + uses(0, [0]))
    missing = uses(0, [0])
    del missing[0]["position"]
    with pytest.raises(StoreError, match=r"usage row 0: missing keys \['position'\]"):
        usage.record(missing)
    wrong = rows_to_table(uses(0, [0]), USAGE_SCHEMA, noun="usage").drop_columns(["staleness"])
    with pytest.raises(StoreError, match=r"does not match USAGE_SCHEMA: missing columns \['staleness'\]"):
        usage.record(wrong)
    assert usage.count() == 0 and usage.record([]) == 0


def test_reuse_counts_and_last_use(usage):
    usage.record(uses(0, [10, 11, 12, 11]))
    usage.record(uses(1, [11, 13, 30]))
    usage.record(uses(2, [12, 31]))
    assert usage.reuse_counts(0) == {10: 1, 11: 3, 12: 2, 13: 1, 30: 1, 31: 1}
    assert usage.reuse_counts(11, 12) == {11: 3, 12: 2}
    assert usage.reuse_counts(14, 29) == {}
    assert usage.last_use([10, 11, 12, 99]) == {10: 0, 11: 1, 12: 2}  # 99 was never used
    assert usage.last_use(range(10, 40)) == {10: 0, 11: 1, 12: 2, 13: 1, 30: 1, 31: 2}  # one range
    assert usage.last_use([]) == {}
    usage.compact()  # the index covers the rows present when it was last refreshed
    assert usage.reuse_counts(11, 12) == {11: 3, 12: 2}
    plan = usage.table.search().where("rollout_seq >= 11 AND rollout_seq <= 12").limit(None).explain_plan()
    assert "ScalarIndexQuery" in plan


def test_rows_filter_and_columns(usage):
    usage.record(uses(0, [1, 2]))
    usage.record(uses(5, [3], policy_version=4))
    t = usage.rows("staleness > 3", columns=["usage_id", "staleness"])
    assert t.column_names == ["usage_id", "staleness"]
    assert t.to_pylist() == [{"usage_id": "run-a/l00000005/p00000", "staleness": 4}]
    assert usage.rows("learner_step = 0", ["rollout_seq"]).column("rollout_seq").to_pylist() == [1, 2]
    with pytest.raises(StoreError, match="unknown columns"):
        usage.rows(columns=["reward"])


def test_tags_read_at_and_compact(usage):
    usage.record(uses(0, [1, 2]))
    usage.tag("step-000001")
    tagged = usage.version
    usage.record(uses(1, [3]))
    usage.compact()
    assert usage.tags() == {"step-000001": tagged}
    assert usage.read_at("step-000001", ["rollout_seq"]).column("rollout_seq").to_pylist() == [1, 2]
    assert usage.count() == 3
    assert usage.record(uses(1, [3])) == 0  # still idempotent after compaction
    with pytest.raises(StoreError, match="already points at version"):
        usage.tag("step-000001")
    with pytest.raises(StoreError, match="no tag 'nope'"):
        usage.read_at("nope")


def test_indexes_and_tables_beside_the_rollouts(tmp_path):
    uri = tmp_path / "db"
    RolloutStore.create(uri, RUN)
    usage = UsageStore.create(uri, RUN)
    assert {tuple(ix.columns) for ix in usage.table.list_indices()} == {
        ("usage_id",), ("rollout_seq",), ("learner_step",)}
    RolloutStore.create(uri, "rollouts-only")
    assert RolloutStore.list_runs(uri) == ["rollouts-only", RUN]
    assert UsageStore.list_runs(uri) == [RUN]
    with pytest.raises(StoreError, match=r"no usage table for run 'rollouts-only'.*UsageStore.create"):
        UsageStore.open(uri, "rollouts-only")
    with pytest.raises(StoreError, match=r"usage table 'usage_run-a'.*already exists.*UsageStore.open"):
        UsageStore.create(uri, RUN)
    reopened = UsageStore.open_or_create(uri, RUN)
    reopened.record(uses(0, [1]))
    assert usage.count() == 1  # the first handle sees the second one's commit
    assert UsageStore.open_or_create(uri, "rollouts-only").count() == 0
    with pytest.raises(StoreError, match="invalid run_id"):
        UsageStore.create(uri, "a/b")


def test_open_rejects_a_mismatching_usage_table(tmp_path):
    import lancedb

    db = lancedb.connect(tmp_path / "db")
    db.create_table("usage_bad", schema=pa.schema([f for f in USAGE_SCHEMA if f.name != "staleness"]))
    with pytest.raises(StoreError, match=r"does not match USAGE_SCHEMA: missing columns \['staleness'\]"):
        UsageStore.open(tmp_path / "db", "bad")
