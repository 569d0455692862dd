"""Resume and fork through the library (no Prefect): a run stopped at any point and resumed
is bit for bit the run that was never stopped; a fork starts from the source's checkpoint
and buffer without touching the source. Real LanceDB tables, real checkpoints on disk."""

from __future__ import annotations

import json

import pytest
import torch

from replay_pipeline.training import checkpoints
from replay_pipeline.buffer.usage import UsageStore
from replay_pipeline.training.checkpoints import CheckpointError
from replay_pipeline.config import ConfigError
from replay_pipeline.run.resume import resolve_config
from replay_pipeline.run.build import build_run
from replay_pipeline.run.phases import TrainingRun
from tests.conftest import TINY_OVERRIDES

STEPS = 6
# Fields that must match exactly between a stopped-and-resumed run and an uninterrupted one
# (timings and the resumed process's own compute seconds are left out).
EXACT = ("learn/loss", "learn/grad_norm", "learn/entropy", "learn/ratio_mean", "learn/clip_frac",
         "learn/kl_behaviour", "score/reward_mean", "score/accuracy", "buffer/staleness_mean",
         "buffer/reuse_mean", "buffer/window_rows", "buffer/unique_frac", "buffer/first_use_frac",
         "buffer/replay_ratio", "buffer/total_rows", "learn/policy_version")


def overrides(root, *extra):
    # Every round commits its own rows (buffer.commit_seconds=0), so that what a stop leaves
    # stored does not depend on the machine's speed; the grouped case is tested on its own below.
    return [f"tracking.root_dir={root}", *TINY_OVERRIDES, f"loop.steps={STEPS}",
            "loop.checkpoint_every=2", "loop.keep_checkpoints=5", "buffer.strategy=prioritized",
            "buffer.reuse_cap=3", "algo.kl_coef=0.01", "buffer.commit_seconds=0", *extra]


def drive(run: TrainingRun, stop_after_append: int | None = None) -> dict[int, dict[str, float]]:
    """The flow's loop without Prefect: returns the metrics of each step run. With
    `stop_after_append=s`, returns right after step s's append (a crash there)."""
    out = {}
    for step in range(run.start_step, run.settings.loop.steps):
        table, m = run.score(run.generate(step))
        m |= run.append(table, step)
        if step == stop_after_append:
            return out
        minibatches, bm = run.sample(step)
        m |= bm | run.learn(minibatches, step)
        out[step] = m
        done = step + 1
        if done % run.settings.loop.checkpoint_every == 0 or done == run.settings.loop.steps:
            run.checkpoint(done)
    return out


def setup(root, *extra) -> TrainingRun:
    return build_run(resolve_config(overrides(root, *extra)), log=lambda _: None)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    run = setup(root, "run_id=straight")
    metrics = drive(run)
    run.finish()
    return root, run, metrics


def assert_same_trajectory(ref_metrics, metrics, steps):
    for step in steps:
        for key in EXACT:
            assert metrics[step][key] == ref_metrics[step][key], (step, key)


def assert_same_counts(ref: TrainingRun, resumed: TrainingRun, replayed: int) -> None:
    """The compute ledger counts what the run generated and trained on, whichever process did:
    the unstopped run's totals exactly; the `replayed` rollouts read back from the store are
    untimed (their generation seconds ran in the stopped process)."""
    for key in ("gen_tokens", "gen_rollouts", "train_tokens", "train_rollouts"):
        assert resumed.ledger.totals[key] == ref.ledger.totals[key], key
    assert (ref.ledger.totals["gen_untimed_rollouts"], resumed.ledger.totals["gen_untimed_rollouts"]) == (0, replayed)


def stored(run_or_store):
    store = run_or_store.store if isinstance(run_or_store, TrainingRun) else run_or_store
    return store.read_at(store.version, columns=["step", "seq", "reward", "completion_ids", "behaviour_logprobs",
                                                  "advantage", "policy_version"]).to_pydict()


