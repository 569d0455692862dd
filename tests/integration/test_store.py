"""RolloutStore against real LanceDB tables in tmp_path (no mocks)."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pytest

from replay_pipeline.buffer import ROLLOUT_SCHEMA, RolloutStore, StoreError
from replay_pipeline.buffer.schema import (INPUT_COLUMNS, SchemaMismatch, columns_to_table, make_rollout_id,
                                          rows_to_table)

RUN = "run-a"


def make_rows(step: int, n_groups: int = 2, group_size: int = 4, run_id: str = RUN, policy_version=None):
    rows = []
    for g in range(n_groups):
        for i in range(group_size):
            comp = [7, 8, 9][: 1 + i % 3]
            rows.append(
                dict(
                    rollout_id=make_rollout_id(run_id, step, g, i),
                    run_id=run_id,
                    policy_version=step if policy_version is None else policy_version,
                    step=step,
                    prompt_id=f"p{g}",
                    group_id=f"{run_id}/s{step:06d}/g{g:04d}",
                    sample_index=i,
                    prompt=f"prompt {g}",
                    completion=f"completion {step}/{g}/{i}",
                    prompt_ids=[1, 2, 3],
                    completion_ids=comp,
                    behaviour_logprobs=[-0.5] * len(comp),
                    reward=float(i % 2),
                    correct=bool(i % 2),
                    advantage=0.25 * i - 0.375,
                    group_reward_mean=0.5,
                    finish_reason="stop",
                    num_tokens=len(comp),
                    seed=1000 + step,
                    created_at=dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc),
                )
            )
    return rows


@pytest.fixture
def store(tmp_path):
    return RolloutStore.create(tmp_path / "db", RUN)


# ------------------------------------------------------------------ schema helpers
def test_make_rollout_id_is_deterministic_and_padded():
    assert make_rollout_id("r1", 4, 2, 7) == "r1/s000004/g0002/i007"
    assert make_rollout_id("r1", 4, 2, 7) == make_rollout_id("r1", 4, 2, 7)


def test_rows_to_table_builds_the_schema_and_names_bad_keys():
    table = rows_to_table(make_rows(0))
    assert table.schema.equals(ROLLOUT_SCHEMA)
    assert table.column("seq").null_count == table.num_rows == 8
    assert "seq" not in INPUT_COLUMNS and len(INPUT_COLUMNS) == len(ROLLOUT_SCHEMA) - 1

    rows = make_rows(0)
    del rows[3]["reward"]
    rows[3]["bogus"] = 1
    with pytest.raises(SchemaMismatch, match=r"row 3.*missing keys \['reward'\].*extra keys \['bogus'\]"):
        rows_to_table(rows)
    rows = make_rows(0)
    rows[0]["reward"] = "high"
    with pytest.raises(SchemaMismatch, match="'reward'"):
        rows_to_table(rows)


# ------------------------------------------------------------------ append, count, seq
def test_append_count_and_seq_across_appends(store):
    assert store.count() == 0
    assert store.append(make_rows(0)) == 8
    assert store.append(rows_to_table(make_rows(1))) == 8  # a table works as well as dicts
    # a table without the seq column at all is accepted too
    assert store.append(rows_to_table(make_rows(2)).drop_columns(["seq"])) == 8
    assert store.count() == 24
    everything = store.window(1000)
    assert everything.column("seq").to_pylist() == list(range(24))
    assert everything.column("step").to_pylist() == [0] * 8 + [1] * 8 + [2] * 8
    assert everything.schema.equals(ROLLOUT_SCHEMA)
    first = everything.slice(0, 1).to_pylist()[0]
    assert first["rollout_id"] == "run-a/s000000/g0000/i000"
    assert first["behaviour_logprobs"] == [-0.5]
    assert first["created_at"] == dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)


def test_idempotent_retry_adds_nothing(store):
    batch = make_rows(0)
    assert store.append(batch) == 8
    version = store.version
    assert store.append(batch) == 0  # retry of a committed batch
    assert store.count() == 8
    assert store.version == version  # no empty commit
    # a batch that is partly stored inserts only the new rows, with gap-free seq
    partial = make_rows(0)[4:] + make_rows(1)
    assert store.append(partial) == 8
    assert store.count() == 16
    assert store.window(100).column("seq").to_pylist() == list(range(16))
    assert store.rows_for_step(1, ["seq"]).column("seq").to_pylist() == list(range(8, 16))


def test_append_rejects_duplicates_and_foreign_runs(store):
    with pytest.raises(StoreError, match="duplicate rollout_id"):
        store.append(make_rows(0) + make_rows(0)[:1])
    with pytest.raises(StoreError, match="run_id"):
        store.append(make_rows(0, run_id="other"))
    with pytest.raises(StoreError, match="assigned by the store"):
        t = rows_to_table(make_rows(0))
        store.append(t.set_column(1, "seq", pa.array(range(8), pa.int64())))
    assert store.count() == 0
    assert store.append([]) == 0


# ------------------------------------------------------------------ window and filters
def test_window_returns_newest_rows_in_seq_order(store):
    for step in range(5):
        store.append(make_rows(step))  # 40 rows
    w = store.window(12)
    assert w.column("seq").to_pylist() == list(range(28, 40))
    assert w.column("step").to_pylist() == [3] * 4 + [4] * 8
    cols = store.window(3, columns=["reward", "rollout_id"])
    assert cols.column_names == ["reward", "rollout_id"]
    assert cols.column("rollout_id").to_pylist() == [make_rollout_id(RUN, 4, 1, i) for i in (1, 2, 3)]
    big = store.window(1000)
    assert big.num_rows == 40 and big.column("seq").to_pylist() == list(range(40))
    with pytest.raises(StoreError, match="positive"):
        store.window(0)
    with pytest.raises(StoreError, match="unknown columns"):
        store.window(4, columns=["nope"])


def test_window_on_empty_table(store):
    w = store.window(16)
    assert w.num_rows == 0 and w.schema.equals(ROLLOUT_SCHEMA)


def test_window_filter_is_pushed_down(store):
    for step in range(3):
        store.append(make_rows(step))
    plan = store.table.search().where("seq >= 20").limit(None).explain_plan(verbose=True)
    assert "seq >= Int64(20)" in plan or "seq >= 20" in plan


def test_rows_for_versions_and_step(store):
    for step in range(4):
        store.append(make_rows(step, policy_version=step // 2))  # versions 0,0,1,1
    t = store.rows_for_versions(1, 1)
    assert t.num_rows == 16
    assert t.column("seq").to_pylist() == list(range(16, 32))
    assert set(t.column("policy_version").to_pylist()) == {1}
    assert store.rows_for_versions(0, 5, ["seq"]).num_rows == 32
    assert store.rows_for_versions(7, 9).num_rows == 0
    s = store.rows_for_step(2, ["step", "sample_index"])
    assert s.column_names == ["step", "sample_index"]
    assert s.column("step").to_pylist() == [2] * 8


# ------------------------------------------------------------------ versions and tags
def test_tags_and_read_at(store):
    store.append(make_rows(0))
    store.tag("step-000001")
    tagged_version = store.version
    store.tag("step-000001")  # idempotent
    store.tag("step-000001", tagged_version)
    store.append(make_rows(1))
    store.append(make_rows(2))
    with pytest.raises(StoreError, match="already points at version"):
        store.tag("step-000001")
    assert store.tags() == {"step-000001": tagged_version}

    old = store.read_at("step-000001")
    assert old.num_rows == 8 and old.column("seq").to_pylist() == list(range(8))
    assert store.read_at(tagged_version, ["rollout_id"]).column_names == ["rollout_id"]
    # the live handle is undisturbed
    assert store.count() == 24
    assert store.window(4).column("seq").to_pylist() == [20, 21, 22, 23]
    store.append(make_rows(3))
    assert store.count() == 32
    with pytest.raises(StoreError, match="no tag 'nope'.*step-000001"):
        store.read_at("nope")
    with pytest.raises(StoreError, match="cannot read version 999"):
        store.read_at(999)


# ------------------------------------------------------------------ schema validation
def test_schema_errors_leave_stored_rows_intact(store):
    store.append(make_rows(0))
    version = store.version

    missing = rows_to_table(make_rows(1)).drop_columns(["reward"])
    with pytest.raises(StoreError, match=r"missing columns \['reward'\]"):
        store.append(missing)

    t = rows_to_table(make_rows(1))
    wrong = t.set_column(
        t.schema.get_field_index("reward"), "reward", t.column("reward").cast(pa.float64())
    )
    with pytest.raises(StoreError, match="'reward' has type double, expected float"):
        store.append(wrong)

    rows = make_rows(1)
    rows[2].pop("advantage")
    with pytest.raises(StoreError, match=r"missing keys \['advantage'\]"):
        store.append(rows)

    assert store.count() == 8 and store.version == version
    assert store.window(100).column("rollout_id").to_pylist() == [r["rollout_id"] for r in make_rows(0)]


def test_open_rejects_a_mismatching_table_and_leaves_it_alone(tmp_path):
    import lancedb

    db = lancedb.connect(tmp_path / "db")
    bad_schema = pa.schema([f for f in ROLLOUT_SCHEMA if f.name != "advantage"] + [pa.field("extra", pa.int8())])
    db.create_table("rollouts_bad", schema=bad_schema)
    with pytest.raises(StoreError, match=r"missing columns \['advantage'\].*unexpected columns \['extra'\]"):
        RolloutStore.open(tmp_path / "db", "bad")
    assert db.open_table("rollouts_bad").version == 1
    assert db.open_table("rollouts_bad").schema.equals(bad_schema)


# ------------------------------------------------------------------ create / open / list
def test_create_twice_open_missing_and_list_runs(tmp_path):
    uri = tmp_path / "db"
    assert RolloutStore.list_runs(uri) == []
    assert not uri.exists()  # listing does not create the directory
    with pytest.raises(StoreError, match="RolloutStore.create"):
        RolloutStore.open(uri, "x")

    a = RolloutStore.create(uri, "run-a")
    assert a.table_name == "rollouts_run-a"
    a.append(make_rows(0))
    with pytest.raises(StoreError, match=r"already exists.*RolloutStore.open"):
        RolloutStore.create(uri, "run-a")
    RolloutStore.create(str(uri), "run_b")
    with pytest.raises(StoreError, match=r"runs there: \['run-a', 'run_b'\].*RolloutStore.create"):
        RolloutStore.open(uri, "missing")
    assert RolloutStore.list_runs(uri) == ["run-a", "run_b"]

    reopened = RolloutStore.open_or_create(uri, "run-a")
    assert reopened.count() == 8
    fresh = RolloutStore.open_or_create(uri, "run-c")
    assert fresh.count() == 0
    assert RolloutStore.list_runs(uri) == sorted(["run-a", "run_b", "run-c"])

    for bad in ("a/b", "", "white space", "x.y"):
        with pytest.raises(StoreError, match="invalid run_id"):
            RolloutStore.create(uri, bad)


def test_second_handle_sees_first_handles_appends(tmp_path):
    uri = tmp_path / "db"
    writer = RolloutStore.create(uri, RUN)
    reader = RolloutStore.open(uri, RUN)
    assert reader.count() == 0
    writer.append(make_rows(0))
    assert reader.count() == 8
    assert reader.version == writer.version
    assert reader.window(2).column("seq").to_pylist() == [6, 7]
    # and the reader's appends continue the writer's seq
    assert reader.append(make_rows(1)) == 8
    assert writer.window(1).column("seq").to_pylist() == [15]
    writer.tag("t1")
    assert reader.tags() == {"t1": writer.version}


def test_window_tolerates_duplicate_seq_from_racing_writers(store):
    # Two writers that read count() at the same moment give their rows the same seq values.
    # Emulate that by writing the second batch straight to the table with colliding seqs.
    store.append(make_rows(0))  # seq 0..7
    store.append(make_rows(1))  # seq 8..15
    racing = rows_to_table(make_rows(2))
    racing = racing.set_column(1, "seq", pa.array(range(8, 16), pa.int64()))  # collides with step 1
    store.table.add(racing)
    assert store.count() == 24
    w = store.window(10, ["seq", "step"])
    assert w.num_rows == 10
    assert w.column("seq").to_pylist() == sorted(w.column("seq").to_pylist())
    assert w.column("seq").to_pylist()[0] >= 8  # only rows from the newest two batches
    # take_seqs returns the first of the rows sharing a seq (by rollout_id), once per request
    got = store.take_seqs([9, 3, 9], ["seq", "rollout_id"])
    assert got.column("rollout_id").to_pylist() == [make_rollout_id(RUN, 1, 0, 1), make_rollout_id(RUN, 0, 0, 3),
                                                    make_rollout_id(RUN, 1, 0, 1)]


# ------------------------------------------------------------------ indexes and fast appends
def test_indexes_exist_after_create_and_filters_use_them(store):
    indexed = {tuple(ix.columns) for ix in store.table.list_indices()}
    assert indexed == {("rollout_id",), ("seq",), ("step",), ("policy_version",)}
    for step in range(3):
        store.append(make_rows(step))
    store.compact()
    for flt in ("policy_version >= 1 AND policy_version <= 1", "seq IN (3, 5)", "step = 2",
                "rollout_id >= 'a' AND rollout_id <= 'z'"):
        plan = store.table.search().where(flt).limit(None).explain_plan(verbose=True)
        assert "ScalarIndexQuery" in plan, (flt, plan)
    assert store.table.index_stats("rollout_id_idx").num_unindexed_rows == 0


def test_compact_adds_indexes_missing_from_an_older_table(tmp_path):
    import lancedb

    lancedb.connect(tmp_path / "db").create_table("rollouts_old", schema=ROLLOUT_SCHEMA)
    old = RolloutStore.open(tmp_path / "db", "old")
    assert list(old.table.list_indices()) == []  # open() modifies nothing
    old.append(make_rows(0, run_id="old"))
    old.compact()
    assert {tuple(ix.columns) for ix in old.table.list_indices()} == {
        ("rollout_id",), ("seq",), ("step",), ("policy_version",)}


def test_append_stays_idempotent_after_compact(store):
    for step in range(4):
        store.append(make_rows(step))
    store.compact()
    version = store.version
    assert store.append(make_rows(1)) == 0  # stored rows now live in the compacted fragment
    assert store.version == version
    assert store.append(make_rows(3)[2:] + make_rows(4)) == 8  # partly stored: only the new rows
    assert store.append(make_rows(4)) == 0  # retry of rows that are not indexed yet
    assert store.count() == 40
    assert store.window(100).column("seq").to_pylist() == list(range(40))
    assert store.table.search().select(["rollout_id"]).limit(None).to_arrow().column(
        "rollout_id").unique().__len__() == 40


def test_id_lookup_of_a_scattered_batch_and_quoted_ids(store):
    # 2,400 stored rows; a batch whose ids sort at both ends of them makes the lookup's
    # ranges span every stored row, so it falls back to exact IN lists.
    for step in range(3):
        store.append(make_rows(step, n_groups=100, group_size=8))
    old = make_rows(0, n_groups=1, group_size=1) + make_rows(2, n_groups=100, group_size=8)[-1:]
    assert store.append(old + make_rows(3)) == 8
    assert store.count() == 2408
    quoted = make_rows(4, n_groups=1, group_size=2)
    for i, row in enumerate(quoted):
        row["rollout_id"] = f"{RUN}/it's '{i}'"
    assert store.append(quoted) == 2
    assert store.append(quoted) == 0
    assert store.window(2, ["rollout_id"]).column("rollout_id").to_pylist() == [r["rollout_id"] for r in quoted]


def _append_steps(uri: str, first_step: int, steps: int) -> None:
    writer = RolloutStore.open(uri, RUN)
    for step in range(first_step, first_step + steps):
        writer.append(make_rows(step))


def test_two_processes_appending_keep_every_row(tmp_path):
    import multiprocessing as mp

    uri = str(tmp_path / "db")
    store = RolloutStore.create(uri, RUN)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_append_steps, args=(uri, first, 10)) for first in (0, 100)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert store.count() == 2 * 10 * 8
    ids = store.table.search().select(["rollout_id"]).limit(None).to_arrow().column("rollout_id").to_pylist()
    expected = {r["rollout_id"] for first in (0, 100) for s in range(first, first + 10) for r in make_rows(s)}
    assert len(ids) == len(set(ids)) and set(ids) == expected
    assert store.append(make_rows(0) + make_rows(105)) == 0  # both writers' rows are found


# ------------------------------------------------------------------ sampler reads
def test_take_seqs_keeps_order_and_duplicates(store):
    for step in range(5):
        store.append(make_rows(step))  # seq 0..39
    got = store.take_seqs([33, 2, 33, 17, 2, 39], columns=["seq", "rollout_id", "completion_ids"])
    assert got.column_names == ["seq", "rollout_id", "completion_ids"]
    assert got.column("seq").to_pylist() == [33, 2, 33, 17, 2, 39]
    assert got.column("rollout_id").to_pylist()[1] == make_rollout_id(RUN, 0, 0, 2)
    import numpy as np

    dense = np.arange(10, 30)[::-1]  # dense values: read with one seq range
    assert store.take_seqs(dense, ["seq"]).column("seq").to_pylist() == dense.tolist()
    assert store.take_seqs(np.array([5], dtype=np.int32)).schema.equals(ROLLOUT_SCHEMA)
    assert store.take_seqs([], ["seq"]).num_rows == 0
    with pytest.raises(StoreError, match=r"no rows with seq \[40, 99\]"):
        store.take_seqs([1, 40, 99])
    with pytest.raises(StoreError, match="integer"):
        store.take_seqs([1.5])
    with pytest.raises(StoreError, match="unknown columns"):
        store.take_seqs([1], ["nope"])


def test_window_meta_reads_light_columns(store):
    for step in range(3):
        store.append(make_rows(step))
    meta = store.window_meta(10)
    assert meta.column_names == ["seq", "policy_version", "correct", "advantage"]
    assert meta.column("seq").to_pylist() == list(range(14, 24))
    assert store.window_meta(3, columns=["seq"]).column("seq").to_pylist() == [21, 22, 23]


def _one_row_per_step(store, n, correct_every):
    rows = []
    for s in range(n):
        row = make_rows(s, n_groups=1, group_size=1)[0]
        row["correct"] = s % correct_every == 0
        rows.append(row)
    store.append(rows)


def test_positive_bias_window_composition(store):
    _one_row_per_step(store, 100, 3)  # seq == step; every 3rd row correct
    w = store.positive_bias_window(20, 0.5, columns=["seq", "correct"])
    newest = list(range(90, 100))
    older_correct = [s for s in range(89, -1, -1) if s % 3 == 0][:10]
    assert w.column("seq").to_pylist() == sorted(older_correct) + newest
    assert older_correct[-1] == 60
    # delta 0: the FIFO window; delta 1: only correct rows, the freshest first
    assert store.positive_bias_window(20, 0.0, ["seq"]).equals(store.window(20, ["seq"]))
    assert store.positive_bias_window(4, 1.0, ["seq"]).column("seq").to_pylist() == [90, 93, 96, 99]
    full = store.positive_bias_window(10, 0.2)
    assert full.schema.equals(ROLLOUT_SCHEMA) and full.num_rows == 10
    assert full.column("seq").to_pylist() == [87, 90] + list(range(92, 100))
    with pytest.raises(StoreError, match="delta"):
        store.positive_bias_window(10, 1.5)


def test_positive_bias_window_with_too_few_correct_or_rows(store):
    _one_row_per_step(store, 30, 12)  # correct: seq 0, 12, 24
    w = store.positive_bias_window(20, 0.5, columns=["seq"])
    assert w.column("seq").to_pylist() == [0, 12] + list(range(20, 30))  # 24 is among the fresh
    assert store.positive_bias_window(100, 0.5, ["seq"]).column("seq").to_pylist() == list(range(30))


def test_positive_bias_window_on_empty_table(store):
    assert store.positive_bias_window(8, 0.5).num_rows == 0
    assert store.positive_bias_window(8, 1.0, ["seq"]).num_rows == 0


def test_prepare_with_a_known_count_and_a_checked_insert(store):
    store.append(make_rows(0))
    rows = store.prepare(make_rows(1), known_new=True, start=8)
    assert rows.column("seq").to_pylist() == list(range(8, 16))
    assert store.insert(rows, expect_count=8) == 8
    # Numbered for a table of 16 rows while another writer made it 24: refused, nothing written.
    stale = store.prepare(make_rows(2), known_new=True, start=16)
    store.append(make_rows(3))
    with pytest.raises(StoreError, match="numbered for a table of 16 rows, but it holds 24"):
        store.insert(stale, expect_count=16)
    assert store.count() == 24 and store.max_step() == 3


def test_columns_to_table_matches_rows_to_table_and_names_bad_columns():
    rows = make_rows(0)
    columns = {k: [r[k] for r in rows] for k in rows[0]}
    columns["run_id"] = RUN  # a scalar repeats over the rows
    built = columns_to_table(columns, len(rows))
    assert built.equals(rows_to_table(rows))
    with pytest.raises(SchemaMismatch, match="unexpected columns \\['bogus'\\]"):
        columns_to_table({**columns, "bogus": [1] * len(rows)}, len(rows))
    with pytest.raises(SchemaMismatch, match="column 'reward' has 3 values, expected 8"):
        columns_to_table({**columns, "reward": [0.0, 1.0, 0.0]}, len(rows))
    with pytest.raises(SchemaMismatch, match="column 'step' cannot be converted"):
        columns_to_table({**columns, "step": ["x"] * len(rows)}, len(rows))


def test_a_numbered_append_behind_another_writers_rows_is_refused_not_retried(store, tmp_path):
    """Issue 22: the sync loop numbers a step's rows for the table it knows; a table that grew
    in between is another driver's doing, so the write stops the run instead of retrying."""
    from replay_pipeline.buffer.lance_table import ConcurrentAppend
    from replay_pipeline.buffer.tables import retry_storage

    store.append(make_rows(0))
    prepared = store.prepare(make_rows(1), known_new=True, start=store.count())
    other = RolloutStore.open(tmp_path / "db", RUN)  # a second process on the same table
    other.append(make_rows(2))
    calls = []

    def commit(attempt):
        calls.append(attempt)
        return store.insert(prepared, expect_count=8)
    with pytest.raises(ConcurrentAppend, match="another process appended in between"):
        retry_storage(commit, delay=0)
    assert calls == [0]  # not retried
    assert store.count() == 16 and sorted(set(store.window(100, columns=["step"]).column("step").to_pylist())) == [0, 2]
