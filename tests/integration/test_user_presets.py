"""Your own presets (issue 23 item 1): `--config-dir DIR` puts a directory laid out like conf/
on Hydra's search path, so `task=mine` or `buffer=big` select the user's files, a preset may
name a custom task and its reward terms, the run's config.yaml records the composed values (a
resume does not need the directory), and a missing directory or option is refused (exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from flows.usage import UnknownFlags, command_line
from replay_pipeline.config import ConfigError, load_config
from tests.conftest import ROOT


def _presets(root):
    (root / "task").mkdir(parents=True)
    (root / "buffer").mkdir()
    (root / "experiment").mkdir()
    template = ROOT / "replay_pipeline" / "tasks" / "template.py"
    (root / "task" / "digits.yaml").write_text(
        f"name: custom\ntarget: {template}:make_task\nargs:\n  terms: 3\nheldout_size: 20\nvalidation_size: 20\n")
    (root / "buffer" / "big.yaml").write_text("strategy: uniform\ncapacity: 96\n")
    (root / "experiment" / "shaped.yaml").write_text(
        "# @package _global_\nloop:\n  steps: 7\nreward:\n  terms:\n    brevity:\n"
        f"      target: {template}:make_task\n      weight: -0.1\n")
    return root


def test_a_config_dir_adds_presets_selected_like_the_built_in_ones(tmp_path):
    presets = _presets(tmp_path / "presets")
    other = tmp_path / "more"
    other.mkdir()
    overrides, show = command_line(["--config-dir", str(presets), "task=digits", "--cfg",
                                    f"--config-dir={other}", "buffer=big", "experiment=shaped"])
    assert show and overrides[0] == f"hydra.searchpath=[file://{presets},file://{other}]"
    assert overrides[1:] == ["task=digits", "buffer=big", "experiment=shaped"]
    cfg = load_config(overrides)
    assert cfg.task.name == "custom" and cfg.task.args.terms == 3 and cfg.task.heldout_size == 20
    assert cfg.buffer.capacity == 96 and cfg.loop.steps == 7
    assert cfg.reward.terms.brevity.weight == -0.1
    with pytest.raises(ConfigError, match="--config-dir /no/such: no directory"):
        command_line(["--config-dir", "/no/such"])
    with pytest.raises(UnknownFlags, match=r"unknown flag\(s\) \['--confg-dir'\]"):
        command_line(["--confg-dir", str(presets)])


def test_the_cli_prints_the_composed_preset_and_refuses_a_missing_option(tmp_path):
    presets = _presets(tmp_path / "presets")
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect")}
    shown = subprocess.run([sys.executable, "-m", "flows.train", "--config-dir", str(presets), "task=digits",
                            "buffer=big", f"tracking.root_dir={tmp_path}", "--cfg"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr[-2000:]
    printed = yaml.safe_load(shown.stdout)
    assert printed["task"]["target"].endswith("template.py:make_task") and printed["buffer"]["capacity"] == 96
    assert "hydra" not in printed  # the search path is not part of the run's record
    missing = subprocess.run([sys.executable, "-m", "flows.train", "--config-dir", str(presets), "buffer=huge"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "Could not find 'buffer/huge'" in missing.stderr
    assert "big" in missing.stderr and "fifo" in missing.stderr and "Traceback" not in missing.stderr
