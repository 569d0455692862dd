"""The rollout viewer (`python -m flows.view`) in a real headless browser (Chromium from the
Debian packages; .ci/run installs it): on a run this test trains, the pages are loaded and
followed link by link as a person would: the runs list, a run's charts, a step's groups, one
rollout with its coloured tokens and uses, a filter, the run as of a checkpoint tag, two runs
side by side; a run whose table is damaged, and one that does not exist, get a page that says
so. Screenshots of the main pages go to $VIEWER_SCREENSHOTS when it is set (the README's)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from html import unescape
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY_OVERRIDES
from tests.servers import prefect_env

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium: apt-get install chromium (.ci/run does)")


def browse(url: str) -> str:
    """The page's DOM after Chromium has loaded and rendered it."""
    done = subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=3000",
                           "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def screenshot(url: str, path: Path) -> None:
    subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1280,900", f"--screenshot={path}", url], capture_output=True, timeout=120, check=True)
    assert path.stat().st_size > 5000


def links(dom: str, pattern: str) -> list[str]:
    return [unescape(h) for h in re.findall(r'href="(' + pattern + r')"', dom)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("viewer")
    env = {**os.environ, **prefect_env(root / ".prefect")}  # the two runs share a server (tests/servers.py)
    for run_id in ("seen", "other"):
        done = subprocess.run([sys.executable, "-m", "flows.train", f"tracking.root_dir={root}", *TINY_OVERRIDES,
                               f"run_id={run_id}", "loop.steps=4", "loop.checkpoint_every=2", "loop.eval_every=2",
                               "loop.passk_every=0", "model.torch_threads=1"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "flows.view", str(root), "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.2)
    yield root, base
    proc.terminate()
    proc.wait(timeout=20)


def test_a_person_follows_the_pages_from_the_runs_to_one_rollout(server):
    root, base = server
    shots = Path(os.environ["VIEWER_SCREENSHOTS"]) if os.environ.get("VIEWER_SCREENSHOTS") else None
    index = browse(base + "/")
    assert links(index, "/run/seen") and links(index, "/run/other") and "FINISHED" in index.upper()
    run = browse(base + "/run/seen")
    assert run.count('class="chart"') == 5 and "64 rollouts" in run  # 4 steps x 16, the charts drawn
    steps = links(run, r"/run/seen/step/\d+")
    assert steps == [f"/run/seen/step/{s}" for s in range(4)]
    step = browse(base + steps[1])
    assert step.count('class="group"') == 4 and "advantage (frozen)" in step
    rollout_url = links(step, r"/run/seen/rollout/[^\"]+")[0]
    rollout = browse(base + rollout_url)
    assert re.search(r"used \d+ times", rollout) and 'class="tok"' in rollout and "background:hsl(" in rollout
    assert "learner steps that used it" in rollout
    wrong = browse(base + "/run/seen/rollouts?versions=1:2&correct=0")
    rows = re.findall(r"<tr><td><a class=\"rollout\"[^>]*>\d+</a></td><td>(\d+)</td><td>(\d+)</td>"
                      r"<td>[^<]*</td><td>[^<]*</td><td>(yes|no)</td>", wrong)
    assert rows and all(1 <= int(v) <= 2 and c == "no" for _, v, c in rows)
    tagged = browse(base + "/run/seen?tag=step-000002")
    assert "32 rollouts" in tagged and "as of tag step-000002" in tagged  # the buffer that checkpoint saw
    both = browse(base + "/compare?runs=seen,other")
    assert both.count('class="chart"') == 10
    if shots is not None:
        shots.mkdir(parents=True, exist_ok=True)
        for name, url in (("runs", "/"), ("run", "/run/seen"), ("step", steps[1]), ("rollout", rollout_url)):
            screenshot(base + url, shots / f"viewer-{name}.png")


def test_a_damaged_or_missing_table_gets_a_page_that_says_so(server):
    root, base = server
    missing = browse(base + "/run/nope")
    assert "cannot show this" in missing and "no rollout table for run" in missing and "Traceback" not in missing
    data = root / "lancedb" / "rollouts_other.lance" / "data"
    victim = max(data.iterdir(), key=lambda p: p.stat().st_size)
    victim.unlink()  # a data file gone
    page = browse(base + "/run/other/step/0")
    assert "is damaged" in page and "python -m flows.query repair other" in page and "Traceback" not in page


def test_a_run_still_being_written_shows_what_is_committed_so_far(server):
    """A training run in progress beside the viewer: the runs list shows it running, its page
    counts the rollouts committed so far and grows on the next load, and its newest step's
    page opens while later steps are being written."""
    root, base = server
    env = {**os.environ, "PREFECT_HOME": str(root / ".prefect-live")}
    proc = subprocess.Popen([sys.executable, "-m", "flows.train", f"tracking.root_dir={root}", *TINY_OVERRIDES,
                             "run_id=live", "loop.steps=100000", "loop.eval_every=0", "loop.passk_every=0",
                             "loop.checkpoint_every=0", "model.torch_threads=1"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        def committed() -> int:
            page = browse(base + "/run/live")
            found = re.search(r"(\d+) rollouts", page)
            return int(found.group(1)) if found and "cannot show this" not in page else 0

        deadline = time.monotonic() + 300
        while (first := committed()) < 32:
            assert proc.poll() is None, proc.stderr.read()[-2000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "the live run stored fewer than two steps in 300 s"
            time.sleep(1)
        index = browse(base + "/")
        row = re.search(r'/run/live".*?</tr>', index, re.S)
        assert row and "RUNNING" in row.group(0).upper(), index[-2000:]
        assert first % 16 == 0  # whole steps only: each step's rows are one commit
        while (later := committed()) <= first:
            assert time.monotonic() < deadline, "the live run's page did not grow"
            time.sleep(1)
        newest = links(browse(base + "/run/live"), r"/run/live/step/\d+")[-1]
        step = browse(base + newest)
        assert step.count('class="group"') == 4 and "Traceback" not in step and later % 16 == 0
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
