"""Every rollout stores the temperature and top_p it was sampled with; the learner re-scores a
row at its own temperature; a table from before the columns is refused with the migration
that adds them, and the migration changes no stored value; a fork that changes them says so."""

from __future__ import annotations

import warnings

import pyarrow as pa
import pytest
import torch

from replay_pipeline.buffer import ROLLOUT_SCHEMA, RolloutStore, StoreError
from replay_pipeline.buffer.schema import ADDED_LATER
from replay_pipeline.config import load_config
from replay_pipeline.training.learner import Learner, collate, token_logprobs_and_entropy
from replay_pipeline.models.tiny import build_tiny_model, build_tokenizer
from replay_pipeline.run.build import build_run
from replay_pipeline.run.loop import sync_round
from replay_pipeline.tracking.tracker import NullTracker
from tests.conftest import TINY_OVERRIDES


def test_a_run_stores_its_sampling_settings_on_every_rollout(tmp_path):
    cfg = load_config([f"tracking.root_dir={tmp_path}", *TINY_OVERRIDES, "run_id=temps", "loop.steps=2",
                       "generator.temperature=0.9", "generator.top_p=0.8"])
    run = build_run(cfg, log=lambda _: None, tracker=NullTracker())
    for step in range(2):
        sync_round(run, step)
    run.flush_writes()
    rows = run.store.table.to_arrow()
    assert set(rows.column("temperature").to_pylist()) == {0.9} and set(rows.column("top_p").to_pylist()) == {0.8}
    run.finish()


def _rows(tok, temps):
    torch.manual_seed(0)
    model = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    prompt = tok("1+2=", add_special_tokens=True)["input_ids"]
    completion = tok("3", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n = len(temps)
    rows = {"prompt_ids": [prompt] * n, "completion_ids": [completion] * n,
            "behaviour_logprobs": [[-1.0] * len(completion)] * n, "advantage": [1.0, -1.0][:n] * (n // 2 or 1),
            "temperature": temps}
    return model, rows


def test_the_learner_rescores_each_row_at_its_own_temperature():
    tok = build_tokenizer()
    model, rows = _rows(tok, [1.0, 0.5])
    learner = Learner(model, temperature=1.0, pad_id=tok.pad_token_id)
    t = learner.row_temperature(rows)
    assert torch.equal(t, torch.tensor([1.0, 0.5]))
    batch = collate(rows["prompt_ids"], rows["completion_ids"], rows["behaviour_logprobs"], rows["advantage"],
                    tok.pad_token_id)
    with torch.no_grad():
        per_row, _ = token_logprobs_and_entropy(model, batch, t)
        at_one, _ = token_logprobs_and_entropy(model, batch, 1.0)
        at_half, _ = token_logprobs_and_entropy(model, batch, 0.5)
    assert torch.allclose(per_row[0], at_one[0]) and torch.allclose(per_row[1], at_half[1])
    assert not torch.allclose(per_row[1], at_one[1])
    # Rows at the learner's own temperature, or with none recorded (null), take the old path.
    assert learner.row_temperature({**rows, "temperature": [1.0, None]}) == 1.0
    assert learner.row_temperature({k: v for k, v in rows.items() if k != "temperature"}) == 1.0
    with pytest.raises(ValueError, match="must be finite numbers > 0"):
        learner.row_temperature({**rows, "temperature": [1.0, 0.0]})


def test_a_table_from_before_the_columns_is_refused_then_migrated_without_changing_a_value(tmp_path):
    import lancedb

    from tests.integration.test_analysis import rollout_rows
    from replay_pipeline.buffer.schema import rows_to_table

    uri = tmp_path / "lancedb"
    full = rows_to_table(rollout_rows("old", 0))
    old_schema = pa.schema([f for f in ROLLOUT_SCHEMA if f.name not in ADDED_LATER])
    columns = {n: full[n] for n in full.schema.names} | {"seq": pa.array(range(full.num_rows), pa.int64())}
    old = pa.Table.from_arrays([columns[n] for n in old_schema.names], schema=old_schema)
    db = lancedb.connect(str(uri))
    db.create_table("rollouts_old", old)
    with pytest.raises(StoreError, match=r"predates the columns \['temperature', 'top_p'\].*flows.query migrate old"):
        RolloutStore.open(uri, "old")
    before = db.open_table("rollouts_old").to_arrow()
    assert RolloutStore.migrate(uri, "old") == ["temperature", "top_p"]
    assert RolloutStore.migrate(uri, "old") == []  # nothing left to add
    store = RolloutStore.open(uri, "old")
    after = store.table.to_arrow()
    assert after.select(before.schema.names).equals(before)  # every stored value as it was
    assert after.column("temperature").null_count == after.num_rows == before.num_rows


def test_a_fork_that_changes_the_sampling_settings_says_so(tmp_path):
    from replay_pipeline.run.resume import resolve_config

    root = tmp_path
    cfg = load_config([f"tracking.root_dir={root}", *TINY_OVERRIDES, "run_id=src", "loop.steps=1"])
    (root / "src").mkdir(parents=True)
    from omegaconf import OmegaConf

    (root / "src" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    with pytest.warns(UserWarning, match=r"generator.temperature 1.0 -> 0.7.*re-scored at their own temperature"):
        resolve_config([f"tracking.root_dir={root}", "fork=src@1", "generator.temperature=0.7"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_config([f"tracking.root_dir={root}", "fork=src@1", "algo.lr=1e-4"])  # no warning
