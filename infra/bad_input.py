"""The bad-input table: `python -m flows.train` given one wrong thing at a time (a typo on the
command line, a damaged data file, an incomplete model directory, a run id that is taken, a
server that does not answer, ...), each of which should be refused before any work with exit
code 2 and one clear `error:` line.

    python infra/bad_input.py                              # every case (a few minutes)
    python infra/bad_input.py --cases unknown-key,jsonl-empty,run-id-exists
    python infra/bad_input.py --root /tmp/bad-input --markdown /tmp/bad-input/table.md

Each case runs the real CLI in a subprocess (its own session; PREFECT_HOME inside the root, no
Prefect analytics, one torch thread for anything that would train) and records: the input
(the command-line difference, or the defect of the file it is given), the first `error:` line
of stderr (when that line only heads a list, "Invalid configuration:", the list's first item
is joined to it), the exit code, the seconds from start to exit, whether a traceback was
printed, how many lines were printed, and, for cases that touch an existing run, whether its
rollout and usage row counts and its checkpoint list are the same after as before ("n/a"
where nothing was stored; for `damaged-resume` also whether the damaged run's file list, paths
and sizes, is the same: nothing written). One JSON line is printed per case (the error line
whole), then a markdown table, and "N cases in S s". Cases that are not refused have another
line in the error column: `damaged-runs` the first output line with `damaged:` (else the
first that names the run `damaged`: the runs listing's row for it), `damaged-skip` its
`warning: skipped` line, `damaged-repair-resume` the first output line of the repair it runs
first (with the repair's exit code when that is not 0); the exit code is the resume's. A case
over SLOW seconds (a case that trains: its own limit) is marked slow.

Set-up, made under the root and only what the chosen cases need (nothing is downloaded):
- `hf/`: tiny Hugging Face model directories (replay_pipeline.models.tiny: one complete, one
  without tokenizer, one without weights, one whose tokenizer has more tokens than the
  model's vocab_size) and `data/`: GSM8K-style JSONL files (one good, one per defect); the
  two are combined so that each case has exactly one thing wrong;
- `existing`: a 3-step run of the tests' tiny model (checkpoints at steps 2 and 3);
- `custom-existing`: a 3-step run of a custom task whose file (a copy of
  replay_pipeline/tasks/template.py under the root) the case then deletes;
- `damaged`: the `existing` run's settings under run id `damaged` (with `existing` in the same
  root), rebuilt from scratch on every call, then 64 bytes 0xff (zeros can still decode)
  written over the middle of the largest file under `lancedb/rollouts_damaged.lance/data/`.
Runs already there from an earlier call with the same root are reused (but `damaged`).

Cases that are not a flows.train command line alone:
- `cfg-head`: `python -m flows.train --cfg | head -3` through `bash -c` with `set -o pipefail`
  (the exit code is python's when it is not 0); expected 0 and no `BrokenPipeError` in stderr;
- `damaged-runs`: `python -m flows.query runs --root ROOT`; expected 0, `existing` listed as
  finished and `damaged` listed (the listing reads light columns only: bytes overwritten in
  other columns' pages are found by the reads that meet them);
- `damaged-read`: `python -m flows.query rollouts damaged`; expected 2, the `error:` line naming
  the table, the file and the repair command; `damaged-skip`: the same with `--skip-damaged`,
  expected 0 with a `warning: skipped` line;
- `damaged-resume`: `resume=damaged loop.steps=5`; expected 2, the `error:` line naming the table
  (`rollouts_damaged`), the file and `python -m flows.query repair damaged`, nothing written;
- `damaged-repair-resume`: `python -m flows.query repair damaged --root ROOT`, then the same
  resume: the file holds rows the checkpoint at step 3 read, so an exact resume is refused
  (expected 2) naming the fork that goes on with every readable row; `damaged-repair-fork`:
  that fork, `fork=damaged@3 loop.steps=5`, expected 0. Both change the damaged run, so they
  run after the other damaged cases (whatever the order --cases gives).
`ok-hf` and `ok-builtin` are controls: the base command lines of the other cases with `--cfg`, which runs
the same pre-flight checks and exits 0, so a refusal is the defect's and not the base's.

Exit code 0 when every case exited as expected (2; 0 for help, the controls, `cfg-head`,
`damaged-runs`, `damaged-skip` and `damaged-repair-fork`) without a traceback, with its run's data intact and,
for the cases above that check their output, that output as expected; else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from replay_pipeline.config.tiny import tiny_overrides  # noqa: E402

TINY = tiny_overrides(1)
EXISTING = [*TINY, "loop.steps=3", "loop.checkpoint_every=2", "loop.eval_every=0", "loop.passk_every=0",
            "run_id=existing"]
CUSTOM_RUN = "custom-existing"
#: A small run of model=hf on the GSM8K-style file, the base the data and model cases vary.
HF_SMALL = ["task.heldout_size=4", "task.validation_size=2", "generator.max_new_tokens=16", "loop.steps=2",
            "loop.prompts_per_step=2", "loop.group_size=2", "loop.minibatch_size=4", "buffer.capacity=8",
            "loop.eval_every=0", "loop.passk_every=0", "tracking.progress=false", "model.torch_threads=1"]
BUILTIN_SMALL = [*TINY, "loop.steps=2", "loop.eval_every=0", "loop.passk_every=0"]
#: TINY for a custom task (task.digits is the addition task's alone, refused otherwise).
CUSTOM_TINY = [a for a in TINY if not a.startswith("task.digits=")]

GSM8K_ROWS = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
               "answer": f"He has {a}+{b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"}
              for a, b in [(3, 4), (10, 5), (7, 8), (12, 30), (1, 1), (100, 250), (45, 55), (9, 9), (0, 6),
                           (21, 21), (33, 4), (600, 400), (2, 7), (8, 80)]]
EXTRA_COUNT = 6
"""Characters the data does not use that the vocab-mismatch tokenizer has, and its model not."""

CASE_TIMEOUT = 240.0
SLOW = 10.0


# ------------------------------------------------------------------ running the CLI
def _env(root: Path, extra: dict[str, str]) -> dict[str, str]:
    from replay_pipeline.system.faults import ENV, SIGNAL_ENV, SIGNAL_LOG_ENV
    from replay_pipeline.system.runs import CACHE_ENV

    env = {**os.environ, "PREFECT_HOME": str(root / ".prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           CACHE_ENV: str(root / "cache")}
    for key in (ENV, SIGNAL_ENV, SIGNAL_LOG_ENV, "PREFECT_API_URL"):
        env.pop(key, None)
    return env | extra


def train(root: Path, args: list[str], extra: dict[str, str] | None = None,
          timeout: float = CASE_TIMEOUT) -> dict:
    """`python -m flows.train ARGS` in a session of its own; its exit code (None: killed at
    the timeout), stdout, stderr and wall seconds. Whatever the run left in its session (a
    temporary Prefect server) is ended with it."""
    return cli(root, [sys.executable, "-m", "flows.train", *args], extra, timeout)


def cli(root: Path, command: list[str], extra: dict[str, str] | None = None,
        timeout: float = CASE_TIMEOUT) -> dict:
    """`command` (a whole argv: another module, or `bash -c ...`) as train() runs flows.train."""
    tag = time.time_ns()
    out, err = root / "logs" / f"{tag}.out", root / "logs" / f"{tag}.err"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as fo, err.open("w") as fe:
        started = time.perf_counter()
        proc = subprocess.Popen(command, cwd=ROOT, env=_env(root, extra or {}),
                                stdout=fo, stderr=fe, text=True, start_new_session=True)
        try:
            code: Optional[int] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        seconds = time.perf_counter() - started
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if code is None:
            proc.wait()
    return {"code": code, "stdout": out.read_text(errors="replace"), "stderr": err.read_text(errors="replace"),
            "seconds": seconds}


def error_line(stderr: str) -> str:
    """The first line starting with `error:`; a line that only heads a list (ends with ':')
    gets the list's first item joined to it."""
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("error:"):
            if line.rstrip().endswith(":") and i + 1 < len(lines) and lines[i + 1].strip():
                return f"{line.rstrip()} {lines[i + 1].strip()}"
            return line.rstrip()
    return ""


