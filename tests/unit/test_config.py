"""Every preset composes, overrides land, and invalid configuration fails with a fix."""

from pathlib import Path

import pytest

from replay_pipeline.config import CONF_DIR, ConfigError, load_config

#: Presets that need something from the user (a checkpoint, a data file) or a machine (vLLM on a
#: GPU) compose only with it: alone they must be refused, naming what is missing. Each is composed
#: with what it needs in its own tests (test_math_task.py, test_vllm_backend.py).
NEEDS = {("model", "hf"): "model.path", ("task", "gsm8k"): "task.path", ("task", "math"): "task.path", ("task", "custom"): "task.target",
         ("generator", "vllm"): "vllm", ("experiment", "qwen3_0p6b"): "model.path",
         ("experiment", "qwen3_0p6b_no_buffer"): "model.path", ("task", "reasoning_gym"): "task.dataset=NAME",
         ("task", "chain_sum"): "needs a Hugging Face model"}
GROUP_OPTIONS = [(g.name, f.stem) for g in sorted(CONF_DIR.iterdir()) if g.is_dir()
                 for f in sorted(g.glob("*.yaml"))]


@pytest.mark.parametrize("group,option", GROUP_OPTIONS)
def test_every_preset_composes(group, option, tmp_path):
    if (group, option) in NEEDS:  # refused by validation, or (what needs the machine) by the pre-flight
        from replay_pipeline.run.preflight import preflight

        with pytest.raises(ConfigError, match=NEEDS[group, option]):
            preflight(load_config([f"{group}={option}", f"tracking.root_dir={tmp_path}"]))
        return
    cfg = load_config([f"{group}={option}"])
    assert cfg.loop.steps >= 1


def test_defaults_are_the_replay_buffer():
    cfg = load_config()
    assert cfg.buffer.strategy == "uniform" and cfg.buffer.capacity == 128
    assert cfg.algo.objective == "grpo_clip" and cfg.algo.eps_low == cfg.algo.eps_high == 0.2


def test_overrides_as_users_write_them():
    cfg = load_config(["buffer.capacity=512", "algo.lr=3e-4"])
    assert cfg.buffer.capacity == 512 and cfg.algo.lr == pytest.approx(3e-4)


@pytest.mark.parametrize("preset", [["experiment=no_buffer"], ["buffer=none"],
                                    ["buffer=none", "loop.prompts_per_step=4"]])
def test_no_buffer_preset(preset):
    cfg = load_config(preset)
    assert cfg.buffer.strategy == "fresh"
    assert cfg.loop.updates_per_step * cfg.loop.minibatch_size == cfg.loop.prompts_per_step * cfg.loop.group_size


@pytest.mark.parametrize("overrides,needle", [
    (["buffer.capacitty=3"], "buffer.capacitty"),
    (["buffer=bogus"], "Available options"),
    (["loop.minibatch_size=60"], "multiple of loop.group_size"),
    (["buffer.capacity=32"], "below one minibatch"),
    (["model=hf"], "model.path"),
    (["buffer=none", "loop.updates_per_step=2"], "exactly once"),
    (["algo.objective=ppo"], "algo.objective"),
    (["algo.lr=abc"], "algo.lr"),
    (["algo.entropy_coef=-0.01"], "algo.entropy_coef=-0.01 must be >= 0"),
    (["loop.group_size=1"], "at least two completions"),
    (["run_id=bad/name"], "run_id"),
    (["resume=bad/name"], "resume="),
    (["fork=some-run"], "<run_id>@<step>"),
    (["fork=some-run@x"], "<run_id>@<step>"),
    (["learner.shard=fsdp2"], "learner.world_size=1 has one; add learner.world_size=2"),
    (["learner.world_size=2", "learner.shard=zero3"], "learner.shard='zero3' is not one of [None, 'fsdp2']"),
])
def test_invalid_configuration_says_how_to_fix(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    assert needle in str(err.value)


@pytest.mark.parametrize("path,needle", [("/definitely/not/here", "not a directory"), (None, "config.json")])
def test_a_model_path_that_is_no_checkpoint_is_refused_before_any_work(tmp_path: Path, path, needle):
    """Valid as configuration; the pre-flight, which looks at the disk, refuses it."""
    from replay_pipeline.run.preflight import preflight

    cfg = load_config([f"model.path={path or tmp_path}", f"tracking.root_dir={tmp_path / 'runs'}"])
    with pytest.raises(ConfigError, match=needle):
        preflight(cfg)


def test_every_field_is_documented():
    """cleanrl style: every config field has a docstring right under its declaration."""
    import ast
    import inspect

    import replay_pipeline.config.schema as config

    tree = ast.parse(inspect.getsource(config))
    undocumented = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.endswith("Config") and node.name != "Config":
            body = node.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign):
                    nxt = body[i + 1] if i + 1 < len(body) else None
                    if not (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
                        undocumented.append(f"{node.name}.{stmt.target.id}")
    assert not undocumented, undocumented


def test_a_plus_override_of_a_key_the_schema_lacks_is_refused_with_the_nearest_key():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) loop.setps \(did you mean loop.steps\?\)"):
        load_config(["+loop.setps=5"])
    # the free-form sections still take any key
    cfg = load_config(["buffer.uri=s3://bucket/prefix", "buffer.storage_options.region=eu-west-1"])
    assert cfg.buffer.storage_options.region == "eu-west-1"


def test_a_value_of_the_wrong_type_says_which_type_is_expected():
    with pytest.raises(ConfigError, match="'abc' of type 'str' could not be converted to Float"):
        load_config(["algo.lr=abc"])
