"""Query any run's rollouts and usage records: python -m flows.query.

    python -m flows.query runs                                   # runs under ./runs/lancedb
    python -m flows.query rollouts RUN_ID --versions 10:20 --correct --min-reuse 2
    python -m flows.query usage RUN_ID --learner-steps 0:9 --format csv --output usage.csv
    python -m flows.query summary RUN_ID --by version|staleness|reuse
    python -m flows.query runs --uri s3://bucket/prefix --storage-option aws_endpoint=http://127.0.0.1:9000
    python -m flows.query rollouts RUN_ID --skip-damaged          # only the rows still readable
    python -m flows.query repair RUN_ID [--table rollouts|usage|all] [--dry-run]

The CLI only parses arguments and renders; the queries are replay_pipeline.reports.analysis, which
is imported after parsing so that --help and argument errors answer at once (lancedb takes a
few seconds to import). Errors go to stderr with exit status 2 and say how to fix the call;
a filter that matches nothing is not an error (exit 0, with a note on stderr).

Damaged tables (a data file missing or corrupt): a read that meets one fails with one line
naming the run, table, file and version and the repair command (exit 2); `runs` lists such
a run as `damaged: <file>` and the other runs as usual; `--skip-damaged` reads the intact
rows, with a warning line per skipped file. `repair` keeps every readable row, brings back
the rows older table versions still hold, moves the damaged files aside into
`<table>.lance/_damaged/<time>/` and reports rows kept, brought back and lost
(replay_pipeline/buffer/repair.py); `--dry-run` only reports. Exit 0 when the tables are
repaired or intact, 2 for bad input (an unknown run).

Output: `table` (default) prints a width-limited table, 20 rows unless --limit says
otherwise; csv, jsonl and parquet write every matching row to --output (csv and jsonl may go
to stdout). In CSV the token-id and log-prob list columns are JSON lists; float32 values are
written at float32 precision (0.1, not 0.10000000149011612). Parquet keeps the Arrow types.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import flows  # noqa: F401  (the package's environment defaults; harmless here)

DEFAULT_TABLE_LIMIT = 20
MAX_CELL = 40  # widest a table cell gets before it is truncated
MIN_CELL = 6
# Rollout columns shown by the table format when --columns is not given: the ids, token lists
# and log-probs do not fit a terminal (ask for them with --columns or write a file).
TABLE_ROLLOUT_COLUMNS = [
    "seq", "policy_version", "step", "sample_index", "prompt", "completion",
    "reward", "correct", "advantage", "num_tokens", "reuse_count", "reward_error",
]

# Run columns the table format shows unless --wide or --columns (full run ids, never cut).
TABLE_RUN_COLUMNS = ["run_id", "status", "pid", "steps", "accuracy", "started", "rollouts"]

EXAMPLES = """\
examples:
  python -m flows.query runs                                  # every run under ./runs/lancedb
  python -m flows.query runs --root /data/replay-runs         # another tracking.root_dir
  python -m flows.query rollouts RUN_ID --versions 10:20 --correct
  python -m flows.query rollouts RUN_ID --steps 100: --reward-max 0 --min-reuse 3 --limit 50
  python -m flows.query rollouts RUN_ID --columns seq,completion,completion_ids,reuse_count
  python -m flows.query rollouts RUN_ID --format parquet --output rollouts.parquet
  python -m flows.query usage RUN_ID --learner-steps 0:9 --format csv --output usage.csv
  python -m flows.query summary RUN_ID --by staleness --format jsonl
  python -m flows.query rollouts RUN_ID --skip-damaged        # the readable rows of a damaged table
  python -m flows.query repair RUN_ID --dry-run               # what a repair would keep and lose
  python -m flows.query rollouts RUN_ID --uri s3://bucket/prefix --versions 0:3 \
      --storage-option aws_endpoint=http://127.0.0.1:9000 --storage-option allow_http=true

