"""The interleaved peer benchmark, end to end: `replay_pipeline.benchmarks.peers.main` runs our
flow (`python -m flows.train experiment=no_buffer`), TRL's GRPOTrainer and the bare loop for a
few steps on the tiny test configuration, two repeats in blocks, each a process of its own, the
three of a repeat taking turns of a second (the others stopped meanwhile); then its JSON, PNG and
MLflow run are read back and checked.

The tiny warm start is kept between test sessions in pytest's cache directory
(.pytest_cache/d/peers_warmstart, content-addressed like runs/cache: a directory's name
is the hash of every setting that shapes it) and copied into the run root first, so only the
first session pays for it (about 30 s here); `-p no:cacheprovider` or `--cache-clear` makes the
test warm-start from scratch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from replay_pipeline.benchmarks.peers import MIN_WINDOW_STEPS, RESULT_JSON, RESULT_PNG, SIDES, main
from replay_pipeline.benchmarks.sides import EXPERIMENT
from replay_pipeline.run.resume import resolve_config
from tests.conftest import TEST_THREADS, TINY_OVERRIDES

STEPS, EVAL_EVERY, REPEATS, SLICE = 3, 2, 2, 1.0
EVAL_STEPS = [0, 2, 3]  # start, every EVAL_EVERY, end
BATCH = 16  # 4 prompts x 4 completions (TRL's num_generations = loop.group_size = 4)


def _stored_warm_starts(config) -> Path | None:
    cache = getattr(config, "cache", None)  # None with -p no:cacheprovider
    return None if cache is None else Path(cache.mkdir("peers_warmstart"))


def _copy_complete(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for d in src.glob("warmstart-*"):
        if (d / "warmstart.json").is_file() and not (dst / d.name / "warmstart.json").is_file():
            shutil.copytree(d, dst / d.name, dirs_exist_ok=True)


@pytest.fixture(scope="module")
def bench(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("peers")
    stored = _stored_warm_starts(request.config)
    if stored is not None:
        _copy_complete(stored, root / "cache")
    assert main(["--steps", str(STEPS), "--eval-every", str(EVAL_EVERY), "--repeats", str(REPEATS),
                 "--slice-seconds", str(SLICE), "--root", str(root), *TINY_OVERRIDES]) == 0
    if stored is not None:
        _copy_complete(root / "cache", stored)
    (out,) = sorted((root / "benchmarks").glob("peers-*"))
    return root, out, json.loads((out / RESULT_JSON).read_text())


def _each(result):
    """(side, record) for every side and repeat."""
    return [(side, r) for side in SIDES for r in result["records"][side]]


def test_every_side_ran_in_blocks_of_fresh_processes(bench):
    root, out, result = bench
    assert result["settings"]["sides"] == list(SIDES) and result["settings"]["repeats"] == REPEATS
    for side in SIDES:
        assert [r["repeat"] for r in result["records"][side]] == list(range(1, REPEATS + 1))
    assert (result["settings"]["interleave"], result["settings"]["slice_seconds"]) == ("turns", SLICE)
    # one log per process
    logs = sorted(p.stem for p in (out / "logs").glob("repeat*.log"))
    assert logs == sorted(f"repeat{r}-{side}" for r in range(1, REPEATS + 1) for side in SIDES)
    for side, r in _each(result):
        assert r["turns"] >= 1 and len(r["pauses"]) in (r["turns"] - 1, r["turns"])
        assert all(a < b for a, b in r["pauses"])
    assert all(r["turns"] > 2 for r in result["records"]["ours"])  # ours, the longest, took several turns
    # within a repeat, no two sides ran at once: the steps no pause touched never overlap
    for repeat in range(REPEATS):
        spans = [(e - s, e, side) for side in SIDES for e, s, kept in
                 zip(*(result["records"][side][repeat][k] for k in ("step_ended_at", "step_seconds", "step_kept")))
                 if kept]
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]) if a[2] != b[2]), spans
    # our side is the real command: two flow runs of their own, children of the benchmark's run
    ours = result["records"]["ours"]
    assert len({r["run_id"] for r in ours}) == REPEATS
    assert all((root / r["run_id"] / "config.yaml").is_file() for r in ours)
    assert all(r["process_seconds"] > 0 for _, r in _each(result))


def test_every_side_measured_seconds_per_step(bench):
    _, _, result = bench
    for side, r in _each(result):
        assert len(r["step_seconds"]) == len(r["gen_seconds"]) == len(r["train_seconds"]) == STEPS
        assert all(s > 0 for s in r["step_seconds"]), side
        assert all(g > 0 for g in r["gen_seconds"]) and all(t > 0 for t in r["train_seconds"]), side
        assert r["torch_threads"] == TEST_THREADS, side  # model.torch_threads on every side
        assert r["startup_seconds"] > 0, side
    for side, r in _each(result):
        for s, g, t in zip(r["step_seconds"], r["gen_seconds"], r["train_seconds"]):
            if side == "trl":  # TRL's step is generation + training by construction
                assert g + t == pytest.approx(s)
            else:  # ours holds the pipeline's own cost too; the bare loop a few lines of its own
                assert g + t <= s + 1e-6


def test_summary_holds_spreads_and_within_repeat_ratios(bench):
    _, _, result = bench
    summary = result["summary"]
    for side in SIDES:
        step = summary["sides"][side]["step_s"]
        medians = [f["step_s"] for f in summary["sides"][side]["per_repeat"]]
        assert step["n"] == REPEATS and step["min"] <= step["median"] <= step["max"]
        assert (step["min"], step["max"]) == (min(medians), max(medians))
    for peer in ("trl", "bare"):
        ratio = summary["ratios"][peer]
        ours = [f["step_s"] for f in summary["sides"]["ours"]["per_repeat"]]
        theirs = [f["step_s"] for f in summary["sides"][peer]["per_repeat"]]
        assert ratio["per_repeat"] == pytest.approx([a / b for a, b in zip(ours, theirs)])
        expected = ("met" if ratio["max"] <= ratio["target"] else "missed" if ratio["min"] > ratio["target"]
                    else "unresolved")
        assert ratio["verdict"] == expected and ratio["met"] == (expected == "met")
        # with few repeats the median's interval is their whole range, and reads the same
        interval = ratio["median_interval"]
        assert (interval["low"], interval["high"]) == (ratio["min"], ratio["max"])
        assert ratio["median_verdict"] == expected
    # each repeat's shared window (the stretch every side was taking steps) is on every record;
    # 3 steps a side leave fewer than MIN_WINDOW_STEPS in it, so every step no pause touched is
    # compared, and the summary says so and why
    for repeat in range(REPEATS):
        records = [result["records"][side][repeat] for side in SIDES]
        assert len({str(r["window"]) for r in records}) == 1
        for r in records:
            assert len(r["step_in_window"]) == STEPS and r["window_steps"] <= sum(r["step_in_window"])
            if r["window"] is not None:
                start, end = r["window"]
                assert start < end and all(e <= end for e, w in zip(r["step_ended_at"], r["step_in_window"]) if w)
    compared = summary["steps_compared"]
    assert compared["min_window_steps"] == MIN_WINDOW_STEPS > STEPS
    assert not compared["shared_window"] and "--steps" in compared["why"]
    assert all("every_step" not in summary["ratios"][peer] for peer in ("trl", "bare"))
    # in turns, quiet is the load measured beside the sides, not the steps' spread
    noise = summary["noise"]
    assert 0.0 <= noise["step_noise_median"] and noise["measured"] == "other_cores"
    assert 0.0 <= noise["other_cores"] and noise["quiet"] == (noise["other_cores"] <= noise["quiet_at_most"])
    assert summary["startup"]["median_s"] == pytest.approx(summary["sides"]["ours"]["startup_s"]["median"])


def test_trl_generated_tokens_are_the_completions_it_produced(bench):
    _, _, result = bench
    for trl in result["records"]["trl"]:
        lengths = trl["completion_lengths"]
        assert len(lengths) == STEPS and all(len(batch) == BATCH for batch in lengths)
        max_new = result["settings"]["max_new_tokens"]
        assert all(1 <= n <= max_new for batch in lengths for n in batch)
        assert trl["gen_tokens"] == sum(sum(batch) for batch in lengths) > 0
        # the same count from TRL's own log: batch x its mean completion length, step by step
        assert len(trl["logged_mean_lengths"]) == STEPS
        assert trl["gen_tokens"] == pytest.approx(sum(BATCH * m for m in trl["logged_mean_lengths"]))
    assert all(r["gen_tokens"] > 0 for _, r in _each(result))


def test_trl_runs_with_our_resolved_settings(bench):
    root, _, result = bench
    cfg = resolve_config(["experiment=no_buffer", f"tracking.root_dir={root}", *TINY_OVERRIDES])
    c = result["records"]["trl"][0]["config"]
    assert c["num_generations"] == cfg.loop.group_size == 4
    assert c["per_device_train_batch_size"] == cfg.loop.prompts_per_step * cfg.loop.group_size == BATCH
    assert c["steps_per_generation"] == 1 and c["num_iterations"] == 1 and c["max_steps"] == STEPS
    assert c["learning_rate"] == cfg.algo.lr and c["epsilon"] == cfg.algo.eps_low
    assert c["epsilon_high"] == cfg.algo.eps_high and c["max_grad_norm"] == cfg.algo.max_grad_norm
    assert c["temperature"] == cfg.generator.temperature
    assert c["max_completion_length"] == cfg.generator.max_new_tokens
    assert (c["loss_type"], c["scale_rewards"], c["beta"]) == ("dapo", "group", 0.0)
    assert (c["lr_scheduler_type"], c["warmup_steps"], c["bf16"], c["use_cpu"]) == ("constant", 0, False, True)
    assert c.get("activation_checkpointing", c.get("gradient_checkpointing")) is False
    assert c["report_to"] in ("none", "[]", [])  # TrainingArguments turns "none" into an empty list
    assert result["records"]["trl"][0]["optimizer"] == "AdamW"


def test_accuracy_against_compute_on_every_side(bench):
    _, _, result = bench
    first = {side: result["records"][side][0]["evals"] for side in SIDES}
    for side, r in _each(result):
        points = r["evals"]
        assert [p["step"] for p in points] == EVAL_STEPS, side
        assert all(0.0 <= p["accuracy"] <= 1.0 for p in points)
        assert points[0]["gen_tokens"] == 0 and points[0]["seconds"] == 0
        tokens = [p["gen_tokens"] for p in points]
        seconds = [p["seconds"] for p in points]
        assert tokens == sorted(tokens) and seconds == sorted(seconds) and tokens[-1] > 0
        assert points[-1]["gen_tokens"] == r["gen_tokens"]
        # deterministic under the seed: every repeat of a side gives the same accuracies
        assert [p["accuracy"] for p in points] == [p["accuracy"] for p in first[side]], side
    for side in SIDES:
        assert result["summary"]["sides"][side]["accuracy_repeatable"]
    # step 0 is the same warm-started weights and the same evaluator on every side
    assert len({first[side][0]["accuracy"] for side in SIDES}) == 1
    for trl in result["records"]["trl"]:
        assert trl["evals"][-1]["seconds"] == pytest.approx(sum(trl["step_unpaused_seconds"]))


def test_outputs_and_mlflow_run(bench):
    root, out, result = bench
    png = out / RESULT_PNG
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert result["json_path"] == str(out / RESULT_JSON)
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    run = client.get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == EXPERIMENT
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {RESULT_JSON, RESULT_PNG}
    for side in SIDES:
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, f"{side}/accuracy")) == EVAL_STEPS
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, f"{side}/step_s")) == [1, 2]
    assert {"ratio/ours_over_trl", "ratio/ours_over_bare"} <= set(run.data.metrics)
    assert run.data.params["settings.steps"] == str(STEPS)
    # our side's flow runs are children of the benchmark's run, in the same experiment
    for ours in result["records"]["ours"]:
        flow_run = client.get_run(ours["mlflow_run_id"])
        assert flow_run.data.tags["mlflow.parentRunId"] == run.info.run_id
        assert flow_run.info.experiment_id == run.info.experiment_id
        ledger = client.get_metric_history(flow_run.info.run_id, "compute/gen_tokens")
        assert max(m.value for m in ledger) == ours["gen_tokens"]
        startup = client.get_metric_history(flow_run.info.run_id, "startup/seconds")
        assert [m.value for m in startup] == [ours["startup_seconds_measured"]]
        assert ours["startup_seconds"] <= ours["startup_seconds_measured"]  # less the pauses
