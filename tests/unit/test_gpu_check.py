"""infra/gpu_check.py, the check a lent GPU machine runs (docs/guides/gpus-and-vllm.md, "The GPU
check"), held here to its tiny CPU shape so that the day a GPU is lent, its minutes go to
measuring: the script runs end to end as a process and writes its JSON (every phase timed, mu
finite, the learner's log-probs equal to the generator's), imports nothing a bare torch machine
lacks, builds the published Qwen3-0.6B shape by default (checked on the meta device, nothing
allocated), and its pytest step records outcomes (passed, failed, not run for want of an import)
without ever failing the check."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "infra" / "gpu_check.py"
#: Not on the lent machine (omegaconf and hydra can be carried there, the others cannot).
BLOCKED = ("lancedb", "lance", "prefect", "mlflow", "omegaconf", "hydra", "vllm")
TINY_ARGS = ["--device", "cpu", "--tiny", "--threads", "1"]
#: The tiny float32 run's learner-vs-generator log-prob gap: measured 4.77e-7 on seeds 0-5 (and
#: on 914 tokens at 64 new tokens), exactly one float32 ulp at |log p| in [4, 8) (log 128 = 4.85:
#: a random model's log-probs are near -log V). 1e-5 is about 20 ulps, ten times tighter than the
#: contract suite's 1e-4 for float32 transformers, which it must also pass.
LOGPROB_BOUND = 1e-5

_SHIM = textwrap.dedent("""
    import json, runpy, sys
    BLOCKED = {blocked!r}
    for name in BLOCKED:  # a machine without them: any import of one raises ImportError
        sys.modules[name] = None
    sys.argv = [{script!r}, *{args!r}]
    try:
        runpy.run_path({script!r}, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code
    loaded = sorted(n for n, m in sys.modules.items() if n.split(".")[0] in BLOCKED and m is not None)
    print("SHIM " + json.dumps({{"code": code, "loaded": loaded}}))
""")


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """`python infra/gpu_check.py --device cpu --tiny --no-pytest` as a process, with lancedb,
    prefect, mlflow, omegaconf, hydra and vllm made unimportable, from a folder outside the
    repository (the script finds the library itself): (process, shim's verdict, the JSON)."""
    out = tmp_path_factory.mktemp("gpu-check")
    code = _SHIM.format(blocked=BLOCKED, script=str(SCRIPT), args=[*TINY_ARGS, "--no-pytest", "--out", str(out)])
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=out, env=env, capture_output=True, text=True,
                          timeout=600)
    shim = [line for line in done.stdout.splitlines() if line.startswith("SHIM ")]
    assert done.returncode == 0 and shim, done.stdout[-2000:] + done.stderr[-3000:]
    return done, json.loads(shim[-1][5:]), json.loads((out / "gpu_check.json").read_text())


def test_the_tiny_run_exits_0_and_times_every_phase(tiny_run):
    done, shim, report = tiny_run
    assert shim["code"] == 0 and report["status"] == "done" and report["errors"] == []
    phases = report["phases"]
    for name in ("build", "warmup", "generate", "logprobs", "learn"):
        assert phases[name]["seconds"] > 0, name
    gen, learn = phases["generate"], phases["learn"]
    assert gen["rows"] == 4 and gen["generate_calls"] == 1 and gen["gen_batch_size"] == 4
    assert 4 <= gen["generated_tokens"] <= 2 * 2 * 8 and gen["tokens_per_second"] > 0
    assert 0 < gen["model_generate_seconds"] <= gen["seconds"]
    assert learn["steps"] == 1 and learn["minibatch_size"] == 4 and learn["tokens"] == gen["generated_tokens"]
    assert learn["step_metrics"][0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy: same weights
    result = report["result"]
    assert math.isfinite(result["mu"]) and result["mu"] > 0
    assert result["mu"] == pytest.approx(gen["seconds"] / learn["seconds"])
    assert result["mu_paper"] == 6.84
    assert report["pytest"] == {"status": "skipped", "reason": "--no-pytest"}
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["transformers"] and env["device_name"]
    assert "built Qwen3ForCausalLM" in done.stdout and "mu = " in done.stdout


def test_the_learners_logprobs_equal_the_generators(tiny_run):
    gap = tiny_run[2]["phases"]["logprobs"]
    assert gap["tokens"] == tiny_run[2]["phases"]["generate"]["generated_tokens"]
    assert 0 <= gap["mean_abs_diff"] <= gap["max_abs_diff"] < LOGPROB_BOUND


def test_the_tiny_model_is_the_requested_architecture(tiny_run, gpu_check):
    model = tiny_run[2]["model"]
    assert model["class"] == "Qwen3ForCausalLM" and model["dtype"] == "torch.float32" and model["device"] == "cpu"
    assert model["config"] == {"model_type": "qwen3", **gpu_check.TINY_MODEL}
    assert model["config"]["num_hidden_layers"] == 2 and model["config"]["vocab_size"] == 128
    assert model["parameters"] == model["parameters_from_config"]
    assert model["tokenizer"]["size"] == model["config"]["vocab_size"]  # every sampled id decodes


def test_the_script_imports_nothing_a_bare_torch_machine_lacks(tiny_run):
    assert tiny_run[1]["loaded"] == []  # and it ran to the end with them unimportable (the tests above)


def test_the_defaults_are_the_gpu_check_shape_and_qwen3_0p6b(gpu_check):
    args = gpu_check.parse_args([])
    assert (args.device, args.dtype, args.prompts, args.completions, args.max_new_tokens) == (
        "cuda", "bfloat16", 8, 16, 512)
    assert gpu_check.TEMPERATURE == 1.0 and not args.no_pytest
    config = gpu_check.qwen3_config()
    assert gpu_check.config_summary(config) == {  # Qwen/Qwen3-0.6B's published config.json
        "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "rope_theta": 1_000_000}
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):  # the architecture without a byte of weights
        model = Qwen3ForCausalLM(config)
    count = sum(p.numel() for p in model.parameters())
    assert count == gpu_check.parameter_count(config) == 596_049_920  # "0.6B", tied embeddings
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.out_features == 16 * 128 and layer.self_attn.k_proj.out_features == 8 * 128
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tiny = gpu_check.parse_args(["--tiny"])
    assert (tiny.dtype, tiny.prompts, tiny.completions, tiny.max_new_tokens) == ("float32", 2, 2, 8)
    assert gpu_check.parse_args(["--tiny", "--prompts", "3"]).prompts == 3


def test_generation_batches_fit_the_memory_there_is(gpu_check):
    config = gpu_check.qwen3_config()
    need = lambda rows: gpu_check.generation_bytes(rows, 33, 512, config)  # noqa: E731
    gib = gpu_check.GIB
    assert need(128)["gpu"] > 80 * gib and need(128)["host"] > 110 * gib  # one call: too much for an H100
    assert gpu_check.fit_gen_batch(64, 128, need, host_free=120 * gib, gpu_free=76 * gib) == (64, None)
    size, why = gpu_check.fit_gen_batch(128, 128, need, host_free=120 * gib, gpu_free=76 * gib)
    assert size == 64 and "gpu" in why and "host" in why
    size, why = gpu_check.fit_gen_batch(64, 128, need, host_free=60 * gib, gpu_free=None)
    assert size == 32 and "host" in why
    assert gpu_check.fit_gen_batch(64, 4, need, host_free=None, gpu_free=None) == (4, None)


def test_out_of_memory_halves_and_retries(gpu_check):
    tried = []

    def run(size):
        tried.append(size)
        if size > 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 40 GiB")
        return "ran"

    out, size, attempts = gpu_check.halving(run, 16, torch.device("cpu"))
    assert (out, size, tried) == ("ran", 4, [16, 8, 4])
    assert [a["size"] for a in attempts] == [16, 8] and "out of memory" in attempts[0]["error"]
    with pytest.raises(torch.cuda.OutOfMemoryError):
        gpu_check.halving(lambda size: run(99), 2, torch.device("cpu"))


def test_the_contract_suite_runs_with_its_generator_on_the_checks_device(gpu_check, tmp_path):
    # "cpu:0" is not "cpu", so the plugin treats it as another device: share_weights is skipped
    record = gpu_check.run_pytest(gpu_check.PYTEST_RUNS[0], "cpu:0", tmp_path, timeout=300, nodes=[
        "test_refuses_a_prompt_longer_than_the_model[transformers]", "test_share_weights_when_supported[transformers]"])
    assert record["status"] == "passed", record
    assert {k: record["counts"][k] for k in ("passed", "skipped", "failures", "errors")} == {
        "passed": 1, "skipped": 1, "failures": 0, "errors": 0}
    tail = record["output_tail"]
    assert "transformers generator(s) built on ['cpu']" in tail  # the suite's factory was replaced
    assert "cannot alias the suite's CPU model" in tail
    assert (tmp_path / "pytest-contract.xml").exists() and (tmp_path / "pytest-contract.txt").exists()


def test_a_file_whose_imports_fail_there_is_not_run(gpu_check, tmp_path):
    contract = [ROOT / gpu_check.PYTEST_RUNS[0]["file"], ROOT / "tests" / "conftest.py"]
    # on the lent machine the contract suite needs only omegaconf and hydra carried
    assert gpu_check.missing_imports(contract, blocked=("lancedb", "lance", "prefect", "mlflow", "vllm")) == {}
    record = gpu_check.run_pytest(gpu_check.PYTEST_RUNS[1], "cuda", tmp_path, timeout=300, blocked=BLOCKED)
    assert record["status"] == "not run" and "mlflow.tracking" in record["failed_imports"]
    assert "omegaconf" in record["hint"]


def test_failing_tests_are_recorded_and_the_check_still_exits_0(gpu_check, tmp_path, monkeypatch):
    failing = tmp_path / "test_fails.py"
    failing.write_text("def test_fails():\n    assert 1 == 2\n\ndef test_passes():\n    pass\n")
    # its own rootdir: the test names do not depend on where the checkout and the temporary directory are
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    monkeypatch.setattr(gpu_check, "PYTEST_RUNS", (dict(name="fails", file=str(failing), args=[], what="a failure"),))
    out = tmp_path / "out"
    assert gpu_check.main([*TINY_ARGS, "--out", str(out)]) == 0
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["status"] == "done" and report["pytest"]["ok"] is False
    (run,) = report["pytest"]["runs"]
    assert run["status"] == "failed" and run["returncode"] == 1
    assert run["counts"]["failures"] == 1 and run["counts"]["passed"] == 1
    assert run["counts"]["failed_tests"] == ["test_fails::test_fails"]