ranges are inclusive LO:HI (0:10); LO: and :HI leave one end open, 5:5 is one value.
The LanceDB database is <root>/lancedb (a training run writes it there); --uri names one directly.
An object store (--uri s3://...) takes the settings of its run's buffer.storage_options as
--storage-option KEY=VALUE, or from the environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...;
keep secrets there rather than on the command line); see infra/object-storage.md.
"""


# ------------------------------------------------------------------ argument types
def _range_type(flag: str) -> Callable[[str], tuple[int | None, int | None]]:
    def parse(text: str) -> tuple[int | None, int | None]:
        lo_text, sep, hi_text = text.partition(":")
        hint = "use LO:HI, e.g. 0:10 (inclusive; 5:5 for one value, 5: for 5 and up, :5 for up to 5)"
        if not sep:
            raise argparse.ArgumentTypeError(f"{text!r} is not a range: {hint}")
        try:
            lo = int(lo_text) if lo_text.strip() else None
            hi = int(hi_text) if hi_text.strip() else None
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a range of integers: {hint}") from None
        if lo is None and hi is None:
            raise argparse.ArgumentTypeError(f"{text!r} gives neither end: {hint}")
        if lo is not None and hi is not None and lo > hi:
            raise argparse.ArgumentTypeError(
                f"{flag} {text} is an empty range: LO must be <= HI, e.g. {flag} {hi}:{lo}"
            )
        return lo, hi

    return parse


def _number_type(cast, ok, what: str, example: str):
    """An argparse type: `cast` the text, accept it if `ok(value)`, else say what was expected."""
    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}, e.g. {example}")
        return value
    return parse


_positive_int = _number_type(int, lambda v: v >= 1, "a positive integer", "--limit 50")
_non_negative_int = _number_type(int, lambda v: v >= 0, "a non-negative integer", "2")
_float = _number_type(float, lambda v: not math.isnan(v), "a number", "0.5")


def _storage_option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not KEY=VALUE, e.g. --storage-option aws_endpoint=http://127.0.0.1:9000")
    return key.strip(), value


def _column_list(text: str) -> list[str]:
    columns = [c.strip() for c in text.split(",") if c.strip()]
    if not columns:
        raise argparse.ArgumentTypeError(f"{text!r} names no columns: use a,b,c, e.g. seq,reward,completion")
    return columns


# ------------------------------------------------------------------ the parser
def build_parser() -> argparse.ArgumentParser:
    where = argparse.ArgumentParser(add_help=False)
    loc = where.add_argument_group("where the runs are")
    one = loc.add_mutually_exclusive_group()
    one.add_argument("--root", default="runs",
                     help="the runs' tracking.root_dir; the database is ROOT/lancedb (default: runs)")
    one.add_argument("--uri", help="a LanceDB database directly (a directory or an object-store URI)")
    loc.add_argument("--storage-option", dest="storage_options", type=_storage_option, action="append",
                     metavar="KEY=VALUE", help="an object-store setting for --uri, as in the run's "
                     "buffer.storage_options (repeat for several); unset keys come from the environment")

    output = argparse.ArgumentParser(add_help=False)
    out = output.add_argument_group("output")
    out.add_argument("--columns", type=_column_list, metavar="A,B,C", help="columns to show, comma-separated")
    out.add_argument("--limit", type=_positive_int, metavar="N",
                     help=f"at most N rows (default: {DEFAULT_TABLE_LIMIT} for table, all rows for files)")
    out.add_argument("--format", choices=["table", "csv", "jsonl", "parquet"], default="table",
                     help="table (default), csv, jsonl or parquet")
    out.add_argument("--output", metavar="FILE", help="write to FILE (required for parquet; csv/jsonl default to stdout)")

    reading = argparse.ArgumentParser(add_help=False)
    reading.add_argument("--skip-damaged", action="store_true",
                         help="read only the intact rows of a damaged table (a warning names each skipped "
                              "file); without it a damaged table is an error naming the repair command")

    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="python -m flows.query",
        description="Read the rollouts and usage records of any run (rollouts_<run_id> and "
                    "usage_<run_id> in the LanceDB database) as a table, CSV, JSONL or Parquet.",
        epilog=EXAMPLES, formatter_class=fmt,
    )
    sub = parser.add_subparsers(dest="command", metavar="{runs,rollouts,usage,summary,migrate,repair}", required=True)

    p = sub.add_parser("runs", parents=[where, output], formatter_class=fmt, epilog=EXAMPLES,
                       help="list the runs: status, steps, accuracy, rollouts, usage records, versions, tags",
                       description="List the runs, newest first. With --root (default: runs), each run's "
                                   "status from its directory: running (with the lease's PID and host), "
                                   "finished, killed (Ctrl-C or SIGTERM), failed, crashed (ended without "
                                   "reporting: kill -9, power cut), or unknown (tables without a run "
                                   "directory under the root); steps done of planned (for a running or "
                                   "crashed run: through its newest checkpoint, where a resume continues); "
                                   "the last held-out accuracy; when it started. The table shows "
                                   + ", ".join(TABLE_RUN_COLUMNS) + " (pid: the lease holder's, for a running "
                                   "run; steps: done/planned); --wide (or --format csv/jsonl) shows every "
                                   "column: steps_done, steps_planned, heldout_accuracy, started_at, holder "
                                   "(PID, host, since), then the tables' figures.")
    p.add_argument("--wide", action="store_true", help="every column in the table format (the holder, "
                   "usage records, policy versions, times, tags)")

    p = sub.add_parser("rollouts", parents=[where, output, reading], formatter_class=fmt, epilog=EXAMPLES,
                       help="a run's rollouts, filtered, with their reuse counts",
                       description="A run's rollouts in append order (seq), with reuse_count: how many "
                                   "learner steps used each. Filters combine with AND.")
    p.add_argument("run_id", metavar="RUN_ID")
    f = p.add_argument_group("filters (ranges are inclusive LO:HI)")
    f.add_argument("--versions", type=_range_type("--versions"), metavar="LO:HI",
                   help="policy versions that generated the rollouts")
    f.add_argument("--steps", type=_range_type("--steps"), metavar="LO:HI", help="generation steps")
    f.add_argument("--reward-min", type=_float, metavar="X", help="reward >= X")
    f.add_argument("--reward-max", type=_float, metavar="X", help="reward <= X")
    c = f.add_mutually_exclusive_group()
    c.add_argument("--correct", dest="correct", action="store_const", const=True, help="only correct rollouts")
    c.add_argument("--incorrect", dest="correct", action="store_const", const=False, help="only incorrect ones")
    f.add_argument("--min-reuse", type=_non_negative_int, metavar="N", help="used at least N times")
    f.add_argument("--max-reuse", type=_non_negative_int, metavar="N", help="used at most N times (0: never)")

    p = sub.add_parser("usage", parents=[where, output, reading], formatter_class=fmt, epilog=EXAMPLES,
                       help="a run's usage records: which rollouts each learner step used",
                       description="A run's usage records, one per (learner step, minibatch position), "
                                   "sorted by learner step.")
    p.add_argument("run_id", metavar="RUN_ID")
    f = p.add_argument_group("filters (ranges are inclusive LO:HI)")
    f.add_argument("--learner-steps", type=_range_type("--learner-steps"), metavar="LO:HI", help="learner steps")
    f.add_argument("--steps", type=_range_type("--steps"), metavar="LO:HI", help="generation steps at use")
    f.add_argument("--versions", type=_range_type("--versions"), metavar="LO:HI",
                   help="the learner's policy version at use")

    p = sub.add_parser("summary", parents=[where, output, reading], formatter_class=fmt, epilog=EXAMPLES,
                       help="per-version statistics, or the staleness or reuse histogram",
                       description="version: rollouts, mean reward, accuracy and mean length per policy "
                                   "version; staleness: uses per staleness; reuse: rollouts per reuse count.")
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument("--by", choices=["version", "staleness", "reuse"], default="version",
                   help="what to summarise (default: version)")

    p = sub.add_parser("migrate", parents=[where], formatter_class=fmt,
                       help="add the columns a rollout table from an older version lacks (null: not recorded)",
                       description="Add the rollout table's columns that came after it was made (per-rollout "
                                   "temperature and top_p) as null columns: a new table version, no stored "
                                   "value changed. Rows with null are re-scored at the run's "
                                   "generator.temperature, as they were before the columns existed.")
    p.add_argument("run_id", metavar="RUN_ID")

    p = sub.add_parser("repair", parents=[where], formatter_class=fmt,
                       help="repair a run's damaged tables: keep every readable row, move the damaged files aside",
                       description="Find the data files of the run's tables that are missing or do not decode "
                                   "(every fragment is read), then write a new table version without them, add "
                                   "back the lost rows that older versions still hold (kept a week after a "
                                   "compaction, and by checkpoint tags), and move the damaged files into "
                                   "<table>.lance/_damaged/<time>/ with a repair.json. Nothing readable is "
                                   "deleted. Reports rows kept, brought back and lost, and the versions.")
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument("--table", choices=["rollouts", "usage", "all"], default="all",
                   help="which table to check and repair (default: all)")
    p.add_argument("--dry-run", action="store_true", help="only report what a repair would do")
    return parser


def _repair(args: argparse.Namespace) -> int:
    """`repair`: the other write this command makes, and only on request."""
    # start-up cost: lancedb, after the arguments are parsed
    from replay_pipeline.buffer import RolloutStore, UsageStore
    from replay_pipeline.buffer.lance_table import StoreError
    from replay_pipeline.buffer.repair import repair_table

    kinds = {"rollouts": [RolloutStore], "usage": [UsageStore], "all": [RolloutStore, UsageStore]}[args.table]
    try:
        uri, opts = _database(args), _options(args)
        if args.run_id not in RolloutStore.list_runs(uri, storage_options=opts) + \
                UsageStore.list_runs(uri, storage_options=opts):
            raise QueryError(f"unknown run id {args.run_id!r}: no rollouts_{args.run_id} or usage_{args.run_id} "
                             f"table in {uri}; `python -m flows.query runs` lists the runs")
        reports = [repair_table(kind.open(uri, args.run_id, storage_options=opts), dry_run=args.dry_run)
                   for kind in kinds if args.run_id in kind.list_runs(uri, storage_options=opts)]
    except (QueryError, StoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for report in reports:
        print("\n".join(report.lines()))
    if any(r.damaged and not r.dry_run for r in reports):
        print(f"resume the run as usual (python -m flows.train resume={args.run_id}): rollouts lost after its "
              "newest checkpoint are generated again; if rows it needs were lost, the resume says which "
              "checkpoint to fork from")
    return 0


def _migrate(args: argparse.Namespace) -> int:
    """`migrate`: the one write this command makes, and only on request."""
    # start-up cost: lancedb, after the arguments are parsed
    from replay_pipeline.buffer import RolloutStore
    from replay_pipeline.buffer.lance_table import StoreError

    try:
        added = RolloutStore.migrate(_database(args), args.run_id, storage_options=_options(args))
    except (QueryError, StoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"rollouts_{args.run_id}: added {', '.join(added)} (null)" if added
          else f"rollouts_{args.run_id}: nothing to migrate")
    return 0


# ------------------------------------------------------------------ commands
class QueryError(Exception):
    """Bad input found by the CLI itself; exit status 2 with this message."""


def _database(args: argparse.Namespace) -> str:
    if args.uri:
        uri = args.uri
        looked = f"--uri {args.uri}"
    else:
        uri = str(Path(args.root) / "lancedb")
        looked = f"--root {args.root}"
    if "://" not in uri or uri.startswith("file://"):
        if args.storage_options:
            raise QueryError(f"--storage-option applies to an object store (--uri s3://bucket/prefix), "
                             f"not the local database {uri}; drop it or pass the run's --uri")
        path = Path(uri.removeprefix("file://")).expanduser().resolve()
        if not path.is_dir():
            raise QueryError(
                f"no LanceDB database at {path} (from {looked}). A training run writes it to "
                f"<tracking.root_dir>/lancedb, e.g. `python -m flows.train tracking.root_dir=runs` "
                f"writes runs/lancedb: pass the run's --root DIR, or --uri PATH of the database"
            )
    return uri


def _database_or_none(args: argparse.Namespace) -> str | None:
    """_database; for `runs` under a root that has run directories but no database yet (every
    run there stopped before it made its tables), None."""
    try:
        return _database(args)
    except QueryError:
        if args.command != "runs" or args.uri:
            raise
        from replay_pipeline.system.runs import list_runs as run_dirs  # start-up cost: after parsing, as analysis
        if not run_dirs(args.root):
            raise
        return None


def _options(args: argparse.Namespace) -> dict[str, str] | None:
    """--storage-option KEY=VALUE pairs as Lance's storage_options (None: the environment's)."""
    return dict(args.storage_options) if args.storage_options else None


def _described(args: argparse.Namespace, flags: list[tuple[str, str]]) -> str:
    parts = []
    for attr, flag in flags:
        value = getattr(args, attr, None)
        if value is None:
            continue
        if isinstance(value, tuple):
            lo, hi = value
            parts.append(f"{flag} {'' if lo is None else lo}:{'' if hi is None else hi}")
        elif attr == "correct":
            parts.append("--correct" if value else "--incorrect")
        else:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


_ROLLOUT_FLAGS = [("versions", "--versions"), ("steps", "--steps"), ("reward_min", "--reward-min"),
                  ("reward_max", "--reward-max"), ("correct", "--correct"), ("min_reuse", "--min-reuse"),
                  ("max_reuse", "--max-reuse")]
_USAGE_FLAGS = [("learner_steps", "--learner-steps"), ("steps", "--steps"), ("versions", "--versions")]


def _limit(args: argparse.Namespace, default_for_table: int | None) -> int | None:
    if args.limit is not None:
        return args.limit
    return default_for_table if args.format == "table" else None


def _cmd_rollouts(analysis: Any, uri: str, args: argparse.Namespace) -> tuple[Any, int, str]:
    filters = {a: getattr(args, a) for a, _ in _ROLLOUT_FLAGS}
    limit = _limit(args, DEFAULT_TABLE_LIMIT)
    columns = args.columns or (TABLE_ROLLOUT_COLUMNS if args.format == "table" else None)
    opts = _options(args)
    result = analysis.rollouts(uri, args.run_id, columns=columns, limit=limit, storage_options=opts, **filters)
    matched = result.num_rows
    if limit is not None and matched == limit:
        matched = analysis.count_rollouts(uri, args.run_id, storage_options=opts, **filters)
    empty = ""
    if matched == 0:
        info = analysis.run_info(uri, args.run_id, storage_options=opts)
        desc = _described(args, _ROLLOUT_FLAGS)
        span = (f"policy versions {info['min_policy_version']}..{info['max_policy_version']}"
                if info["rollouts"] else "no rows yet")
        empty = (f"no rollouts of run {args.run_id} match {desc or 'the query'} "
                 f"(the run has {info['rollouts']} rollouts, {span}, {info['usage_records']} usage records)")
    return result, matched, empty


def _cmd_usage(analysis: Any, uri: str, args: argparse.Namespace) -> tuple[Any, int, str]:
    filters = {a: getattr(args, a) for a, _ in _USAGE_FLAGS}
    limit = _limit(args, DEFAULT_TABLE_LIMIT)
    opts = _options(args)
    result = analysis.usage(uri, args.run_id, columns=args.columns, limit=limit, storage_options=opts, **filters)
    matched = result.num_rows
    if limit is not None and matched == limit:
        matched = analysis.count_usage(uri, args.run_id, storage_options=opts, **filters)
    empty = ""
    if matched == 0:
        total = analysis.count_usage(uri, args.run_id, storage_options=opts)
        if total == 0:
            empty = (f"run {args.run_id} has no usage records (no usage_{args.run_id} table: the run "
                     f"predates the usage log, or no learner step has run yet)")
        else:
            empty = (f"no usage records of run {args.run_id} match {_described(args, _USAGE_FLAGS)} "
                     f"(the run has {total})")
    return result, matched, empty


def _select(table: Any, columns: list[str] | None, what: str) -> Any:
    if columns is None:
        return table
    unknown = [c for c in columns if c not in table.column_names]
    if unknown:
        raise QueryError(f"unknown {what} columns {unknown}; valid columns: {table.column_names}")
    return table.select(columns)


def _cmd_summary(analysis: Any, uri: str, args: argparse.Namespace) -> tuple[Any, int, str]:
    fn = {"version": analysis.per_version_summary, "staleness": analysis.staleness_histogram,
          "reuse": analysis.reuse_histogram}[args.by]
    result = _select(fn(uri, args.run_id, storage_options=_options(args)), args.columns, f"summary --by {args.by}")
    matched = result.num_rows
    if args.limit is not None and matched > args.limit:
        result = result.slice(0, args.limit)
    empty = ""
    if matched == 0:
        empty = (f"run {args.run_id} has no usage records to summarise (no usage_{args.run_id} table, "
                 f"or it is empty)" if args.by == "staleness" else f"run {args.run_id} has no rollouts yet")
    return result, matched, empty


def _with_status(table: Any, root: Path) -> Any:
    """The runs' tables joined with their directories under `root` (a run killed before it made
    its tables is listed too): status, holder, steps done of planned, last held-out accuracy
    and start (replay_pipeline.run.lineage.run_status); newest first."""
    # start-up cost: pyarrow and the lineage module only for this command
    from datetime import timezone

    import pyarrow as pa

    from replay_pipeline.run.lineage import run_status
    from replay_pipeline.system.runs import list_runs as run_dirs

    stored = {row["run_id"]: row for row in table.to_pylist()} if table is not None else {}
    ids = list(dict.fromkeys([*run_dirs(root), *sorted(stored)]))
    rows = []
    for run_id in ids:
        state = run_status(root, run_id) if (root / run_id).is_dir() else {}
        damaged = stored.get(run_id, {}).get("damaged")
        row = {"run_id": run_id, "status": f"damaged: {damaged}" if damaged else state.get("status", "unknown"),
               "steps_done": state.get("steps_done"), "steps_planned": state.get("steps_planned"),
               "heldout_accuracy": state.get("heldout_accuracy"),
               "started_at": datetime.fromisoformat(state["started_at"]).astimezone(timezone.utc)
               if state.get("started_at") else None,
               "holder": state.get("holder")}
        row["pid"] = int(row["holder"].split()[1]) if row["holder"] else None
        rows.append(row | {k: v for k, v in stored.get(run_id, {"rollouts": 0, "usage_records": 0}).items()
                           if k != "run_id"})
    rows.sort(key=lambda r: (r["started_at"] is not None, r["started_at"] or 0, r["run_id"]), reverse=True)
    fields = [pa.field("run_id", pa.string()), pa.field("status", pa.string()), pa.field("steps_done", pa.int64()),
              pa.field("steps_planned", pa.int64()), pa.field("heldout_accuracy", pa.float64()),
              pa.field("started_at", pa.timestamp("s", tz="UTC")),
              pa.field("holder", pa.string()), pa.field("pid", pa.int64())]
    schema = pa.schema(fields + ([f for f in table.schema if f.name != "run_id"] if table is not None else
                                 [pa.field("rollouts", pa.int64()), pa.field("usage_records", pa.int64())]))
    return pa.Table.from_pylist(rows, schema=schema)


def _runs_view(table: Any) -> Any:
    """The table format's runs, to fit a terminal: full id, status, the lease holder's PID,
    steps as done/planned, last held-out accuracy, start to the minute, rollouts."""
    # start-up cost: pyarrow only for this command
    import pyarrow as pa

    rows = table.to_pylist()
    steps = [f"{r['steps_done'] if r['steps_done'] is not None else '?'}/{r['steps_planned'] or '?'}" for r in rows]
    started = [r["started_at"].strftime("%Y-%m-%d %H:%M") if r["started_at"] else None for r in rows]
    return pa.table({"run_id": table.column("run_id"), "status": table.column("status"),
                     "pid": table.column("pid"), "steps": pa.array(steps, pa.string()),
                     "accuracy": table.column("heldout_accuracy"), "started": pa.array(started, pa.string()),
                     "rollouts": table.column("rollouts")})


def _cmd_runs(analysis: Any, uri: str | None, args: argparse.Namespace) -> tuple[Any, int, str]:
    table = analysis.list_runs(uri, storage_options=_options(args)) if uri else None
    if table is not None and table.column("damaged").null_count == table.num_rows:
        table = table.drop_columns(["damaged"])  # shown only when a run has a damaged table
    if not args.uri:
        table = _with_status(table, Path(args.root).expanduser().resolve())
    if args.columns is None and args.format == "table" and not args.wide and not args.uri:
        result = _runs_view(table)
    else:
        result = _select(table, args.columns, "runs")
    matched = result.num_rows
    if args.limit is not None and matched > args.limit:
        result = result.slice(0, args.limit)
    empty = f"no runs in {uri or args.root}: it holds no rollouts_<run_id> tables" if matched == 0 else ""
    return result, matched, empty


COMMANDS = {"runs": _cmd_runs, "rollouts": _cmd_rollouts, "usage": _cmd_usage, "summary": _cmd_summary}


# ------------------------------------------------------------------ rendering
def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, list):
        return "[" + ", ".join(_cell(v) for v in value) + "]"
    text = str(value)
    return text.replace("\n", "\\n").replace("\t", "\\t")


def _truncate(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def render_table(table: Any, width: int, keep: tuple[str, ...] = ("run_id",)) -> tuple[str, list[str]]:
    """The rows as a plain-text table at most ``width`` characters wide, and the names of the
    columns left out because they did not fit.

    Numbers, timestamps and the `keep` columns (run ids: a cut id cannot be pasted into
    resume=) are never truncated (a cut number misleads); long headers are abbreviated first,
    then text and list cells, and only then are columns left out."""
    # start-up cost: pyarrow's writers, only for this output format
    import pyarrow as pa

    names = list(table.column_names)
    cells = {n: [_cell(v) for v in table.column(n).to_pylist()] for n in names}
    exact = {n: n in keep or not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_list(t)
                                  or pa.types.is_large_list(t)) for n, t in zip(names, table.schema.types)}
    numeric = {n: pa.types.is_integer(t) or pa.types.is_floating(t) for n, t in zip(names, table.schema.types)}
    content = {n: max(map(len, cells[n]), default=0) for n in names}
    widths = {n: max(len(n), content[n] if n in keep else min(content[n], MAX_CELL)) for n in names}
    sep = "  "

    def total(cols: list[str]) -> int:
        return sum(widths[c] for c in cols) + len(sep) * (len(cols) - 1)

    def header_floor(n: str, shortest: int) -> int:
        return max(min(content[n], MAX_CELL), min(len(n), shortest))

    def text_floor(n: str, shortest: int) -> int:
        return widths[n] if exact[n] else max(min(len(n), shortest), min(content[n], shortest))

    stages = [lambda n: header_floor(n, 10), lambda n: text_floor(n, 12),
              lambda n: header_floor(n, MIN_CELL), lambda n: text_floor(n, MIN_CELL)]
    shown = list(names)
    for floor in stages:
        while total(shown) > width:
            over = [c for c in shown if widths[c] > floor(c)]
            if not over:
                break
            widths[max(over, key=lambda c: widths[c])] -= 1
    while total(shown) > width and len(shown) > 1:
        shown.pop()

    def line(values: list[str]) -> str:
        out = []
        for c, v in zip(shown, values):
            v = _truncate(v, widths[c])
            out.append(v.rjust(widths[c]) if numeric[c] else v.ljust(widths[c]))
        return sep.join(out).rstrip()

    lines = [line(shown), sep.join("-" * widths[c] for c in shown)]
    lines += [line([cells[c][i] for c in shown]) for i in range(table.num_rows)]
    return "\n".join(lines), [c for c in names if c not in shown]


def _text_ready(table: Any) -> Any:
    """float32 (scalar or list) columns as float64 at float32 precision, for text formats."""
    # start-up cost: pyarrow's writers, only for this output format
    import pyarrow as pa
    import pyarrow.compute as pc

    for i, field in enumerate(table.schema):
        t = field.type
        if pa.types.is_float32(t):
            col = pc.cast(pc.cast(table.column(i), pa.string()), pa.float64())
        elif pa.types.is_list(t) and pa.types.is_float32(t.value_type):
            col = pc.cast(pc.cast(table.column(i), pa.list_(pa.string())), pa.list_(pa.float64()))
        else:
            continue
        table = table.set_column(i, pa.field(field.name, col.type), col)
    return table


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def write_csv(table: Any, sink: Any) -> None:
    """CSV with a header; list columns (token ids, log-probs, tags) as JSON lists."""
    # start-up cost: pyarrow's writers, only for this output format
    import pyarrow as pa
    import pyarrow.csv as pcsv

    table = _text_ready(table)
    for i, field in enumerate(table.schema):
        if pa.types.is_list(field.type) or pa.types.is_large_list(field.type):
            values = [None if v is None else json.dumps(v) for v in table.column(i).to_pylist()]
            table = table.set_column(i, pa.field(field.name, pa.string()), pa.array(values, pa.string()))
    pcsv.write_csv(table, sink)


def write_jsonl(table: Any, sink: Any) -> None:
    """One JSON object per row; lists stay JSON lists, timestamps are ISO 8601."""
    table = _text_ready(table)
    for batch in table.to_batches():
        for row in batch.to_pylist():
            sink.write((json.dumps(row, default=_json_default, ensure_ascii=False) + "\n").encode())


def _emit(args: argparse.Namespace, result: Any, matched: int, empty: str, what: str) -> None:
    if empty:
        print(empty, file=sys.stderr)
    if args.format == "table":
        if matched == 0:
            return
        width = shutil.get_terminal_size((120, 24)).columns
        text, dropped = render_table(result, width)
        notes = []
        if result.num_rows < matched:
            notes.append(f"{matched} {what} matched, the first {result.num_rows} shown "
                         f"(--limit N for more, --format csv --output FILE for all)")
        else:
            notes.append(f"{matched} {what}")
        if dropped:
            notes.append(f"columns left out to fit {width} characters: {', '.join(dropped)} "
                         f"(choose with --columns, or widen the terminal)")
        body = text + "\n" + "\n".join(notes) + "\n"
        if args.output:
            Path(args.output).write_text(body)
        else:
            sys.stdout.write(body)
        return
    if args.format == "parquet":
        # start-up cost: pyarrow's writers, only for this output format
        import pyarrow.parquet as pq

        pq.write_table(result, args.output)
    else:
        writer = write_csv if args.format == "csv" else write_jsonl
        if args.output:
            with open(args.output, "wb") as sink:
                writer(result, sink)
        else:
            sys.stdout.flush()
            writer(result, sys.stdout.buffer)
            sys.stdout.buffer.flush()
    if args.output:
        print(f"wrote {result.num_rows} {what} to {args.output}", file=sys.stderr)


@contextlib.contextmanager
def _reading(analysis: Any, args: argparse.Namespace):
    """--skip-damaged: the command reads only intact rows, and each skipped file gets one
    warning line on stderr (after the command, in the CLI's own words)."""
    if not getattr(args, "skip_damaged", False):
        yield
        return
    with warnings.catch_warnings(), analysis.intact_reads() as skipped:
        warnings.simplefilter("ignore")  # said below, once per file
        yield
    for damaged in skipped.values():
        print(f"warning: skipped {damaged.rows} unreadable rows of run {args.run_id}: data file "
              f"{damaged.describe()}; `python -m flows.query repair {args.run_id}` repairs the table",
              file=sys.stderr)


_WHAT = {"runs": "runs", "rollouts": "rollouts", "usage": "usage records", "summary": "rows"}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("migrate", "repair"):
        return _migrate(args) if args.command == "migrate" else _repair(args)
    if args.format == "parquet" and not args.output:
        parser.error("--format parquet writes a binary file: add --output FILE, e.g. --output rollouts.parquet")
    for lo, hi in (("reward_min", "reward_max"), ("min_reuse", "max_reuse")):
        a, b = getattr(args, lo, None), getattr(args, hi, None)
        if a is not None and b is not None and a > b:
            flag_lo, flag_hi = "--" + lo.replace("_", "-"), "--" + hi.replace("_", "-")
            parser.error(f"{flag_lo} {a} > {flag_hi} {b} matches nothing: give {flag_lo} <= {flag_hi} (both inclusive)")
    try:
        uri = _database_or_none(args)
        from replay_pipeline.reports import analysis  # after parsing: lancedb is slow to import
        from replay_pipeline.buffer.lance_table import StoreError

        with _reading(analysis, args):
            result, matched, empty = COMMANDS[args.command](analysis, uri, args)
    except (QueryError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except StoreError as exc:  # a damaged table: run, table, file, version and the repair command
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        _emit(args, result, matched, empty, _WHAT[args.command])
    except OSError as exc:
        if isinstance(exc, BrokenPipeError):  # `... | head`: the reader left, nothing to report
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        print(f"error: cannot write {args.output or 'the output'}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
