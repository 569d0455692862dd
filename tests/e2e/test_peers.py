"""Side by side with TRL, end to end: `replay_pipeline.benchmarks.trl_compare.main` runs the
real flow (experiment=no_buffer) and TRL's GRPOTrainer for a few steps on the tiny test
configuration, then its JSON, PNG and MLflow run are read back and checked.

The tiny warm start is kept between test sessions in pytest's cache directory
(.pytest_cache/d/trl_compare_warmstart, content-addressed like runs/cache: a directory's name
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

from replay_pipeline.benchmarks.trl_compare import EXPERIMENT, RESULT_JSON, RESULT_PNG, main
from replay_pipeline.resume import resolve_config
from tests.conftest import TINY_OVERRIDES

STEPS, EVAL_EVERY = 3, 2
EVAL_STEPS = [0, 2, 3]  # start, every EVAL_EVERY, end
BATCH = 16  # 4 prompts x 4 completions (TRL's num_generations = loop.group_size = 4)


def _stored_warm_starts(config) -> Path | None:
    cache = getattr(config, "cache", None)  # None with -p no:cacheprovider
    return None if cache is None else Path(cache.mkdir("trl_compare_warmstart"))


def _copy_complete(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for d in src.glob("warmstart-*"):
        if (d / "warmstart.json").is_file() and not (dst / d.name / "warmstart.json").is_file():
            shutil.copytree(d, dst / d.name, dirs_exist_ok=True)


@pytest.fixture(scope="module")
def bench(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("trl-compare")
    stored = _stored_warm_starts(request.config)
    if stored is not None:
        _copy_complete(stored, root / "cache")
    assert main(["--steps", str(STEPS), "--eval-every", str(EVAL_EVERY), "--root", str(root),
                 *TINY_OVERRIDES]) == 0
    if stored is not None:
        _copy_complete(root / "cache", stored)
    (out,) = sorted((root / "benchmarks").glob("trl_compare-*"))
    return root, out, json.loads((out / RESULT_JSON).read_text())


def test_both_sides_measured_seconds_per_step(bench):
    _, _, result = bench
    for side in ("ours", "trl"):
        r = result[side]
        assert len(r["step_seconds"]) == len(r["gen_seconds"]) == len(r["train_seconds"]) == STEPS
        assert all(s > 0 for s in r["step_seconds"]), side
        assert all(g > 0 for g in r["gen_seconds"]) and all(t > 0 for t in r["train_seconds"]), side
        s = r["summary"]
        assert s["step_seconds_mean"] > 0 and s["step_seconds_median"] > 0
        assert r["torch_threads"] == 2  # model.torch_threads on both sides
    # TRL's step is generation + training; ours also holds the pipeline's own cost
    for s, g, t in zip(result["trl"]["step_seconds"], result["trl"]["gen_seconds"], result["trl"]["train_seconds"]):
        assert g + t == pytest.approx(s)
    for s, g, t in zip(result["ours"]["step_seconds"], result["ours"]["gen_seconds"], result["ours"]["train_seconds"]):
        assert g + t <= s + 1e-6


def test_trl_generated_tokens_are_the_completions_it_produced(bench):
    _, _, result = bench
    trl = result["trl"]
    lengths = trl["completion_lengths"]
    assert len(lengths) == STEPS and all(len(batch) == BATCH for batch in lengths)
    max_new = result["settings"]["max_new_tokens"]
    assert all(1 <= n <= max_new for batch in lengths for n in batch)
    assert trl["gen_tokens"] == sum(sum(batch) for batch in lengths) > 0
    # the same count from TRL's own log: batch x its mean completion length, step by step
    assert len(trl["logged_mean_lengths"]) == STEPS
    assert trl["gen_tokens"] == pytest.approx(sum(BATCH * m for m in trl["logged_mean_lengths"]))
    assert result["ours"]["gen_tokens"] > 0


def test_trl_runs_with_our_resolved_settings(bench):
    root, _, result = bench
    cfg = resolve_config(["experiment=no_buffer", f"tracking.root_dir={root}", *TINY_OVERRIDES])
    c = result["trl"]["config"]
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
    assert result["trl"]["optimizer"] == "AdamW"


def test_accuracy_against_compute_on_both_sides(bench):
    _, _, result = bench
    ours, trl = result["ours"]["evals"], result["trl"]["evals"]
    assert [p["step"] for p in ours] == [p["step"] for p in trl] == EVAL_STEPS
    for points in (ours, trl):
        assert all(0.0 <= p["accuracy"] <= 1.0 for p in points)
        assert points[0]["gen_tokens"] == 0 and points[0]["seconds"] == 0
        tokens = [p["gen_tokens"] for p in points]
        seconds = [p["seconds"] for p in points]
        assert tokens == sorted(tokens) and seconds == sorted(seconds) and tokens[-1] > 0
    # step 0 is the same warm-started weights and the same evaluator on both sides
    assert ours[0]["accuracy"] == trl[0]["accuracy"]
    assert trl[-1]["gen_tokens"] == result["trl"]["gen_tokens"]
    assert ours[-1]["gen_tokens"] == result["ours"]["gen_tokens"]
    assert trl[-1]["seconds"] == pytest.approx(sum(result["trl"]["step_seconds"]))
    for side in ("ours", "trl"):
        s = result[side]["summary"]
        assert s["accuracy_final"] == result[side]["evals"][-1]["accuracy"]
        assert s["accuracy_best"] == max(p["accuracy"] for p in result[side]["evals"])


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
    accuracy = client.get_metric_history(run.info.run_id, "trl/accuracy")
    assert sorted(m.step for m in accuracy) == EVAL_STEPS
    assert run.data.params["settings.steps"] == str(STEPS)
    # the flow's own run is a child of the comparison run, in the same experiment
    flow_run = client.get_run(result["ours"]["mlflow_run_id"])
    assert flow_run.data.tags["mlflow.parentRunId"] == run.info.run_id
    assert flow_run.info.experiment_id == run.info.experiment_id
    ledger = client.get_metric_history(flow_run.info.run_id, "compute/gen_tokens")
    assert max(m.value for m in ledger) == result["ours"]["gen_tokens"]
