"""Your own task by import path (issue 23 item 1): a task file outside the project, named by
task.target, trains with `python -m flows.train`, resumes (the target re-imported from the
run's config.yaml), forks, runs in the async loop's generator processes and in `flows.evaluate`;
a weighted reward term (reward.terms) is added in the generator process too; a resume whose
task file is gone is refused before any work, naming it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from replay_pipeline.buffer import RolloutStore
from tests.conftest import ROOT, TEST_THREADS
from tests.servers import prefect_env

MODEL = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=64",
         "model.warmstart.target_accuracy=0.0", "model.warmstart.eval_every=10", f"model.torch_threads={TEST_THREADS}",
         "loop.prompts_per_step=4", "loop.group_size=4", "loop.minibatch_size=16", "buffer.capacity=32",
         "tracking.progress=false", "loop.eval_every=0", "loop.passk_every=0", "loop.eval_samples=2"]


def train(root, *args):
    env = {**os.environ, **prefect_env(root / ".prefect")}  # a root's runs share a server (tests/servers.py)
    return subprocess.run([sys.executable, "-m", "flows.train", f"tracking.root_dir={root}", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


def test_a_task_file_outside_the_project_trains_resumes_and_runs_in_generator_processes(tmp_path):
    mine = tmp_path / "elsewhere" / "my_task.py"
    mine.parent.mkdir()
    shutil.copy(ROOT / "replay_pipeline" / "tasks" / "template.py", mine)
    task = ["task=custom", f"task.target={mine}:make_task", "+task.args.terms=3", "task.heldout_size=20",
            "task.validation_size=20"]
    done = train(tmp_path, *MODEL, *task, "run_id=mine", "loop.steps=3", "loop.checkpoint_every=2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = RolloutStore.open(tmp_path / "lancedb", "mine").window(1000, columns=["prompt"]).column("prompt").to_pylist()
    assert len(rows) == 3 * 16 and all(p.count("+") == 2 and p.endswith("=") for p in rows)  # its prompts

    more = train(tmp_path, "resume=mine", "loop.steps=5")  # re-imported from config.yaml
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    assert RolloutStore.open(tmp_path / "lancedb", "mine").count() == 5 * 16
    forked = train(tmp_path, "fork=mine@4", "run_id=mine-fork", "loop.steps=5")  # and from the source's
    assert forked.returncode == 0, forked.stdout[-3000:] + forked.stderr[-3000:]
    fork_rows = RolloutStore.open(tmp_path / "lancedb", "mine-fork").window(1000, columns=["prompt", "run_id"])
    assert fork_rows.num_rows == 5 * 16 and all(p.count("+") == 2 for p in fork_rows.column("prompt").to_pylist())

    evaluated = subprocess.run([sys.executable, "-m", "flows.evaluate", "mine", f"--root={tmp_path}", "--n=2"],
                               cwd=ROOT, capture_output=True, text=True, timeout=600,
                               env={**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect")})
    assert evaluated.returncode == 0, evaluated.stdout[-2000:] + evaluated.stderr[-2000:]

    bonus = tmp_path / "elsewhere" / "bonus.py"  # a weighted reward term, in the generator process too
    bonus.write_text("def half(prompt, completion, finish_reason):\n    return 0.5\n")
    async_run = train(tmp_path, *MODEL, *task, "run_id=mine-async", "loop=async", "loop.steps=3",
                      "loop.checkpoint_every=0", "model.torch_threads=1", f"+reward.terms.half.target={bonus}:half")
    assert async_run.returncode == 0, async_run.stdout[-3000:] + async_run.stderr[-3000:]
    workers = RolloutStore.open(tmp_path / "lancedb", "mine-async").window(
        1000, columns=["worker", "prompt", "reward", "correct"])
    assert set(workers.column("worker").to_pylist()) == {0} and "+" in workers.column("prompt")[0].as_py()
    assert [r - 0.5 for r in workers.column("reward").to_pylist()] == [
        float(c) for c in workers.column("correct").to_pylist()]

    mine.rename(mine.with_suffix(".gone"))
    refused = train(tmp_path, "resume=mine", "loop.steps=6")
    assert refused.returncode == 2 and f"no file {mine}" in refused.stderr, refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr
