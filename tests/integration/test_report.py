"""replay_pipeline.reports.report and python -m flows.report against a real MLflow SQLite store and
real LanceDB tables in tmp_path, with metric histories built here so that every number is
known by hand.

The sweep "sw" (id abc123): 20 rounds, evaluations at steps 0, 5, 10, 15, 20 (an evaluation
at step E is paired with the ledger logged at step E - 1, the first E rounds).

| config (seeds) | family | tokens/round per seed | s/round | gen/train rollouts per round |
|---|---|---|---|---|
| no_buffer (4), baseline | no_buffer | 100 | 2.0 | 64 / 64 |
| replay (4) | replay | 45, 49, 51, 60 | 1.5 | 32 / 128 |
| replay_lr2 (2) | replay | 40 | 1.2 | 32 / 128 |
| slow (2) | slow | 100 | 2.0 | 64 / 64 |
| broken (1, FAILED) | | | | |

Seed accuracy = median + offset, offsets (-0.1, -0.02, 0.02, 0.1) for 4 seeds (median m,
IQR m - 0.04 .. m + 0.04 with linear interpolation) and (-0.02, 0.02) for 2 (m -+ 0.01).
Medians at steps 0, 5, 10, 15, 20:
  no_buffer 0.3 0.5 0.6 0.55 0.5  -> baseline peak 0.6 at step 10: 1000 tokens, 20 s,
                                     (5.28 x 64 + 64) x 10 = 4019.2 projected
  replay    0.3 0.55 0.62 0.65 0.6 -> reaches 0.6 at step 10: median(450, 490, 510, 600) = 500
                                     tokens (0.50), 15 s (0.75), (5.28 x 32 + 128) x 10 = 2969.6 (0.74)
  replay_lr2 0.3 0.45 0.58 0.61 0.5 -> at step 15: 600 tokens (0.60), 18 s (0.90), 4454.4 (1.11)
  slow      0.3 0.4 0.45 0.5 0.52  -> not reached
Best buffer configuration: replay. Frontier of family replay (tokens): (0, 0.3 replay),
(200, 0.45 lr2), (250, 0.55 replay), (400, 0.58 lr2), (500, 0.62 replay), (750, 0.65 replay);
it reaches 0.6 at 500 tokens via replay.
Final compute/mu per seed: no_buffer 1.0 1.1 1.2 1.3 (median 1.15), replay 0.9 1.0 1.0 1.1 (1.0),
replay_lr2 1.0 1.0, slow 1.2 1.2; all 12 runs: median 1.05 (the planner: on-policy, gamma 1).
pass@k at step 20: median P[k] (+0.05 for replay, -0.05 for lr2 and slow), 4 seeds offset
(-0.05, -0.01, 0.01, 0.05): IQR -+ 0.02. The paper's pass@1 (T=0.1), eval/pass_at_1_t01: 0.25 at
step 0, 0.58 + the same shift and offsets at step 20, and for replay also 0.70 (+ offsets) at
step 10, so its maximum over training (0.70) is not its final value (0.63).
LanceDB: replay seeds 0 and 1 each hold test_analysis's run-a tables (32 rollouts, 22 uses),
so the pooled histograms are twice test_analysis's; the other children have none.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flows import report as report_cli
from replay_pipeline.reports import evidence, report
from replay_pipeline.buffer import RolloutStore
from replay_pipeline.buffer.schema import rows_to_table
from replay_pipeline.buffer.usage import UsageStore
from tests.integration.test_analysis import rollout_rows, usage_table

REPO = Path(__file__).resolve().parents[2]
NAME, SWEEP_ID = "sw", "abc123"
EVALS = [0, 5, 10, 15, 20]
ROUNDS = 20
P = {1: 0.5, 2: 0.6, 4: 0.68, 8: 0.74, 16: 0.8}
PAPER_PASS1 = 0.58  # eval/pass_at_1_t01 at step 20, before the shift
OFFSETS = {4: [-0.1, -0.02, 0.02, 0.1], 2: [-0.02, 0.02]}
CONFIGS = {  # medians, tokens/round per seed, seconds/round, gen/train rollouts per round, mu per seed, pass shift
    "no_buffer": ([0.3, 0.5, 0.6, 0.55, 0.5], [100] * 4, 2.0, (64, 64), [1.0, 1.1, 1.2, 1.3], 0.0),
    "replay": ([0.3, 0.55, 0.62, 0.65, 0.6], [45, 49, 51, 60], 1.5, (32, 128), [0.9, 1.0, 1.0, 1.1], 0.05),
    "replay_lr2": ([0.3, 0.45, 0.58, 0.61, 0.5], [40, 40], 1.2, (32, 128), [1.0, 1.0], -0.05),
    "slow": ([0.3, 0.4, 0.45, 0.5, 0.52], [100, 100], 2.0, (64, 64), [1.2, 1.2], -0.05),
}
OVERRIDES = {"no_buffer": ["experiment=no_buffer"], "replay": ["experiment=replay"],
             "replay_lr2": ["experiment=replay", "algo.lr=2e-4"],
             "slow": ["experiment=replay", "buffer.capacity=4096"], "broken": ["buffer.capacity=1"]}
PROJECTED = "projected at mu=5.28 (GPU-scale projection)"


def run_id(config: str, seed: int) -> str:
    return f"{NAME}-{config}-s{seed}-{SWEEP_ID}"


def child_metrics(config: str, k: int) -> list[tuple[str, float, int]]:
    """(key, value, step) of seed index k of config."""
    medians, tokens, seconds, (gen, train), mus, shift = CONFIGS[config]
    off = OFFSETS[len(tokens)][k]
    out = []
    for s in range(ROUNDS):  # round s's ledger, logged at step s, covers s + 1 rounds
        n = s + 1
        out += [("compute/gen_tokens", tokens[k] * n, s), ("compute/gen_rollouts", gen * n, s),
                ("compute/train_rollouts", train * n, s), ("compute/gen_seconds", seconds * n / 2, s),
                ("compute/train_seconds", seconds * n / 2, s), ("compute/gen_train_seconds", seconds * n, s),
                ("compute/mu", mus[k], s), ("learn/entropy", 1.0 - 0.01 * s + off, s),
                ("buffer/staleness_mean", 1.0, s)]
    for step, m in zip(EVALS, medians):
        out += [("eval/accuracy", m + off, step), ("eval/sample_entropy", 0.8 - 0.01 * step + off, step)]
    for key, value in P.items():
        out += [(f"eval/pass_at_{key}", 0.2, 0), (f"eval/pass_at_{key}", value + shift + off / 2, ROUNDS)]
    if (config, k) == ("replay_lr2", 1):  # resumed at step 10 over 2 stored steps of 32 rollouts
        out += [("compute/gen_untimed_rollouts", 0.0 if s < 10 else 64.0, s) for s in range(ROUNDS)]
    out += [("eval/pass_at_1_t01", 0.25, 0), ("eval/pass_at_1_t01", PAPER_PASS1 + shift + off / 2, ROUNDS)]
    if config == "replay":
        out.append(("eval/pass_at_1_t01", 0.70 + off / 2, 10))
    return out


def make_child(client, experiment: str, parent: str, root: Path, config: str, k: int) -> str:
    from mlflow.entities import Metric, Param

    rid = run_id(config, k)
    tags = {"mlflow.parentRunId": parent, "replay_pipeline.run_id": rid}
    if (config, k) == ("replay", 0):  # what flows.train tags; seed 1 is found from tracking.root_dir
        tags["replay_pipeline.lancedb_uri"] = str(root / "lancedb")
    run = client.create_run(experiment, run_name=rid, tags=tags)
    params = {"run_id": rid, "tracking.root_dir": str(root), "algo.lr": "1e-4", "loop.prompts_per_step": 8,
              "loop.steps": ROUNDS, "loop.group_size": 8, "loop.minibatch_size": 64}
    metrics = [Metric(key, float(v), 2, step) for key, v, step in child_metrics(config, k)]
    if (config, k) == ("no_buffer", 0):  # a stale value from before a resume: the later one wins
        metrics.append(Metric("eval/accuracy", 0.0, 1, 10))
    for i in range(0, len(metrics), 1000):
        client.log_batch(run.info.run_id, metrics=metrics[i:i + 1000],
                         params=[Param(a, str(b)) for a, b in params.items()] if i == 0 else [])
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def make_tables(root: Path, rid: str) -> None:
    """test_analysis's run-a tables for run `rid`, written with the project's stores."""
    uri = root / "lancedb"
    store = RolloutStore.create(uri, rid)
    for step in range(4):
        store.append(rows_to_table(rollout_rows(rid, step)))
    UsageStore.create(uri, rid).record(usage_table(rid))


def start_cli(*args: str) -> subprocess.Popen:
    # PREFECT_HOME comes from tests/conftest.py, so flows/__init__ creates nothing in the repo.
    env = {k: v for k, v in os.environ.items() if k != "REPLAY_PIPELINE_ROOT"}
    return subprocess.Popen([sys.executable, "-m", "flows.report", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def make_parent(client, experiment: str, record: dict) -> str:
    run = client.create_run(experiment, run_name=f"{NAME}-{SWEEP_ID}",
                            tags={"replay_pipeline.sweep": NAME, "replay_pipeline.sweep_id": SWEEP_ID})
    client.log_dict(run.info.run_id, record, "sweep.json")
    client.set_terminated(run.info.run_id)
    return run.info.run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("report")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("replay-pipeline", artifact_location=(root / "mlartifacts").as_uri())
    cli = start_cli("f" * 32, "--mlflow-uri", uri)  # ~5 s of imports, overlapping the set-up below
    parent = client.create_run(experiment, run_name=f"{NAME}-{SWEEP_ID}",
                               tags={"replay_pipeline.sweep": NAME, "replay_pipeline.sweep_id": SWEEP_ID})
    pid = parent.info.run_id
    children = []
    for config, spec in CONFIGS.items():
        for k in range(len(spec[1])):
            children.append({"config": config, "seed": k, "run_id": run_id(config, k), "status": "FINISHED",
                             "mlflow_run_id": make_child(client, experiment, pid, root, config, k),
                             "overrides": ["loop.steps=20", *OVERRIDES[config], f"seed={k}",
                                           f"run_id={run_id(config, k)}"]})
    children.append({"config": "broken", "seed": 0, "run_id": run_id("broken", 0), "status": "FAILED",
                     "error": "ConfigError: too small", "overrides": ["loop.steps=20", *OVERRIDES["broken"]]})
    record = {"name": NAME, "sweep_id": SWEEP_ID, "mlflow_run_id": pid, "children": children,
              "families": {"replay_lr2": "replay"}}
    client.log_dict(pid, record, "sweep.json")
    client.set_terminated(pid, status="FAILED")
    for k in (0, 1):
        make_tables(root, run_id("replay", k))
    no_baseline = make_parent(client, experiment, {**record, "baseline": "broken"})
    return {"root": root, "uri": uri, "client": client, "parent": pid, "no_baseline": no_baseline,
            "child": children[0]["mlflow_run_id"], "cli": cli}


@pytest.fixture(scope="module")
def built(store):
    return report.build_report(store["uri"], store["parent"], root=store["root"])


@pytest.fixture(scope="module")
def at_target(store, tmp_path_factory):
    """The sweep's report at the stated target 0.55, which the baseline's median seed reaches
    (at the baseline's median peak it does not, and no per-seed ratio exists)."""
    return report.build_report(store["uri"], store["parent"], target=0.55, out=tmp_path_factory.mktemp("at-target"))


def cells(table: str, config: str) -> list[str]:
    row = next(line for line in table.splitlines() if line.startswith(f"| {config} "))
    return [c.strip() for c in row.strip("|").split("|")]


# ------------------------------------------------------------------ the numbers
def test_table_values(built):
    t = built.table
    header = [c.strip() for c in t.splitlines()[0].strip("|").split("|")]
    assert header == ["config", "runs", "peak acc", "final acc", "final pass@1, T=0.1", "final pass@1, T=1",
                      "final pass@16, T=1",
                      "generated tokens to baseline peak", "ratio", "measured seconds to baseline peak", "ratio",
                      f"{PROJECTED} to baseline peak", "ratio"]
    assert cells(t, "no_buffer") == ["no_buffer (baseline)", "4", "0.600", "0.500", "0.580", "0.500", "0.800",
                                     "1,000", "1.00", "20.0", "1.00", "4,019", "1.00"]
    assert cells(t, "replay") == ["replay", "4", "0.650", "0.600", "0.630", "0.550", "0.850",
                                  "500", "0.50", "15.0", "0.75", "2,970", "0.74"]


def test_the_table_names_the_k_the_runs_sampled(built):
    """Runs that sampled 8 completions a prompt (the smollm2 grid) show final pass@8, not an
    empty pass@16 column."""
    summary = copy.deepcopy(built.summary)
    for c in summary["configs"].values():
        c["final_pass_at_k"] = {k if k != 16 else 8: v for k, v in c["final_pass_at_k"].items()}
    t = report._table(summary)
    header = [c.strip() for c in t.splitlines()[0].strip("|").split("|")]
    assert header[4:7] == ["final pass@1, T=0.1", "final pass@1, T=1", "final pass@8, T=1"]
    assert cells(t, "replay")[4:7] == ["0.630", "0.550", "0.850"]
    assert cells(t, "replay_lr2") == ["replay_lr2", "2", "0.610", "0.500", "0.530", "0.450", "0.750",
                                      "600", "0.60", "18.0", "0.90", "4,454", "1.11"]
    assert cells(t, "slow")[7:] == ["not reached", "-"] * 3
    assert "| broken" not in t  # no finished run


def test_the_papers_pass1_at_temperature_0_1_is_read_its_way(built):
    """eval/pass_at_1_t01, the paper's pass@1, is in the table (its final median) and under Per
    configuration as the paper reads it: the maximum over training of the median curve (replay's
    0.70 at step 10, above its final 0.63), with the IQR at that step."""
    replay = built.summary["configs"]["replay"]
    assert replay["max_pass1_t01"] == pytest.approx({"step": 10, "median": 0.70, "q25": 0.68, "q75": 0.72})
    assert replay["final_pass1_t01"] == pytest.approx({"step": 20, "median": 0.63, "q25": 0.61, "q75": 0.65})
    assert built.summary["configs"]["no_buffer"]["max_pass1_t01"]["step"] == 20
    details = built.path.read_text().split("## Per configuration")[1]
    header = [c.strip() for c in details.strip().splitlines()[0].strip("|").split("|")]
    assert header[4:6] == ["pass@1, T=0.1", "pass@1"]
    assert cells(details, "replay (max)")[4] == "0.700 [0.680, 0.720] (step 10)"
    assert cells(details, "replay (final)")[4] == "0.630 [0.610, 0.650] (step 20)"


def test_runs_resumed_over_stored_steps_are_named_with_their_untimed_rollouts(built):
    notes = [n for n in built.summary["notes"] if n.startswith("Measured seconds of")]
    assert notes == ["Measured seconds of 1 run(s) leave out the generation of rollouts a resume read back from the "
                     "store (replay_lr2 seed 1: 64): a stopped process generated them and its seconds went with it; "
                     "generated tokens, rollouts and the projection count them."]
    assert notes[0] in built.path.read_text()


def test_summary_numbers(built):
    s = built.summary
    assert s["baseline"]["peak_accuracy"] == pytest.approx(0.6) and s["baseline"]["peak_step"] == 10
    assert s["baseline"]["compute_at_peak"] == pytest.approx({"tokens": 1000, "seconds": 20, "projected": 4019.2})
    replay = s["configs"]["replay"]
    assert replay["to_baseline_peak"]["tokens"] == pytest.approx({"step": 10, "compute": 500, "ratio": 0.5})
    assert replay["to_baseline_peak"]["projected"]["ratio"] == pytest.approx(2969.6 / 4019.2)
    assert replay["peak_accuracy"] == pytest.approx({"median": 0.65, "q25": 0.61, "q75": 0.69})
    assert replay["final_pass_at_k"][16] == pytest.approx({"step": 20, "median": 0.85, "q25": 0.83, "q75": 0.87})
    assert s["configs"]["replay_lr2"]["peak_accuracy"] == pytest.approx({"median": 0.61, "q25": 0.6, "q75": 0.62})
    assert s["configs"]["slow"]["to_baseline_peak"] == {"tokens": None, "seconds": None, "projected": None}
    assert (s["configs"]["no_buffer"]["final_mu"], replay["final_mu"]) == pytest.approx((1.15, 1.0))
    # the stale step-10 value (0.0, logged earlier) lost to the later one
    nb = {r["step"]: r for r in s["curves"]["no_buffer"]}
    assert nb[10]["eval/accuracy/median"] == pytest.approx(0.6) and nb[10]["n"] == 4
    assert nb[10]["tokens/median"] == 1000 and nb[0]["tokens/median"] == 0
    assert s["best"]["config"] == "replay"
    assert any("broken seed 0" in n and "FAILED" in n for n in s["notes"])


def test_frontier_per_family(built):
    f = built.summary["frontiers"]
    assert set(f) == {"no_buffer", "replay", "slow"} and f["replay"]["configs"] == ["replay", "replay_lr2"]
    points = f["replay"]["tokens"]["points"]
    # Labels exactly, numbers approximately: pytest.approx takes only flat numeric sequences
    # (pytest 9.2 refuses nested ones), so the two are compared apart.
    assert [(p["config"], p["step"]) for p in points] == [
        ("replay", 0), ("replay_lr2", 5), ("replay", 5), ("replay_lr2", 10), ("replay", 10), ("replay", 15)]
    assert [p["compute"] for p in points] == pytest.approx([0, 200, 250, 400, 500, 750])
    reach = f["replay"]["tokens"]["to_baseline_peak"]
    assert reach["config"] == "replay"
    assert (reach["compute"], reach["ratio"]) == pytest.approx((500, 0.5))
    assert f["slow"]["seconds"]["to_baseline_peak"] is None


def test_best_config_is_chosen_on_projected_compute_with_ties_inside_one_interval():
    def c(tokens, projected, resolution=10.0, family=None):
        ev = {"tokens": {"median": tokens, "resolution": resolution},
              "projected": {"median": projected, "resolution": resolution}}
        return {"evidence": ev} | ({"family": family} if family else {})

    configs = {"base": c(100, 100), "a": c(50, 90), "b": c(60, 70), "c": c(40, 75), "d": c(None, None)}
    assert report.best_config(configs, "base") == ("b", ["c"])  # c is 5 away: inside one interval of 10
    assert report.best_config({**configs, "c": c(40, 85)}, "base") == ("b", [])
    assert report.best_config({"base": c(1, 1)}, "base") == (None, [])
    # The baseline's learning-rate variants are on-policy runs, never "the best buffer configuration".
    assert report.best_config({**configs, "base-lrx2": c(1, 1, family="base")}, "base") == ("b", ["c"])


def test_per_seed_crossings_at_the_baselines_peak(built):
    """Target 0.6 (the baseline's median peak at step 10, not its last evaluation). Baseline
    seeds: never, never, 900 (0.52 at 500 -> 0.62 at 1000), 500 (0.6 at step 5): the median seed
    does not reach it, so no ratio exists; the report says so rather than inventing one."""
    s = built.summary
    assert s["target"] == {"accuracy": pytest.approx(0.6), "source": "the baseline's median peak",
                           "baseline_still_rising": False}
    base = s["configs"]["no_buffer"]["evidence"]["tokens"]
    assert base["per_seed"] == {"0": None, "1": None, "2": pytest.approx(900), "3": pytest.approx(500)}
    assert (base["median"], base["reached"], base["seeds"]) == (None, 2, 4)
    replay = s["configs"]["replay"]["evidence"]["tokens"]
    assert replay["per_seed"] == {"0": None, "1": pytest.approx(490), "2": pytest.approx(255 + 255 * 3 / 7),
                                  "3": pytest.approx(240)}
    assert replay["median"] == pytest.approx((490 + 255 + 255 * 3 / 7) / 2)
    assert replay["ratio"]["ratio"] is None and replay["ratio"]["high"] is None
    assert replay["resolution"] == pytest.approx(50 * 5)  # 5 rounds between evaluations at the median seed's 50 tokens a round
    assert s["configs"]["replay"]["design"] == {"R": 64, "B": 64, "K": 2, "replay_ratio": 2.0,
                                                "gamma": pytest.approx((1 + 5.28 / 2) / 6.28), "gamma_mu": 5.28}
    assert s["best"]["config"] == "replay" and s["best"]["ties"] == [] and s["best"]["chosen_by"] == "projected"
    md = built.path.read_text()
    assert "## Per-seed crossings" in md and "Target: accuracy 0.600 (the baseline's median peak)" in md
    assert "| replay | 2.00 | 0.58 | 3/4 |" in md and "still rising" not in md
    assert "**No ratio**: only 2 of the baseline's 4 seeds reach the target" in md
    # the answer comes first: the figure, then why there is no ratio
    glance = md.split("## At a glance", 1)[1].split("## What was swept", 1)[0]
    assert "![held-out accuracy against generated tokens" in glance and "(accuracy_vs_tokens.png)" in glance
    assert "No ratio: only 2 of the baseline's 4 seeds reach the target 0.600" in glance


def test_the_report_opens_with_the_figure_and_the_best_ratio(at_target):
    """At a stated target the baseline's median seed gets there: the glance names the best
    configuration with its token ratio and interval, under the accuracy-tokens figure."""
    built = at_target
    md = built.path.read_text()
    assert md.index("## At a glance") < md.index("## What was swept") < md.index("## Plots")
    glance = md.split("## At a glance", 1)[1].split("## What was swept", 1)[0]
    r = built.summary["best"]["evidence"]["tokens"]["ratio"]
    assert "(accuracy_vs_tokens.png)" in glance and (built.path.parent / "accuracy_vs_tokens.png").stat().st_size > 1000
    assert (f"**replay** reaches the target 0.550 (stated (--target)) with {r['ratio']:.2f} [{r['low']:.2f}, "
            f"{r['high']:.2f}] of the baseline's generated tokens") in glance
    assert "3/4 seeds reach it" in glance or "4/4 seeds reach it" in glance


def test_per_seed_crossings_at_a_stated_target_give_a_ratio_with_an_interval(store):
    """Target 0.55. Baseline seeds: never, 850, 650, 375 -> median 750, q25 581.25. Replay seeds
    (45, 49, 51, 60 tokens a round): 675, 315, 234.6, 180 -> median 274.8, ratio 0.3664."""
    s, _ = report.summarise(report.load(store["uri"], store["parent"]), target=0.55, n_boot=2000)
    base = s["configs"]["no_buffer"]["evidence"]["tokens"]
    assert base["per_seed"] == {"0": None, "1": pytest.approx(850), "2": pytest.approx(650), "3": pytest.approx(375)}
    assert (base["median"], base["q25"], base["q75"]) == (pytest.approx(750), pytest.approx(581.25), None)
    replay = s["configs"]["replay"]["evidence"]["tokens"]
    assert [replay["per_seed"][k] for k in "0123"] == pytest.approx([675, 315, 234.6, 180])
    r = replay["ratio"]
    assert r["ratio"] == pytest.approx((315 + 234.6) / 2 / 750)
    assert r["low"] <= r["ratio"] <= r["high"] and (r["level"], r["n_boot"]) == (0.95, 2000)
    assert s["target"]["source"] == "stated (--target)"


def ratio_cell(r: dict) -> str:
    """The per-seed table's "ratio [95% CI]" cell for a ratio_interval result, written out here."""
    def bound(x: float) -> str:
        return "inf" if x == math.inf else f"{x:.2f}"

    point = "not reached by the median seed" if r["ratio"] is None else f"{r['ratio']:.2f}"
    return f"{point} [{bound(r['low'])}, {bound(r['high'])}]"


def test_the_written_interval_is_ratio_interval_of_the_listed_crossings(at_target):
    """End to end: for every configuration and compute measure, the ratio and interval that
    report.json and report.md's per-seed table give are evidence.ratio_interval (95%, 10,000
    resamples, seed 0) of the per-seed crossings report.json lists for that configuration and for
    the baseline, in the order it lists them (an infinite bound is null in report.json, "inf"
    in report.md). Pins the report's wiring: which crossings go in, on which side, with which
    level and resamples, and how the bounds are written."""
    data = json.loads((at_target.path.parent / "report.json").read_text())
    per_seed_table = at_target.path.read_text().split("## Per-seed crossings", 1)[1].split("\n## ", 1)[0]
    base = data["configs"][data["baseline"]["config"]]["evidence"]
    assert set(data["configs"]) == {"no_buffer", "replay", "replay_lr2", "slow"}
    for name, c in data["configs"].items():
        row = cells(per_seed_table, name)
        for i, key in enumerate(("tokens", "seconds", "projected")):
            written = c["evidence"][key]["ratio"]
            r = evidence.ratio_interval(list(c["evidence"][key]["per_seed"].values()),
                                        list(base[key]["per_seed"].values()), n_boot=10_000, seed=0)
            assert (r["level"], r["n_boot"], r["seed"]) == (0.95, 10_000, 0)
            assert written == {k: None if isinstance(v, float) and math.isinf(v) else v for k, v in r.items()}
            assert row[5 + 2 * i] == ratio_cell(r), (name, key)
    replay = data["configs"]["replay"]["evidence"]["tokens"]["ratio"]  # a bound of each kind is checked
    assert replay["low"] < replay["ratio"] < replay["high"] < math.inf
    assert base["tokens"]["ratio"]["high"] is None and "| slow | 2.00 | 0.58 | 0/2 |" in per_seed_table


def test_the_interval_does_not_depend_on_the_order_sweep_json_lists_the_runs(store):
    """The bootstrap draws seed indices, so the interval is a function of the per-seed crossings
    only if they are resampled in one order: the report resamples them in seed order, the order
    report.json lists them. The same runs listed the other way round in sweep.json (run in
    another order, or shards named in another order) give the same intervals."""
    sweep = report.load(store["uri"], store["parent"])
    flipped = dataclasses.replace(sweep, children=sweep.children[::-1])
    ahead, _ = report.summarise(sweep, target=0.55, n_boot=2000)
    behind, _ = report.summarise(flipped, target=0.55, n_boot=2000)
    for name in ahead["configs"]:
        for key in ("tokens", "seconds", "projected"):
            assert behind["configs"][name]["evidence"][key] == ahead["configs"][name]["evidence"][key], (name, key)


def test_markdown_report(built):
    md = built.path.read_text()
    assert built.path.name == "report.md"
    # At the baseline's median peak the median baseline seed never gets there: no per-seed ratio,
    # and the median-curve reading beside it.
    for name, ratio in (("generated tokens", "0.50"), ("measured seconds", "0.75"), (PROJECTED, "0.74")):
        line = f"{name}: compute ratio undefined (per-seed crossings); {ratio} read off the median curves"
        assert re.search(f"^{re.escape(line)}$", md, re.M), line
    assert "**Protocol: nothing held out.**" in md  # this sweep.json records no selection seeds
    assert "**replay**" in md and "| replay | replay | `experiment=replay` | 4 |" in md
    assert "Shared overrides: `loop.steps=20`" in md and "Seeds: 0, 1, 2, 3" in md
    assert "median of the final compute/mu of 12 finished runs): 1.05" in md
    assert re.search(r"At the measured mu = 1.05: replay should not pay off.*predicted gamma 1.00.*"
                     r"illustrative defaults alpha = 0.25, rho = 0.05", md)
    assert re.search(r"At the GPU-scale projection, mu = 5.28: replay should pay off.*buffer.capacity = 64, "
                     r"loop.updates_per_step = 4, predicted gamma 0.79", md)
    for png in report.PLOTS:
        assert f"]({png})" in md and (built.path.parent / png).stat().st_size > 1000


def test_outputs_and_artifacts(store, built):
    out = built.path.parent
    assert out == store["root"].resolve() / "reports" / f"{NAME}-{SWEEP_ID}"
    data = json.loads((out / "report.json").read_text())
    assert data["configs"]["replay"]["final_pass_at_k"]["1"]["median"] == pytest.approx(0.55)
    assert data["measures"]["projected"]["label"] == PROJECTED
    logged = {f.path for f in store["client"].list_artifacts(store["parent"], "report")}
    assert {f"report/{n}" for n in ("report.md", "report.json", *report.PLOTS)} <= logged


def test_buffer_distributions_pooled_over_seeds(built):
    d = built.summary["distributions"]
    assert set(d) == {"replay"}  # the only config with tables (seeds 0 and 1)
    assert d["replay"]["runs"] == 2 and d["replay"]["staleness"] == {0: 34, 1: 8, 3: 2}
    assert d["replay"]["reuse_count"] == {0: 36, 1: 20, 2: 4, 3: 2, 5: 2}
    assert d["replay"]["steps_since_last_use"] == {0: 2, 1: 10, 2: 2, 3: 2}
    notes = "\n".join(built.summary["notes"])
    assert "replay seed 2: buffer tables not read at" in notes and "unknown run id" in notes
    assert "no_buffer: no seed's LanceDB tables could be read" in notes


# ------------------------------------------------------------------ bad input
def test_unknown_parent_run(store):
    with pytest.raises(report.ReportError, match=rf"no MLflow run '0{{32}}'.*flows.sweep prints it.*"
                                                 rf"Recent sweep parent runs there: .*{store['parent']}"):
        report.build_report(store["uri"], "0" * 32)


def test_run_without_sweep_json(store):
    with pytest.raises(report.ReportError, match=r"has no sweep.json artifact: it is not a sweep's parent run"):
        report.build_report(store["uri"], store["child"])


def test_no_finished_baseline_children(store):
    with pytest.raises(report.ReportError, match=r"no finished runs of the baseline configuration 'broken'.*"
                                                 r"\[.FAILED.\].*finished runs: \[.no_buffer., .replay.*--baseline NAME"):
        report.build_report(store["uri"], store["no_baseline"])


def test_missing_store_and_bad_mu(tmp_path, store):
    with pytest.raises(report.ReportError, match=r"no MLflow store at .*nowhere.*--root DIR"):
        report.tracking_uri(tmp_path / "nowhere")
    with pytest.raises(report.ReportError, match=r"mu=0 must be a finite number > 0"):
        report.build_report(store["uri"], store["parent"], mu=0)


def test_cli_unknown_run_id(store, capsys):
    assert report_cli.main(["f" * 32, "--root", str(store["root"])]) == 2
    assert "error: no MLflow run 'ffff" in capsys.readouterr().err
    out, err = store["cli"].communicate(timeout=120)  # the real process, started by the fixture
    assert store["cli"].returncode == 2 and "error: no MLflow run 'ffff" in err and "Traceback" not in err


def test_max_of_median_pass_at_k_is_read_where_the_median_curve_peaks():
    import pandas as pd

    runs = [pd.DataFrame({"eval/pass_at_16": [0.5, 0.9, 0.7]}, index=[0, 10, 20]),
            pd.DataFrame({"eval/pass_at_16": [0.5, 0.7, 0.7]}, index=[0, 10, 20])]
    curve = report.aggregate(runs)
    peak, final = report._pass_at_k(curve, peak=True)[16], report._pass_at_k(curve)[16]
    assert peak == {"step": 10, "median": pytest.approx(0.8), "q25": pytest.approx(0.75), "q75": pytest.approx(0.85)}
    assert final["step"] == 20 and final["median"] == pytest.approx(0.7)


# ------------------------------------------------------------------ a sweep run in shards
def test_a_sweep_run_in_shards_reports_as_the_whole(store, built, tmp_path):
    """The fixture's sweep split by seed over two stores, as two processes with their own
    roots run it (`flows.sweep --seeds` each): seeds 2-3 of the 4-seed configurations move to
    a second SQLite store. The report over both (--shard) has the whole sweep's table and
    per-seed crossings; shards that are not one grid over disjoint seeds are refused."""
    from mlflow.tracking import MlflowClient

    whole = report.load_sweep(store["client"], store["uri"], store["parent"])
    moved = [c for c in whole["children"] if c["status"] == "FINISHED" and c["seed"] >= 2]
    part_a = {**whole, "sweep_id": "abc124", "children": [c for c in whole["children"] if c not in moved]}
    parent_a = make_parent(store["client"], store["client"].get_run(store["parent"]).info.experiment_id, part_a)
    root_b = tmp_path / "b"
    uri_b = f"sqlite:///{root_b / 'mlflow.db'}"
    root_b.mkdir()
    client_b = MlflowClient(tracking_uri=uri_b)
    exp_b = client_b.create_experiment("replay-pipeline", artifact_location=(root_b / "mlartifacts").as_uri())
    parent_b = client_b.create_run(exp_b, run_name="part-b").info.run_id
    children_b = [{**c, "mlflow_run_id": make_child(client_b, exp_b, parent_b, root_b, c["config"], c["seed"]),
                   "overrides": [*c["overrides"], f"tracking.root_dir={root_b}"]} for c in moved]
    part_b = {**whole, "sweep_id": "abc125", "mlflow_run_id": parent_b, "children": children_b}
    client_b.log_dict(parent_b, part_b, "sweep.json")

    assert built.summary["sweep"]["shards"] is None and " shards (" not in built.path.read_text()  # a whole sweep
    sharded = report.build_report(store["uri"], parent_a, root=store["root"], out=tmp_path / "out",
                                  shards=[(uri_b, parent_b)])
    assert sharded.table == built.table
    for config in ("no_buffer", "replay"):
        assert (sharded.summary["configs"][config]["evidence"]["tokens"]["per_seed"]
                == built.summary["configs"][config]["evidence"]["tokens"]["per_seed"])
    assert [s["sweep_id"] for s in sharded.summary["sweep"]["shards"]] == ["abc124", "abc125"]
    assert "Run in 2 shards (sw-abc124, sw-abc125; parent runs" in sharded.path.read_text()

    other = {**part_b, "children": [{**c, "overrides": [*c["overrides"], "algo.lr=1e-3"]} for c in children_b]}
    client_b.log_dict(parent_b, other, "sweep.json")
    with pytest.raises(report.ReportError, match=r"shard sw-abc125 is not a part of sweep sw-abc124: "
                                                 r"configuration 'no_buffer' is trained with .*algo.lr=1e-3"):
        report.load(store["uri"], parent_a, shards=[(uri_b, parent_b)])
    client_b.log_dict(parent_b, {**part_b, "children": [*children_b, whole["children"][0]]}, "sweep.json")
    with pytest.raises(report.ReportError, match=r"seed 0 in both: shards split the seeds or the configurations"):
        report.load(store["uri"], parent_a, shards=[(uri_b, parent_b)])

    # Split by configuration instead (a grid's controls run apart, on the same seeds): the
    # replay configuration's runs of every seed in the second store, the baseline's in the first.
    by_config = [c for c in whole["children"] if c["config"] == "replay"]
    part_c = {**whole, "sweep_id": "abc126", "children": [c for c in whole["children"] if c not in by_config]}
    parent_c = make_parent(store["client"], store["client"].get_run(store["parent"]).info.experiment_id, part_c)
    parent_d = client_b.create_run(exp_b, run_name="part-d").info.run_id
    children_d = [{**c, "mlflow_run_id": make_child(client_b, exp_b, parent_d, root_b, c["config"], c["seed"]),
                   "overrides": [*c["overrides"], f"tracking.root_dir={root_b}"]} for c in by_config]
    client_b.log_dict(parent_d, {**whole, "sweep_id": "abc127", "mlflow_run_id": parent_d, "children": children_d},
                      "sweep.json")
    split = report.build_report(store["uri"], parent_c, root=store["root"], out=tmp_path / "out-c",
                                shards=[(uri_b, parent_d)])
    assert sorted(split.table.splitlines()) == sorted(built.table.splitlines())  # rows in the shards' order
    assert (split.summary["configs"]["replay"]["evidence"]["tokens"]["per_seed"]
            == built.summary["configs"]["replay"]["evidence"]["tokens"]["per_seed"])

    # One part still running (or stopped part-way): its sweep.json lists the child that has not
    # ended; the whole is an interim report that says so first and how to go on.
    client_b.log_dict(parent_d, {**whole, "sweep_id": "abc127", "mlflow_run_id": parent_d, "children": children_d[:-1],
                                 "pending": ["sw-replay-s3-abc127"]}, "sweep.json")
    interim = report.load(store["uri"], parent_c, shards=[(uri_b, parent_d)])
    assert interim.record["pending"] == ["sw-replay-s3-abc127"]
    assert interim.notes[0] == (
        f"**Interim report**: 1 child run(s) of the sweep have not ended yet (sw-replay-s3-abc127); this report "
        f"reads the {len(whole['children']) - 1} that have. Continue the sweep (python -m flows.sweep ... "
        "--continue abc127) and report again for the final figures.")


def test_a_sweep_read_at_half_its_budget_is_the_sweep_stopped_at_step_10(store, tmp_path):
    """The fixture's baseline and replay runs (4 seeds each) in a store of their own, with pass@k
    also sampled at step 10 (P[k] - 0.1 + shift + offset/2; the baseline's paper pass@1 0.48 +
    offset/2, replay's is the fixture's 0.70 there), read at budget 1/2: every run cut at step 10
    of its 20. Baseline medians 0.3 0.5 0.6 -> peak 0.6 at step 10 as before; replay 0.3 0.55
    0.62 reaches it at step 10 with 500 tokens (0.50); its final accuracy is step 10's 0.62 and
    its final pass@1 0.5 - 0.1 + 0.05 = 0.45 (the baseline's 0.40). Steps 10-19's rounds are
    dropped; budgets that miss an evaluation (or pass@k, or the paper's pass@1) are refused."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    root = tmp_path / "half"
    root.mkdir()
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("replay-pipeline", artifact_location=(root / "mlartifacts").as_uri())
    parent = client.create_run(exp, run_name="half").info.run_id
    children = []
    for config in ("no_buffer", "replay"):
        for k in range(4):
            mid = make_child(client, exp, parent, root, config, k)
            shift, off = CONFIGS[config][5], OFFSETS[4][k]
            client.log_batch(mid, metrics=[Metric(f"eval/pass_at_{key}", value - 0.1 + shift + off / 2, 3, 10)
                                           for key, value in P.items()])
            if config == "no_buffer":  # replay's fixture already logs it at step 10
                client.log_batch(mid, metrics=[Metric("eval/pass_at_1_t01", 0.48 + off / 2, 3, 10)])
            children.append({"config": config, "seed": k, "run_id": run_id(config, k), "status": "FINISHED",
                             "mlflow_run_id": mid, "overrides": ["loop.steps=20", *OVERRIDES[config]]})
    client.log_dict(parent, {"name": NAME, "sweep_id": "half01", "mlflow_run_id": parent, "children": children},
                    "sweep.json")

    half = report.build_report(uri, parent, root=root, budget=0.5)
    assert half.path.parent == root / "reports" / f"{NAME}-half01-budget0.5"
    assert half.artifact_uri.endswith("/report-budget0.5")
    assert cells(half.table, "no_buffer") == ["no_buffer (baseline)", "4", "0.600", "0.600", "0.480", "0.400",
                                              "0.700", "1,000", "1.00", "20.0", "1.00", "4,019", "1.00"]
    assert cells(half.table, "replay") == ["replay", "4", "0.620", "0.620", "0.700", "0.450", "0.750",
                                           "500", "0.50", "15.0", "0.75", "2,970", "0.74"]
    s = half.summary
    assert s["sweep"]["budget"] == {"fraction": 0.5, "cuts": {"no_buffer": 10, "replay": 10}}
    assert s["configs"]["replay"]["final_step"] == 10 and s["distributions"] == {}
    assert "Read at 0.5 of the budget" in half.path.read_text()
    assert any("buffer distributions left out" in n for n in s["notes"])
    cut = report.load(uri, parent, budget=0.5).children[0]
    assert cut.history.index.max() == 10 and cut.history[report.ACCURACY].dropna().index.tolist() == [0, 5, 10]
    assert cut.history["learn/entropy"].dropna().index.max() == 9  # round 10 (logged at step 10) is gone
    whole = report.build_report(uri, parent, root=root)
    assert whole.summary["configs"]["replay"]["final_step"] == 20 and whole.summary["sweep"]["budget"] is None

    with pytest.raises(report.ReportError, match=r"0.25 of its 20 steps is step 5, where it did not log "
                                                 r"eval/pass_at_1_t01, eval/pass_at_1, .*choose a budget that "
                                                 r"lands on an evaluation"):
        report.load(uri, parent, budget=0.25)
    with pytest.raises(report.ReportError, match=r"step 6, where it did not log eval/accuracy"):
        report.load(uri, parent, budget=0.3)
    with pytest.raises(report.ReportError, match=r"must be a fraction in \(0, 1\]"):
        report.build_report(uri, parent, root=root, budget=1.5)
    assert report_cli.main([parent, "--mlflow-uri", uri, "--root", str(root), "--budget", "1/2"]) == 0
    with pytest.raises(SystemExit):
        report_cli.build_parser().parse_args([parent, "--budget", "0"])
