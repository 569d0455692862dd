"""An unexpected error during a run (issue 23 item 3): a few short lines instead of a traceback
of hundreds. They name the error, the file that holds its traceback (<run_dir>/errors.log, also
an MLflow artifact) and how to resume. The MLflow run and run.json end FAILED, exit code 1,
and the rows stored before the error stay readable."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from mlflow.tracking import MlflowClient

from replay_pipeline.buffer import RolloutStore
from tests.conftest import ROOT, TEST_THREADS

BOOM = '''

class Flaky(DigitSumTask):
    """Fails in its second RL step's prompts (the warm start draws other batch sizes)."""
    calls = [0]

    def train_prompts(self, n, rng):
        if n == 3:
            self.calls[0] += 1
            if self.calls[0] == 2:
                raise KeyError("prompt table lost its index")
        return super().train_prompts(n, rng)


def make_flaky(**kw):
    return Flaky(**vars(make_task(**kw)))
'''


def test_an_error_in_the_loop_ends_in_one_line_with_the_log_file_and_mlflow_failed(tmp_path):
    task_file = tmp_path / "flaky.py"
    shutil.copy(ROOT / "replay_pipeline" / "tasks" / "template.py", task_file)
    task_file.write_text(task_file.read_text() + BOOM)
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect")}
    done = subprocess.run(
        [sys.executable, "-m", "flows.train", f"tracking.root_dir={tmp_path}", "run_id=flaky", "task=custom",
         f"task.target={task_file}:make_flaky", "task.heldout_size=20", "task.validation_size=20",
         "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=64",
         "model.warmstart.target_accuracy=0.0", "model.warmstart.eval_every=10", f"model.torch_threads={TEST_THREADS}",
         "loop.prompts_per_step=3", "loop.group_size=4", "loop.minibatch_size=12", "buffer.capacity=24",
         "loop.steps=4", "loop.eval_every=0", "loop.passk_every=0", "tracking.progress=false"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert "Traceback" not in out and len(out.splitlines()) < 20, out[-3000:]
    log = tmp_path / "flaky" / "errors.log"
    last = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert last == [f"error: run flaky failed at step 1 of 4: KeyError: 'prompt table lost its index'. The "
                    f"traceback is in {log}; the MLflow run is FAILED; resume with: python -m flows.train "
                    "resume=flaky once the cause is fixed"], out[-3000:]
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and 'raise KeyError("prompt table lost its index")' in text
    assert json.loads((tmp_path / "flaky" / "run.json").read_text())["status"] == "FAILED"
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                filter_string="tags.`replay_pipeline.run_id` = 'flaky'")
    assert run.info.status == "FAILED"
    assert "errors.log" in {a.path for a in client.list_artifacts(run.info.run_id)}
    assert RolloutStore.open(tmp_path / "lancedb", "flaky").count() == 12  # step 0's rows, stored