def matching_line(output: str, needle: str) -> str:
    """The first line of `output` that contains `needle` (for the cases whose column is not an
    `error:` line)."""
    return next((line.rstrip() for line in output.splitlines() if needle in line), "")


def free_port() -> int:
    """A local port where nothing listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------ set-up
@dataclass
class Paths:
    root: Path
    corrupted: Optional[Path] = None  # the damaged run's data file that set-up overwrote

    @property
    def hf(self) -> Path:
        return self.root / "hf"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def task_file(self) -> Path:
        return self.root / "tasks" / "digit_sum.py"

    def model(self, kind: str) -> Path:
        return self.hf / kind

    def jsonl(self, kind: str) -> Path:
        return self.data / f"{kind}.jsonl"


def _chars() -> str:
    from replay_pipeline.tasks.math import GSM8K_TEMPLATE

    text = GSM8K_TEMPLATE + "".join(r["question"] + r["answer"] for r in GSM8K_ROWS) + "0123456789+=#"
    return "".join(sorted(set(text)))


def make_hf(paths: Paths) -> None:
    """The model directories and the data files (rebuilt on every call: seconds)."""
    from replay_pipeline.models.tiny import build_tiny_model, build_tokenizer

    for folder in (paths.hf, paths.data):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    chars = _chars()
    extra = "".join([c for c in "XZ@$%&~^|{}[]" if c not in chars][:EXTRA_COUNT])
    tok = build_tokenizer(chars)
    model = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    model.save_pretrained(paths.model("good"))
    tok.save_pretrained(paths.model("good"))
    model.save_pretrained(paths.model("no-tokenizer"))
    model.config.save_pretrained(paths.model("no-weights"))
    tok.save_pretrained(paths.model("no-weights"))
    model.save_pretrained(paths.model("vocab-mismatch"))
    build_tokenizer(chars + extra).save_pretrained(paths.model("vocab-mismatch"))

    lines = [json.dumps(r) for r in GSM8K_ROWS]
    paths.jsonl("good").write_text("\n".join(lines) + "\n", encoding="utf-8")
    paths.jsonl("missing-field").write_text("".join(json.dumps({"question": r["question"]}) + "\n"
                                                    for r in GSM8K_ROWS), encoding="utf-8")
    raw = [line.encode("utf-8") for line in lines]
    raw[2] = raw[2].replace(b"Tom has", b"Tom \xff\xfe has", 1)  # row 3: two bytes that are not UTF-8
    paths.jsonl("not-utf8").write_bytes(b"\n".join(raw) + b"\n")
    paths.jsonl("empty").write_bytes(b"")


def _complete(root: Path, run_id: str) -> bool:
    from replay_pipeline.training.checkpoints import list_checkpoints

    return (root / run_id / "config.yaml").is_file() and bool(list_checkpoints(root / run_id / "checkpoints"))


def make_run(paths: Paths, run_id: str, args: list[str]) -> None:
    """A finished small run (reused when an earlier call made it)."""
    root = paths.root
    if _complete(root, run_id):
        return
    if (root / run_id).exists():
        raise SystemExit(f"{root / run_id} is an incomplete run from an earlier call; give a fresh --root")
    done = train(root, [f"tracking.root_dir={root}", *args], timeout=600)
    if done["code"] != 0 or not _complete(root, run_id):
        raise SystemExit(f"set-up run {run_id} failed (exit {done['code']}):\n"
                         f"{done['stdout'][-2000:]}\n{done['stderr'][-3000:]}")


def make_existing(paths: Paths) -> None:
    make_run(paths, "existing", EXISTING)


def make_custom_existing(paths: Paths) -> None:
    if not _complete(paths.root, CUSTOM_RUN):
        paths.task_file.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "replay_pipeline" / "tasks" / "template.py", paths.task_file)
    make_run(paths, CUSTOM_RUN, [*CUSTOM_TINY, "model.warmstart.target_accuracy=0.0", "task=custom",
                                 f"task.target={paths.task_file}:make_task", "task.heldout_size=20",
                                 "task.validation_size=20", "loop.steps=3", "loop.checkpoint_every=2",
                                 "loop.eval_every=0", "loop.passk_every=0", f"run_id={CUSTOM_RUN}"])


DAMAGED_RUN = "damaged"
DAMAGED = [*[a for a in EXISTING if not a.startswith("run_id=")], f"run_id={DAMAGED_RUN}"]
CORRUPT_BYTES = 64


def _damaged_tables(root: Path) -> list[Path]:
    return [root / "lancedb" / f"{kind}_{DAMAGED_RUN}.lance" for kind in ("rollouts", "usage")]


def make_damaged(paths: Paths) -> None:
    """The `damaged` run, rebuilt from scratch on every call (a repair case changes it): the
    `existing` run's settings under its own run id, then CORRUPT_BYTES bytes 0xff (zeros can
    still decode) written over the middle of the largest data file of its rollout table."""
    root = paths.root
    for path in (root / DAMAGED_RUN, *_damaged_tables(root)):
        shutil.rmtree(path, ignore_errors=True)
    make_run(paths, DAMAGED_RUN, DAMAGED)
    files = sorted((f for f in (_damaged_tables(root)[0] / "data").iterdir() if f.is_file()),
                   key=lambda f: (-f.stat().st_size, f.name))
    if not files:
        raise SystemExit(f"set-up run {DAMAGED_RUN} has no rollout data files")
    target = files[0]
    with target.open("r+b") as fh:
        fh.seek(max(0, target.stat().st_size // 2 - CORRUPT_BYTES // 2))
        fh.write(b"\xff" * CORRUPT_BYTES)
    paths.corrupted = target


SETUPS: dict[str, Callable[[Paths], None]] = {"hf": make_hf, "existing": make_existing,
                                              "custom-existing": make_custom_existing, "damaged": make_damaged}


def snapshot(root: Path, run_id: str) -> dict:
    """Row counts of the run's rollout and usage tables and its checkpoints."""
    from replay_pipeline.buffer import RolloutStore
    from replay_pipeline.buffer.usage import UsageStore
    from replay_pipeline.training.checkpoints import list_checkpoints

    return {"rollouts": RolloutStore.open(root / "lancedb", run_id).count(),
            "usage": UsageStore.open(root / "lancedb", run_id).count(),
            "checkpoints": [p.name for p in list_checkpoints(root / run_id / "checkpoints")]}


