"""Damaged tables: real LanceDB tables whose data files are corrupted (bytes overwritten in
the middle) or deleted. Every read names the run, table, file and version; `flows.query
runs` keeps listing the other runs; `--skip-damaged` reads the intact rows; `flows.query
repair` keeps every readable row, brings back what older versions hold and moves the damaged
files aside; a resume after it continues bit for bit when the lost rows can be generated
again, and is refused (before the MLflow run is touched) when they cannot."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flows.query import main as query
from replay_pipeline.buffer import RolloutStore
from replay_pipeline.buffer.lance_table import DamagedTable, StoreError
from replay_pipeline.buffer.repair import DAMAGED_DIR
from replay_pipeline.run.resume import resolve_config
from replay_pipeline.run.build import build_run
from replay_pipeline.run.preflight import check_start_point
from tests.conftest import TINY_OVERRIDES
from tests.integration.test_analysis import RUN_A, RUN_B, build_replay_db, rollout_rows
from tests.integration.test_resume import EXACT, drive, stored


def fragment_files(store: RolloutStore) -> list[tuple[Path, list[int]]]:
    """Each fragment's data file and the generation steps of its rows, in fragment order."""
    ds = store._dataset()
    return [(Path(ds.uri) / "data" / f.data_files()[0].path, sorted(set(f.to_table(columns=["step"])["step"].to_pylist())))
            for f in ds.get_fragments()]


def corrupt(path: Path) -> None:
    """600 bytes in the middle of the file overwritten with garbage. (Zeros are not always
    enough: Lance files carry no page checksums, and zeroed bytes may decode as wrong values.)"""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid - 300:mid + 300] = (bytes(range(1, 256)) * 3)[:600]
    path.write_bytes(bytes(data))


def file_of_step(store: RolloutStore, step: int) -> Path:
    return next(path for path, steps in fragment_files(store) if steps == [step])


