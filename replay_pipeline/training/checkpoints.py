"""Checkpoints, written atomically and verified on load.

A checkpoint is a directory filled under a temporary name, then renamed into place, so a crash
mid-write never leaves a directory that looks complete. Its `state.json` is written last and
lists every other file with its size and SHA-256 (the manifest); a checkpoint is *complete*
when `state.json` exists, and *valid* when it parses and every file matches the manifest.
`latest_valid` walks checkpoints newest first and skips, with a warning, any that is
incomplete (no state.json: killed while writing), garbled (state.json not JSON) or corrupt
(a file missing, truncated or changed), so a resume falls back to the previous good one.

Layout of <run_dir>/checkpoints/step-000020/ (20 = generation steps completed):
    model/        save_pretrained() weights, config and tokenizer (a Hugging Face checkpoint)
    optimizer.pt  optimizer state (torch.save)
    state.json    step, policy version, learner steps, the rollout/usage table tags it saw,
                  the MLflow run id, the config hash, RNG states, sampler state, compute
                  ledger totals, evaluation history and the manifest (see TrainingRun.checkpoint)
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

STATE_FILE = "state.json"
FORMAT_VERSION = 2
_TMP_PREFIX = ".tmp-"


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not fit the run; the message says what to do."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def checkpoint_step(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _manifest(directory: Path) -> dict[str, dict[str, Any]]:
    return {p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != STATE_FILE}


def save_checkpoint(directory: Path, step: int, model, tokenizer, optimizer,
                    state: dict[str, Any], keep: int,
                    before_rename: Callable[[Path], None] | None = None,
                    whole: tuple[dict[str, Any], dict[str, Any]] | None = None) -> Path:
    """Write step-NNNNNN atomically and keep the newest `keep`; returns its path.

    `before_rename(tmp)` runs after every file is written and before the rename (the
    fault-injection tests kill the process there). `whole`: the model's and the optimizer's
    state dicts as one process holds them, written instead of the live ones' (a sharded
    learner's, gathered onto rank 0: the checkpoint is then a one-process run's)."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / checkpoint_name(step)
    tmp = directory / f"{_TMP_PREFIX}{checkpoint_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp / "model", **({} if whole is None else {"state_dict": whole[0]}))
    tokenizer.save_pretrained(tmp / "model")
    torch.save(optimizer.state_dict() if whole is None else whole[1], tmp / "optimizer.pt")
    full = {"format": FORMAT_VERSION, "step": step, **state, "manifest": _manifest(tmp)}
    _write_synced(tmp / STATE_FILE, json.dumps(full, indent=2, default=str))
    if before_rename is not None:
        before_rename(tmp)
    if final.exists():  # a checkpoint of the same step from before a resume: replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(directory)
    prune(directory, keep)
    return final


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints (state.json present), oldest first; incomplete ones are skipped
    with a warning. Cheap: nothing is read or hashed (see `verify` for that)."""
    if not directory.is_dir():
        return []
    found = []
    for path in sorted(directory.glob("step-*")):
        if not (path / STATE_FILE).is_file():
            warnings.warn(f"skipping incomplete checkpoint {path} (no {STATE_FILE}; "
                          "the process probably stopped while writing it)")
            continue
        found.append(path)
    return found


def prune(directory: Path, keep: int) -> None:
    for path in list_checkpoints(directory)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def remove_partial(directory: Path) -> list[Path]:
    """Delete temporary directories left by a process killed while writing a checkpoint."""
    removed = sorted(directory.glob(f"{_TMP_PREFIX}step-*")) if directory.is_dir() else []
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def read_state(path: Path) -> dict[str, Any]:
    """state.json of a checkpoint; CheckpointError if it is missing or not JSON."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} has no {STATE_FILE}: it is incomplete") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path / STATE_FILE} is garbled ({exc})") from exc
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"{path / STATE_FILE} is not a checkpoint state (no 'step')")
    return state


def verify(path: Path) -> dict[str, Any]:
    """The checkpoint's state after checking every file against its manifest.

    Raises CheckpointError naming the first problem (garbled state, missing file, size or
    checksum mismatch, or a checkpoint written before manifests existed)."""
    state = read_state(path)
    manifest = state.get("manifest")
    if not isinstance(manifest, dict) or not manifest:
        raise CheckpointError(f"{path} has no file manifest (format {state.get('format', 1)}); "
                              "it cannot be verified, so it is not used")
    for name, meta in manifest.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path} is missing {name}")
        if file.stat().st_size != meta.get("bytes"):
            raise CheckpointError(f"{path}/{name} has {file.stat().st_size} bytes, "
                                  f"the manifest says {meta.get('bytes')}")
        if _sha256(file) != meta.get("sha256"):
            raise CheckpointError(f"{path}/{name} does not match its checksum")
    return state


def latest_valid(directory: Path, *, at_step: int | None = None) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies (or the one of `at_step`), with its state; bad
    ones are skipped with a warning. None if there is none."""
    candidates = list_checkpoints(directory)
    if at_step is not None:
        candidates = [p for p in candidates if checkpoint_step(p) == at_step]
    for path in reversed(candidates):
        try:
            return path, verify(path)
        except CheckpointError as exc:
            warnings.warn(f"skipping checkpoint {path.name}: {exc}")
    return None


def load_optimizer_state(path: Path) -> dict[str, Any]:
    return torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)


# ---------------------------------------------------------------------- RNG states
def capture_rng() -> dict[str, Any]:
    """The global Python, NumPy and torch RNG states, as JSON-able values."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    return {
        "python": [version, list(internal), gauss],
        "numpy": {"bit_generator": np_state["bit_generator"],
                  "key": np_state["state"]["key"].tolist(), "pos": int(np_state["state"]["pos"]),
                  "has_gauss": int(np_state["has_gauss"]), "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state().tolist(),
    }


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"],
                         "state": {"key": np.asarray(n["key"], dtype=np.uint32), "pos": n["pos"]},
                         "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
