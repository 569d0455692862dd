"""The deployment files (infra/) name flows and flags that exist, and the deploy and sweep
commands refuse bad input before anything is registered or trained."""

from __future__ import annotations

import importlib
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.deploy import ENTRYPOINTS
from replay_pipeline.config import ConfigError
from replay_pipeline.run.resume import resolve_config
from tests.conftest import ROOT


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / "infra" / name).read_text())


def test_prefect_yaml_declares_the_three_flows_at_real_entrypoints():
    spec = load("prefect.yaml")
    deployments = {d["name"]: d for d in spec["deployments"]}
    assert set(deployments) == {"train", "evaluate", "sweep"}
    for name, d in deployments.items():
        assert d["entrypoint"] == ENTRYPOINTS[name]
        path, func = d["entrypoint"].split(":")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        flow = getattr(module, func)
        assert flow.name == name  # a Prefect flow of that name
        assert set(d.get("parameters", {})) <= set(flow.parameters.properties)


def test_compose_runs_the_servers_and_a_deploy_command_the_cli_accepts():
    spec = load("compose.yaml")
    services = spec["services"]
    assert {"prefect-server", "mlflow", "minio", "worker", "deploy"} <= set(services)
    command = shlex.split(services["deploy"]["command"])
    assert command[:3] == ["python", "-m", "flows.deploy"]
    from flows.deploy import main

    with pytest.raises(SystemExit) as exc:  # argparse accepts every flag, then --help exits 0
        main(command[3:] + ["--help"])
    assert exc.value.code == 0
    assert "prefect worker start --pool replay-pipeline" in services["worker"]["command"]
    assert (ROOT / "infra" / "Dockerfile").is_file()


