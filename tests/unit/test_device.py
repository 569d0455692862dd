"""`model.device`: what validation accepts and refuses, how it resolves, that a resume may
change it, and that an explicit `cpu` learner step is the default one, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch

from replay_pipeline.config import ConfigError, load_config
from replay_pipeline.training.learner import Learner, collate
from replay_pipeline.models.device import device_problem, resolve_device
from replay_pipeline.models.tiny import build_tiny_model, build_tokenizer
from replay_pipeline.run.resume import FORK_FREE, RESUMABLE, config_hash

CUDA = torch.cuda.is_available()


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_default_is_auto_and_resolves_to_the_cpu_without_a_gpu(no_cuda):
    assert load_config([]).model.device == "auto"
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")


def test_auto_here():
    assert resolve_device("auto").type == ("cuda" if CUDA else "cpu")


@pytest.mark.parametrize("name", ["gpu", "CUDA", "cuda:", "cuda:x", "mps:0", ""])
def test_an_unknown_device_is_refused_with_the_fix(name):
    with pytest.raises(ConfigError) as err:
        load_config([f"model.device='{name}'"])
    text = str(err.value)
    assert f"model.device={name!r} is not one of ['auto', 'cpu', 'cuda', 'cuda:N']" in text
    assert "set model.device=auto" in text and "model.device=cpu" in text


@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_refused_saying_how_to_fix(no_cuda, name, tmp_path):
    from replay_pipeline.run.preflight import preflight

    cfg = load_config([f"model.device={name}", f"tracking.root_dir={tmp_path}"])  # valid: the probe is pre-flight's
    with pytest.raises(ConfigError) as err:
        preflight(cfg)
    text = str(err.value)
    assert f"model.device={name} asks for a CUDA GPU" in text and "torch.cuda.is_available() is False" in text
    assert "set model.device=cpu" in text
    with pytest.raises(ValueError, match="set model.device=cpu"):  # where the run itself resolves it
        resolve_device(name)


def test_a_gpu_index_that_is_not_there_is_refused(one_gpu):
    assert device_problem("cuda:0") is None and device_problem("cuda") is None
    problem = device_problem("cuda:3")
    assert "torch sees 1 CUDA device(s) here (cuda:0 to cuda:0)" in problem


def test_device_is_a_hardware_setting_a_resume_or_fork_may_change():
    assert "model.device" in RESUMABLE and "model.device" in FORK_FREE
    assert config_hash(load_config(["model.device=cpu"])) == config_hash(load_config([]))


def _rows(tok):
    prompts = [tok("1+2=")["input_ids"], tok("4+4=")["input_ids"]]
    completions = [tok("3", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
                   tok("9", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    return {"prompt_ids": prompts, "completion_ids": completions,
            "behaviour_logprobs": [[-1.0, -0.5], [-2.0, -0.1]], "advantage": [1.0, -1.0]}


def test_an_explicit_cpu_learner_step_equals_the_default():
    tok = build_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    default = Learner(copy.deepcopy(model), lr=1e-2, pad_id=tok.pad_token_id)
    explicit = Learner(copy.deepcopy(model).to(resolve_device("cpu")), lr=1e-2, pad_id=tok.pad_token_id)
    assert explicit.device == default.device == torch.device("cpu")
    for _ in range(2):
        assert default.step(_rows(tok)) == explicit.step(_rows(tok))
    for (name, a), (_, b) in zip(default.model.state_dict().items(), explicit.model.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_batch_on_the_cpu_keeps_its_tensors():
    tok = build_tokenizer()
    rows = _rows(tok)
    batch = collate(rows["prompt_ids"], rows["completion_ids"], rows["behaviour_logprobs"], rows["advantage"],
                    pad_id=tok.pad_token_id)
    moved = batch.to(torch.device("cpu"))
    assert moved.input_ids is batch.input_ids and moved.advantages is batch.advantages and moved.rewards is None


def test_auto_threads_take_every_core_when_idle_and_one_fewer_per_busy_core():
    import os

    from replay_pipeline.models.device import auto_threads
    cores = len(os.sched_getaffinity(0))
    assert auto_threads(busy=0.1)[0] == cores
    assert auto_threads(busy=1.0) == (max(1, cores - 1), f"1.0 of {cores} cores busy with other processes")
    assert auto_threads(busy=cores + 3.0)[0] == 1  # never fewer than one


def test_busy_cores_sees_a_real_cpu_bound_process():
    import subprocess
    import sys
    import time

    from replay_pipeline.models.device import busy_cores
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        busy = busy_cores(window=1.0)
        assert busy is not None and busy >= 0.8, busy  # one core, kept busy by the other process
    finally:
        spinner.kill()
        spinner.wait()
