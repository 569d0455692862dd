"""What a command's start-up costs, and what its two remedies save: `python -m flows.train` on
the default model with its cached warm start, against itself without bytecode and with the
interpreter's full collections during start-up, interleaved.

    python -m replay_pipeline.benchmarks.startup --root runs            # 3 rounds of the 3 arms
    python -m replay_pipeline.benchmarks.startup --root runs --repeats 5

Arms, each a fresh process and a new run id (a 2-step default run, no evaluation but the
step-0 one, which the start-up figure leaves out):
- **as installed**: the command as `infra/install.sh` leaves it, bytecode compiled at install
  time and full collections deferred until the first round (replay_pipeline/system/heap.py);
- **no bytecode**: `PYTHONPYCACHEPREFIX` pointed at an empty folder and
  `PYTHONDONTWRITEBYTECODE=1`, so every module is compiled from source in every process:
  what a machine that sets PYTHONDONTWRITEBYTECODE=1 (this kind does) gets without the
  bytecode the install compiles;
- **full collections**: the command with `heap.defer_full_collections` made a no-op, so the
  collector walks the growing heap as Python's defaults have it.

The first, unmeasured run builds or finds the warm start in `--root`'s cache (the default
model's takes minutes when it is new). Per arm, medians [min-max] over the repeats: start-up to
the first round (as the run prints it, to 0.1 s: process creation to the first round, the
step-0 evaluation left out), the process's wall and CPU seconds. Run it with nothing else on
the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import uuid
from pathlib import Path

from replay_pipeline.benchmarks.process_end import measure, table, train_command

RUN = ["experiment=no_buffer", "loop.eval_every=0", "loop.passk_every=0", "loop.checkpoint_every=0",
       "tracking.progress=false", "tracking.log_model=false", "tracking.experiment=startup-benchmark"]
#: The control arm with the interpreter's full collections during start-up.
FULL_COLLECTIONS = train_command("from replay_pipeline.system import heap\nheap.defer_full_collections = lambda: None")
ARMS = ("as installed", "no bytecode", "full collections")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replay_pipeline.benchmarks.startup", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of the arms (default 3)")
    parser.add_argument("--steps", type=int, default=2, help="RL steps per run (default 2)")
    parser.add_argument("--root", type=Path, required=True,
                        help="the run root (tracking.root_dir) whose cache holds, or will hold, the warm start")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every arm, e.g. model.torch_threads=1")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be at least 1")
    root = args.root.resolve()
    run = [*RUN, f"loop.steps={args.steps}", *args.overrides]
    print(f"warm-up run under {root} (builds the warm start if the cache has none)", flush=True)
    measure(root, [*run, "run_id=startup-warm-up"])
    arms: dict[str, list[dict[str, float]]] = {name: [] for name in ARMS}
    stamp = uuid.uuid4().hex[:6]  # a fresh run id per measurement
    with tempfile.TemporaryDirectory(prefix="rp-no-bytecode-") as empty:
        variants = {"as installed": {}, "no bytecode": {"env_extra": {"PYTHONPYCACHEPREFIX": empty,
                                                                       "PYTHONDONTWRITEBYTECODE": "1"}},
                    "full collections": {"script": FULL_COLLECTIONS}}
        for i in range(args.repeats):
            for name in ARMS:
                arms[name].append(measure(root, [*run, f"run_id=startup-{stamp}-{i}-{name.split()[0]}"],
                                          **variants[name]))
                print(f"  round {i + 1} {name}: start-up {arms[name][-1]['startup_s']:.2f} s", flush=True)
    print(f"{args.repeats} interleaved rounds of a {args.steps}-step default run, medians [min-max]; runs under {root}")
    lines, summary = table(arms, {"startup_s": "start-up s", "wall_s": "wall s", "cpu_s": "CPU s"})
    print("\n".join(lines))
    out = root / "benchmarks" / f"startup-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"arms": arms, "medians": summary, "steps": args.steps, "overrides": run}, indent=1))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
