"""The peer benchmark's arithmetic (replay_pipeline/benchmarks/peers.py), worked by hand:
per-repeat medians of a step and its parts, the spread over repeats, and ratios taken within
each repeat rather than between the sides' overall medians."""

from __future__ import annotations

import pytest

from replay_pipeline.benchmarks.peers import (MIN_WINDOW_STEPS, apply_window, median_interval, repeat_figures, report,
                                             summarise, verdict)
from replay_pipeline.benchmarks.turns import CORES


def record(steps, gen, train, *, tokens=100.0, accuracies=(0.2, 0.3), startup=None, eval_s=0.5, eval_tokens=250.0):
    return {"name": "x", "step_seconds": list(steps), "gen_seconds": list(gen), "train_seconds": list(train),
            "gen_tokens": tokens, "startup_seconds": startup, "eval_seconds": eval_s, "eval_tokens": eval_tokens,
            "evals": [{"step": i, "accuracy": a, "gen_tokens": 0.0, "seconds": 0.0} for i, a in enumerate(accuracies)]}


def test_repeat_figures_are_medians_of_the_step_and_its_parts():
    f = repeat_figures(record([0.30, 0.10, 0.20], [0.10, 0.05, 0.10], [0.10, 0.04, 0.05], tokens=50.0, startup=4.0))
    assert f["step_s"] == pytest.approx(0.20)
    assert f["gen_s"] == pytest.approx(0.10)
    assert f["train_s"] == pytest.approx(0.05)
    # other per step: 0.10, 0.01, 0.05 -> median 0.05 (not 0.20 - 0.10 - 0.05 of the medians)
    assert f["other_s"] == pytest.approx(0.05)
    assert f["step_mean_s"] == pytest.approx(0.20) and f["steps_total_s"] == pytest.approx(0.60)
    assert f["startup_s"] == 4.0
    assert f["gen_ms_per_token"] == pytest.approx(1000 * 0.25 / 50)   # 5 ms a token
    assert f["eval_ms_per_token"] == pytest.approx(1000 * 0.5 / 250)  # 2 ms a token


def test_a_record_whose_times_do_not_line_up_is_refused():
    with pytest.raises(ValueError, match="as many"):
        repeat_figures(record([0.1, 0.2], [0.1], [0.05, 0.05]))
    with pytest.raises(ValueError, match="at least one"):
        repeat_figures(record([], [], []))


def test_ratios_are_taken_within_each_repeat():
    # repeat 1 is a slow spell for every side (2x): within-repeat ratios stay 1.2 and 1.0,
    # while a ratio of overall medians would mix the spells
    ours = [record([0.24] * 3, [0.1] * 3, [0.1] * 3, startup=6.0), record([0.48] * 3, [0.2] * 3, [0.2] * 3, startup=8.0),
            record([0.24] * 3, [0.1] * 3, [0.1] * 3, startup=7.0)]
    trl = [record([0.20] * 3, [0.1] * 3, [0.1] * 3), record([0.40] * 3, [0.2] * 3, [0.2] * 3),
           record([0.20] * 3, [0.1] * 3, [0.1] * 3)]
    bare = [record([0.24] * 3, [0.12] * 3, [0.12] * 3), record([0.48] * 3, [0.24] * 3, [0.24] * 3),
            record([0.30] * 3, [0.15] * 3, [0.15] * 3)]
    s = summarise({"ours": ours, "trl": trl, "bare": bare})
    assert s["ratios"]["trl"]["per_repeat"] == pytest.approx([1.2, 1.2, 1.2])
    assert s["ratios"]["trl"]["median"] == pytest.approx(1.2) and not s["ratios"]["trl"]["met"]
    assert s["ratios"]["trl"]["verdict"] == "missed"
    assert s["ratios"]["bare"]["per_repeat"] == pytest.approx([1.0, 1.0, 0.8])
    assert s["ratios"]["bare"]["median"] == pytest.approx(1.0) and s["ratios"]["bare"]["met"]
    assert s["ratios"]["bare"]["verdict"] == "met"
    assert (s["ratios"]["bare"]["min"], s["ratios"]["bare"]["max"]) == pytest.approx((0.8, 1.0))
    step = s["sides"]["ours"]["step_s"]
    assert (step["median"], step["min"], step["max"], step["n"]) == pytest.approx((0.24, 0.24, 0.48, 3))
    assert s["sides"]["ours"]["other_s"]["median"] == pytest.approx(0.04)
    assert s["startup"] == {"target_s": 10.0, "median_s": 7.0, "verdict": "met", "met": True}
    assert s["noise"] == {"step_noise_median": 0.0, "quiet_at_most": 0.10, "quiet": True,  # steady steps
                          "measured": "step_noise"}


