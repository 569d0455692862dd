"""Guard rails, as a user meets them (issue 22), with real processes: a second driver on a
live run is refused before any work and the first ends as if it had been alone; Ctrl-C and
SIGTERM at each kind of point end the run within seconds with one line, MLflow KILLED, the
Prefect flow run CANCELLED and no process left behind; a kill before the first checkpoint
(in the warm start) resumes. Every stopped run, resumed, ends identical to one never stopped.
The cases are infra/faults.py's, the script behind the fault table (docs/reliability.md)."""

from __future__ import annotations

import contextlib
import importlib.util
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from tests.conftest import ROOT
from tests.servers import prefect_env

_spec = importlib.util.spec_from_file_location("faults_table", ROOT / "infra" / "faults.py")
faults_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(faults_table)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("guard")


@pytest.fixture(scope="module")
def shared(root):
    """The environment of the runs that share one Prefect server (tests/servers.py); the stops
    whose point is the temporary server's behaviour (a Ctrl-C in a task, a SIGTERM between
    tasks, a kill) keep their own."""
    return prefect_env(root / ".prefect")


@pytest.fixture(scope="module")
def reference(root, shared):
    code, out, _ = faults_table.train(root, root / "cache", [*faults_table.RUN, "run_id=unstopped"], shared)
    assert code == 0, out[-3000:]
    return faults_table.fingerprint(root, "unstopped")


