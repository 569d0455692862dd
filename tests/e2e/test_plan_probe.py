"""The planner fed by measurements (issue 24 item 2): `python -m flows.plan --probe STEPS`
trains a short run, measures alpha and rho on its rollouts at its checkpoint (noise.json) and
plans with them, saying so with their intervals; `--run RUN --measure` does the same for an
existing run, and a later `--run RUN` reads the measured values back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT, TINY_OVERRIDES

TINY = [o for o in TINY_OVERRIDES if not o.startswith(("model.torch_threads", "tracking.progress"))]


def plan(root, *args):
    env = {**os.environ, "PREFECT_HOME": str(root / ".prefect")}
    return subprocess.run([sys.executable, "-m", "flows.plan", "--root", str(root), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_a_probe_measures_alpha_and_rho_and_the_plan_uses_them(tmp_path):
    extra = [a for o in [*TINY, "model.torch_threads=1", "loop.eval_every=0", "loop.passk_every=0"]
             for a in ("--probe-override", o)]
    done = plan(tmp_path, "--probe", "10", "--json", *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout)
    run_id = record["run_id"]
    noise = json.loads((tmp_path / run_id / "noise.json").read_text())
    assert noise["rollouts"] == 8 * 16 and noise["steps"] == list(range(2, 10))  # versions 2..10 of a 10-step run
    for key in ("alpha", "rho"):
        est = noise[key]
        assert est["low"] <= est["value"] <= est["high"] and len(est["points"]) >= 2
    assert record["rho"] == max(noise["rho"]["value"], 0.0)
    assert record["alpha_source"].startswith(f"measured on run {run_id}: 128 rollouts")
    again = plan(tmp_path, "--run", run_id)  # the measured values are read back
    assert again.returncode == 0 and "measured on run" in again.stdout and "95% interval" in again.stdout
    refused = plan(tmp_path, "--mu", "5", "--measure")
    assert refused.returncode == 2 and "--measure measures a run: give it --run RUN_ID" in refused.stderr
