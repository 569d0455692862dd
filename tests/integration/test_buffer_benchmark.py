"""replay_pipeline.benchmarks.buffer on small real tables: the disk check refuses before the
fill, saying what to do; a fill reports its append rate per tenth, its compactions and its
disk size, leaves out the windows larger than the table, and keeps its table only with --keep."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from replay_pipeline.benchmarks import buffer
from replay_pipeline.buffer.store import RolloutStore


def _figures(out: str) -> dict:
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["benchmark"] == "buffer"
    return figures


def test_check_disk_asks_for_the_estimate_and_its_headroom():
    assert buffer.check_disk(10e9, 12e9) is None
    problem = buffer.check_disk(10e9, 11e9, where="/data", rows_fit=916_666)
    for words in ("'/data'", "needs about 12.0 GB", "11.0 GB are free", "Free some space",
                  "--dir", "fewer --rows", "916,666 rows fit"):
        assert words in problem


def test_the_fill_model_counts_rewrites_and_index_copies():
    small = buffer.fill_model(100_000, 2048, 50)  # 49 appends: only the final compaction
    assert small == {"data_rows": 200_000, "index_rows": 200_000, "compactions": [100_000]}
    at_1m, at_10m = (buffer.fill_model(rows, 2048, 50) for rows in (1_000_000, 10_000_000))
    assert len(at_10m["compactions"]) == 98 and at_10m["compactions"][-2:] == [9_932_800, 10_000_000]
    assert 2.9 < at_10m["data_rows"] / 10_000_000 <= 3.0
    assert at_10m["index_rows"] > 30 * at_1m["index_rows"]  # every compaction rewrites the indexes whole
    per_row = {"data_bytes_per_row": 680.0, "index_bytes_per_row": 35.0}
    free = buffer.estimate_disk(1_000_000, 2048, 50, **per_row) * (1 + buffer.DISK_HEADROOM)
    assert 1_000_000 - 2048 <= buffer.rows_that_fit(free, 2048, 50, **per_row) <= 1_000_000


def test_too_little_free_space_is_refused_before_the_fill(tmp_path, monkeypatch, capsys):
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=10**6))
    target = tmp_path / "bench"
    assert buffer.main(["--rows", "20000", "--dir", str(target)]) == 2
    out, err = capsys.readouterr()
    assert "needs about" in out and "0.0 GB free" in out
    assert "not enough disk space" in err and "--dir" in err and "fewer --rows" in err
    assert "(about 0 rows fit there)" in err
    assert list(target.iterdir()) == []  # the sample is gone and no table was started


def test_a_small_fill_reports_its_series_and_keeps_its_table(tmp_path, capsys):
    args = ["--rows", "20480", "--batch", "1024", "--compact-every", "4", "--dir", str(tmp_path), "--keep"]
    assert buffer.main(args) == 0
    out = capsys.readouterr().out
    r = _figures(out)
    assert len(r["append_rows_per_s_decile"]) == 10 and all(v > 0 for v in r["append_rows_per_s_decile"])
    series = r["compact_series"]
    assert [rows for rows, _, _ in series] == [4096, 8192, 12288, 16384, 20480]
    assert all(s > 0 for _, s, _ in series)
    sizes = [size for _, _, size in series]
    assert sizes == sorted(sizes) and sizes[0] > 0
    assert [v is not None for v in r["compact_s_decile"]] == [False, True] * 5
    assert r["disk_bytes_peak"] == r["disk_bytes_final"] >= sizes[-1]
    assert abs(r["disk_estimate_bytes"] / r["disk_bytes_final"] - 1) < 0.25
    assert r["draw_ms_10k"] > 0 and r["versions_query_rows_10k"] == 10_240
    for key in ("draw_ms_100k", "window_meta_ms_100k", "draw_ms_1m", "window_meta_ms_1m"):
        assert key not in r  # windows larger than the table
    kept = Path(r["kept_dir"])
    assert list(tmp_path.iterdir()) == [kept] and f"kept in {kept}" in out
    assert RolloutStore.open(kept, buffer.RUN).count() == 20_480


def test_without_keep_the_directory_is_removed(tmp_path, capsys):
    assert buffer.main(["--rows", "10000", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    r = _figures(out)
    assert "kept_dir" not in r and list(tmp_path.iterdir()) == []
    assert r["compact_series"] == [] and "none during the fill" in out
