"""Evaluation on real models: evaluate_sampled/evaluate_all on a tiny random model, and
`python -m flows.evaluate` end to end on a checkpoint written by `python -m flows.train`,
read back from the run's MLflow store."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from replay_pipeline.training.evaluation import evaluate_all, evaluate_sampled
from replay_pipeline.generation import TransformersGenerator
from replay_pipeline.models.tiny import build_tiny_model, build_tokenizer
from replay_pipeline.tasks.base import Prompt
from tests.conftest import ROOT, TINY_OVERRIDES

RUN_ID = "ev1"
PROMPTS = [Prompt(f"p{i}", f"{i}+{i}=", str(2 * i)) for i in range(4)]


class ConstantTask:
    """Every completion earns `reward`, whatever the model says."""

    name = "constant"

    def __init__(self, reward: float):
        self.value = reward

    def reward(self, prompt, completion, finish_reason):
        return self.value


@pytest.fixture(scope="module")
def generator():
    tok = build_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    return TransformersGenerator(model, tok, max_new_tokens=4)


@pytest.mark.parametrize("reward, expected", [(1.0, 1.0), (0.0, 0.0)])
def test_sampled_pass_at_k_on_a_task_whose_answer_is_fixed(generator, reward, expected):
    m = evaluate_sampled(generator, ConstantTask(reward), PROMPTS, n=4, ks=(1, 2, 4), seed=3)
    assert [m[f"eval/pass_at_{k}"] for k in (1, 2, 4)] == [expected] * 3
    assert 0 < m["eval/sample_entropy"] and 1 <= m["eval/sample_length"] <= 4


def test_sampled_entropy_is_mean_negative_logprob_of_the_samples(generator):
    m = evaluate_sampled(generator, ConstantTask(1.0), PROMPTS, n=4, ks=(1,), seed=5)
    samples = generator.generate([p.text for p in PROMPTS], n=4, seed=5, temperature=1.0, top_p=1.0)
    lps = [-lp for group in samples for s in group for lp in s.logprobs]
    assert m["eval/sample_entropy"] == pytest.approx(sum(lps) / len(lps), rel=1e-6)


def test_evaluate_all_has_every_key(generator):
    m = evaluate_all(generator, ConstantTask(1.0), PROMPTS, n=4, seed=0)
    for key in ("eval/accuracy", "eval/pass_at_1_t01", "eval/pass_at_1", "eval/pass_at_2",
                "eval/pass_at_4", "eval/sample_entropy", "eval/sample_length"):
        assert key in m
    assert "eval/pass_at_8" not in m  # k runs up to n only


# ------------------------------------------------------------------ the CLI, end to end
def _env(root: Path) -> dict[str, str]:
    return {**os.environ, "PREFECT_HOME": str(root / ".prefect")}


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    train = [sys.executable, "-m", "flows.train", f"tracking.root_dir={root}", f"run_id={RUN_ID}",
             *TINY_OVERRIDES, "loop.steps=2", "loop.checkpoint_every=1", "loop.eval_every=1"]
    proc = subprocess.run(train, cwd=ROOT, env=_env(root), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cmd = [sys.executable, "-m", "flows.evaluate", RUN_ID, "--root", str(root), "--n", "4"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(root), capture_output=True, text=True, timeout=300)
    return root, proc


def test_cli_runs_its_flow_on_the_private_prefect_server(evaluated):
    """With no PREFECT_API_URL, flows.evaluate starts the private server flows.train uses
    (flows/prefect_server.py), not Prefect's own temporary one, which logs its start."""
    root, proc = evaluated
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PREFECT_API_URL" not in _env(root)
    assert "Starting temporary server" not in proc.stdout + proc.stderr


def test_cli_logs_metrics_and_artifact_to_the_runs_mlflow_run(evaluated):
    root, proc = evaluated
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"Run {RUN_ID}, checkpoint step-000002" in proc.stdout
    assert "pass@k (T=1)" in proc.stdout and "k=4:" in proc.stdout
    state = json.loads((root / RUN_ID / "checkpoints" / "step-000002" / "state.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    run_id = state["mlflow_run_id"]
    at_step = {}
    for key in ("eval/pass_at_1", "eval/pass_at_2", "eval/pass_at_4", "eval/pass_at_1_t01",
                "eval/sample_entropy", "eval/accuracy"):
        history = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        assert state["policy_version"] in history, (key, history)
        at_step[key] = history[state["policy_version"]]
    ks = [at_step[f"eval/pass_at_{k}"] for k in (1, 2, 4)]
    assert ks == sorted(ks) and all(0 <= v <= 1 for v in ks)
    assert at_step["eval/sample_entropy"] > 0
    local = client.download_artifacts(run_id, "eval/step-000002.json", str(root / "dl"))
    record = json.loads(Path(local).read_text())
    assert record["step"] == 2 and record["metrics"]["eval/pass_at_4"] == at_step["eval/pass_at_4"]


def test_cli_errors_say_how_to_fix(evaluated, capsys, tmp_path):
    from flows.evaluate import main

    root, _ = evaluated
    assert main(["nope", "--root", str(root)]) == 2
    err = capsys.readouterr().err
    assert "unknown run 'nope'" in err and f"runs found there: {RUN_ID}" in err

    assert main([RUN_ID, "--root", str(root), "--step", "7"]) == 2
    err = capsys.readouterr().err
    assert "no complete checkpoint at step 7" in err and "available steps: 1, 2" in err

    # a copy of the run with a garbled state.json, then with no checkpoints at all
    copy = tmp_path / "runs"
    shutil.copytree(root / RUN_ID, copy / RUN_ID)
    (copy / RUN_ID / "checkpoints" / "step-000002" / "state.json").write_text("{not json")
    assert main([RUN_ID, "--root", str(copy), "--step", "2"]) == 2
    assert "state.json is garbled" in capsys.readouterr().err
    shutil.rmtree(copy / RUN_ID / "checkpoints")
    assert main([RUN_ID, "--root", str(copy)]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