def test_in_turns_quiet_is_the_load_measured_beside_the_sides():
    def measured(other, machine=20.0):
        r = record([0.1, 0.3, 0.2, 0.5], [0.05] * 4, [0.05] * 4)  # a spread of 75%: not what is judged
        return r | {"machine_cpu": machine, "other_cpu": other}
    quiet = summarise({"ours": [measured(0.2)], "bare": [measured(0.3)]})["noise"]
    assert quiet["measured"] == "other_cores" and quiet["quiet"]
    assert quiet["other_cores"] == pytest.approx(0.5 / 40.0 * CORES)
    busy = summarise({"ours": [measured(9.0)], "bare": [measured(10.0)]})["noise"]
    assert not busy["quiet"] and busy["other_cores"] == pytest.approx(19.0 / 40.0 * CORES)


def test_accuracies_repeat_or_say_they_do_not():
    same = [record([0.1], [0.05], [0.05], accuracies=(0.2, 0.4)) for _ in range(2)]
    other = [record([0.1], [0.05], [0.05], accuracies=(0.2, 0.4)), record([0.1], [0.05], [0.05], accuracies=(0.2, 0.5))]
    s = summarise({"bare": same, "trl": other})
    assert s["sides"]["bare"]["accuracy_repeatable"] and not s["sides"]["trl"]["accuracy_repeatable"]
    assert (s["sides"]["bare"]["accuracy_final"], s["sides"]["bare"]["accuracy_best"]) == (0.4, 0.4)
    assert s["ratios"] == {} and "startup" not in s  # no ours side: nothing to compare with


def test_sides_with_different_repeat_counts_are_refused():
    with pytest.raises(ValueError, match="same number"):
        summarise({"ours": [record([0.1], [0.05], [0.05])] * 2, "bare": [record([0.1], [0.05], [0.05])]})


def test_evaluation_cost_is_judged_per_token():
    fast = record([0.1], [0.05], [0.05], tokens=100.0, eval_s=0.1, eval_tokens=500.0)  # 0.2 vs 0.5 ms a token
    slow = record([0.1], [0.05], [0.05], tokens=100.0, eval_s=1.0, eval_tokens=500.0)  # 2.0 vs 0.5
    s = summarise({"bare": [fast], "trl": [slow]})
    assert s["evaluation"]["bare"]["met"] and not s["evaluation"]["trl"]["met"]
    assert s["evaluation"]["trl"]["eval_ms_per_token"] == pytest.approx(2.0)


def test_a_median_within_the_target_is_not_met_when_a_repeat_misses_it():
    # a drifting machine's reading: median 0.907 within <= 1.0, but one repeat at 1.435
    ours = [record([r], [0.1], [0.1]) for r in (0.907, 1.435, 0.815)]
    trl = [record([1.0], [0.1], [0.1]) for _ in range(3)]
    bare = [record([s], [0.1], [0.1]) for s in (0.5, 0.5, 0.5)]
    s = summarise({"ours": ours, "trl": trl, "bare": bare})
    assert s["ratios"]["trl"]["median"] == pytest.approx(0.907)
    assert s["ratios"]["trl"]["verdict"] == "unresolved" and not s["ratios"]["trl"]["met"]
    assert s["ratios"]["bare"]["verdict"] == "missed"  # 1.63 and more in every repeat


@pytest.mark.parametrize("low, high, expected", [(0.9, 1.0, "met"), (1.01, 1.2, "missed"), (0.95, 1.05, "unresolved")])
def test_verdicts_read_the_whole_range(low, high, expected):
    assert verdict(low, high, 1.0) == expected