# (buffer.commit_seconds, the steps a crash after step 3's append leaves stored): every round
# committed, or the rounds since the checkpoint at 2 held in memory and lost with the process.
GROUPING = [pytest.param("0", 3, id="per-round"), pytest.param("1e9", 1, id="grouped")]


@pytest.mark.parametrize("commit_seconds,stored_through", GROUPING)
def test_resume_after_crash_is_bit_for_bit(reference, commit_seconds, stored_through):
    root, ref, ref_metrics = reference
    run_id = f"stopped-{stored_through}"
    grouping = f"buffer.commit_seconds={commit_seconds}"
    run = setup(root, f"run_id={run_id}", grouping)
    before = drive(run, stop_after_append=3)  # checkpoint at 2 done; steps 2 and 3 made beyond it
    assert sorted(before) == [0, 1, 2]
    del run
    resumed = setup(root, f"resume={run_id}", grouping)
    assert resumed.start_step == 2 and resumed.stored_through == stored_through and resumed.policy_version == 2
    after = drive(resumed)
    assert sorted(after) == [2, 3, 4, 5]
    for step in (2, 3):  # read back if stored, else generated again from the step's seed
        assert (after[step]["generate/seconds"] == 0.0) == (step <= stored_through)
    assert after[4]["generate/seconds"] > 0.0
    metrics = {**before, **after}
    assert_same_trajectory(ref_metrics, metrics, range(STEPS))
    # Same rows, none lost or duplicated; same usage; same final weights.
    assert stored(resumed) == stored(ref)
    ids = resumed.store.window(10_000, columns=["rollout_id"]).column("rollout_id").to_pylist()
    assert len(ids) == len(set(ids)) == STEPS * 16
    u_ref, u = ref.usage.rows().to_pydict(), resumed.usage.rows().to_pydict()
    for key in ("learner_step", "position", "rollout_seq", "staleness"):
        assert u[key] == u_ref[key]
    for a, b in zip(ref.learner.model.state_dict().values(), resumed.learner.model.state_dict().values()):
        assert torch.equal(a, b)
    assert_same_counts(ref, resumed, replayed=16 * (stored_through - 1))  # steps 2..stored_through read back
    # The same MLflow run, RUNNING again and then finished; its lineage in run.json.
    assert resumed.tracker.run_id == json.loads((root / run_id / "run.json").read_text())["mlflow_run_id"]
    info = json.loads((root / run_id / "run.json").read_text())
    assert info["resumes"][0]["from_step"] == 2
    resumed.finish()
    assert resumed.tracker.status() == "FINISHED"


def test_resume_before_first_checkpoint_reuses_everything(reference):
    root, ref, ref_metrics = reference
    run = setup(root, "run_id=early")
    drive(run, stop_after_append=1)  # no checkpoint yet
    resumed = setup(root, "resume=early")
    assert resumed.start_step == 0 and resumed.stored_through == 1
    metrics = drive(resumed)
    assert_same_trajectory(ref_metrics, metrics, range(STEPS))
    assert_same_counts(ref, resumed, replayed=16 * 2)


