"""The fault table: a small run stopped at each point that matters, by each signal a user or
a machine sends, then resumed, against a run that was never stopped.

    python infra/faults.py                       # every point x SIGINT, SIGTERM, SIGKILL (about 8 min)
    python infra/faults.py --points generate,evaluate --signals SIGINT
    python infra/faults.py --root /tmp/faults --markdown faults.md

SIGINT goes to the run's process group, as Ctrl-C in a terminal sends it; SIGTERM and SIGKILL
to the trainer's PID only, as `kill` does. Each is sent by the run itself when it reaches the
point (replay_pipeline/system/faults.py), which notes the time, so "exit" is the seconds from the
signal to the process's end. For each case it reports: the exit code and the last line
printed, whether a traceback was printed, the MLflow run's status and the Prefect flow run's
state once the process is gone, processes left behind (in the run's session, or its
temporary Prefect server), and after `resume=<id>` to the end: rollouts lost and duplicated
against the unstopped run, and whether rows, usage records and final weights are identical.

Runs use the tests' tiny model (a few seconds of warm start) at one torch thread. The
warm-start cases train the warm start in a cache of their own, so that it really runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from replay_pipeline.config.tiny import tiny_overrides  # noqa: E402
from replay_pipeline.system.faults import ENV, SIGNAL_ENV, SIGNAL_LOG_ENV  # noqa: E402
from replay_pipeline.run.lineage import run_status  # noqa: E402
from replay_pipeline.system.runs import CACHE_ENV  # noqa: E402

TINY = tiny_overrides(1)
STEPS = 20
RUN = [*TINY, f"loop.steps={STEPS}", "loop.checkpoint_every=5", "loop.eval_every=10", "loop.passk_every=10",
       "loop.eval_samples=4", "loop.pass1_samples=4", "buffer.strategy=prioritized", "buffer.reuse_cap=3"]

#: point -> the step (or steps done) it fires at.
POINTS = {"warm_start": 5, "generate": 12, "between_tasks": 9, "evaluate": 10, "checkpoint_write": 15}
SIGNALS = ("SIGINT", "SIGTERM", "SIGKILL")


def _env(root: Path, cache: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, "PREFECT_HOME": str(root / ".prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           CACHE_ENV: str(cache)}
    for key in (ENV, SIGNAL_ENV, SIGNAL_LOG_ENV):
        env.pop(key, None)
    return env | extra


def train(root: Path, cache: Path, args: list[str], extra: dict[str, str] | None = None,
          timeout: float = 600) -> tuple[int, str, int]:
    """The CLI in a session of its own (so SIGINT to its group is a terminal's Ctrl-C);
    returns (exit code, output, pid)."""
    out = root / f"out-{time.time_ns()}.txt"
    with out.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "flows.train", f"tracking.root_dir={root}", *args],
                                cwd=ROOT, env=_env(root, cache, extra or {}), stdout=sink,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        code = proc.wait(timeout=timeout)
    return code, out.read_text(), proc.pid


def left_behind(pid: int) -> list[str]:
    """Processes still in the session the run led, or temporary Prefect servers it started."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            sid = os.getsid(int(entry.name))
        except (OSError, ProcessLookupError):
            continue
        if sid == pid or f"--parent {pid}" in cmd:
            found.append(f"{entry.name}: {cmd[:80]}")
    return found


def mlflow_status(root: Path, run_id: str) -> str:
    with sqlite3.connect(root / "mlflow.db") as db:
        rows = db.execute("SELECT r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                          "WHERE t.key = 'replay_pipeline.run_id' AND t.value = ?", (run_id,)).fetchall()
    return ",".join(s for (s,) in rows) or "none"


def prefect_states(root: Path, run_id: str) -> list[str]:
    """The states of the run's Prefect flow runs, oldest first (from run.json's list)."""
    try:
        ids = json.loads((root / run_id / "run.json").read_text()).get("prefect_flow_runs", [])
    except (OSError, ValueError):
        return []
    db = root / ".prefect" / "prefect.db"
    if not ids or not db.exists():
        return []
    with sqlite3.connect(db) as con:
        states = dict(con.execute(f"SELECT id, state_type FROM flow_run WHERE id IN ({','.join('?' * len(ids))})",
                                  ids).fetchall())
    return [states.get(i, "?") for i in ids]


def fingerprint(root: Path, run_id: str) -> dict:
    from safetensors.torch import load_file

    from replay_pipeline.buffer import RolloutStore
    from replay_pipeline.buffer.usage import UsageStore
    from replay_pipeline.training.checkpoints import list_checkpoints

    # Rollout ids begin with the run id: rows are keyed by their id without it.
    rows = RolloutStore.open(root / "lancedb", run_id).window(
        1_000_000, columns=["seq", "step", "rollout_id", "reward", "completion_ids", "behaviour_logprobs",
                            "advantage"]).to_pylist()
    usage = UsageStore.open(root / "lancedb", run_id).rows(
        columns=["learner_step", "position", "rollout_seq", "rollout_id"]).to_pylist()
    for row in [*rows, *usage]:
        row["rollout_id"] = row["rollout_id"].split("/", 1)[1]
    ckpts = list_checkpoints(root / run_id / "checkpoints")
    weights = load_file(next((ckpts[-1] / "model").glob("*.safetensors"))) if ckpts else {}
    return {"rows": rows, "usage": usage, "weights": {k: v.numpy().tobytes() for k, v in weights.items()}}


def compare(mine: dict, ref: dict) -> dict:
    ids = [r["rollout_id"] for r in mine["rows"]]
    ref_ids = {r["rollout_id"] for r in ref["rows"]}
    return {"lost": len(ref_ids - set(ids)), "duplicated": len(ids) - len(set(ids)),
            "identical": mine["rows"] == ref["rows"] and mine["usage"] == ref["usage"]
            and mine["weights"] == ref["weights"]}


def one_case(root: Path, cache: Path, point: str, signame: str, ref: dict,
             env: dict[str, str] | None = None) -> dict:
    """Stop a run at `point` by `signame`, then resume it, against the unstopped `ref`; `env`
    adds to both processes' environment (e.g. a PREFECT_API_URL: the tests' shared server)."""
    run_id = f"{point}-{signame.lower()}"
    step = POINTS[point]
    sig_log = root / f"{run_id}.signal"
    if point == "warm_start":
        cache = root / f"cache-{run_id}"  # a cold cache: the warm start really trains
    spec = {ENV: f"{point}:{step}"} if signame == "SIGKILL" else {SIGNAL_ENV: f"{point}:{step}:{signame}",
                                                                  SIGNAL_LOG_ENV: str(sig_log)}
    code, out, pid = train(root, cache, [*RUN, f"run_id={run_id}"], {**(env or {}), **spec})
    ended = time.time()
    sent = float(sig_log.read_text()) if sig_log.exists() else None
    time.sleep(2)
    lines = [ln for ln in out.splitlines() if ln.strip()]
    case = {"point": f"{point} ({step})", "signal": signame, "exit_code": code,
            "exit_seconds": round(ended - sent, 1) if sent else None,
            "traceback": "Traceback" in out, "last_line": lines[-1][:160] if lines else "",
            "mlflow": mlflow_status(root, run_id), "prefect": "/".join(prefect_states(root, run_id)),
            "left_behind": left_behind(pid), "status": run_status(root, run_id)["status"]}
    rcode, rout, _ = train(root, cache, [f"resume={run_id}"], env)
    case["resume_exit_code"] = rcode
    case["mlflow_after_resume"] = mlflow_status(root, run_id)
    case["prefect_after_resume"] = "/".join(prefect_states(root, run_id))
    case |= compare(fingerprint(root, run_id), ref) if rcode == 0 else {"lost": None, "duplicated": None,
                                                                         "identical": False,
                                                                         "resume_output": rout[-1500:]}
    return case


def table(cases: list[dict]) -> str:
    head = ("| point (step) | signal | exit | seconds to exit | traceback | `flows.query runs` | MLflow | Prefect "
            "| left behind | resumed: lost / duplicated rows | identical to the unstopped run |")
    lines = [head, "|" + "---|" * 11]
    for c in cases:
        seconds = c["exit_seconds"] if c["exit_seconds"] is not None else "at once (the kernel)"
        lines.append(f"| {c['point']} | {c['signal']} | {c['exit_code']} | {seconds} | "
                     f"{'yes' if c['traceback'] else 'no'} | {c['status']} | {c['mlflow']} (then {c['mlflow_after_resume']}) | "
                     f"{c['prefect']} (then {c['prefect_after_resume']}) | {len(c['left_behind'])} | "
                     f"{c['lost']} / {c['duplicated']} | {'yes' if c['identical'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=None, help="where the runs go (default: a new temp dir)")
    parser.add_argument("--points", default=",".join(POINTS), help=f"comma-separated, of {', '.join(POINTS)}")
    parser.add_argument("--signals", default=",".join(SIGNALS), help="comma-separated, of " + ", ".join(SIGNALS))
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    points = [p for p in args.points.split(",") if p]
    signals = [s for s in args.signals.split(",") if s]
    bad = [p for p in points if p not in POINTS] + [s for s in signals if s not in SIGNALS]
    if bad:
        parser.error(f"unknown {bad}: points are {list(POINTS)}, signals {list(SIGNALS)}")
    root = (args.root or Path(tempfile.mkdtemp(prefix="rp-faults-"))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    cache = root / "cache"
    start = time.time()
    code, out, _ = train(root, cache, [*RUN, "run_id=unstopped"])
    if code != 0:
        print(out[-3000:], file=sys.stderr)
        return 1
    ref = fingerprint(root, "unstopped")
    cases = []
    for point in points:
        for signame in signals:
            case = one_case(root, cache, point, signame, ref)
            cases.append(case)
            print(json.dumps({k: v for k, v in case.items() if k != "resume_output"}), flush=True)
    (root / "faults.json").write_text(json.dumps(cases, indent=2))
    text = table(cases)
    print(f"\n{text}\n\n{len(cases)} cases in {time.time() - start:.0f} s; runs under {root}")
    if args.markdown:
        args.markdown.write_text(text + "\n")
    ok = all(c["identical"] and c["lost"] == 0 and c["duplicated"] == 0 and not c["left_behind"] for c in cases)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
