"""A real pretrained model through the whole loop (issue 46): experiment=smollm2_chain_sum, at a
tiny size, prepares SmolLM2-135M-Instruct from its package on first use, trains on
reasoning-gym's chain_sum through the chat template, stores every rollout (the task's text in
`prompt`, the ChatML tokens in `prompt_ids`, eos as pad), logs its model to MLflow, stops and
resumes bit for bit, and is read by flows.query, the viewer and flows.evaluate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from html import escape

import numpy as np
import pytest

from replay_pipeline.buffer import RolloutStore
from replay_pipeline.models.packaged import packaged_problems
from replay_pipeline.run.lineage import read_run_info
from tests.conftest import ROOT, TEST_THREADS
from tests.servers import free_port, prefect_env, start_process, stop_process, wait_for_http

missing = packaged_problems("smollm2-135m-instruct")
pytestmark = [pytest.mark.skipif(bool(missing), reason="; ".join(missing) or "installed"),
              pytest.mark.skipif(__import__("importlib").util.find_spec("reasoning_gym") is None,
                                 reason="reasoning-gym is not installed (the dev install has it)")]

SMALL = ["experiment=smollm2_chain_sum", "task.heldout_size=4", "task.validation_size=0",
         "loop.prompts_per_step=2", "loop.group_size=4", "loop.minibatch_size=8", "buffer.capacity=16",
         "generator.max_new_tokens=12", "loop.eval_every=0", "loop.passk_every=3", "loop.eval_samples=2",
         "loop.pass1_samples=1", "loop.checkpoint_every=0", f"model.torch_threads={TEST_THREADS}",
         "tracking.progress=false"]
R = 2 * 4  # rollouts a step
COLUMNS = ["seq", "step", "prompt", "prompt_ids", "completion_ids", "behaviour_logprobs", "reward", "advantage",
           "finish_reason", "completion"]


def train(root, *args):
    env = {**os.environ, **prefect_env(root / ".prefect")}
    return subprocess.run([sys.executable, "-m", "flows.train", f"tracking.root_dir={root}", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)


def rows(root, run_id):
    table = RolloutStore.open(root / "lancedb", run_id).window(10_000, columns=COLUMNS).to_pylist()
    return sorted(table, key=lambda r: r["seq"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One run of 3 steps straight; one stopped after 2 and resumed to 3 (the same seed)."""
    root = tmp_path_factory.mktemp("smollm2")
    straight = train(root, *SMALL, "run_id=straight", "loop.steps=3")
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    first = train(root, *SMALL, "run_id=cut", "loop.steps=2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    resumed = train(root, "resume=cut", "loop.steps=3")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return root, straight.stdout + straight.stderr


def test_the_model_is_prepared_once_and_every_rollout_is_stored_as_the_model_saw_it(runs):
    """The first run prepared the model (the later ones found it); 3 x R rollouts with the
    task's question in `prompt`, ChatML in `prompt_ids` (<|im_start|> first, the assistant's
    turn opened last), completions cut at <|im_end|> (id 2) when they stop, log-probs <= 0."""
    root, log = runs
    assert log.count("preparing smollm2-135m-instruct") == 1 and "warning: generator.max_new_tokens" not in log
    assert (root / "cache" / "models" / "smollm2-135m-instruct" / "prepared.json").is_file()
    stored = rows(root, "straight")
    assert len(stored) == 3 * R and [r["step"] for r in stored] == [s for s in range(3) for _ in range(R)]
    for r in stored:
        assert r["prompt"].startswith("State the final answer to the following arithmetic problem:")
        assert r["prompt_ids"][0] == 1 and r["prompt_ids"][-4:] == [1, 520, 9531, 198]  # ...<|im_start|>assistant\n
        assert 2 not in r["completion_ids"][:-1] and (r["finish_reason"] == "stop") == (r["completion_ids"][-1] == 2)
        assert len(r["behaviour_logprobs"]) == len(r["completion_ids"]) <= 12
        assert all(x <= 0 for x in r["behaviour_logprobs"]) and r["reward"] in (0.0, 1.0)
        assert "<|im_end|>" not in r["completion"]


def test_stop_and_resume_is_bit_for_bit(runs):
    """The run stopped after step 2 and resumed to step 3 stored exactly the straight run's
    rollouts (token ids, log-probs, rewards, advantages) and ends at the same weights."""
    root, _ = runs
    a, b = rows(root, "straight"), rows(root, "cut")
    assert len(a) == len(b) == 3 * R
    for x, y in zip(a, b):
        for key in ("prompt_ids", "completion_ids", "behaviour_logprobs", "reward", "advantage"):
            assert x[key] == y[key], key
    from safetensors.numpy import load_file

    def weights(run_id):
        (ckpt,) = sorted((root / run_id / "checkpoints").glob("step-000003"))
        return load_file(next((ckpt / "model").glob("*.safetensors")))

    wa, wb = weights("straight"), weights("cut")
    assert wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)


def test_mlflow_holds_the_logged_model_and_the_sampled_evaluation(runs):
    """The final policy is an MLflow logged model linked to the run; the sampled evaluation
    (pass@k, pass@1) ran before the first step and after the last, never between."""
    import mlflow
    from mlflow.tracking import MlflowClient

    root, _ = runs
    info = read_run_info(root, "straight")
    client = MlflowClient(tracking_uri=info["mlflow_uri"])
    run = client.get_run(info["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    (logged,) = [m for m in client.search_logged_models(experiment_ids=[run.info.experiment_id])
                 if m.source_run_id == run.info.run_id]
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(client.tracking_uri)
    try:
        assert "transformers" in mlflow.models.get_model_info(f"models:/{logged.model_id}").flavors
    finally:
        mlflow.set_tracking_uri(previous)
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval/pass_at_2")) == [0, 3]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")) == [0, 3]


def test_query_viewer_and_evaluate_read_the_run(runs):
    """flows.query lists its rollouts, the viewer's run and step pages show its text, and
    flows.evaluate scores its checkpoint on the task's held-out prompts."""
    root, _ = runs
    env = {**os.environ, **prefect_env(root / ".prefect")}
    query = subprocess.run([sys.executable, "-m", "flows.query", "rollouts", "straight", "--root", str(root),
                            "--format", "jsonl", "--columns", "seq,prompt,completion"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert query.returncode == 0, query.stderr[-2000:]
    listed = [json.loads(line) for line in query.stdout.splitlines() if line.strip()]
    assert len(listed) == 3 * R and "arithmetic problem" in listed[0]["prompt"]

    port = free_port()
    proc = start_process([sys.executable, "-m", "flows.view", str(root), "--port", str(port)],
                         root / "viewer.log", env=env, cwd=ROOT)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/", timeout=120, proc=proc)
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/run/straight", timeout=60).read().decode()
        assert f"{3 * R} rollouts" in page
        step = urllib.request.urlopen(f"http://127.0.0.1:{port}/run/straight/step/0", timeout=60).read().decode()
        assert escape(listed[0]["prompt"], quote=False) in step or escape(listed[0]["prompt"]) in step
    finally:
        stop_process(proc)

    evaluated = subprocess.run([sys.executable, "-m", "flows.evaluate", "straight", f"--root={root}", "--n=2"],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert evaluated.returncode == 0, evaluated.stdout[-2000:] + evaluated.stderr[-2000:]
    assert "accuracy" in evaluated.stdout
