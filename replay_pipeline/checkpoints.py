"""Checkpoints, written atomically: a temporary directory is filled, then renamed into
place, so a crash mid-write never leaves a directory that looks complete. A checkpoint is
complete when its `state.json` exists (written last, before the rename).

Layout of <run_dir>/checkpoints/step-000020/:
    model/        save_pretrained() weights, config and tokenizer (a Hugging Face checkpoint)
    optimizer.pt  optimizer state
    state.json    step, policy version, table version tag, MLflow run id, config hash, RNG states
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "state.json"


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def save_checkpoint(directory: Path, step: int, model, tokenizer, optimizer,
                    state: dict[str, Any], keep: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / checkpoint_name(step)
    tmp = directory / f".tmp-{checkpoint_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}, indent=2, default=str))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    prune(directory, keep)
    return final


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first; incomplete ones are skipped with a warning."""
    if not directory.is_dir():
        return []
    found = []
    for path in sorted(directory.glob("step-*")):
        if not (path / STATE_FILE).is_file():
            warnings.warn(f"skipping incomplete checkpoint {path} (no {STATE_FILE})")
            continue
        found.append(path)
    return found


def prune(directory: Path, keep: int) -> None:
    for path in list_checkpoints(directory)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def read_state(path: Path) -> dict[str, Any]:
    return json.loads((path / STATE_FILE).read_text())
