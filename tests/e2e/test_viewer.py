"""The rollout viewer (`python -m flows.view`) in a real headless browser (Chromium from the
Debian packages; .ci/run installs it): on two runs this test trains, the pages are loaded and
followed link by link as a person would, and the values they show are checked against the
run's own tables (RolloutStore, UsageStore) and MLflow store, read here independently: the
runs list; a run's charts (their tick labels, and each point's hover text against the usage
table's staleness and reuse, MLflow's held-out accuracy and loss, the rollouts' fraction
correct) and its step table, page by page; a step's groups with each member's use count; one
rollout used N times that says N, and one never used; the reuse, version and step filters and
the rollout list's pages; the run as of a checkpoint tag; two runs on shared charts; a run whose
table is damaged, and one that does not exist, get a page that says so. The data layer's
numbers on hand-made tables: tests/integration/test_viewer_data.py."""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from html import unescape
from html.parser import HTMLParser

import pytest

from replay_pipeline.buffer import RolloutStore
from replay_pipeline.buffer.usage import UsageStore
from replay_pipeline.reports.viewer import value_label
from replay_pipeline.run.lineage import read_run_info
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


def links(dom: str, pattern: str) -> list[str]:
    return [unescape(h) for h in re.findall(r'href="(' + pattern + r')"', dom)]


class Page(HTMLParser):
    """What a rendered page shows, read from its DOM: each chart (`charts[key]`: its tick labels,
    legend, and per series each point's hover text and link) and each table's rows by class
    (`tables[cls]`: lists of cells, each a (text, link) pair)."""

    def __init__(self, dom: str):
        super().__init__(convert_charrefs=True)
        self.charts: dict[str, dict] = {}
        self.tables: dict[str, list[list[tuple[str, str | None]]]] = {}
        self._chart = self._series = self._href = self._text = self._point = self._table = None
        self._row: list | None = None
        self._cell: list | None = None
        self.feed(dom)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "a":
            self._href = a.get("href")
            if self._cell is not None:
                self._cell[1] = self._href
        if tag == "svg" and "chart" in classes:
            self._chart = self.charts[a["data-chart"]] = {"x": [], "y": [], "legend": [], "series": {}}
        elif self._chart is not None:
            if tag == "text":
                self._text = ("x" if "x-tick" in classes else "y" if "y-tick" in classes
                              else "legend" if "legend-label" in classes else None)
                if self._text:
                    self._chart[self._text].append("")
            elif tag == "g" and "line" in classes:
                self._series = self._chart["series"].setdefault(a["data-series"], [])
            elif tag == "circle" and "pt" in classes:
                self._point = {"title": "", "href": self._href}
                self._series.append(self._point)
            elif tag == "title" and self._point is not None:
                self._text = "title"
        if tag == "table":
            self._table = self.tables.setdefault(a.get("class", ""), [])
        elif tag == "tr" and self._table is not None:
            self._row = []
        elif tag == "td" and self._row is not None:
            self._cell = ["", None]

    def handle_endtag(self, tag):
        if tag == "a":
            self._href = None
        elif tag == "svg":
            self._chart = None
        elif tag in ("text", "title"):
            self._text = None
        elif tag == "circle":
            self._point = None
        elif tag == "g":
            self._series = None
        elif tag == "td" and self._cell is not None:
            self._row.append((self._cell[0].strip(), self._cell[1]))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            if self._row:  # not the header
                self._table.append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._text == "title":
            self._point["title"] += data
        elif self._text:
            self._chart[self._text][-1] += data
        if self._cell is not None:
            self._cell[0] += data

    def column(self, table: str, index: int) -> list[str]:
        return [row[index][0] for row in self.tables.get(table, [])]

    def titles(self, chart: str, series: str) -> list[str]:
        return [p["title"] for p in self.charts[chart]["series"][series]]


def round_ticks(labels: list[str]) -> bool:
    """Ticks a reader can read: evenly spaced, 1, 2 or 5 times a power of ten apart."""
    values = [float(v) for v in labels]
    gaps = {round(b - a, 9) for a, b in zip(values, values[1:])}
    if len(values) < 2 or len(gaps) != 1:
        return False
    gap = gaps.pop()
    return round(gap / 10 ** math.floor(math.log10(gap)), 6) in (1.0, 2.0, 5.0)