def test_a_second_driver_on_a_live_run_is_refused_and_the_first_ends_as_if_alone(root, reference, shared):
    first = subprocess.Popen([sys.executable, "-m", "flows.train", f"tracking.root_dir={root}",
                              *faults_table.RUN, "run_id=raced"], cwd=ROOT,
                             env=faults_table._env(root, root / "cache", shared), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not (root / "raced" / "checkpoints" / "step-000005").is_dir():
            assert first.poll() is None and time.time() < deadline
            time.sleep(0.05)
        # Held still (a tiny run is over in seconds) while the second driver comes: it is live,
        # holds its lease, and must go on exactly as if nobody had come.
        first.send_signal(signal.SIGSTOP)
        listed = subprocess.run([sys.executable, "-m", "flows.query", "runs", "--root", str(root)], cwd=ROOT,
                                env={**faults_table._env(root, root / "cache", shared), "COLUMNS": "80"},
                                capture_output=True, text=True, timeout=120)
        row = next(line for line in listed.stdout.splitlines() if line.startswith("raced "))
        cells = row.split()
        assert cells[:3] == ["raced", "running", str(first.pid)] and cells[3].endswith(f"/{faults_table.STEPS}"), listed.stdout
        assert all(len(line) <= 80 for line in listed.stdout.splitlines())
        for second in (["resume=raced"], [*faults_table.RUN, "run_id=raced"]):  # resume, or the same id anew
            # On no shared server, as a user's command: it must not boot a Prefect server of its
            # own either (5-9 s of CPU beside the live run), watched among its children throughout.
            started, children = time.time(), set()
            with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
                proc = subprocess.Popen([sys.executable, "-m", "flows.train", f"tracking.root_dir={root}", *second],
                                        cwd=ROOT, env=faults_table._env(root, root / "cache", {}), stdout=out,
                                        stderr=err, text=True)
                while proc.poll() is None and time.time() - started < 120:
                    with contextlib.suppress(psutil.Error):
                        children |= {" ".join(c.cmdline()) for c in psutil.Process(proc.pid).children(recursive=True)}
                    time.sleep(0.05)
                try:
                    code = proc.wait(timeout=5)
                finally:  # past its 120 s: not left running beside the next case
                    if proc.poll() is None:
                        proc.kill()
                out.seek(0), err.seek(0)
                stdout, stderr = out.read(), err.read()
            assert code == 2, stdout[-2000:] + stderr[-2000:]
            assert f"being driven by another process: PID {first.pid}" in stderr
            assert "Traceback" not in stderr and time.time() - started < 60
            assert not [c for c in children if "flows.prefect_server" in c], children
        first.send_signal(signal.SIGCONT)
        assert first.wait(timeout=300) == 0
    finally:
        if first.poll() is None:
            first.kill()
    compared = faults_table.compare(faults_table.fingerprint(root, "raced"), reference)
    assert compared == {"lost": 0, "duplicated": 0, "identical": True}


STOPS = [  # point, signal, whether the run has its own Prefect server
    ("generate", "SIGINT", True),            # inside a Prefect task (a round)
    ("between_tasks", "SIGTERM", True),      # between Prefect tasks
    ("evaluate", "SIGINT", False),           # in an evaluation
    ("warm_start", "SIGTERM", False),        # in the warm start, before the run's first round
    ("checkpoint_write", "SIGINT", False),   # while a checkpoint is written
    ("warm_start", "SIGKILL", True),         # killed before the first checkpoint: resumes from step 0
]


@pytest.mark.parametrize("point, signame, own_server", STOPS, ids=[f"{p}-{s}" for p, s, _ in STOPS])
def test_a_stop_at_each_kind_of_point_behaves_and_resumes_bit_for_bit(root, reference, shared, point, signame,
                                                                      own_server):
    # own_server: the run starts its temporary Prefect server, as a user's does, so that a
    # Ctrl-C, a SIGTERM and a kill show what they do to it (left_behind); the others share one.
    case = faults_table.one_case(root, root / "cache", point, signame, reference, None if own_server else shared)
    assert case["resume_exit_code"] == 0, case
    assert (case["lost"], case["duplicated"], case["identical"]) == (0, 0, True), case
    assert case["left_behind"] == [], case  # no Prefect server or generator outlives the trainer
    assert case["mlflow_after_resume"] == "FINISHED"
    if signame == "SIGKILL":
        assert case["exit_code"] == -signal.SIGKILL and case["status"] == "crashed"
        # Nothing could report the kill; the resume marks the dead flow run CRASHED.
        assert case["prefect_after_resume"].split("/") == ["CRASHED", "COMPLETED"], case
        return
    assert case["exit_code"] == 128 + signal.Signals[signame], case
    # That the run stopped at its safe point, not at its end, the exit code and the last line
    # tell (130/143, "stopped by ..."); this bound catches an end that hangs (such as a minute of
    # retries against a Prefect server Ctrl-C had killed). A quiet machine ends in a few seconds,
    # one loaded twice over in about ten, so the bound leaves room for a loaded CI machine.
    assert case["exit_seconds"] is not None and case["exit_seconds"] < 30, case
    assert not case["traceback"], case
    assert case["last_line"].startswith(f"stopped by {signame}") and "resume=" in case["last_line"], case
    assert case["mlflow"] == "KILLED" and case["prefect"] == "CANCELLED" and case["status"] == "killed", case


def test_ctrl_c_stops_the_async_loop_with_its_generators_and_it_resumes(root):
    """The async learner and its generator processes are one run: a terminal's Ctrl-C reaches
    them all, the generators ignore it and the learner stops them; nothing is left running."""
    args = [*faults_table.TINY, "run_id=async-stop", "loop=async", "loop.steps=12", "loop.eval_every=0",
            "loop.passk_every=0", "loop.checkpoint_every=2", "loop.eval_samples=2"]
    sig_log = root / "async-stop.signal"
    code, out, pid = faults_table.train(root, root / "cache", args, {
        faults_table.SIGNAL_ENV: "between_tasks:5:SIGINT", faults_table.SIGNAL_LOG_ENV: str(sig_log)})
    ended = time.time()
    assert code == 130, out[-3000:]
    assert ended - float(sig_log.read_text()) < 15 and "Traceback" not in out, out[-3000:]
    assert [ln for ln in out.splitlines() if ln.strip()][-1].startswith("stopped by SIGINT"), out[-2000:]
    time.sleep(2)
    assert faults_table.left_behind(pid) == []  # generators and the Prefect server are gone
    assert faults_table.mlflow_status(root, "async-stop") == "KILLED"
    assert faults_table.prefect_states(root, "async-stop") == ["CANCELLED"]
    code, out, _ = faults_table.train(root, root / "cache", ["resume=async-stop"])
    assert code == 0, out[-3000:]
    assert "stored rollouts kept as buffer data" in out
    assert faults_table.mlflow_status(root, "async-stop") == "FINISHED"