def file_list(root: Path, run_id: str) -> list[str]:
    """Every file of the run (its directory and both tables) with its size: a run that nothing
    wrote to has the same list after as before."""
    tops = [root / run_id, root / "lancedb" / f"rollouts_{run_id}.lance", root / "lancedb" / f"usage_{run_id}.lance"]
    return sorted(f"{f.relative_to(root)} {f.stat().st_size}" for top in tops if top.exists()
                  for f in top.rglob("*") if f.is_file())


# ------------------------------------------------------------------ the cases
@dataclass
class Case:
    input: str
    args: list[str]
    needs: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    run: Optional[str] = None  # the existing run it touches (data intact check)
    expect: int = 2
    prepare: Optional[Callable[[], Optional[str]]] = None  # a str it returns is the error column
    command: Optional[list[str]] = None  # a whole argv instead of flows.train ARGS (args unused)
    files: Optional[str] = None  # a run whose file list must stay the same (data intact check)
    match: tuple[str, ...] = ()  # the error column: the first output line with the first of these found
    check: Optional[Callable[[dict], list[str]]] = None  # more problems, from the finished command
    slow: float = 0.0  # seconds over which the case is slow (0: SLOW)


def _hf(paths: Paths, model: str = "good", data: str = "good") -> list[str]:
    return ["model=hf", f"model.path={paths.model(model)}", "task=gsm8k", f"task.path={paths.jsonl(data)}",
            *HF_SMALL]