def test_start_up_must_stay_under_its_target_in_every_repeat():
    assert verdict(8.0, 10.0, 10.0, strict=True) == "unresolved"  # "under 10 s": 10.0 is not under
    ours = [record([0.1], [0.05], [0.05], startup=s) for s in (9.0, 11.0, 9.5)]
    assert summarise({"ours": ours})["startup"]["verdict"] == "unresolved"


def test_step_noise_is_the_interquartile_range_over_the_median():
    # quartiles (inclusive) of 1..5 are 2 and 4, median 3: spread 2 / 3
    f = repeat_figures(record([0.1, 0.2, 0.3, 0.4, 0.5], [0.0] * 5, [0.0] * 5))
    assert f["step_noise"] == pytest.approx(2 / 3)
    assert repeat_figures(record([0.3], [0.1], [0.1]))["step_noise"] == 0.0
    noisy = [record([0.1, 0.2, 0.3, 0.4, 0.5], [0.0] * 5, [0.0] * 5)] * 2
    s = summarise({"bare": noisy})
    assert s["noise"]["step_noise_median"] == pytest.approx(2 / 3) and not s["noise"]["quiet"]


@pytest.mark.parametrize("n, k, coverage", [(1, 1, 0.0), (3, 1, 0.75), (5, 1, 0.9375), (8, 1, 0.9921875),
                                            (9, 2, 1 - 20 / 512), (10, 2, 1 - 22 / 1024), (20, 6, None)])
def test_the_medians_interval_is_the_kth_smallest_to_kth_largest(n, k, coverage):
    values = [float(x) for x in range(n, 0, -1)]  # given in any order
    interval = median_interval(values)
    assert (interval["low"], interval["high"]) == (float(k), float(n + 1 - k))
    if coverage is not None:
        assert interval["coverage"] == pytest.approx(coverage)
    assert interval["coverage"] >= 0.9375 or k == 1
    with pytest.raises(ValueError):
        median_interval([])


#: The ours/bare ratios of a real run of 9 repeats (named after its start time).
RATIOS_1337 = [1.064, 1.032, 1.072, 1.088, 1.076, 1.076, 1.130, 1.045, 1.079]


def _report(summary, repeats, steps) -> str:
    settings = {"repeats": repeats, "steps": steps, "prompts_per_step": 8, "group_size": 8, "lr": 3e-5,
                "max_new_tokens": 6, "seed": 0, "slice_seconds": 2.0, "temperature": 1.0, "torch_threads": 2}
    return report({"settings": settings, "summary": summary, "json_path": "p.json", "png_path": "p.png",
                   "mlflow_run_id": "r", "mlflow_uri": "sqlite:///m.db"})


def test_nine_repeats_get_an_interval_and_its_own_verdict():
    # every-repeat rule unresolved, the median's 96% interval [1.045, 1.088] straddles 1.05 too,
    # with the median (1.076) over it
    ratios = RATIOS_1337
    ours = [record([r] * 3, [0.1] * 3, [0.1] * 3, startup=7.0) for r in ratios]
    bare = [record([1.0] * 3, [0.1] * 3, [0.1] * 3) for _ in ratios]
    r = summarise({"ours": ours, "bare": bare})["ratios"]["bare"]
    assert r["verdict"] == "unresolved" and r["median"] == pytest.approx(1.076)
    assert (r["median_interval"]["low"], r["median_interval"]["high"]) == pytest.approx((1.045, 1.088))
    assert r["median_verdict"] == "unresolved"
    narrow = summarise({"ours": [record([x - 0.04] * 3, [0.1] * 3, [0.1] * 3, startup=7.0) for x in ratios],
                        "bare": bare})["ratios"]["bare"]
    assert narrow["verdict"] == "unresolved" and narrow["median_verdict"] == "met"  # 1.005-1.048: one outlier left out


def test_the_report_prints_the_medians_interval_under_each_ratio():
    records = {"ours": [record([r] * 3, [0.1] * 3, [0.1] * 3, startup=7.0) for r in RATIOS_1337],
               "bare": [record([1.0] * 3, [0.1] * 3, [0.1] * 3) for _ in RATIOS_1337]}
    text = _report(summarise(records), repeats=9, steps=3)
    line = next(x for x in text.splitlines() if "the median's" in x)
    assert "96% interval [1.045-1.088]: straddles the target (the median misses it)" in line


