"""Runs made before the Dask engine was retired (docs/log.md says when) still resume and fork: their saved
config.yaml holds `loop.dask_address` (null, or a scheduler) and `loop.engine` local or dask.
A null address is dropped and the checkpoint's config hash still matches (the key was never
hashed); a run that used Dask is refused with the command that continues it, unless the
command line picks loop.engine=local or loop.engine=ray. Real saved configs and checkpoints."""

from __future__ import annotations

import pytest
import yaml

from replay_pipeline.config import ConfigError, flatten, load_config
from replay_pipeline.run.build import build_run
from replay_pipeline.run.resume import config_hash, resolve_config, saved_config
from replay_pipeline.training import checkpoints
from tests.integration.test_resume import drive, overrides


def _as_before(path, **loop) -> None:
    """Rewrite a saved config.yaml as an earlier version wrote it (loop.dask_address present)."""
    saved = yaml.safe_load(path.read_text())
    saved["loop"] = {**saved["loop"], "dask_address": None, **loop}
    path.write_text(yaml.safe_dump(saved, sort_keys=False))


@pytest.fixture(scope="module")
def old_runs(tmp_path_factory):
    """Two stopped sync runs with a checkpoint at step 2: `local` (loop.engine: local,
    loop.dask_address: null) and `dasked` (loop.engine: dask)."""
    root = tmp_path_factory.mktemp("retired")
    for run_id, loop in (("local", {}), ("dasked", {"engine": "dask"})):
        run = build_run(resolve_config(overrides(root, f"run_id={run_id}", "loop.steps=4")), log=lambda _: None)
        drive(run, stop_after_append=2)  # a crash after step 2's append: checkpoint 2 is the newest
        del run  # stopped, as by a crash
        _as_before(root / run_id / "config.yaml", **loop)
    return root


def _hash_matches(root, run_id, cfg) -> None:
    _, state = checkpoints.latest_valid(root / run_id / "checkpoints")
    assert state["config_hash"] == config_hash(cfg, keys=flatten(saved_config(root, run_id)))


def test_a_null_dask_address_is_dropped_and_the_old_checkpoint_resumes(old_runs):
    root = old_runs
    assert "dask_address: null" in (root / "local" / "config.yaml").read_text()
    cfg = resolve_config([f"tracking.root_dir={root}", "resume=local"])
    assert "dask_address" not in cfg.loop and cfg.loop.engine == "local"
    _hash_matches(root, "local", cfg)
    run = build_run(cfg, log=lambda _: None)  # verifies the checkpoint's config hash
    assert run.start_step == 2
    del run
    assert "dask_address" not in (root / "local" / "config.yaml").read_text()  # saved again without it
    fork = resolve_config([f"tracking.root_dir={root}", "fork=local@2", "run_id=local-fork"])
    assert "dask_address" not in fork.loop


@pytest.mark.parametrize("how", ["resume=dasked", "fork=dasked@2"])
def test_a_run_made_on_dask_is_refused_with_the_command_that_continues_it(old_runs, how):
    root = old_runs
    with pytest.raises(ConfigError) as info:
        resolve_config([f"tracking.root_dir={root}", how])
    message = str(info.value)
    assert f"{how}: this run's generators ran on Dask (loop.engine=dask), and the Dask engine was retired: " \
           "Ray does everything it did" in message
    assert f"python -m flows.train tracking.root_dir={root} {how} loop.engine=ray " in message
    assert f"python -m flows.train tracking.root_dir={root} {how} loop.engine=local " in message


def test_a_run_made_on_a_dask_scheduler_names_it(tmp_path):
    saved = load_config([f"tracking.root_dir={tmp_path}", "loop=async"])
    path = tmp_path / "sched" / "config.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(flatten_free(saved), sort_keys=False))
    _as_before(path, engine="dask", dask_address="tcp://10.0.0.5:8786")
    with pytest.raises(ConfigError, match=r"\(loop.engine=dask loop.dask_address=tcp://10.0.0.5:8786\)"):
        resolve_config([f"tracking.root_dir={tmp_path}", "resume=sched"])
    with pytest.raises(ConfigError) as info:
        resolve_config([f"tracking.root_dir={tmp_path}", "resume=sched"])
    command = f"python -m flows.train tracking.root_dir={tmp_path} resume=sched loop.engine=ray "
    assert command in str(info.value)  # the command as given, and it works: the run's loop=async is its own
    cfg = resolve_config(command.split()[3:])
    assert cfg.loop.engine == "ray" and cfg.loop.mode == "async" and "dask_address" not in cfg.loop


def test_a_resume_is_checked_with_the_saved_run_not_the_command_line_alone(tmp_path):
    """`resume=ID loop.engine=ray` of an async run: alone, the command line is a sync run that
    places nothing on Ray (refused); merged into the saved run it is valid. Merged settings
    that break a rule are still refused."""
    saved = load_config([f"tracking.root_dir={tmp_path}", "loop=async"])
    path = tmp_path / "was-async" / "config.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(flatten_free(saved), sort_keys=False))
    with pytest.raises(ConfigError, match="places nothing on Ray"):
        load_config([f"tracking.root_dir={tmp_path}", "loop.engine=ray"])
    cfg = resolve_config([f"tracking.root_dir={tmp_path}", "resume=was-async", "loop.engine=ray"])
    assert cfg.loop.engine == "ray" and cfg.loop.mode == "async"
    with pytest.raises(ConfigError, match="learner.shard=fsdp2 shards the model over the learner's ranks"):
        resolve_config([f"tracking.root_dir={tmp_path}", "resume=was-async", "learner.shard=fsdp2"])
    with pytest.raises(ConfigError, match="places nothing on Ray"):  # a new run is checked as before
        resolve_config([f"tracking.root_dir={tmp_path}", "loop.engine=ray"])
    for bad in ("resume=../was-async", "fork=was-async", "fork=../x@2"):  # refused before the run is read
        with pytest.raises(ConfigError, match="may only hold letters|must be <run_id>@<step>"):
            resolve_config([f"tracking.root_dir={tmp_path}", bad])


def test_an_old_dask_run_resumes_locally_from_its_checkpoint(old_runs):
    root = old_runs
    cfg = resolve_config([f"tracking.root_dir={root}", "resume=dasked", "loop.engine=local"])
    assert cfg.loop.engine == "local" and "dask_address" not in cfg.loop
    _hash_matches(root, "dasked", cfg)
    run = build_run(cfg, log=lambda _: None)
    assert run.start_step == 2
    del run
    again = resolve_config([f"tracking.root_dir={root}", "resume=dasked"])  # its config.yaml now says local
    assert again.loop.engine == "local"


def test_a_new_run_on_dask_says_it_was_retired():
    with pytest.raises(ConfigError, match=r"loop.engine=dask was retired: Ray does everything.*use loop.engine=ray"):
        load_config(["loop=async", "loop.engine=dask"])


def flatten_free(cfg):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)