def cases(paths: Paths) -> dict[str, Case]:
    # Command-line errors get the difference alone (their message repeats every override);
    # the rest the small run's settings, so that a case that is not refused trains briefly.
    b, one = BUILTIN_SMALL, ["model.torch_threads=1"]
    damage = ("existing", "damaged")

    def query(*words: str) -> list[str]:
        return [sys.executable, "-m", "flows.query", *words, "--root", str(paths.root)]

    return {
        "help": Case("`--help`", ["--help"], expect=0),
        "unknown-key": Case("`loop.stepz=4`", ["loop.stepz=4", *one]),
        "plus-typo": Case("`+loop.setps=5`", ["+loop.setps=5", *one]),
        "not-a-number": Case("`algo.lr=abc`", ["algo.lr=abc", *one]),
        "unknown-flag": Case("`--bogus`", ["--bogus", *one]),
        "jsonl-missing-field": Case("task.path: JSONL rows without `answer`", _hf(paths, data="missing-field"),
                                    ("hf",)),
        "jsonl-not-utf8": Case("task.path: JSONL with bytes 0xff 0xfe in row 3", _hf(paths, data="not-utf8"), ("hf",)),
        "jsonl-empty": Case("task.path: an empty JSONL", _hf(paths, data="empty"), ("hf",)),
        "data-missing": Case("task.path: a file that does not exist", _hf(paths, data="missing"), ("hf",)),
        "model-no-tokenizer": Case("model.path: model saved, no tokenizer", _hf(paths, model="no-tokenizer"), ("hf",)),
        "model-no-weights": Case("model.path: config + tokenizer, no weights", _hf(paths, model="no-weights"),
                                 ("hf",)),
        "model-vocab-mismatch": Case(f"model.path: tokenizer +{EXTRA_COUNT} tokens over the model's vocab_size",
                                     _hf(paths, model="vocab-mismatch"), ("hf",)),
        "too-long-generation": Case("`generator.max_new_tokens=200` (built-in model)",
                                    [*b, "generator.max_new_tokens=200"]),
        "run-id-exists": Case("`run_id=existing`", [*b, "run_id=existing"], ("existing",), run="existing"),
        "resume-unknown": Case("`resume=nope`", ["resume=nope"]),
        "fork-bad-step": Case("`fork=existing@999`", [*b, "fork=existing@999"], ("existing",), run="existing"),
        "disk-too-small": Case("`loop.steps=2000000000`", [*b, "loop.steps=2000000000"]),
        "mlflow-silent": Case("`tracking.mlflow_uri=http://127.0.0.1:<free port>`",
                              [*b, f"tracking.mlflow_uri=http://127.0.0.1:{free_port()}"]),
        "prefect-silent": Case("env `PREFECT_API_URL=http://127.0.0.1:<free port>/api`", b,
                               env={"PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api"}),
        "custom-task-missing": Case("`task=custom task.target=/no/such/file.py:make_task`",
                                    [*CUSTOM_TINY, "loop.steps=2", "task=custom",
                                     "task.target=/no/such/file.py:make_task"]),
        "reward-term-missing": Case("`+reward.terms.x.target=/no/such.py:f`",
                                    [*b, "+reward.terms.x.target=/no/such.py:f"]),
        "reward-term-bad-key": Case("`+reward.terms.x.target=m:f +reward.terms.x.wieght=1`",
                                    [*b, "+reward.terms.x.target=m:f", "+reward.terms.x.wieght=1"]),
        "chat-template-none": Case("`generator.chat_template=true`, tiny HF tokenizer (no template)",
                                   [*_hf(paths), "generator.chat_template=true"], ("hf",)),
        "config-dir-missing": Case("`--config-dir /no/such/dir`", ["--config-dir", "/no/such/dir", *one]),
        "resume-task-file-gone": Case(f"`resume={CUSTOM_RUN} loop.steps=5`, its task file deleted",
                                      [f"resume={CUSTOM_RUN}", "loop.steps=5"], ("custom-existing",),
                                      run=CUSTOM_RUN, prepare=lambda: paths.task_file.unlink(missing_ok=True)),
        "cfg-head": Case("`--cfg | head -3` (bash, `set -o pipefail`)", [], expect=0,
                         command=["bash", "-c", f"set -o pipefail; {shlex.quote(sys.executable)} -m flows.train "
                                  f"tracking.root_dir={shlex.quote(str(paths.root))} --cfg | head -3"],
                         check=lambda done: ["BrokenPipeError"] if "BrokenPipeError" in done["stderr"] else []),
        "damaged-runs": Case(f"`python -m flows.query runs`, run `{DAMAGED_RUN}`: {CORRUPT_BYTES} bytes 0xff "
                             "in its largest rollout data file", [], damage, run="existing", expect=0,
                             command=query("runs"), match=("damaged:", DAMAGED_RUN), check=_runs_listed),
        "damaged-read": Case(f"`python -m flows.query rollouts {DAMAGED_RUN}`, that run damaged", [], damage,
                             run="existing", files=DAMAGED_RUN, command=query("rollouts", DAMAGED_RUN),
                             check=lambda done: _names_damage(paths, done)),
        "damaged-skip": Case(f"`python -m flows.query rollouts {DAMAGED_RUN} --skip-damaged`", [], damage,
                             run="existing", files=DAMAGED_RUN, expect=0, match=("warning: skipped",),
                             command=query("rollouts", DAMAGED_RUN, "--skip-damaged")),
        "damaged-resume": Case(f"`resume={DAMAGED_RUN} loop.steps=5`, that run damaged",
                               [f"resume={DAMAGED_RUN}", "loop.steps=5"], damage, run="existing",
                               files=DAMAGED_RUN, check=lambda done: _names_damage(paths, done)),
        "damaged-repair-resume": Case(f"`python -m flows.query repair {DAMAGED_RUN}`, then "
                                      f"`resume={DAMAGED_RUN} loop.steps=5` (rows the checkpoint read were lost)",
                                      [f"resume={DAMAGED_RUN}", "loop.steps=5"], damage, run="existing",
                                      prepare=lambda: _repair(paths),
                                      check=lambda done: [] if f"fork={DAMAGED_RUN}@3" in done["stderr"]
                                      else ["the refusal does not name the fork to make"]),
        "damaged-repair-fork": Case(f"after the repair, `fork={DAMAGED_RUN}@3 loop.steps=5` (every readable row "
                                    "kept)", [f"fork={DAMAGED_RUN}@3", "loop.steps=5"], damage, run="existing",
                                    expect=0, slow=120.0),
        "ok-hf": Case("control: the model/data cases' base, `--cfg`", [*_hf(paths), "--cfg"], ("hf",), expect=0),
        "ok-builtin": Case("control: the built-in cases' base, `--cfg`", [*b, "--cfg"], expect=0),
    }