def _timed(seconds, start):
    """A record of steps of `seconds` back to back from epoch second `start`, none cut by a pause."""
    ends, t = [], start
    for x in seconds:
        t += x
        ends.append(t)
    r = record(seconds, [x / 2 for x in seconds], [x / 4 for x in seconds])
    return r | {"step_ended_at": ends, "step_kept": [True] * len(seconds),
                "evals": [e | {"clean": False} for e in r["evals"]]}


def _drifting_repeat():
    """ours starts its steps 3 s after the bare loop and runs on alone for 6 s after it; the
    machine slows from 0.10 to 0.13 s a step (both sides) 6 s after the start. In the stretch
    both were stepping ours is 1.05x the bare loop at either speed."""
    bare = _timed([0.100] * 60 + [0.130] * 40, 0.0)  # 0-6 s fast, 6-11.2 s slow
    ours = _timed([0.105] * 28 + [0.1365] * 100, 3.0)  # 3-5.94 s fast, then slow to 17.6 s
    return ours, bare


def test_sides_are_compared_over_the_stretch_they_were_all_taking_steps():
    ours, bare = _drifting_repeat()
    apply_window([ours, bare])
    assert ours["window"] == bare["window"] == pytest.approx([3.0, 11.2])
    assert ours["window_steps"] >= MIN_WINDOW_STEPS and bare["window_steps"] == 70  # its steps from 3 s on
    s = summarise({"ours": [ours], "bare": [bare]})
    assert s["steps_compared"]["shared_window"] and "at least" in s["steps_compared"]["why"]
    # ours' window steps: 28 fast (0.105) and 40 slow (0.1365): median slow; bare's: 30 fast, 40 slow
    assert s["ratios"]["bare"]["per_repeat"] == pytest.approx([1.05])
    # over every step, ours' slow run on its own after the bare loop ended tips it to 1.365
    assert s["ratios"]["bare"]["every_step"]["per_repeat"] == pytest.approx([0.1365 / 0.100])
    assert s["sides"]["bare"]["steps_kept"]["median"] == 70
    text = _report(s, repeats=1, steps=128)
    assert "steps compared: over the stretch of each repeat in which every side was taking steps" in text
    assert "over every step no pause touched (the same repeats, outside the shared window too): 1.365" in text


def test_too_short_a_shared_window_falls_back_to_every_step_and_says_why():
    ours, bare = _drifting_repeat()
    ours = _timed([0.105] * 20, 10.5)  # its steps overlap the bare loop's only in 10.5-11.2 s
    apply_window([ours, bare])
    assert ours["window_steps"] < MIN_WINDOW_STEPS
    s = summarise({"ours": [ours], "bare": [bare]})
    compared = s["steps_compared"]
    # the side with the fewest is named: the bare loop, 5 steps in 10.5-11.2 s (ours 6)
    assert not compared["shared_window"] and "bare had 5 measured steps in repeat 1" in compared["why"]
    assert "--steps" in compared["why"] and ours["window_steps"] == 6
    assert s["ratios"]["bare"]["per_repeat"] == pytest.approx([0.105 / 0.100])  # every step: medians 0.105, 0.100
    assert "every_step" not in s["ratios"]["bare"]
    # no window at all: none of a side's steps is inside, the repeat still summarises over every step
    late = _timed([0.105] * 20, 50.0)
    apply_window([late, bare])
    assert late["window"] is None and late["window_steps"] == 0
    assert not summarise({"ours": [late], "bare": [bare]})["steps_compared"]["shared_window"]
    with pytest.raises(ValueError, match="shared window"):
        repeat_figures(late, window=True)


def test_processes_one_after_another_have_no_shared_window():
    s = summarise({"ours": [record([0.1], [0.05], [0.05])], "bare": [record([0.1], [0.05], [0.05])]})
    assert not s["steps_compared"]["shared_window"] and "one after another" in s["steps_compared"]["why"]