def test_corrupt_newest_checkpoint_falls_back_with_a_warning(reference):
    root, ref, ref_metrics = reference
    run = setup(root, "run_id=corrupt")
    drive(run, stop_after_append=4)  # checkpoints at 2 and 4
    ckpt = root / "corrupt" / "checkpoints"
    weights = next((ckpt / "step-000004" / "model").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    with pytest.warns(UserWarning, match="step-000004.*bytes"):
        resumed = setup(root, "resume=corrupt")
    assert resumed.start_step == 2
    metrics = drive(resumed)
    assert_same_trajectory(ref_metrics, metrics, range(2, STEPS))


def test_garbled_or_missing_checkpoint_files_are_skipped(tmp_path, reference):
    root, ref, _ = reference
    src = root / "straight" / "checkpoints"
    good = checkpoints.latest_valid(src)
    assert good is not None and good[0].name == "step-000006"
    import shutil

    for name, damage in [("garbled", lambda p: (p / "state.json").write_text("{not json")),
                         ("missing", lambda p: (p / "optimizer.pt").unlink()),
                         ("incomplete", lambda p: (p / "state.json").unlink())]:
        d = tmp_path / name / "checkpoints"
        shutil.copytree(src / "step-000004", d / "step-000004")
        shutil.copytree(src / "step-000006", d / "step-000006")
        damage(d / "step-000006")
        with pytest.warns(UserWarning, match="step-000006"):
            found = checkpoints.latest_valid(d)
        assert found[0].name == "step-000004" and found[1]["step"] == 4
    with pytest.raises(CheckpointError, match="garbled"):
        checkpoints.read_state(tmp_path / "garbled" / "checkpoints" / "step-000006")


def test_checkpoint_holds_everything_a_resume_needs(reference):
    root, ref, _ = reference
    path, state = checkpoints.latest_valid(root / "straight" / "checkpoints")
    for key in ("step", "policy_version", "learner_steps", "table_tag", "table_version", "usage_version",
                "mlflow_run_id", "config_hash", "rng", "sampler", "compute", "history", "manifest"):
        assert key in state, key
    assert set(state["rng"]) == {"python", "numpy", "torch"}
    assert state["mlflow_run_id"] == ref.tracker.run_id
    assert ref.store.tags()[state["table_tag"]] == state["table_version"]
    assert state["sampler"]["window_end"] == STEPS * 16
    # The tag reads the table as the checkpoint saw it.
    assert ref.store.read_at(state["table_tag"]).num_rows == STEPS * 16
    assert {"model/config.json", "optimizer.pt"} <= set(state["manifest"])


def test_resume_refuses_a_trajectory_change_and_allows_extending(reference):
    root, ref, _ = reference
    with pytest.raises(ConfigError, match=r"algo\.lr.*fork=straight@"):
        resolve_config(overrides(root, "resume=straight", "algo.lr=0.1"))
    with pytest.raises(ConfigError, match=r"buffer\.positive_bias \(0\.0 -> 0\.5\)"):
        resolve_config(overrides(root, "resume=straight", "buffer=positive_bias"))
    with pytest.raises(ConfigError, match="no run 'nope'"):
        resolve_config(overrides(root, "resume=nope"))
    cfg = resolve_config(overrides(root, "resume=straight", f"loop.steps={STEPS + 2}"))
    assert cfg.loop.steps == STEPS + 2 and cfg.run_id == "straight"


def test_resume_refuses_an_edited_config(tmp_path, reference):
    root, _, _ = reference
    run = setup(root, "run_id=edited")
    drive(run, stop_after_append=2)
    path = root / "edited" / "config.yaml"
    path.write_text(path.read_text().replace("kl_coef: 0.01", "kl_coef: 0.02"))
    with pytest.raises(CheckpointError, match="different configuration"):  # only `resume=` given
        build_run(resolve_config([f"tracking.root_dir={root}", "resume=edited"]), log=lambda _: None)


def test_fork_shares_the_buffer_and_leaves_the_source_alone(reference):
    root, ref, ref_metrics = reference
    source_rows = ref.store.count()
    source_version = ref.store.version
    fork = setup(root, "fork=straight@4", "run_id=forked", "algo.lr=1e-4", "loop.steps=7")
    assert fork.start_step == 4 and fork.policy_version == 4 and fork.learner.steps == 8
    assert fork.store.count() == 4 * 16  # the buffer as it stood after step 4 (rows of steps 0..3)
    assert fork.learner.optimizer.param_groups[0]["lr"] == 1e-4
    metrics = drive(fork)
    assert sorted(metrics) == [4, 5, 6]
    assert ref.store.count() == source_rows and ref.store.version == source_version
    rows = fork.store.window(10_000, columns=["run_id", "step"]).to_pydict()
    assert set(zip(rows["run_id"], rows["step"])) == {("straight", s) for s in range(4)} | {
        ("forked", s) for s in range(4, 7)}
    # The shared files outlive a compaction of the source (its tag protects them).
    ref.store.compact()
    assert fork.store.read_at(fork.store.version).num_rows == 7 * 16
    # Lineage in MLflow.
    tags = fork.tracker.client.get_run(fork.tracker.run_id).data.tags
    assert tags["replay_pipeline.fork_of"] == "straight" and tags["replay_pipeline.fork_step"] == "4"
    assert tags["replay_pipeline.fork_mlflow_run_id"] == ref.tracker.run_id
    # With the same configuration, a fork at a checkpoint continues exactly like the source.
    same = setup(root, "fork=straight@2", "run_id=forked-same")
    m = drive(same)
    for step in range(2, STEPS):
        for key in ("learn/loss", "score/reward_mean", "buffer/reuse_mean"):
            assert m[step][key] == ref_metrics[step][key]


def test_fork_errors_name_the_fix(reference):
    root, _, _ = reference
    with pytest.raises(CheckpointError, match=r"no valid checkpoint at step 3.*\[2, 4, 6\]"):
        setup(root, "fork=straight@3", "run_id=bad-fork")
    with pytest.raises(ConfigError, match="model.hidden_size"):
        resolve_config(overrides(root, "fork=straight@2", "model.hidden_size=64"))
    with pytest.raises(ConfigError, match="fork="):
        resolve_config(overrides(root, "fork=straight"))


@pytest.mark.parametrize("args,needle", [
    (["resume=nope"], "no run 'nope'"),
    (["resume=straight", "algo.lr=0.5"], "cannot change algo.lr"),
    (["fork=straight@3"], "no valid checkpoint at step 3"),
    (["fork=straight@2", "model.num_layers=3"], "cannot change model.num_layers"),
    (["resume=straight", "fork=straight@2"], "not both"),
])
def test_cli_refuses_bad_resume_and_fork_before_any_work(reference, capsys, args, needle):
    from flows.train import main

    root, ref, _ = reference
    version = ref.store.version
    assert main([f"tracking.root_dir={root}", *args]) == 2
    assert needle in capsys.readouterr().err
    assert ref.store.version == version  # nothing written


def test_cli_refuses_to_resume_a_table_whose_schema_does_not_match(tmp_path, reference, capsys):
    import lancedb
    import pyarrow as pa

    from flows.train import main

    root, _, _ = reference
    other = tmp_path / "root"
    import shutil

    shutil.copytree(root / "straight", other / "straight")
    db = lancedb.connect(str(other / "lancedb"))
    db.create_table("rollouts_straight", data=pa.table({"rollout_id": ["x"], "seq": [0]}))
    UsageStore.create(other / "lancedb", "straight")
    assert main([f"tracking.root_dir={other}", "resume=straight"]) == 2
    assert "does not match ROLLOUT_SCHEMA" in capsys.readouterr().err
    assert db.open_table("rollouts_straight").count_rows() == 1  # left as it was


def test_resume_last_picks_the_newest_run_under_the_root_and_says_when_there_is_none(tmp_path):
    import json as _json

    from omegaconf import OmegaConf

    from replay_pipeline.config import ConfigError, load_config
    from replay_pipeline.run.resume import resolve_config

    with pytest.raises(ConfigError, match="resume=last: no run under"):
        resolve_config(["resume=last", f"tracking.root_dir={tmp_path}"])
    for run_id, created in [("b-older", "2026-12-01T10:00:00+00:00"), ("a-newer", "2026-12-01T11:00:00+00:00")]:
        (tmp_path / run_id).mkdir()
        (tmp_path / run_id / "config.yaml").write_text(OmegaConf.to_yaml(load_config([f"run_id={run_id}"])))
        (tmp_path / run_id / "run.json").write_text(_json.dumps({"created_at": created}))
    (tmp_path / "z-no-config").mkdir()  # a directory without config.yaml is not a run
    cfg = resolve_config(["resume=last", f"tracking.root_dir={tmp_path}", "loop.steps=7"])
    assert cfg.resume == "a-newer" and cfg.run_id == "a-newer" and cfg.loop.steps == 7