def used(root, run_id: str) -> list[dict]:
    """The run's usage records, read straight from its usage table."""
    return UsageStore.open(root / "lancedb", run_id).rows(
        columns=["rollout_id", "rollout_seq", "step", "staleness", "learner_step"]).to_pylist()


def rollouts(root, run_id: str) -> list[dict]:
    store = RolloutStore.open(root / "lancedb", run_id)
    return store.read_at(store.version, ["seq", "rollout_id", "step", "policy_version", "correct", "reward"]).to_pylist()


def mlflow_history(root, run_id: str, metric: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient  # start-up cost: mlflow, for the two checks that read it

    info = read_run_info(root, run_id)
    history = MlflowClient(tracking_uri=info["mlflow_uri"]).get_metric_history(info["mlflow_run_id"], metric)
    return sorted((int(m.step), float(m.value)) for m in history)


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
    uses = used(root, "seen")
    counts = Counter(u["rollout_id"] for u in uses)
    index = browse(base + "/")
    assert links(index, "/run/seen") and links(index, "/run/other") and "FINISHED" in index.upper()
    dom = browse(base + "/run/seen")
    run = Page(dom)
    assert dom.count('class="chart"') == 5 and "64 rollouts" in dom and f"{len(uses)} usage records" in dom
    steps = [link for _, link in (row[0] for row in run.tables["steps"])]
    assert steps == [f"/run/seen/step/{s}" for s in range(4)]
    assert run.column("steps", 4) == [str(sum(u["step"] == s for u in uses)) for s in range(4)]  # uses a step
    step = Page(browse(base + steps[1]))
    members = step.tables["members"]
    assert len(members) == 16 and len(step.tables) == 1
    shown = {row[0][1].rsplit("/rollout/", 1)[1]: int(row[4][0]) for row in members}  # rollout id: times used
    assert shown == {rid: counts.get(rid, 0) for rid in shown}  # each member's uses, as the usage table has them
    most = max(shown, key=shown.get)
    assert shown[most] >= 1
    rollout = browse(base + f"/run/seen/rollout/{most}")
    assert f"used {counts[most]} times" in rollout and 'class="tok"' in rollout and "background:hsl(" in rollout
    assert Page(rollout).column("uses", 0) == [str(u["learner_step"]) for u in uses if u["rollout_id"] == most]
    never = sorted(r["rollout_id"] for r in rollouts(root, "seen") if r["rollout_id"] not in counts)
    if never:  # a tiny run's buffer may use every rollout
        assert "used 0 times" in browse(base + f"/run/seen/rollout/{never[0]}")
    wrong = Page(browse(base + "/run/seen/rollouts?versions=1:2&correct=0"))
    expected = [r for r in rollouts(root, "seen") if 1 <= r["policy_version"] <= 2 and not r["correct"]]
    assert wrong.column("rollouts", 0) == [str(r["seq"]) for r in expected]
    assert wrong.column("rollouts", 2) == [str(r["policy_version"]) for r in expected]
    tagged = browse(base + "/run/seen?tag=step-000002")
    assert "32 rollouts" in tagged and "as of tag step-000002" in tagged  # the buffer that checkpoint saw
    assert Page(tagged).column("steps", 0) == ["0", "1"]


def test_the_charts_show_the_tables_values_on_round_ticks(server):
    """Each chart has tick labels at round values and axis labels; each point's hover text is
    the value the run's own tables (or MLflow) give for that step, and each point opens its step."""
    root, base = server
    dom = browse(base + "/run/seen")
    run = Page(dom)
    assert set(run.charts) == {"accuracy", "reward", "loss", "staleness", "reuse"}
    for key, chart in run.charts.items():
        assert round_ticks(chart["x"]) and round_ticks(chart["y"]), (key, chart["x"], chart["y"])
    assert run.charts["staleness"]["x"] == ["0", "1", "2", "3"] and 'class="axis-label x-label"' in dom
    uses = used(root, "seen")
    use_steps = sorted({u["step"] for u in uses})
    stale = {s: [u["staleness"] for u in uses if u["step"] == s] for s in use_steps}
    assert run.titles("staleness", "mean") == [f"mean: {value_label(sum(v) / len(v))} at step {s}"
                                               for s, v in stale.items()]
    assert run.titles("staleness", "most") == [f"most: {value_label(max(v))} at step {s}" for s, v in stale.items()]
    assert run.charts["staleness"]["legend"] == ["mean", "most"]
    mean_reuse, most_reuse = [], []
    for s in use_steps:
        so_far = Counter(u["rollout_seq"] for u in uses if u["step"] <= s)
        mean_reuse.append(f"mean, of the rollouts used so far: {value_label(sum(so_far.values()) / len(so_far))} "
                          f"at step {s}")
        most_reuse.append(f"most, of one rollout: {value_label(max(so_far.values()))} at step {s}")
    assert run.titles("reuse", "mean, of the rollouts used so far") == mean_reuse
    assert run.titles("reuse", "most, of one rollout") == most_reuse
    heldout = mlflow_history(root, "seen", "eval/accuracy")
    assert heldout and run.titles("accuracy", "held-out (greedy)") == [
        f"held-out (greedy): {value_label(v)} at step {s}" for s, v in heldout]
    rows = rollouts(root, "seen")
    correct = {s: [r["correct"] for r in rows if r["step"] == s] for s in range(4)}
    assert run.titles("accuracy", "the step's rollouts") == [
        f"the step's rollouts: {value_label(sum(v) / len(v))} at step {s}" for s, v in correct.items()]
    loss = mlflow_history(root, "seen", "learn/loss")
    assert loss and run.titles("loss", "loss") == [f"loss: {value_label(v)} at step {s}" for s, v in loss]
    points = run.charts["reward"]["series"]["mean reward"]
    assert [p["href"] for p in points] == [f"/run/seen/step/{s}" for s in range(4)]  # a point opens its step
    both = Page(browse(base + "/compare?runs=seen,other"))
    assert set(both.charts) == set(run.charts) and both.charts["reward"]["legend"] == ["seen", "other"]
    other = rollouts(root, "other")
    assert both.titles("reward", "other") == [
        f"other: {value_label(sum(r['reward'] for r in other if r['step'] == s) / 16)} at step {s}" for s in range(4)]
    assert [p["href"] for p in both.charts["reward"]["series"]["other"]] == [f"/run/other/step/{s}" for s in range(4)]


def test_the_step_table_the_rollout_list_and_the_reuse_filter_page_through_the_right_rows(server):
    root, base = server
    dom = browse(base + "/run/seen?size=3")
    assert Page(dom).column("steps", 0) == ["0", "1", "2"]
    following = links(dom, r"/run/seen\?from=\d+&amp;size=3#steps")
    assert following == ["/run/seen?from=3&size=3#steps"] * 4  # next and last (the last page), above and below
    second = browse(base + following[0])
    assert Page(second).column("steps", 0) == ["3"] and links(second, r"/run/seen\?from=0&amp;size=3#steps")
    jumped = browse(base + "/run/seen/step?step=2")  # the jump-to-step field's request
    assert "run seen, step 2" in jumped and len(Page(jumped).tables["members"]) == 16
    seqs = [r["seq"] for r in rollouts(root, "seen")]
    listed = browse(base + "/run/seen/rollouts")
    assert Page(listed).column("rollouts", 0) == [str(s) for s in sorted(seqs)[:50]]
    nxt = links(listed, r"/run/seen/rollouts\?start=\d+")
    assert nxt == ["/run/seen/rollouts?start=50"]
    rest = browse(base + nxt[0])
    assert Page(rest).column("rollouts", 0) == [str(s) for s in sorted(seqs)[50:]] and 'class="next"' not in rest
    counts = Counter(u["rollout_seq"] for u in used(root, "seen"))
    for least in (1, 2, max(counts.values())):
        page = Page(browse(base + f"/run/seen/rollouts?min_reuse={least}"))
        expected = [s for s in sorted(seqs) if counts.get(s, 0) >= least][:50]
        assert page.column("rollouts", 0) == [str(s) for s in expected], least
        assert page.column("rollouts", 6) == [str(counts[s]) for s in expected]
    one_step = Page(browse(base + "/run/seen/rollouts?steps=2:2&min_reuse=1"))
    expected = [r["seq"] for r in rollouts(root, "seen") if r["step"] == 2 and counts.get(r["seq"], 0) >= 1]
    assert one_step.column("rollouts", 0) == [str(s) for s in expected] and one_step.column("rollouts", 1) == [
        "2"] * len(expected)


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
