"""python -m flows.plan: the report against replay_pipeline.algo.planner, and --run against a real
MLflow SQLite store built here with MlflowClient (the tags, params and metric flows.train logs).

A process that reads a run spends seconds importing mlflow, so only the main paths run as
subprocesses; the other error cases call flows.plan.main in-process.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flows import plan as plan_cli
from replay_pipeline.algo import planner

REPO = Path(__file__).resolve().parents[2]
RUN = "20260101-120000-abc123"        # mu logged at steps 0 (nan), 1, 5 and 3 (last in time)
NO_MU = "20260101-130000-def456"      # only a nan mu so far: the run has not trained yet
OTHER = "20260101-110000-0a0b0c"      # defaults, to be listed as a known run


def run_cli(*args: str) -> subprocess.CompletedProcess:
    # PREFECT_HOME comes from tests/conftest.py, so flows/__init__ creates nothing in the repo.
    env = {k: v for k, v in os.environ.items() if k != "REPLAY_PIPELINE_ROOT"}
    return subprocess.run([sys.executable, "-m", "flows.plan", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180)


def _number(label: str, text: str) -> float:
    match = re.search(re.escape(label) + r"\s*=?\s*([-+0-9.e]+)", text)
    assert match, f"{label!r} not in\n{text}"
    return float(match.group(1))


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """ROOT with ROOT/mlflow.db holding three runs tagged as flows.train tags them."""
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("plan-cli")
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.create_experiment("replay-pipeline", artifact_location=(root / "art").as_uri())

    def make(run_id: str, params: dict[str, object], mus: list[tuple[int, float]], start: int) -> None:
        run = client.create_run(experiment, start_time=start, tags={"replay_pipeline.run_id": run_id})
        client.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in params.items()],
                         tags=[RunTag("mlflow.runName", run_id)])
        for t, (step, mu) in enumerate(mus):
            client.log_batch(run.info.run_id, metrics=[Metric("compute/mu", mu, 1_000 + t, step)])
        client.set_terminated(run.info.run_id)

    make(OTHER, {"loop.prompts_per_step": 8, "loop.group_size": 8, "loop.minibatch_size": 64},
         [(0, 0.55)], start=1_000)
    make(RUN, {"loop.prompts_per_step": 4, "loop.group_size": 8, "loop.minibatch_size": 16,
               "loop.updates_per_step": 2, "buffer.capacity": 64, "buffer.strategy": "uniform"},
         [(0, math.nan), (1, 3.0), (5, 6.5), (3, 4.0)], start=2_000)
    make(NO_MU, {"loop.prompts_per_step": 8}, [(0, math.nan)], start=3_000)
    return root


def test_defaults_are_the_projects():
    from replay_pipeline.config import LoopConfig

    loop = LoopConfig()
    assert (plan_cli.DEFAULT_PROMPTS_PER_STEP, plan_cli.DEFAULT_GROUP_SIZE, plan_cli.DEFAULT_MINIBATCH) == (
        loop.prompts_per_step, loop.group_size, loop.minibatch_size)


def test_mu_report_matches_the_planner():
    result = run_cli("--mu", "6.84", "--rollouts-per-step", "64", "--minibatch", "64")
    assert result.returncode == 0, result.stderr
    expected = planner.plan(6.84, 64, 64, alpha=0.25, rho=0.05)
    out = result.stdout
    assert _number("x* =", out) == pytest.approx(expected.x_star, rel=1e-3)
    assert "learner updates" in out and "N = x R / K" in out  # the unit is said
    assert _number("y* =", out) == pytest.approx(expected.y_star, rel=1e-3)
    assert _number("buffer.capacity", out) == expected.capacity == 64  # 3.78 x 64 / 5 = 48 -> one batch
    assert _number("loop.updates_per_step", out) == expected.updates_per_step == 5
    assert _number("replay ratio y = K x B / R", out) == pytest.approx(expected.y, rel=1e-3)
    realised = out[out.index("realised:"):]
    assert _number("predicted gamma", realised) == pytest.approx(expected.gamma, abs=6e-4)
    assert "illustrative default" in out
    assert f"python -m flows.train buffer.capacity={expected.capacity} loop.updates_per_step=5" in out


def test_json_matches_the_planner_exactly():
    result = run_cli("--mu", "5.28", "-R", "128", "-B", "32", "--alpha", "0.2", "--rho", "0.1", "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    expected = planner.plan(5.28, 128, 32, alpha=0.2, rho=0.1)
    for field in ("x_star", "y_star", "capacity", "updates_per_step", "x", "y", "gamma", "gamma_star",
                  "mu", "alpha", "rho", "method"):
        assert record[field] == getattr(expected, field), field
    assert record["overrides"] == [f"buffer.capacity={expected.capacity}",
                                   f"loop.updates_per_step={expected.updates_per_step}",
                                   "loop.minibatch_size=32"]
    assert record["run_id"] is None and record["mu_source"] == "--mu"


def test_cpu_mu_recommends_staying_on_policy(capsys):
    assert plan_cli.main(["--mu", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "python -m flows.train buffer.capacity=64 loop.updates_per_step=1" in out
    assert "stay near on-policy" in out


def test_imports_stay_light():
    code = ("import sys, flows.plan; "
            "print(sorted(m for m in ('prefect', 'torch', 'mlflow', 'hydra') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_run_takes_the_latest_mu_and_the_runs_sizes(store):
    result = run_cli("--run", RUN, "--root", str(store), "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    expected = planner.plan(6.5, 32, 16, alpha=0.25, rho=0.05)  # step 5, not step 3 logged after it
    assert record["mu"] == 6.5 and record["mu_step"] == 5 and record["run_id"] == RUN
    assert (record["rollouts_per_step"], record["minibatch_size"]) == (32, 16)
    assert (record["capacity"], record["updates_per_step"]) == (expected.capacity, expected.updates_per_step)
    assert record["overrides"] == [f"buffer.capacity={expected.capacity}",
                                   f"loop.updates_per_step={expected.updates_per_step}",
                                   "loop.prompts_per_step=4", "loop.group_size=8", "loop.minibatch_size=16"]
    current = record["current"]
    assert (current["capacity"], current["updates_per_step"], current["x"], current["y"]) == (64, 2, 4.0, 1.0)  # x = K N / R learner updates
    assert current["gamma"] == pytest.approx(
        planner.predicted_gamma(6.5, 4.0, 1.0, planner.power_law_noise(0.25), 0.05))


def test_run_report_and_command_line_sizes_win(store, capsys):
    uri = f"sqlite:///{store / 'mlflow.db'}"
    assert plan_cli.main(["--run", RUN, "--mlflow-uri", uri, "-R", "64", "--minibatch", "64"]) == 0
    out = capsys.readouterr().out
    expected = planner.plan(6.5, 64, 64)
    assert f"run {RUN}, compute/mu at step 5" in out
    assert _number("buffer.capacity", out) == expected.capacity
    assert "this run:" in out


def test_unknown_run_exits_2_and_lists_known_ones(store):
    result = run_cli("--run", "20990101-000000-ffffff", "--root", str(store))
    assert result.returncode == 2
    assert "no run '20990101-000000-ffffff'" in result.stderr
    assert NO_MU in result.stderr and RUN in result.stderr and OTHER in result.stderr
    assert result.stdout == ""


def test_run_without_mu_exits_2(store, capsys):
    assert plan_cli.main(["--run", NO_MU, "--root", str(store)]) == 2
    err = capsys.readouterr().err
    assert f"run {NO_MU} has no compute/mu yet" in err and "--mu" in err


def test_missing_store_exits_2_without_creating_one(tmp_path, capsys):
    assert plan_cli.main(["--run", RUN, "--root", str(tmp_path)]) == 2
    assert "no MLflow store" in capsys.readouterr().err
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("args,message", [
    (["--mu", "-1"], "mu=-1.0 must be a finite number > 0"),
    (["--mu", "0"], "mu=0.0 must be a finite number > 0"),
    (["--mu", "6.84", "--alpha", "0.5"], "alpha=0.5 must be below 1/2"),
    (["--mu", "6.84", "--alpha", "0"], "no finite optimal horizon"),
    (["--mu", "6.84", "--rho", "-0.1"], "rho=-0.1 must be a finite number >= 0"),
])
def test_invalid_numbers_exit_2(args, message, capsys):
    assert plan_cli.main(args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--mu", "abc"], "'abc' is not a number"),
    (["--mu", "nan"], "is not a finite number"),
    (["--mu", "6.84", "-R", "0"], "'0' is not a positive integer"),
    (["--mu", "6.84", "--minibatch", "2.5"], "'2.5' is not a positive integer"),
    ([], "one of the arguments --mu --run --probe is required"),
    (["--mu", "6.84", "--run", RUN], "not allowed with argument"),
])
def test_argument_errors_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        plan_cli.main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
