"""`lance_table.in_order`, the check that lets a query's result skip its sort: it must say True
exactly when sorting by the keys would leave the rows where they are."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from replay_pipeline.buffer.lance_table import in_order

KEYS = ("seq", "rollout_id")


def _table(seq, ids, chunks=1):
    cut = len(seq) // 2 if chunks == 2 else len(seq)
    return pa.table({"seq": pa.chunked_array([seq[:cut], seq[cut:]], pa.int64()),
                     "rollout_id": pa.chunked_array([ids[:cut], ids[cut:]], pa.string()),
                     "tokens": pa.chunked_array([[[i] for i in seq[:cut]], [[i] for i in seq[cut:]]],
                                                pa.list_(pa.int64()))})


def _sorting_keeps_it(table):
    ordered = table.sort_by([(k, "ascending") for k in KEYS])
    return all(ordered.column(k).to_pylist() == table.column(k).to_pylist() for k in KEYS)


@pytest.mark.parametrize("seed", range(40))
def test_in_order_agrees_with_sorting(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 30))
    seq = rng.integers(0, 6, n)  # many ties on the first key, decided by the second
    if seed % 3 == 0:
        seq = np.sort(seq)
    ids = [f"r{int(x)}" for x in rng.integers(0, 4, n)]
    if seed % 2 == 0:  # sorted by both keys
        order = sorted(range(n), key=lambda i: (seq[i], ids[i]))
        seq, ids = seq[order], [ids[i] for i in order]
    table = _table([int(x) for x in seq], ids, chunks=1 + seed % 2)
    assert in_order(table, KEYS) == _sorting_keeps_it(table)


def test_nulls_in_a_key_are_left_to_the_sort():
    table = pa.table({"seq": pa.array([1, None, 3], pa.int64()), "rollout_id": ["a", "b", "c"]})
    assert not in_order(table, KEYS)
