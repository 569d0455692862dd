"""The scale benchmark's reading of its measurements (replay_pipeline/benchmarks/scale.py):
medians over the interleaved repeats per side, each generator's rate pooled, and bad arguments
refused before anything runs. (Its measurements are the real flow's: docs/performance.md.)"""

from __future__ import annotations

import pytest

from replay_pipeline.benchmarks import scale


def test_the_report_gives_each_side_its_medians():
    result = {"steps": 20, "repeats": 3, "records": {
        "ranks1": [{"rounds_per_second": r, "learn_seconds": 0.1, "generate_seconds": 0.2, "wait_seconds": None}
                   for r in (1.0, 3.0, 2.0)],
        "actors2": [{"rounds_per_second": 4.0, "learn_seconds": 0.3, "generate_seconds": None, "wait_seconds": w,
                     "generator_rollouts_per_second": [10.0, 30.0]} for w in (0.5, 0.1, 0.3)]}}
    lines = scale.report(result).splitlines()
    assert lines[0] == "rounds of the default run, 20 a measurement, medians of 3"
    assert "| sync, 1 learner rank | 2.000 | 0.100 | 0.200 | - | - |" in lines
    assert "| async on Ray, 2 generator actors | 4.000 | 0.300 | - | 0.300 | 20.0 |" in lines


@pytest.mark.parametrize("argv", [["--sides", "ranks3"], ["--sides", ""], ["--steps", "0"], ["--repeats", "0"]])
def test_bad_arguments_are_refused_before_any_run(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        scale.main(argv)
    assert exit_.value.code == 2
    assert "--sides takes some of ranks1, ranks2, actors1, actors2" in capsys.readouterr().err
