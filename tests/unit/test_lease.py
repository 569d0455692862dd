"""The run lease (replay_pipeline/system/lease.py) with real processes: a live holder refuses a
second driver and is named; a holder killed with SIGKILL is taken over with a warning; a
lease of another host counts while its heartbeat is fresh, and is taken over once expired."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from replay_pipeline.system import lease
from tests.conftest import ROOT

HOLD = """
import sys, time
from replay_pipeline.system.lease import acquire
acquire(sys.argv[1], command="holder")
print("held", flush=True)
time.sleep(120)
"""


def hold(run_dir):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_holder_refuses_a_second_driver_and_is_named(tmp_path):
    proc = hold(tmp_path / "run")
    try:
        with pytest.raises(lease.LeaseHeld) as refused:
            lease.acquire(tmp_path / "run")
        text = str(refused.value)
        assert f"PID {proc.pid}" in text and "holder" in text and "resume then" in text
        assert lease.holder(tmp_path / "run")["pid"] == proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_holder_is_taken_over_with_a_warning(tmp_path):
    proc = hold(tmp_path / "run")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert lease.read_lease(tmp_path / "run")["pid"] == proc.pid  # left behind by the kill
    assert lease.holder(tmp_path / "run") is None  # but nobody drives the run
    with pytest.warns(UserWarning, match=f"taking over the lease of PID {proc.pid}"):
        mine = lease.acquire(tmp_path / "run")
    try:
        assert lease.read_lease(tmp_path / "run")["pid"] == os.getpid()
    finally:
        mine.release()
    assert not (tmp_path / "run" / lease.LEASE).exists()  # given back: no lease file left


def test_acquire_is_reentrant_within_a_process(tmp_path):
    a = lease.acquire(tmp_path / "run")
    b = lease.acquire(tmp_path / "run")
    assert a is b
    b.release()
    assert lease.holder(tmp_path / "run")["pid"] == os.getpid()  # still held once
    a.release()
    assert lease.holder(tmp_path / "run") is None


def _foreign(run_dir, beat_age):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / lease.LEASE).write_text(json.dumps(
        {"host": "another-host", "pid": 4242, "since": "2026-12-01T00:00:00+00:00", "command": "train",
         "heartbeat": time.time() - beat_age, "token": "x"}))


def test_another_hosts_lease_counts_until_its_heartbeat_expires(tmp_path, monkeypatch):
    monkeypatch.setenv(lease.TIMEOUT_ENV, "30")
    _foreign(tmp_path / "run", beat_age=5)
    with pytest.raises(lease.LeaseHeld, match="PID 4242 on another-host"):
        lease.acquire(tmp_path / "run")
    _foreign(tmp_path / "run", beat_age=31)
    with pytest.warns(UserWarning, match="on another-host"):
        mine = lease.acquire(tmp_path / "run")
    mine.release()


def test_the_heartbeat_keeps_the_lease_fresh(tmp_path, monkeypatch):
    monkeypatch.setenv(lease.TIMEOUT_ENV, "1")  # a beat every 0.25 s
    mine = lease.acquire(tmp_path / "run")
    try:
        first = lease.read_lease(tmp_path / "run")["heartbeat"]
        time.sleep(0.8)
        assert lease.read_lease(tmp_path / "run")["heartbeat"] > first
    finally:
        mine.release()


def test_a_command_line_naming_a_live_run_is_known_before_anything_loads(tmp_path):
    """flows/train.py boots no Prefect server for a command another process's lease refuses."""
    from flows.usage import names_a_live_run

    root = f"tracking.root_dir={tmp_path}"
    proc = hold(tmp_path / "live")
    try:
        assert names_a_live_run([root, "resume=live"]) and names_a_live_run(["run_id=live", f"++{root}"])
        assert not names_a_live_run([root, "resume=other"])  # no such run
        assert not names_a_live_run([root, "resume=last"])  # decided later, with the runs listed
        assert not names_a_live_run(["resume=live"])  # another root (./runs)
    finally:
        proc.kill()
        proc.wait()
    assert not names_a_live_run([root, "resume=live"])  # its holder is gone
