"""The start-up benchmark (replay_pipeline/benchmarks/startup.py) end to end on the tiny test
model: one round of its three arms, each a real `python -m flows.train` process."""

from __future__ import annotations

import json

from replay_pipeline.benchmarks import startup
from tests.conftest import TINY_OVERRIDES


def test_the_startup_benchmark_measures_its_arms_and_the_bytecode_it_saves(tmp_path, capsys):
    assert startup.main(["--root", str(tmp_path), "--repeats", "1", "--steps", "1", *TINY_OVERRIDES]) == 0
    out = capsys.readouterr().out
    (written,) = (tmp_path / "benchmarks").glob("startup-*.json")
    result = json.loads(written.read_text())
    assert list(result["arms"]) == list(startup.ARMS) and str(written) in out
    for name, (row,) in result["arms"].items():
        assert 0 < row["startup_s"] < row["wall_s"], (name, row)  # read from the run's own summary line
        assert f"{row['startup_s']:.2f} [" in out
    # Compiling every module from source again is seconds of CPU in each process (8 s of a
    # default start-up here): the arm without bytecode must cost visibly more than the
    # command as installed (CPU seconds: less sensitive to a busy machine than wall time).
    installed, no_bytecode = (result["arms"][a][0] for a in ("as installed", "no bytecode"))
    assert no_bytecode["cpu_s"] > installed["cpu_s"] + 3, (installed, no_bytecode)
