"""Checkpoint helpers that need no model: RNG states survive JSON, the manifest catches
damage, crash points are inert unless asked for."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from replay_pipeline.training import checkpoints

from replay_pipeline.system import faults
from replay_pipeline.training.checkpoints import CheckpointError
from replay_pipeline.run.resume import RESUMABLE, config_hash
from replay_pipeline.config import flatten, load_config
from tests.conftest import ROOT


def test_rng_states_round_trip_through_json():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.normal(), torch.rand(3)  # leave a cached gaussian around
    state = json.loads(json.dumps(checkpoints.capture_rng()))
    expected = (random.random(), np.random.normal(), torch.rand(4))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    checkpoints.restore_rng(state)
    got = (random.random(), np.random.normal(), torch.rand(4))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


class _Saveable:
    def __init__(self, payload: bytes):
        self.payload = payload

    def save_pretrained(self, path):
        path.mkdir(parents=True, exist_ok=True)
        (path / f"{type(self).__name__}.bin").write_bytes(self.payload)


class _Tokenizer(_Saveable):
    pass


class _Optimizer:
    def state_dict(self):
        return {"state": {}, "param_groups": [{"lr": 0.1}]}


def _save(directory, step, keep=3):
    return checkpoints.save_checkpoint(directory, step, _Saveable(b"w" * 100), _Tokenizer(b"t"), _Optimizer(),
                                       {"policy_version": step}, keep=keep)


def test_manifest_detects_damage_and_latest_valid_falls_back(tmp_path):
    for step in (2, 4, 6, 8):
        _save(tmp_path, step)
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == ["step-000004", "step-000006", "step-000008"]
    path, state = checkpoints.latest_valid(tmp_path)
    assert path.name == "step-000008" and state["policy_version"] == 8 and state["format"] == 2
    (path / "model" / "_Saveable.bin").write_bytes(b"x" * 100)  # same size, other bytes
    with pytest.raises(CheckpointError, match="checksum"):
        checkpoints.verify(path)
    with pytest.warns(UserWarning, match="step-000008"):
        assert checkpoints.latest_valid(tmp_path)[0].name == "step-000006"
    assert checkpoints.latest_valid(tmp_path, at_step=4)[0].name == "step-000004"
    assert checkpoints.latest_valid(tmp_path, at_step=5) is None


def test_a_killed_write_leaves_no_checkpoint_only_a_temporary_directory(tmp_path):
    _save(tmp_path, 2)

    def die(tmp):
        raise KeyboardInterrupt  # stands in for the kill: nothing after this line runs

    with pytest.raises(KeyboardInterrupt):
        checkpoints.save_checkpoint(tmp_path, 4, _Saveable(b"w"), _Tokenizer(b"t"), _Optimizer(), {}, keep=3,
                                    before_rename=die)
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == ["step-000002"]
    removed = checkpoints.remove_partial(tmp_path)
    assert [p.name.rsplit("-", 1)[0] for p in removed] == [".tmp-step-000004"]
    assert not list(tmp_path.glob(".tmp-*"))


def _crash_points(spec: str | None, *calls: tuple[str, int]) -> subprocess.CompletedProcess:
    """Call faults.crash_point(*call) for each call in a child process with the crash spec set
    (or unset): a crash kills the child, never pytest, so the test can fail and say so."""
    env = {k: v for k, v in os.environ.items() if k != faults.ENV} | ({faults.ENV: spec} if spec else {})
    code = ("import sys; from replay_pipeline.system import faults\n"
            f"for point, step in {list(calls)!r}:\n"
            "    faults.crash_point(point, step)\n"
            "print('survived', flush=True)")
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_crash_point_is_inert_unless_named():
    for spec in (None, "generate:2"):
        done = _crash_points(spec, ("generate", 1), ("after_append", 2))
        assert done.returncode == 0 and done.stdout.strip() == "survived", (spec, done.returncode, done.stderr)


def test_a_named_crash_point_kills_with_sigkill():
    done = _crash_points("after_append:2", ("generate", 2), ("after_append", 2), ("after_append", 3))
    assert done.returncode == -signal.SIGKILL and "survived" not in done.stdout


def test_config_hash_ignores_only_what_a_resume_may_change():
    base = load_config([])
    assert config_hash(base) == config_hash(load_config(["loop.steps=7", "tracking.progress=false", "run_id=x"]))
    assert config_hash(base) != config_hash(load_config(["algo.lr=0.1"]))
    assert config_hash(base) != config_hash(load_config(["seed=1"]))
    assert "loop.steps" in RESUMABLE and "algo.lr" not in RESUMABLE


def test_config_hash_over_a_saved_runs_keys_ignores_fields_added_since():
    from omegaconf import OmegaConf

    cfg = load_config([])
    saved = OmegaConf.to_container(cfg, resolve=True)
    del saved["generator"]["gpu_memory_utilization"]  # a field a run saved before it existed lacks
    stored = config_hash(saved)  # what that run's checkpoints carry
    assert config_hash(cfg) != stored
    assert config_hash(cfg, keys=flatten(saved)) == stored
    changed = load_config(["algo.lr=0.1"])
    assert config_hash(changed, keys=flatten(saved)) != stored  # a real change still shows