def _runs_listed(done: dict) -> list[str]:
    """`flows.query runs`: `existing` listed as finished, the damaged run listed too (as
    `damaged: <file>` when the damage is in the columns the listing reads or a file is missing;
    damage inside other columns' pages is found by the reads that meet it: damaged-read)."""
    lines = done["stdout"].splitlines()
    problems = []
    if not any("existing" in line and "finished" in line and "damaged" not in line for line in lines):
        problems.append("existing not listed as finished")
    if not any(DAMAGED_RUN in line for line in lines):
        problems.append(f"{DAMAGED_RUN} not listed")
    return problems


def _names_damage(paths: Paths, done: dict) -> list[str]:
    """The refused resume's `error:` line names the table, the file and the repair command."""
    line = error_line(done["stderr"])
    wanted = {"table": f"rollouts_{DAMAGED_RUN}", "file": paths.corrupted.name if paths.corrupted else "?",
              "repair command": f"python -m flows.query repair {DAMAGED_RUN}"}
    return [f"error line lacks the {what}" for what, text in wanted.items() if text not in line]


def _repair(paths: Paths) -> str:
    """`flows.query repair` of the damaged run; its first output line (its exit code too when not 0)."""
    done = cli(paths.root, [sys.executable, "-m", "flows.query", "repair", DAMAGED_RUN, "--root", str(paths.root)])
    first = next((ln.strip() for ln in (done["stdout"] + done["stderr"]).splitlines() if ln.strip()), "")
    return first if done["code"] == 0 else f"repair exit {done['code']}: {first}"