def test_deploy_refuses_to_run_without_a_prefect_server():
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    proc = subprocess.run([sys.executable, "-m", "flows.deploy"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "PREFECT_API_URL is not set" in proc.stderr


@pytest.mark.parametrize("configs,seeds,overrides,message", [
    ({}, [0], [], "no configurations"),
    ({"a": []}, [], [], "no seeds"),
    ({"a": []}, [1, 1], [], "seeds repeat"),
    ({"bad name": []}, [0], [], "letters, digits"),
    ({"a": []}, [0], ["seed=3"], "sets seed and run_id itself"),
    ({"a": ["loop.steps=5"], "b": ["buffer.capacity=-1"]}, [0], [], "configuration 'b'"),
    ({"a": ["algo.nope=1"]}, [0], [], "configuration 'a'"),
])
def test_sweep_plan_refuses_bad_input_naming_it(configs, seeds, overrides, message):
    from flows.sweep import plan

    with pytest.raises(ConfigError, match=message):
        plan(configs, seeds, overrides, "s", "x")


def test_sweep_plan_gives_every_child_its_seed_and_run_id():
    from flows.sweep import plan

    children = plan({"a": ["buffer.capacity=64"], "b": []}, [0, 3], ["loop.steps=5"], "s", "x1")
    assert [(c.config, c.seed, c.run_id) for c in children] == [
        ("a", 0, "s-a-s0-x1"), ("a", 3, "s-a-s3-x1"), ("b", 0, "s-b-s0-x1"), ("b", 3, "s-b-s3-x1")]
    assert children[0].overrides == ["loop.steps=5", "buffer.capacity=64", "seed=0", "run_id=s-a-s0-x1"]


def test_sweep_cli_exits_2_before_any_work(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flows.sweep", "--config", "a=buffer.capacity=0",
                           f"tracking.root_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "configuration 'a'" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_sweep_grids_validate_and_settle_takes_what_is_given():
    from flows.sweep import GRIDS, plan, settle

    for name, grid in GRIDS.items():  # every child of every built-in grid composes and validates
        configs, seeds, overrides, factors = settle(name, None, None, None, None)
        assert (configs, seeds, factors) == (grid.configs, grid.seeds, grid.lr_factors)
        assert len(plan(configs, seeds, overrides, name, "x")) == len(configs) * len(seeds)
    assert "no_buffer" in GRIDS["default"].configs and len(GRIDS["default"].seeds) >= 4
    # the headline grid: the default grid's configurations of the same names and the controls, at
    # 10 confirmation seeds disjoint from the seeds that chose them
    head, default = GRIDS["headline"], GRIDS["default"]
    assert len(head.seeds) == 10 and not set(head.seeds) & set(head.selection["seeds"]) and head.lr_factors == []
    assert set(head.selection["seeds"]) == set(default.seeds)
    assert head.overrides == default.overrides and "no_buffer" in head.configs
    assert {"no_buffer_r32", "onpolicy_prio_r32_b32"} <= set(head.configs)
    assert all(default.configs[name] == extra for name, extra in head.configs.items() if name in default.configs)
    # the long grid: headline runs at three times the budget, evaluated as often per rollout
    long = GRIDS["long"]
    assert "no_buffer" in long.configs and len(long.configs) >= 2 and long.lr_factors == []
    assert {"no_buffer_r32", "onpolicy_prio_r32_b32"} <= set(long.configs)
    assert all(head.configs[name] == extra for name, extra in long.configs.items())
    assert long.seeds == head.seeds and not set(long.seeds) & set(long.selection["seeds"])
    assert len(long.overrides) == len(default.overrides)
    assert all(o == d or o.startswith("loop.steps=") for o, d in zip(long.overrides, default.overrides))
    assert resolve_config(long.overrides).loop.steps == 3 * resolve_config(default.overrides).loop.steps
    configs, seeds, overrides, factors = settle(None, {"a": []}, None, ["loop.steps=3"], None)
    assert (configs, seeds, overrides, factors) == ({"a": []}, [0, 1], ["loop.steps=3"], [])
    # the quick grid: the baseline against the best configuration on an odd number of held-out seeds
    quick = GRIDS["quick"]
    assert set(quick.configs) == {"no_buffer", "posbias_prio512_r32_b32"}
    assert len(quick.seeds) % 2 == 1 and len(quick.seeds) >= 3 and not set(quick.seeds) & set(quick.selection["seeds"])
    configs, seeds, overrides, factors = settle("quick", None, [5], ["loop.steps=3"], [2])
    assert seeds == [5] and factors == [2.0] and overrides[-1] == "loop.steps=3"
    assert overrides[:-1] == GRIDS["quick"].overrides
    with pytest.raises(ConfigError, match="unknown sweep grid 'huge'"):
        settle("huge", None, None, None, None)
    with pytest.raises(ConfigError, match=r"factors \[1.0, -2.0\]"):
        settle(None, {"a": []}, None, None, [1, -2])


def test_the_smollm2_grid_runs_the_preset_as_its_replay_child():
    """GRIDS["smollm2"] spells out experiment=smollm2_chain_sum (its children pick their own
    experiment): its posbias_prio256_r32_b32 child, at the grid's equal budget, composes to the
    preset itself (model, task, sampling, buffer, loop, objective), so the grid's runs of that
    child are the preset's seeds; its configurations are the toy grids' of the same names, on
    seeds that chose nothing."""
    from flows.sweep import GRIDS, equal_budget

    grid = GRIDS["smollm2"]
    children = equal_budget(grid.configs, grid.overrides, "no_buffer")
    preset = resolve_config(["experiment=smollm2_chain_sum"])
    child = resolve_config([*grid.overrides, *children["posbias_prio256_r32_b32"]])
    for section in ("model", "task", "generator", "buffer", "loop", "algo"):
        assert child[section] == preset[section], section
    assert all(GRIDS["headline"].configs[name] == extra for name, extra in grid.configs.items())
    assert "no_buffer" in grid.configs and not set(grid.seeds) & set(grid.selection["seeds"]) and len(grid.seeds) >= 3


def test_the_onpolicy_control_draws_by_advantage_from_the_fresh_batch_only():
    from flows.sweep import GRIDS

    cfg = resolve_config(GRIDS["headline"].configs["onpolicy_prio_r32_b32"])
    rollouts = cfg.loop.prompts_per_step * cfg.loop.group_size
    assert cfg.buffer.strategy == "prioritized" and cfg.buffer.positive_bias == 0
    assert cfg.buffer.capacity == rollouts == cfg.loop.minibatch_size * cfg.loop.updates_per_step == 32


def test_the_held_out_protocol_refuses_confirming_on_the_seeds_that_chose():
    from flows.sweep import protocol

    p = protocol(list(range(10, 20)), None, "headline", False)
    assert p["selection_seeds"] == [0, 1, 2, 3] and p["confirmation_seeds"] == list(range(10, 20))
    assert p["configs_tried"] == 9 and "default grid" in p["chosen_on"]
    with pytest.raises(ConfigError, match=r"seeds \[3\] both chose the configurations"):
        protocol([3, 4], None, "headline", False)
    with pytest.raises(ConfigError, match="never used to choose"):
        protocol([0, 1], [1, 2], None, True)
    assert protocol([0, 1], None, None, True)["selection_seeds"] is None  # explicit configs: nothing held out
    assert protocol([5], [0, 1], None, True)["chosen_on"] == "as given (--selection-seeds)"


def test_sweep_cli_refuses_overlapping_selection_and_confirmation_seeds(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flows.sweep", "--grid", "headline", "--seeds", "2,11",
                           f"tracking.root_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "seeds [2] both chose the configurations" in proc.stderr, proc.stderr
    assert not any(tmp_path.iterdir())


def test_equal_budget_gives_every_configuration_the_baselines_generated_rollouts():
    from flows.sweep import equal_budget, plan

    shared = ["loop.steps=50", "loop.eval_every=10"]
    configs = {"base": ["experiment=no_buffer"],                        # 8 prompts x 8 = 64 a step
               "half": ["experiment=replay", "loop.prompts_per_step=4"],  # 32 a step: twice the steps
               "third": ["experiment=replay", "loop.prompts_per_step=3"],  # 24: 50 x 64/24 = 133.3 -> 134
               "own": ["experiment=replay", "loop.prompts_per_step=4", "loop.steps=7"],
               "same": ["experiment=replay"],
               "broken": ["buffer.capacity=0"]}
    out = equal_budget(configs, shared, "base")
    assert out["base"] == configs["base"] and out["same"] == configs["same"]
    assert out["half"] == [*configs["half"], "loop.steps=100", "loop.eval_every=20", "loop.passk_every=200"]
    assert out["third"] == [*configs["third"], "loop.steps=134", "loop.eval_every=27", "loop.passk_every=267"]
    assert out["own"] == [*configs["own"], "loop.eval_every=20", "loop.passk_every=200"]  # its own steps stay
    assert out["broken"] == configs["broken"]                        # left for plan() to name
    del out["broken"]
    steps = {c.config: (c.overrides, c.seed) for c in plan(out, [0], shared, "t", "x")}
    from replay_pipeline.run.resume import resolve_config
    generated = {name: (cfg := resolve_config(o)).loop.steps * cfg.loop.prompts_per_step * cfg.loop.group_size
                 for name, (o, _) in steps.items()}
    assert generated["half"] == generated["base"] == 50 * 64 and generated["third"] >= 50 * 64
    assert equal_budget(configs, shared, "absent") == configs
    longer = equal_budget({"base": ["experiment=no_buffer", "loop.steps=80"], "same": ["experiment=replay"],
                           "half": ["experiment=replay", "loop.prompts_per_step=4"]}, shared, "base")
    assert longer["same"] == ["experiment=replay", "loop.steps=80"]  # the baseline's own length, same size
    assert longer["half"] == ["experiment=replay", "loop.prompts_per_step=4", "loop.steps=160", "loop.eval_every=20",
                              "loop.passk_every=200"]
    assert equal_budget({"a": ["loop=async"], "b": ["loop.prompts_per_step=4"]}, shared, "b")["a"] == ["loop=async"]


def test_lr_variants_scale_the_configurations_own_learning_rate():
    from flows.sweep import lr_variants

    assert lr_variants("asym", ["algo=asymre", "algo.lr=1e-4"], ["loop.steps=3"], [0.5, 2]) == {
        "asym-lrx0p5": ["algo=asymre", "algo.lr=1e-4", "algo.lr=5e-05"],
        "asym-lrx2": ["algo=asymre", "algo.lr=1e-4", "algo.lr=0.0002"]}


def _pins(name: str) -> dict[str, str]:
    """{canonical name: version} of an infra/ constraints file; every line must be an exact pin."""
    import re

    pins = {}
    for line in (ROOT / "infra" / name).read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        found = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.+!-]*)", line.strip())
        assert found, f"infra/{name}: {line!r} is not an exact pin name==version"
        pins[re.sub(r"[-_.]+", "-", found[1]).lower()] = found[2]
    return pins


def test_cpu_constraints_pin_every_dependency_exactly():
    """Every direct dependency of the package and of the extras the tests install, and every
    dependency those declare in turn, has an exact pin; torch is the CPU build's."""
    import re
    import tomllib
    from importlib import metadata

    pins = _pins("constraints-cpu.txt")
    assert pins["torch"] == _pins("constraints-torch-cpu.txt")["torch"] == "2.13.0"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    direct = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    names = {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", d)[0]).lower() for d in direct}
    assert not names - set(pins), f"direct dependencies without a pin: {sorted(names - set(pins))}"
    # The transitive ones, as far as this environment has them installed (CI installs all).
    missing = set()
    for name in sorted(names):
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for req in requires:
            if "extra ==" in req:
                continue
            dep = re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", req)[0]).lower()
            try:
                metadata.version(dep)
            except metadata.PackageNotFoundError:
                continue  # a marker (platform, python version) left it out here
            if dep not in pins:
                missing.add(f"{dep} (needed by {name})")
    assert not missing, f"installed transitive dependencies without a pin: {sorted(missing)}"


@pytest.mark.skipif(os.environ.get("RP_CI_PINNED") != "1",
                    reason="checks the running environment against the pins: set by .ci/run's pinned mode")
def test_environment_is_exactly_the_pinned_one():
    """In CI's pinned mode, what is installed is what infra/constraints-cpu.txt says, and nothing
    that it does not name (pip, setuptools, uv, which infra/install.sh installs with, and the
    project itself aside)."""
    from importlib import metadata

    pins = _pins("constraints-cpu.txt")
    installed = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            import re

            installed[re.sub(r"[-_.]+", "-", name).lower()] = dist.version.split("+")[0]
    extra = set(installed) - set(pins) - {"pip", "setuptools", "wheel", "uv", "replay-pipeline"}
    assert not extra, f"installed but not pinned: {sorted(extra)}; refresh with infra/refresh-constraints.sh"
    wrong = {n: (installed[n], v) for n, v in pins.items() if n in installed and installed[n] != v}
    assert not wrong, f"installed (left) differs from the pin (right): {wrong}"
    assert not set(pins) - set(installed), f"pinned but not installed: {sorted(set(pins) - set(installed))}"


@pytest.mark.skipif(os.environ.get("RP_CI_PINNED") != "1",
                    reason="checks the environment infra/install.sh made: set by .ci/run's pinned mode")
def test_the_install_compiled_the_bytecode_of_what_every_command_imports():
    """infra/install.sh compiles bytecode at install time: where PYTHONDONTWRITEBYTECODE=1 is set
    no import writes it, and every process would compile these sources again (8 s of a 16-s
    start-up). Each module's cached bytecode exists and is not older than its source."""
    import importlib.util

    stale = []
    for name in ("mlflow", "sqlalchemy", "prefect", "transformers", "lancedb", "torch", "hydra",
                 "replay_pipeline.run.phases", "flows.train"):
        source = importlib.util.find_spec(name).origin
        cached = Path(importlib.util.cache_from_source(source))
        if not cached.exists() or cached.stat().st_mtime < Path(source).stat().st_mtime:
            stale.append(f"{name} ({cached})")
    assert not stale, f"no current bytecode for {stale}: install with `sh infra/install.sh dev`"
