"""Curated data sets from runs' tables: python -m flows.export.

    python -m flows.export RUN_ID --kind sft --output exports/sft            # correct rollouts
    python -m flows.export RUN_A RUN_B --kind preference --gap 1 --output exports/pairs
    python -m flows.export RUN_ID --kind rows --versions 10:20 --correct false --format parquet --output out
    python -m flows.export RUN_ID --tag step-000100 --output exports/at-100   # as of a checkpoint

Each export writes `<kind>.<format>` and `manifest.json` (runs, table versions or tag,
filters, counts, the command) into --output; an sft export loads back as a task data set
(the manifest's `load_as_task`). What each kind holds: replay_pipeline/reports/export.py. Errors go
to stderr with exit status 2, before anything is written.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import flows  # noqa: F401  (the package's environment defaults)
from replay_pipeline.reports.export import FORMATS, KINDS, export
from replay_pipeline.reports.viewer import ViewError


def _range(text: str | None) -> tuple[int | None, int | None] | None:
    if text is None:
        return None
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            return int(lo), int(lo)
        return (int(lo) if lo else None, int(hi) if hi else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a range LO:HI of integers (either side may be empty)")


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r}: give true or false")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flows.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_ID")
    parser.add_argument("--root", default=os.environ.get("REPLAY_PIPELINE_ROOT", "runs"))
    parser.add_argument("--kind", choices=KINDS, default="sft")
    parser.add_argument("--format", choices=FORMATS, default="jsonl")
    parser.add_argument("--output", required=True, help="directory for the data file and manifest.json")
    parser.add_argument("--versions", type=_range, help="policy versions LO:HI (inclusive)")
    parser.add_argument("--steps", type=_range, help="generation steps LO:HI (inclusive)")
    parser.add_argument("--correct", type=_bool, help="true or false")
    parser.add_argument("--reward-min", type=float)
    parser.add_argument("--reward-max", type=float)
    parser.add_argument("--gap", type=float, default=1.0, help="preference: the least reward gap of a pair")
    parser.add_argument("--columns", help="rows: comma-separated columns (default all)")
    parser.add_argument("--tag", help="read each table as of this checkpoint tag (step-000100)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        manifest = export(args.root, args.runs, args.output, kind=args.kind, fmt=args.format, versions=args.versions,
                          steps=args.steps, correct=args.correct, reward_min=args.reward_min,
                          reward_max=args.reward_max, gap=args.gap, tag=args.tag,
                          columns=args.columns.split(",") if args.columns else None,
                          command="python -m flows.export " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
    except (ValueError, ViewError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: manifest[k] for k in ("kind", "file", "rows", "sources")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
