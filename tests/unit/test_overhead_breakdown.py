"""The overhead benchmark's table of where a sync round goes (replay_pipeline/benchmarks/
overhead.py): each part from the phase means, scoring less its reward, and the rest of the
round after them, worked by hand."""

from __future__ import annotations

from replay_pipeline.benchmarks.overhead import breakdown


def test_parts_and_the_rest_add_up_to_the_round():
    means = {"generate/seconds": 0.100, "score/seconds": 0.008, "score/reward_seconds": 0.005,
             "buffer/append_seconds": 0.002, "buffer/sample_seconds": 0.003, "learn/seconds": 0.070,
             "learn/publish_seconds": 0.0, "buffer/record_seconds": 0.002}
    lines = breakdown(0.200, means)
    rows = {line.rsplit(maxsplit=2)[0].strip(): line.split()[-2:] for line in lines[1:]}
    assert rows["generation (sampling, decoding)"] == ["100.0", "50.0%"]
    assert rows["reward (the verifier)"] == ["5.0", "2.5%"]
    assert rows["scoring: advantages, the rows' table"] == ["3.0", "1.5%"]  # 8 ms less the 5 of the reward
    assert rows["learner step (forward, backward, AdamW)"] == ["70.0", "35.0%"]
    # 200 - (100 + 5 + 3 + 2 + 3 + 70 + 0 + 2) = 15 ms
    assert rows["the rest: Prefect task, MLflow hand-off, ledger"] == ["15.0", "7.5%"]
    assert rows["round"] == ["200.0", "100.0%"]


def test_a_missing_phase_counts_as_nothing():
    lines = breakdown(0.1, {"generate/seconds": 0.04, "learn/seconds": 0.05})
    rest = [line for line in lines if line.strip().startswith("the rest")][0]
    assert rest.split()[-2:] == ["10.0", "10.0%"]
