"""Where the policy lives and how many CPU threads it gets: `model.device` resolved to a
torch.device, and `model.torch_threads=0` (auto) to a thread count.

Decisions:
- `auto` (the default) is CUDA when torch sees a GPU, else the CPU, resolved by each process
  for itself: an async generator on a Ray node without a GPU runs on its CPU while the
  learner trains on its own GPU.
- `cuda` is the current CUDA device with its index (`cuda:0` unless the process chose
  another), so every tensor of the learner and of its generator compares equal by device.
- An explicit CUDA device where none is visible is refused, never silently replaced by the
  CPU: a run asked to train on a GPU that falls back to a 2-core CPU would look stuck.
- `model.torch_threads=0` (the default) is chosen once, when a run is built: every core when
  the machine is idle, fewer when other processes keep cores busy (`auto_threads`), and the
  count chosen is what the run's config.yaml records, so a resume continues at it.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

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


def busy_cores(window: float = 0.5) -> float | None:
    """How many cores other processes kept busy over `window` seconds (Linux: /proc/stat's busy
    time less this process's own); None where /proc is not there."""
    def sample() -> tuple[int, int, int]:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return sum(values), values[3] + values[4], sum(int(v) for v in own[11:15])
    try:
        total0, idle0, own0 = sample()
        time.sleep(window)
        total1, idle1, own1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    cores = os.cpu_count() or 1
    elapsed = max(total1 - total0, 1)
    busy = (elapsed - (idle1 - idle0)) - (own1 - own0)
    return max(busy, 0) * cores / elapsed


def auto_threads(busy: float | None = None) -> tuple[int, str]:
    """model.torch_threads=0: the count a run takes, and why. Every core this process may use
    when the machine is idle; one fewer per core another process keeps busy, at least one.
    On a 2-core CPU machine (docs/performance.md, "Threads"): two threads are 1.5x faster than one
    when the machine is idle, and 2.2-1.8x slower beside one CPU-bound job (each spin-waits for
    the other while the job holds a core)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = busy_cores() if busy is None else busy
    if busy is None:
        return torch.get_num_threads(), "torch's default (the machine's load is unknown here)"
    threads = max(1, cores - int(round(busy)))
    return threads, f"{busy:.1f} of {cores} cores busy with other processes"
