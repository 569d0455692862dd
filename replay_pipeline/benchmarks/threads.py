"""Which torch thread policy the default run should have: seconds per RL round and per
warm-start step at each option, on a quiet machine and beside one other CPU-bound process.

    python -m replay_pipeline.benchmarks.threads                      # 1 / 2 / 2 passive x quiet / beside a job
    python -m replay_pipeline.benchmarks.threads --competitors beside --repeats 3
    python -m replay_pipeline.benchmarks.threads --options 1,2,2:passive,2:active

An option is `THREADS[:WAIT]`: model.torch_threads, and OpenMP's wait policy
(OMP_WAIT_POLICY, read when torch loads: `passive` sleeps at the end of a parallel region,
`active` spins, unset is libgomp's default, spinning for a while first). Two torch threads on a
two-core machine spin-wait for each other; when another process holds one core, each spin
burns the time slice the other thread needs, and every step slows 10-30x.

Each measurement is a fresh process (the wait policy is read once) that builds the default
run (the default model and task, from the cached warm start, no MLflow or Prefect: the
library's `build_run` and `run_rounds`), times `--steps` rounds after one warm-up round, and
times `--warm-steps` supervised warm-start steps of the default model. The competitor
("beside") is a torch matmul loop at `--competitor-threads` threads (1 by default), the shape
of another training job. Options and
competitors are interleaved, `--repeats` times, so a noisy machine hits every side alike;
the figures are medians over the repeats. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMPETITOR = ("import sys, torch\ntorch.set_num_threads(int(sys.argv[1]))\na = torch.randn(512, 512)\n"
              "while True:\n    a = torch.tanh(a @ a * 0.01)\n")


def _option(text: str) -> tuple[int, str | None]:
    threads, _, wait = text.partition(":")
    if not threads.isdigit() or int(threads) < 1 or wait not in ("", "passive", "active"):
        raise argparse.ArgumentTypeError(f"{text!r}: an option is THREADS[:passive|:active], e.g. 2:passive")
    return int(threads), wait or None


def child(threads: int, steps: int, warm_steps: int, root: str, policy: str) -> dict[str, float]:
    """One measurement (in a fresh process, with OMP_WAIT_POLICY already in the environment)."""
    # start-up cost: the library loads in the measuring process only
    import torch
    from omegaconf import OmegaConf

    from replay_pipeline.config import TASK_DEFAULTS, load_config
    from replay_pipeline.models.warmstart import warm_start
    from replay_pipeline.run.build import build_run
    from replay_pipeline.run.loop import run_rounds
    from replay_pipeline.tasks import task_from_config
    from replay_pipeline.tracking.tracker import NullTracker

    cfg = load_config([f"tracking.root_dir={root}", f"model.torch_threads={threads}", "tracking.progress=false",
                       f"model.path={policy}", f"loop.steps={steps + 1}", "loop.eval_every=0",
                       "loop.passk_every=0", "loop.checkpoint_every=0"])
    run = build_run(cfg, log=lambda _: None, tracker=NullTracker())
    try:
        run_rounds(run, 0, 0)  # warm-up: first allocations, the first window read
        start = time.perf_counter()
        run_rounds(run, 1, steps)
        round_seconds = (time.perf_counter() - start) / steps
    finally:
        run.finish("FINISHED")
    task = task_from_config(OmegaConf.to_container(cfg.task, resolve=True), TASK_DEFAULTS)
    start = time.perf_counter()
    warm_start(task, Path(root) / "warm", eval_every=warm_steps, max_steps=warm_steps, target_accuracy=0.0,
               threads=threads, log=lambda _: None)
    warm_seconds = (time.perf_counter() - start) / warm_steps
    return {"round_seconds": round_seconds, "warm_step_seconds": warm_seconds, "torch_threads": torch.get_num_threads()}


def measure(option: tuple[int, str | None], steps: int, warm_steps: int, policy: str) -> dict[str, float]:
    threads, wait = option
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if wait:
        env["OMP_WAIT_POLICY"] = wait.upper()
    with tempfile.TemporaryDirectory(prefix="rp-threads-") as root:
        out = subprocess.run([sys.executable, "-m", "replay_pipeline.benchmarks.threads", "--child",
                              str(threads), "--steps", str(steps), "--warm-steps", str(warm_steps),
                              "--root", root, "--policy", policy], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def default_policy(root: str) -> str:
    """The default run's warm-start directory (trained once, cached under `root`)."""
    # start-up cost: the library loads after the command has parsed its arguments
    from omegaconf import OmegaConf

    from replay_pipeline.config import TASK_DEFAULTS, load_config
    from replay_pipeline.models.policy import load_policy
    from replay_pipeline.system.runs import RunPaths
    from replay_pipeline.tasks import task_from_config

    cfg = load_config([f"tracking.root_dir={root}"])
    task = task_from_config(OmegaConf.to_container(cfg.task, resolve=True), TASK_DEFAULTS)
    _, _, info = load_policy(cfg, task, RunPaths.make(root, "threads-benchmark"), log=print)
    return info["path"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replay_pipeline.benchmarks.threads", description=__doc__.split("\n\n")[0])
    parser.add_argument("--options", type=lambda t: [_option(x) for x in t.split(",")],
                        default=[(1, None), (2, None), (2, "passive")], help="THREADS[:WAIT],... (default 1,2,2:passive)")
    parser.add_argument("--competitors", default="quiet,beside", help="quiet, beside, or both (default)")
    parser.add_argument("--steps", type=int, default=20, help="RL rounds timed per measurement (default 20)")
    parser.add_argument("--warm-steps", type=int, default=25, help="warm-start steps timed (default 25)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--competitor-threads", type=int, default=1,
                        help="torch threads of the competing job (default 1; 2: another job as greedy as ours)")
    parser.add_argument("--root", default=None, help="where the default warm start is cached (default: runs)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--policy", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.steps, args.warm_steps, args.root, args.policy)))
        return 0
    sides = [c for c in args.competitors.split(",") if c]
    if not sides or set(sides) - {"quiet", "beside"}:
        parser.error("--competitors: quiet, beside or quiet,beside")
    policy = default_policy(args.root or "runs")
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for repeat in range(args.repeats):
        for side in sides:
            competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR,
                                                                str(args.competitor_threads)]) if side == "beside" else None
            try:
                time.sleep(1.0 if competitor else 0)
                for option in args.options:
                    label = f"{option[0]} thread{'s' if option[0] > 1 else ''}" + (f", {option[1]}" if option[1] else "")
                    figure = measure(option, args.steps, args.warm_steps, policy)
                    results.setdefault((label, side), []).append(figure)
                    print(f"repeat {repeat + 1} {side:6} {label:20} round {figure['round_seconds']:.3f} s  "
                          f"warm-start step {figure['warm_step_seconds']:.3f} s", flush=True)
            finally:
                if competitor is not None:
                    competitor.kill()
                    competitor.wait()
    print("\n| option | machine | s / RL round (median) | s / warm-start step (median) |\n|---|---|---|---|")
    for (label, side), figures in results.items():
        print(f"| {label} | {'quiet' if side == 'quiet' else 'beside one CPU-bound job'} | "
              f"{statistics.median(f['round_seconds'] for f in figures):.3f} | "
              f"{statistics.median(f['warm_step_seconds'] for f in figures):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
