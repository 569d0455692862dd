"""What a command's end costs: `python -m flows.train` with and without the skipped final
garbage collection (replay_pipeline/system/process_exit.py), interleaved.

    python -m replay_pipeline.benchmarks.process_end                 # 3 pairs of a 4-step tiny run
    python -m replay_pipeline.benchmarks.process_end --repeats 5 --steps 8

Each measurement is a fresh `flows.train` process on the tests' tiny model (one torch thread,
its warm start cached by a first, unmeasured run in REPLAY_PIPELINE_CACHE_DIR if set, else in
the benchmark's root), a new run id each time. The control arm is the same command with
`gc.freeze` taken off the exit handlers (`atexit.unregister`), i.e. the interpreter's usual end.
Figures per arm, medians over the repeats: the process's wall seconds, its CPU seconds (user +
system, from wait4), and the seconds from the run's last line (`total time ...`) to the
process's end. Run it with nothing else on the machine.

`measure` (one measured `flows.train` process, also the start-up it printed, to 0.1 s) and
`table` (the arms' medians [min-max]) are the start-up benchmark's too
(replay_pipeline/benchmarks/startup.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from replay_pipeline.config.tiny import tiny_overrides
from replay_pipeline.system.runs import CACHE_ENV

ROOT = Path(__file__).resolve().parents[2]
TINY = [*tiny_overrides(1), "loop.eval_every=0", "loop.passk_every=0"]


def train_command(prelude: str) -> str:
    """A `python -c` script that runs `prelude`, then `python -m flows.train` with its arguments."""
    return (f"import runpy, sys\n{prelude}\n"
            "sys.argv = ['flows.train', *sys.argv[1:]]\nrunpy.run_module('flows.train', run_name='__main__')\n")


#: The control arm: the command with the interpreter's usual end.
USUAL_END = train_command("import atexit, gc\nimport flows\natexit.unregister(gc.freeze)")


STARTUP = re.compile(r"\(start-up to the first round ([0-9.]+) s\)")


def measure(root: Path, args: list[str], script: str | None = None,
            env_extra: dict[str, str] | None = None) -> dict[str, float]:
    """One `flows.train` process (or `python -c script` that runs it, `train_command`): wall,
    CPU, last-line-to-end seconds and the start-up to the first round the run printed."""
    head = [sys.executable, "-c", script] if script else [sys.executable, "-m", "flows.train"]
    env = {**os.environ, "PREFECT_HOME": str(root / ".prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           CACHE_ENV: os.environ.get(CACHE_ENV) or str(root / "cache"), **(env_extra or {})}
    env.pop("PREFECT_API_URL", None)
    started = time.perf_counter()
    proc = subprocess.Popen([*head, f"tracking.root_dir={root}", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last_line_at, startup, tail = None, float("nan"), []
    for line in proc.stdout:
        tail = [*tail[-20:], line]
        if line.startswith("total time"):
            last_line_at = time.perf_counter()
        elif found := STARTUP.search(line):
            startup = float(found.group(1))
    proc.stdout.close()
    _, status, usage = os.wait4(proc.pid, 0)  # reaped here (for its rusage), not by Popen
    ended = time.perf_counter()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or last_line_at is None:
        raise RuntimeError(f"flows.train exited with {proc.returncode}:\n{''.join(tail)}")
    return {"wall_s": ended - started, "cpu_s": usage.ru_utime + usage.ru_stime, "end_s": ended - last_line_at,
            "startup_s": startup}


def table(arms: dict[str, list[dict[str, float]]], columns: dict[str, str]) -> tuple[list[str], dict]:
    """The report's lines (medians [min-max] over the repeats, per arm and column) and the medians."""
    width = max(len(name) for name in arms) + 2
    lines = [f"{'arm':<{width}}" + "".join(f"{title:>22}" for title in columns.values())]
    summary: dict[str, dict[str, float]] = {}
    for name, rows in arms.items():
        cells = []
        for key in columns:
            values = [r[key] for r in rows]
            summary.setdefault(name, {})[key] = statistics.median(values)
            cells.append(f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]")
        lines.append(f"{name:<{width}}" + "".join(f"{c:>22}" for c in cells))
    return lines, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replay_pipeline.benchmarks.process_end", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved pairs (default 3)")
    parser.add_argument("--steps", type=int, default=4, help="RL steps per run (default 4)")
    parser.add_argument("--root", type=Path, default=None, help="where the runs go (default: a new temp dir)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be at least 1")
    root = (args.root or Path(tempfile.mkdtemp(prefix="rp-process-end-"))).resolve()
    run = [*TINY, f"loop.steps={args.steps}"]
    measure(root, [*run, "run_id=warm-up"])  # caches the warm start
    arms: dict[str, list[dict[str, float]]] = {"skipped final collection": [], "usual end": []}
    for i in range(args.repeats):
        for name in arms:
            arms[name].append(measure(root, [*run, f"run_id=r{i}-{name.split()[0]}"],
                                      script=USUAL_END if name == "usual end" else None))
    print(f"{args.repeats} interleaved pairs of a {args.steps}-step tiny run, medians [min-max]; runs under {root}")
    lines, summary = table(arms, {"wall_s": "wall s", "cpu_s": "CPU s", "end_s": "last line to end s"})
    print("\n".join(lines))
    (root / "process_end.json").write_text(json.dumps({"arms": arms, "medians": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
