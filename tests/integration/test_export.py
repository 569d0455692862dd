"""flows.export (issue 25 item 3): curated sets from real runs' tables with a manifest that
reproduces them, read back: correct rollouts as SFT pairs that load as a task data set (the
math task's own loader), preference pairs from groups with a reward gap, filtered rows as
Parquet, and the table as of a checkpoint tag."""

from __future__ import annotations

import json
import shlex

import pyarrow.parquet as pq
import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from flows.export import main as export_cli
from replay_pipeline.run.resume import resolve_config
from replay_pipeline.run.build import build_run
from replay_pipeline.tasks.math import MathTask
from tests.conftest import TINY_OVERRIDES
from tests.integration.test_resume import drive


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    for run_id in ("a", "b"):
        run = build_run(resolve_config([f"tracking.root_dir={root}", *TINY_OVERRIDES, f"run_id={run_id}",
                                        "loop.steps=6", "loop.checkpoint_every=3", "model.torch_threads=1"]),
                        log=lambda _: None)
        drive(run)
        run.finish()
    return root


def test_sft_export_of_two_runs_loads_back_as_a_task_data_set(root, tmp_path, capsys):
    assert export_cli(["a", "b", "--root", str(root), "--kind", "sft", "--output", str(tmp_path / "sft")]) == 0
    manifest = json.loads((tmp_path / "sft" / "manifest.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "sft" / "sft.jsonl").read_text().splitlines()]
    assert manifest["rows"] == len(rows) > 0 and {s["run_id"] for s in manifest["sources"]} == {"a", "b"}
    assert all(s["version"] > 0 for s in manifest["sources"]) and manifest["filters"]["sql"] == "correct = true"
    assert manifest["command"].startswith("python -m flows.export a b")
    # the manifest's load_as_task is a command line a shell and Hydra's override grammar accept as written
    parsed = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(shlex.split(manifest["load_as_task"]))}
    assert parsed["task.prompt_template"] == "{question}" and parsed["task.path"] == str(tmp_path / "sft" / "sft.jsonl")
    task = MathTask(path=str(tmp_path / "sft" / "sft.jsonl"), format="gsm8k", answer_field="reference",
                    prompt_template="{question}", heldout_size=2, validation_size=0)
    prompts = task.heldout_prompts() + task.train_prompts(8, __import__("numpy").random.default_rng(0))
    by_question = {r["question"]: r["answer"] for r in rows}
    for p in prompts:  # each prompt is an exported one, and its exported completion scores as correct
        assert p.text in by_question and task.reward(p, f"#### {by_question[p.text].strip()}", "stop") == 1.0


def test_preference_pairs_rows_as_parquet_and_the_table_as_of_a_tag(root, tmp_path):
    assert export_cli(["a", "--root", str(root), "--kind", "preference", "--gap", "1",
                       "--output", str(tmp_path / "pref")]) == 0
    pairs = [json.loads(line) for line in (tmp_path / "pref" / "preference.jsonl").read_text().splitlines()]
    assert pairs and all(p["chosen_reward"] - p["rejected_reward"] >= 1 and p["chosen"] != p["rejected"] for p in pairs)
    assert export_cli(["a", "--root", str(root), "--kind", "rows", "--versions", "1:2", "--correct", "false",
                       "--columns", "seq,policy_version,correct", "--format", "parquet",
                       "--output", str(tmp_path / "rows")]) == 0
    table = pq.read_table(tmp_path / "rows" / "rows.parquet")
    assert table.column_names == ["seq", "policy_version", "correct"]
    assert set(table.column("policy_version").to_pylist()) <= {1, 2} and not any(table.column("correct").to_pylist())
    assert export_cli(["a", "--root", str(root), "--kind", "rows", "--tag", "step-000003", "--columns", "step",
                       "--output", str(tmp_path / "tagged")]) == 0
    tagged = [json.loads(line) for line in (tmp_path / "tagged" / "rows.jsonl").read_text().splitlines()]
    assert len(tagged) == 3 * 16 and max(r["step"] for r in tagged) == 2  # the buffer as of step 3's checkpoint
    assert json.loads((tmp_path / "tagged" / "manifest.json").read_text())["sources"][0]["tag"] == "step-000003"


def test_bad_exports_are_refused_before_anything_is_written(root, tmp_path, capsys):
    assert export_cli(["nope", "--root", str(root), "--output", str(tmp_path / "x")]) == 2
    assert "no rollout table for run 'nope'" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert export_cli(["a", "--root", str(root), "--kind", "sft", "--correct", "false", "--output", str(tmp_path / "y")]) == 2
    assert "an sft export holds correct rollouts" in capsys.readouterr().err and not (tmp_path / "y").exists()
