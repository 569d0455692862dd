"""Where the policy lives: `model.device` resolved to a torch.device.

Decisions:
- `auto` (the default) is CUDA when torch sees a GPU, else the CPU, resolved by each process
  for itself: an async generator on a Dask machine without a GPU runs on its CPU while the
  learner trains on its own GPU.
- `cuda` is the current CUDA device with its index (`cuda:0` unless the process chose
  another), so every tensor of the learner and of its generator compares equal by device.
- An explicit CUDA device where none is visible is refused, never silently replaced by the
  CPU: a run asked to train on a GPU that falls back to a 2-core CPU would look stuck.
"""

from __future__ import annotations

import re

import torch

DEVICES = ("auto", "cpu", "cuda", "cuda:N")
"""The values `model.device` accepts (N: a CUDA device index)."""


def device_problem(name: str, key: str = "model.device") -> str | None:
    """Why `name` cannot be used as the device here (None when it can), with the fix."""
    name = str(name)
    if name in ("auto", "cpu"):
        return None
    match = re.fullmatch(r"cuda(?::([0-9]+))?", name)
    if match is None:
        return f"{key}={name!r} is not one of {list(DEVICES)}; set {key}=auto (the GPU if there is one) or {key}=cpu"
    if not torch.cuda.is_available():
        return (f"{key}={name} asks for a CUDA GPU, but torch sees none here (torch.cuda.is_available() is "
                f"False; torch {torch.__version__}); set {key}=cpu, or {key}=auto to use a GPU only where there is one")
    index, count = match.group(1), torch.cuda.device_count()
    if index is not None and int(index) >= count:
        return (f"{key}={name}: torch sees {count} CUDA device(s) here (cuda:0 to cuda:{count - 1}); "
                f"pick one of them, or set {key}=cuda")
    return None


def resolve_device(name: str = "auto") -> torch.device:
    """The torch.device `model.device` names on this machine; ValueError (with the fix) if it
    cannot be used here."""
    problem = device_problem(name)
    if problem is not None:
        raise ValueError(problem)
    name = str(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)
