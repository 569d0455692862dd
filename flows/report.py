"""Report on a sweep: python -m flows.report PARENT_RUN_ID.

    python -m flows.report 3f9c...e1                          # the parent run flows.sweep printed
    python -m flows.report 3f9c...e1 --root /data/replay-runs --mu 6.84 --out sweep-report/
    python -m flows.report 3f9c...e1 --root runs-a --shard runs-b 7d21...0a   # one grid, seeds split in two
    python -m flows.report 3f9c...e1 --budget 1/3             # a 3x sweep read at the default budget

A sweep run in shards (the same grid with its --seeds, or its configurations, split over
processes or machines, each with its own root) is reported as one with --shard ROOT
PARENT_RUN_ID per further part: the shards must agree in name, baseline and every shared
configuration's overrides, and no configuration and seed may be in two of them
(replay_pipeline.reports.report.merge_shards); the report goes to the first parent run.

--budget F reads every run as if it had stopped after the fraction F of its steps (exact for
this project's runs, whose first rounds do not depend on their length: replay_pipeline.reports.report,
"At a smaller budget"), to report-budget<F>/ beside the whole report.

Reads the sweep's parent MLflow run (its sweep.json) and the metric histories of its finished
children, then writes report.md, report.json and the plots (accuracy against generated tokens,
measured seconds and compute projected at --mu, the frontier per family, pass@k, entropy and
the buffer's staleness, reuse and steps-since-last-use distributions) to --out, and logs them
to the parent run under report/. The work is replay_pipeline.reports.report; this module parses and
prints. Errors go to stderr with exit status 2 and say how to fix the call.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from fractions import Fraction

import flows  # noqa: F401  (the package's environment defaults: MLflow logging level)

os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # sweep.json's download
from replay_pipeline.reports import report


def _mu(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number > 0, e.g. 5.28")
    return value


def _accuracy(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 <= value <= 1):
        raise argparse.ArgumentTypeError(f"{text!r} is not an accuracy in [0, 1], e.g. 0.5")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(Fraction(text))
    except (ValueError, ZeroDivisionError):
        value = math.nan
    if not (0 < value <= 1):
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in (0, 1], e.g. 1/3")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flows.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("parent_run_id", metavar="PARENT_RUN_ID",
                        help="the sweep's parent MLflow run id (python -m flows.sweep prints it)")
    parser.add_argument("--mlflow-uri", metavar="URI", help="MLflow tracking store (default: sqlite:///ROOT/mlflow.db)")
    parser.add_argument("--root", default=os.environ.get("REPLAY_PIPELINE_ROOT", "runs"),
                        help="the runs' tracking.root_dir (default: $REPLAY_PIPELINE_ROOT or runs)")
    parser.add_argument("--mu", type=_mu, default=report.DEFAULT_MU,
                        help=f"mu of the GPU-scale projection (default {report.DEFAULT_MU:g}, the paper's Qwen2.5-7B)")
    parser.add_argument("--out", metavar="DIR", help="output directory (default: ROOT/reports/<sweep name>-<sweep id>)")
    parser.add_argument("--target", type=_accuracy, metavar="ACCURACY",
                        help="read the per-seed crossings at this held-out accuracy (default: the baseline's "
                             "median peak; give one below it when the baseline is still rising)")
    parser.add_argument("--baseline", metavar="NAME",
                        help="the baseline configuration (default: sweep.json's baseline, else no_buffer)")
    parser.add_argument("--budget", type=_fraction, metavar="FRACTION",
                        help="read every run as if it had stopped after this fraction of its steps (1/3: a "
                             "3x-budget sweep at the default budget); each run must have evaluated there")
    parser.add_argument("--shard", nargs=2, action="append", default=[], metavar=("ROOT", "PARENT_RUN_ID"),
                        help="a further part of the same sweep: its runs' root (or an MLflow URI) and its parent "
                             "run id; repeatable")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        uri = report.tracking_uri(args.root, args.mlflow_uri)
        shards = [(where if "://" in where else report.tracking_uri(where), parent) for where, parent in args.shard]
        result = report.build_report(uri, args.parent_run_id, mu=args.mu, out=args.out, root=args.root,
                                     baseline=args.baseline, target=args.target, shards=shards,
                                     budget=args.budget)
    except report.ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(result.table)
    print(f"\nreport: {result.path}")
    print(f"logged to MLflow run {args.parent_run_id} as {result.artifact_uri}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