def _short(state: Optional[dict]) -> Optional[dict]:
    """The state for the JSON line: a file list as its length (what changed is listed apart)."""
    return state if not state or "files" not in state else state | {"files": len(state["files"])}


def one_case(paths: Paths, name: str, case: Case) -> dict:
    root = paths.root
    note = case.prepare() if case.prepare else None

    def state() -> Optional[dict]:
        if not (case.run or case.files):
            return None
        return ({"run": snapshot(root, case.run)} if case.run else {}) | \
            ({"files": file_list(root, case.files)} if case.files else {})

    before = state()
    if case.command:
        done = cli(root, case.command, case.env)
    else:
        args = case.args if case.args[:1] == ["--help"] else [f"tracking.root_dir={root}", *case.args]
        done = train(root, args, case.env)
    after = state()
    output = done["stdout"] + done["stderr"]
    intact = "n/a" if before is None else ("yes" if before == after else "NO")
    error = note if note is not None else (next(filter(None, (matching_line(output, m) for m in case.match)), "")
                                           if case.match else error_line(done["stderr"]))
    result = {"case": name, "input": case.input, "error": error, "exit_code": done["code"],
              "expected": case.expect, "seconds": round(done["seconds"], 2), "traceback": "Traceback" in output,
              "output_lines": len([ln for ln in output.splitlines() if ln.strip()]), "data_intact": intact,
              "before": _short(before), "after": _short(after)}
    if before and "files" in before and before["files"] != after["files"]:
        result["files_added"] = sorted(set(after["files"]) - set(before["files"]))
        result["files_removed"] = sorted(set(before["files"]) - set(after["files"]))
    problems = []
    if done["code"] != case.expect:
        problems.append(f"exit {done['code']}")
    if result["traceback"]:
        problems.append("traceback")
    if intact == "NO":
        problems.append("data changed")
    if case.expect == 2 and not result["error"]:
        problems.append("no error: line")
    checked = case.check(done) if case.check else []
    problems += checked
    slow = case.slow or SLOW
    if done["seconds"] > slow:
        problems.append(f"> {slow:.0f} s")
    result["problems"], result["checks_failed"] = problems, checked
    if problems:
        result["stdout_tail"], result["stderr_tail"] = done["stdout"][-1500:], done["stderr"][-3000:]
    return result