# ------------------------------------------------------------------ reads, runs, skip, repair
def test_damaged_table_is_named_other_runs_listed_intact_rows_read_and_repaired(tmp_path, capsys):
    build_replay_db(tmp_path)
    (tmp_path / RUN_A).mkdir()  # a run directory: `runs --root` lists it by status
    store = RolloutStore.open(tmp_path / "lancedb", RUN_A)
    files = fragment_files(store)
    bad, gone = files[1][0], files[2][0]  # steps 1 and 2
    corrupt(bad)
    gone.unlink()

    with pytest.raises(DamagedTable) as caught:
        store.window(32)
    exc = caught.value
    assert (exc.run_id, exc.table, exc.version) == (RUN_A, f"rollouts_{RUN_A}", store.version)
    assert sorted(exc.paths) == sorted([str(bad), str(gone)])
    assert {f.problem.split(":")[0] for f in exc.files} == {"corrupt", "missing"}

    root = str(tmp_path)
    assert query(["rollouts", RUN_A, "--root", root, "--format", "csv"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: table rollouts_run-a of run run-a is damaged at version")
    assert bad.name in err and gone.name in err and "python -m flows.query repair run-a" in err

    assert query(["runs", "--root", root, "--format", "jsonl"]) == 0
    runs = {r["run_id"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert runs[RUN_A]["status"].startswith("damaged: rollouts_run-a.lance/data/")
    assert runs[RUN_B]["status"] == "unknown" and runs[RUN_B]["rollouts"] == 8  # the other run as usual

    # The intact rows only, with one warning line per skipped file; a filter that needs a scan too.
    assert query(["rollouts", RUN_A, "--root", root, "--skip-damaged", "--format", "jsonl", "--columns", "seq"]) == 0
    out = capsys.readouterr()
    assert [json.loads(r)["seq"] for r in out.out.splitlines()] == [*range(8), *range(24, 32)]
    warnings = [line for line in out.err.splitlines() if line.startswith("warning: skipped 8 unreadable rows")]
    assert len(warnings) == 2 and any(bad.name in w for w in warnings) and any(gone.name in w for w in warnings)
    assert query(["summary", RUN_A, "--root", root, "--skip-damaged", "--format", "jsonl"]) == 0
    assert [json.loads(r)["policy_version"] for r in capsys.readouterr().out.splitlines()] == [0, 3]

    assert query(["repair", "nope", "--root", root]) == 2
    assert "unknown run id 'nope'" in capsys.readouterr().err
    version = store.version
    assert query(["repair", RUN_A, "--root", root, "--dry-run"]) == 0
    assert "would keep 16 readable rows" in capsys.readouterr().out and store.version == version
    assert query(["repair", RUN_A, "--root", root]) == 0
    out = capsys.readouterr().out
    assert "keep 16 readable rows; bring back 0 rows; 16 rows lost" in out and "seq lost: 8-23" in out
    assert "usage_run-a: intact (22 rows" in out
    moved = list((tmp_path / "lancedb" / f"rollouts_{RUN_A}.lance" / DAMAGED_DIR).glob("*"))
    assert len(moved) == 1 and (moved[0] / bad.name).is_file() and (moved[0] / "repair.json").is_file()
    assert not bad.exists()  # moved aside, not deleted: the bytes are the corrupted ones, kept
    repaired = RolloutStore.open(tmp_path / "lancedb", RUN_A)
    assert repaired.window(32, columns=["seq"])["seq"].to_pylist() == [*range(8), *range(24, 32)]
    assert repaired.damage() == [] and any(t.startswith("repaired-") for t in repaired.tags())
    assert query(["runs", "--root", root, "--format", "jsonl"]) == 0
    assert not any(json.loads(r)["status"].startswith("damaged") for r in capsys.readouterr().out.splitlines())


def test_repair_brings_back_rows_an_older_version_still_holds(tmp_path):
    uri = build_replay_db(tmp_path)
    store = RolloutStore.open(uri, RUN_A)
    store.compact()  # the 32 rows rewritten into one file; the per-append files stay for a week
    store.append(rollout_rows(RUN_A, 4))
    store.append(rollout_rows(RUN_A, 5))
    files = fragment_files(store)
    assert [steps for _, steps in files] == [[0, 1, 2, 3], [4], [5]]
    corrupt(files[0][0])
    files[2][0].unlink()  # step 5: no other copy
    from replay_pipeline.buffer.repair import repair_table

    report = repair_table(store)
    assert (report.rows_before, report.rows_kept, report.rows_recovered, report.rows_lost) == (48, 8, 32, 8)
    assert report.lost_seqs == [(40, 47)]
    assert store.window(100, columns=["seq"])["seq"].to_pylist() == list(range(40))
    assert store.rows_for_step(2, columns=["seq"])["seq"].to_pylist() == list(range(16, 24))  # their own seq


# ------------------------------------------------------------------ resume after a repair
STEPS = 4


def overrides(root, *extra):
    # One fragment a round (buffer.commit_seconds=0: no grouped commits), so that the damage
    # below hits exactly the rows of the steps it names; with grouping a fragment holds a
    # group of rounds, and a repair regenerates the whole group the same way.
    return [f"tracking.root_dir={root}", *TINY_OVERRIDES, "model.torch_threads=1", f"loop.steps={STEPS}",
            "loop.checkpoint_every=2", "buffer.compact_every=0", "buffer.commit_seconds=0", *extra]


def setup(root, *extra):
    return build_run(resolve_config(overrides(root, *extra)), log=lambda _: None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A straight run, and a run stopped after step 3's append (checkpoint at step 2; steps 2 and
    3 stored beyond it) whose MLflow run was then ended KILLED; its root copied for a second case."""
    root = tmp_path_factory.mktemp("damaged-resume")
    straight = setup(root, "run_id=straight")
    ref = drive(straight)
    straight.finish()
    hurt = setup(root, "run_id=hurt")
    drive(hurt, stop_after_append=3)
    hurt.flush_writes()
    hurt.finish("KILLED")
    other = tmp_path_factory.mktemp("damaged-early")
    for name in ("hurt", "lancedb", "mlflow.db"):
        (shutil.copytree if (root / name).is_dir() else shutil.copy)(root / name, other / name)
    return root, straight, ref, other


def test_resume_after_repair_regenerates_lost_rows_bit_for_bit(runs, capsys):
    root, straight, ref, _ = runs
    store = RolloutStore.open(root / "lancedb", "hurt")
    corrupt(file_of_step(store, 2))  # after the checkpoint at step 2, before the stored step 3
    assert query(["repair", "hurt", "--root", str(root)]) == 0
    assert "16 rows lost" in capsys.readouterr().out
    check_start_point(resolve_config(overrides(root, "resume=hurt")), log=lambda _: None)  # allowed
    resumed = setup(root, "resume=hurt")
    assert (resumed.start_step, resumed.stored_through) == (2, 3)
    metrics = drive(resumed)
    assert metrics[2]["generate/seconds"] > 0.0 and metrics[3]["generate/seconds"] == 0.0  # 2 again, 3 read back
    for step in (2, 3):
        for key in EXACT:
            assert metrics[step][key] == ref[step][key], (step, key)
    assert stored(resumed) == stored(straight)  # every row, at its own seq
    resumed.finish()
    assert resumed.tracker.status() == "FINISHED"


def test_resume_refused_on_damage_and_on_rows_lost_before_the_checkpoint(runs, capsys):
    _, _, _, root = runs
    store = RolloutStore.open(root / "lancedb", "hurt")
    read, later = file_of_step(store, 1), file_of_step(store, 3)
    read.unlink()  # a step the checkpoint at step 2 read
    corrupt(later)  # inside its pages: found by the deep check before Prefect starts
    cfg = resolve_config(overrides(root, "resume=hurt"))
    with pytest.raises(DamagedTable, match=r"rollouts_hurt of run hurt is damaged at version \d+: data file .*"
                                           r"\(missing; .*\(corrupt: .*python -m flows.query repair hurt"):
        check_start_point(cfg, log=lambda _: None)
    assert query(["repair", "hurt", "--root", str(root)]) == 0
    capsys.readouterr()
    refused = (r"cannot resume hurt from step 2 exactly: 16 rollouts \(seq below 32\) .* fork it from this "
               r"checkpoint .*python -m flows.train fork=hurt@2")
    with pytest.raises(StoreError, match=refused):
        check_start_point(cfg, log=lambda _: None)
    with pytest.raises(StoreError, match=refused):
        setup(root, "resume=hurt")  # the library path refuses too, before the MLflow run is touched
    from mlflow.tracking import MlflowClient

    info = json.loads((root / "hurt" / "run.json").read_text())
    assert MlflowClient(f"sqlite:///{root / 'mlflow.db'}").get_run(info["mlflow_run_id"]).info.status == "KILLED"


def test_a_fork_after_repair_goes_on_with_every_readable_row(runs):
    """The refusal above names a fork from the checkpoint: it clones the repaired version (the
    tagged one references the files moved aside), keeps every readable row before the fork
    point, and numbers its new rows after the largest seq it kept (here step 0's: the lost
    step 1 leaves no gap behind it)."""
    _, _, _, root = runs  # after the test above: step 1's rows lost, the table repaired
    source = RolloutStore.open(root / "lancedb", "hurt")
    kept = source.window(1000, columns=["seq", "step"]).to_pydict()
    fork = setup(root, "fork=hurt@2", "run_id=after-repair")
    drive(fork)
    fork.flush_writes()
    rows = fork.store.window(1000, columns=["seq", "step", "run_id"]).to_pydict()
    inherited = [(q, s) for q, s, r in zip(rows["seq"], rows["step"], rows["run_id"]) if r == "hurt"]
    assert inherited == [(q, s) for q, s in zip(kept["seq"], kept["step"]) if s < 2]  # step 0 (step 1 was lost)
    new = [q for q, r in zip(rows["seq"], rows["run_id"]) if r == "after-repair"]
    assert new == list(range(16, 16 + 16 * (STEPS - 2)))  # after the kept rows, in order
    assert "fork-after-repair" in source.tags()
    fork.finish()
    assert fork.tracker.status() == "FINISHED"