def _cell(text: str, limit: int | None = None) -> str:
    text = " ".join(str(text).split())
    if limit and len(text) > limit:
        text = text[: limit - 1] + "…"
    return text.replace("|", "\\|")


def table(results: list[dict]) -> str:
    lines = ["| case | input | first `error:` line | exit | seconds | traceback | output lines | data intact "
             "| as expected |", "|" + "---|" * 9]
    for r in results:
        error = f"`{_cell(r['error'], 160)}`" if r["error"] else "—"
        lines.append(f"| {r['case']} | {_cell(r['input'])} | {error} | "
                     f"{'timeout' if r['exit_code'] is None else r['exit_code']} | {r['seconds']:.1f} | "
                     f"{'yes' if r['traceback'] else 'no'} | {r['output_lines']} | {r['data_intact']} | "
                     f"{'yes' if not r['problems'] else 'NO: ' + ', '.join(r['problems'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=None, help="where the runs go (default: a new temp dir)")
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    root = (args.root or Path(tempfile.mkdtemp(prefix="rp-bad-input-"))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    paths = Paths(root)
    every = cases(paths)
    chosen = [c for c in args.cases.split(",") if c] if args.cases else list(every)
    # the repair changes the damaged run: it goes after the cases that need the run damaged
    for late in ("damaged-repair-resume", "damaged-repair-fork"):  # they change the damaged run: last, in order
        if late in chosen:
            chosen.remove(late)
            chosen.append(late)
    bad = [c for c in chosen if c not in every]
    if bad:
        parser.error(f"unknown case(s) {bad}; cases are {', '.join(every)}")
    start = time.perf_counter()
    needs = {n for c in chosen for n in every[c].needs}
    for name, make in SETUPS.items():  # in this order: the runs reuse nothing of hf/
        if name in needs:
            began = time.perf_counter()
            make(paths)
            print(f"set-up {name}: {time.perf_counter() - began:.1f} s", flush=True)
    setup_seconds = time.perf_counter() - start
    results = []
    for name in chosen:
        result = one_case(paths, name, every[name])
        results.append(result)
        print(json.dumps(result), flush=True)
    (root / "bad_input.json").write_text(json.dumps(results, indent=2))
    text = table(results)
    total = time.perf_counter() - start
    print(f"\n{text}\n\n{len(results)} cases in {total:.0f} s (set-up {setup_seconds:.0f} s of it; "
          f"cases {sum(r['seconds'] for r in results):.0f} s); runs under {root}")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text + "\n")
    ok = all(r["exit_code"] == r["expected"] and not r["traceback"] and r["data_intact"] != "NO"
             and not r["checks_failed"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
