"""The rollout viewer's data layer (replay_pipeline/reports/viewer.py) without a browser: the
numbers its pages show, from real LanceDB tables written here with the project's own writers
(RolloutStore.append, UsageStore.record), worked out by hand below.

Run `viewer`: 6 generation steps x 2 groups x 4 samples = 48 rollouts, seq = 8 * step + 4 * group
+ sample, policy version = step. Sample i of step s is correct iff i < min(s, 4); reward is 1 if
correct, plus 0.5 in group 1: fraction correct 0, .25, .5, .75, 1, 1 and mean reward that + .25.

Uses (USES: learner step, generation step at use, learner's version, rollout seqs), 16 in all:
  seq 0: 4 (learner steps 0-3, staleness 1, 2, 3, 4)   seq 8, 16: 2 each
  seq 1, 2, 3, 9, 17, 24, 32, 33: 1 each              the other 38 rollouts: 0
Per step of use 1..5: uses 4, 3, 4, 2, 3; staleness mean 1, 4/3, 7/4, 5/2, 5/3 and most 1, 2, 3,
4, 3; through each step, uses over rollouts used so far 4/4, 7/6, 11/8, 13/9, 16/11 and the most
uses of one rollout 1, 2, 3, 4, 4.
Both tables are tagged `step-000003` after step 2's rollouts and uses: 24 rollouts, 7 uses (seq 0
used twice by then).
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import re
import tomllib
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from flows import view

from replay_pipeline.buffer import RolloutStore
from replay_pipeline.buffer.schema import make_rollout_id, rows_to_table
from replay_pipeline.buffer.usage import UsageStore, make_usage_id
from replay_pipeline.reports import viewer
from tests.conftest import ROOT

RUN = "viewer"
TAG = "step-000003"
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
USES = [(0, 1, 1, [0, 1, 2, 3]), (1, 2, 2, [0, 8, 9]), (2, 3, 3, [0, 8, 16, 17]), (3, 4, 4, [0, 24]),
        (4, 5, 5, [16, 32, 33])]
REUSE = {0: 4, 8: 2, 16: 2, **{s: 1 for s in (1, 2, 3, 9, 17, 24, 32, 33)}}


def rollout_rows(step: int) -> list[dict]:
    rows = []
    for g in range(2):
        for i in range(4):
            correct = i < min(step, 4)
            rows.append(dict(rollout_id=make_rollout_id(RUN, step, g, i), run_id=RUN, policy_version=step, step=step,
                             prompt_id=f"p{g}", group_id=f"{RUN}/s{step:06d}/g{g:04d}", sample_index=i,
                             prompt=f"{g}+{step}=", completion=f"<b>{step}/{g}/{i}</b>", prompt_ids=[1, 2, 3],
                             completion_ids=[10, 11], behaviour_logprobs=[-0.1, -2.0],
                             reward=float(correct) + 0.5 * g, correct=correct, advantage=0.125 * i,
                             group_reward_mean=0.0, finish_reason="stop", num_tokens=2, seed=step,
                             created_at=T0 + dt.timedelta(minutes=step)))
    return rows


def usage_rows(learner_step: int, step: int, version: int, seqs: list[int]) -> list[dict]:
    return [dict(usage_id=make_usage_id(RUN, learner_step, position), run_id=RUN, learner_step=learner_step,
                 step=step, position=position,
                 rollout_id=make_rollout_id(RUN, seq // 8, (seq % 8) // 4, seq % 4), rollout_seq=seq,
                 rollout_step=seq // 8, rollout_policy_version=seq // 8, policy_version=version,
                 staleness=version - seq // 8, created_at=T0 + dt.timedelta(minutes=step, seconds=1))
            for position, seq in enumerate(seqs)]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("viewer-data")
    store = RolloutStore.create(root / "lancedb", RUN)
    usage = UsageStore.create(root / "lancedb", RUN)
    for step in range(6):
        store.append(rows_to_table(rollout_rows(step)))
        for learner_step, at, version, seqs in USES:
            if at == step:
                usage.record(usage_rows(learner_step, at, version, seqs))
        if step == 2:
            store.tag(TAG)
            usage.tag(TAG)
    stored = store.read_at(store.version, ["seq", "rollout_id"]).sort_by("seq")
    assert stored.column("rollout_id").to_pylist() == [make_rollout_id(RUN, s // 8, (s % 8) // 4, s % 4)
                                                        for s in range(48)]  # seq = 8 step + 4 group + sample
    return root


def seq_of(page: dict) -> list[int]:
    return [r["seq"] for r in page["rows"]]


def test_the_per_step_series_are_the_tables_numbers(root):
    data = viewer.series(root, RUN)
    assert data["steps"] == [0, 1, 2, 3, 4, 5] and data["counts"] == [8] * 6 and data["rollouts"] == 48
    assert data["correct"] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert data["reward"] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.25, 1.25])
    assert data["use_steps"] == [1, 2, 3, 4, 5] and data["uses"] == [4, 3, 4, 2, 3] and data["usage_records"] == 16
    assert data["staleness"] == pytest.approx([1, 4 / 3, 7 / 4, 5 / 2, 5 / 3])
    assert data["staleness_max"] == [1, 2, 3, 4, 3]
    assert data["reuse"] == pytest.approx([4 / 4, 7 / 6, 11 / 8, 13 / 9, 16 / 11])
    assert data["reuse_max"] == [1, 2, 3, 4, 4]
    assert data["accuracy"] == [] and data["loss"] == []  # no MLflow store for this run


def test_as_of_a_tag_the_series_stop_where_the_checkpoint_did(root):
    data = viewer.series(root, RUN, TAG)
    assert data["steps"] == [0, 1, 2] and data["rollouts"] == 24 and data["usage_records"] == 7
    assert data["use_steps"] == [1, 2] and data["uses"] == [4, 3] and data["reuse_max"] == [1, 2]
    assert data["reuse"] == pytest.approx([1.0, 7 / 6])
    with pytest.raises(viewer.ViewError, match="no tag 'step-000009'"):
        viewer.series(root, RUN, "step-000009")


def test_a_rollout_used_n_times_shows_n_and_its_uses(root):
    first = viewer.rollout(root, RUN, make_rollout_id(RUN, 0, 0, 0))
    assert first["reuse_count"] == 4
    assert [(u["learner_step"], u["step"], u["staleness"]) for u in first["uses"]] == [
        (0, 1, 1), (1, 2, 2), (2, 3, 3), (3, 4, 4)]
    assert viewer.rollout(root, RUN, make_rollout_id(RUN, 2, 0, 0))["reuse_count"] == 2  # seq 16
    unused = viewer.rollout(root, RUN, make_rollout_id(RUN, 0, 1, 1))  # seq 5
    assert unused["reuse_count"] == 0 and unused["uses"] == []
    assert [round(t["p"], 4) for t in unused["tokens"]] == [0.9048, 0.1353]  # exp(-0.1), exp(-2)
    with pytest.raises(viewer.ViewError, match="has no rollout"):
        viewer.rollout(root, RUN, "viewer/s000099/g0000/i000")


def test_a_steps_groups_carry_each_members_reuse_count(root):
    for step in range(6):
        groups = viewer.groups(root, RUN, step)
        assert [g["group_id"] for g in groups] == [f"{RUN}/s{step:06d}/g0000", f"{RUN}/s{step:06d}/g0001"]
        counts = [m["reuse_count"] for g in groups for m in g["members"]]
        assert counts == [REUSE.get(8 * step + k, 0) for k in range(8)]
        assert [g["mean_reward"] for g in groups] == pytest.approx(
            [min(step, 4) / 4, min(step, 4) / 4 + 0.5])
    tagged = viewer.groups(root, RUN, 0, TAG)
    assert [m["reuse_count"] for m in tagged[0]["members"]] == [2, 1, 1, 1]  # learner steps 0 and 1 only


def test_the_reuse_filter_lists_the_rollouts_used_that_often(root):
    many = viewer.page(root, RUN, min_reuse=2)
    assert seq_of(many) == [0, 8, 16] and [r["reuse_count"] for r in many["rows"]] == [4, 2, 2]
    assert many["next"] is None and many["matching"] == 48
    assert seq_of(viewer.page(root, RUN, min_reuse=3)) == [0]
    assert seq_of(viewer.page(root, RUN, min_reuse=5)) == []
    assert seq_of(viewer.page(root, RUN, min_reuse=1)) == sorted(REUSE)
    assert seq_of(viewer.page(root, RUN, min_reuse=2, tag=TAG)) == [0]  # seq 8: one use by then
    one_step = viewer.page(root, RUN, steps=(2, 2), min_reuse=1)
    assert seq_of(one_step) == [16, 17] and one_step["matching"] == 8
    assert seq_of(viewer.page(root, RUN, versions=(3, 3), correct=True)) == [24, 25, 26, 28, 29, 30]


def test_pages_of_rollouts_end_where_the_rows_do(root):
    first = viewer.page(root, RUN, size=4)
    assert seq_of(first) == [0, 1, 2, 3] and first["next"] == 4
    last = viewer.page(root, RUN, size=4, start=44)
    assert seq_of(last) == [44, 45, 46, 47] and last["next"] is None  # full, and nothing after it
    used = viewer.page(root, RUN, size=4, min_reuse=1)
    assert seq_of(used) == [0, 1, 2, 3] and used["next"] == 8  # the next page starts at the next match
    used = viewer.page(root, RUN, size=4, min_reuse=1, start=used["next"])
    assert seq_of(used) == [8, 9, 16, 17] and used["next"] == 24
    used = viewer.page(root, RUN, size=3, min_reuse=1, start=used["next"])
    assert seq_of(used) == [24, 32, 33] and used["next"] is None


def test_the_step_table_pages_fifty_steps_at_a_time(root):
    data = viewer.series(root, RUN)
    page = viewer.step_table(data, None, size=4)
    assert [r["step"] for r in page["rows"]] == [0, 1, 2, 3]
    assert (page["prev"], page["next"], page["first"], page["last"], page["index"], page["total"]) == (
        None, 4, 0, 4, 0, 6)
    assert page["rows"][0] == {"step": 0, "rollouts": 8, "reward": 0.25, "correct": 0.0, "uses": 0, "staleness": None}
    assert page["rows"][2]["uses"] == 3 and page["rows"][2]["staleness"] == pytest.approx(4 / 3)
    page = viewer.step_table(data, 4, size=4)
    assert [r["step"] for r in page["rows"]] == [4, 5] and (page["prev"], page["next"]) == (0, None)
    assert [r["step"] for r in viewer.step_table(data, 99, size=4)["rows"]] == [4, 5]  # past the end: the last page
    # A 500-step run (the default's length), fifty steps a page.
    steps = list(range(500))
    long = {"steps": steps, "counts": [64] * 500, "reward": [0.5] * 500, "correct": [0.5] * 500,
            "use_steps": steps, "uses": [128] * 500, "staleness": [1.0] * 500}
    page = viewer.step_table(long, 250)
    assert viewer.STEPS_PAGE == 50 and [r["step"] for r in page["rows"]] == list(range(250, 300))
    assert (page["prev"], page["next"], page["first"], page["last"]) == (200, 300, 0, 450)
    assert [r["step"] for r in viewer.step_table(long, None)["rows"]] == list(range(50))


@pytest.mark.parametrize("lo, hi, count, integer, ticks, labels", [
    (0, 1, 4, False, [0, 0.2, 0.4, 0.6, 0.8, 1], ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]),
    (0.13, 0.87, 4, False, [0, 0.2, 0.4, 0.6, 0.8, 1], ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]),
    (-0.119, 0.22, 4, False, [-0.2, -0.1, 0, 0.1, 0.2, 0.3], ["-0.2", "-0.1", "0.0", "0.1", "0.2", "0.3"]),
    (1, 2.46, 4, False, [1, 1.5, 2, 2.5], ["1.0", "1.5", "2.0", "2.5"]),
    (0.3, 0.35, 4, False, [0.3, 0.31, 0.32, 0.33, 0.34, 0.35], ["0.30", "0.31", "0.32", "0.33", "0.34", "0.35"]),
    (0, 499, 6, True, [0, 100, 200, 300, 400, 500], ["0", "100", "200", "300", "400", "500"]),
    (0, 11, 6, True, [0, 2, 4, 6, 8, 10, 12], ["0", "2", "4", "6", "8", "10", "12"]),
    (1, 5, 6, True, [1, 2, 3, 4, 5], ["1", "2", "3", "4", "5"]),
    (0, 0, 4, False, [0, 0.2, 0.4, 0.6, 0.8, 1], ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]),
    (3, 3, 6, True, [2, 3, 4], ["2", "3", "4"]),
    (0, 1500, 4, False, [0, 500, 1000, 1500], ["0", "500", "1000", "1500"]),
])
def test_axis_ticks_fall_on_round_values(lo, hi, count, integer, ticks, labels):
    got = viewer.nice_ticks(lo, hi, count=count, integer=integer)
    assert got == pytest.approx(ticks, abs=1e-12)
    assert [viewer.tick_label(v, got) for v in got] == labels


def test_the_charts_place_each_value_on_its_axes(root):
    data = viewer.series(root, RUN)
    charts = {c["key"]: c for c in viewer.run_charts(data, RUN)}
    assert list(charts) == ["accuracy", "reward", "loss", "staleness", "reuse"]
    stale = charts["staleness"]
    assert [t["label"] for t in stale["x_ticks"]] == ["1", "2", "3", "4", "5"]
    assert [t["label"] for t in stale["y_ticks"]] == ["0", "1", "2", "3", "4"]
    assert stale["legend"] and [r["name"] for r in stale["legend_rows"]] == ["mean", "most"]
    mean, most = stale["lines"]
    assert [p["label"] for p in mean["points"]] == [
        "mean: 1 at step 1", "mean: 1.333 at step 2", "mean: 1.75 at step 3", "mean: 2.5 at step 4",
        "mean: 1.667 at step 5"]
    assert [p["y"] for p in most["points"]] == [1, 2, 3, 4, 3]
    # A point sits where its value's tick is: most staleness 4 at step 4 on the "4" and "4" ticks.
    x_at = {t["label"]: t["pos"] for t in stale["x_ticks"]}
    y_at = {t["label"]: t["pos"] for t in stale["y_ticks"]}
    assert (most["points"][3]["px"], most["points"][3]["py"]) == (x_at["4"], y_at["4"])
    assert y_at["0"] == stale["box"]["y1"] and y_at["4"] == stale["box"]["y0"]  # the axis spans the ticks
    assert x_at["1"] == stale["box"]["x0"] and x_at["5"] == stale["box"]["x1"]
    assert all(p["link"] and p["step"] == p["x"] for p in mean["points"])  # each point opens its step
    reuse = charts["reuse"]
    assert [p["y"] for p in reuse["lines"][1]["points"]] == [1, 2, 3, 4, 4]
    assert [p["label"] for p in reuse["lines"][0]["points"]][-1] == "mean, of the rollouts used so far: 1.455 at step 5"
    acc = charts["accuracy"]
    assert [t["label"] for t in acc["y_ticks"]] == ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]  # fractions: 0 to 1
    assert [r["name"] for r in acc["legend_rows"]] == ["held-out (greedy) (no data)", "the step's rollouts"]
    assert charts["loss"]["empty"] and not charts["loss"]["legend"]  # no MLflow: "no data yet"
    both = viewer.compare_charts([(RUN, data), ("other", {**data, "reward": [r * 2 for r in data["reward"]]})])
    reward = {c["key"]: c for c in both}["reward"]
    assert [r["name"] for r in reward["legend_rows"]] == [RUN, "other"]
    assert [t["label"] for t in reward["y_ticks"]] == ["0.0", "0.5", "1.0", "1.5", "2.0", "2.5"]
    assert reward["lines"][1]["points"][-1]["label"] == "other: 2.5 at step 5"


def test_a_missing_run_is_a_view_error(root):
    with pytest.raises(viewer.ViewError, match="rollout table"):
        viewer.series(root, "nope")


def test_the_pages_escape_what_the_tables_hold_and_show_the_counts(root):
    """The templates autoescape: a completion holding markup is shown as text. The step page's
    `times used` column and the rollout page's count are the usage table's."""
    client = TestClient(view.create_app(root))
    step = client.get(f"/run/{RUN}/step/0")
    assert step.status_code == 200
    assert "&lt;b&gt;0/0/0&lt;/b&gt;" in step.text and "<b>0/0/0</b>" not in step.text
    assert step.text.count('class="num reuse">') == 8
    assert [int(c) for c in re.findall(r'class="num reuse">(\d+)<', step.text)] == [4, 1, 1, 1, 0, 0, 0, 0]
    first = client.get(f"/run/{RUN}/rollout/{make_rollout_id(RUN, 0, 0, 0)}")
    assert "used 4 times" in first.text
    assert "used 0 times" in client.get(f"/run/{RUN}/rollout/{make_rollout_id(RUN, 0, 1, 1)}").text
    jump = client.get(f"/run/{RUN}/step?step=3", follow_redirects=False)
    assert jump.status_code == 303 and jump.headers["location"] == f"/run/{RUN}/step/3"
    bad = client.get(f"/run/{RUN}?from=abc")
    assert bad.status_code == 404 and "from=&#39;abc&#39;: give a whole number" in bad.text


def test_every_template_ships_in_the_wheel():
    """pyproject's package data names every template, so an installed viewer has its pages."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package = Path(viewer.__file__).parent
    templates = sorted(p.relative_to(package).as_posix() for p in (package / "templates").iterdir())
    assert "run.html" in [Path(t).name for t in templates]
    assert all(any(fnmatch.fnmatch(t, g) for g in data["replay_pipeline.reports"]) for t in templates), templates


def test_the_viewer_serves_this_machine_only(tmp_path, capsys):
    assert view.main([str(tmp_path), "--host", "0.0.0.0"]) == 2
    assert "not a loopback address" in capsys.readouterr().err
    assert view._loopback("127.0.0.1") and view._loopback("::1") and view._loopback("localhost")
    assert not view._loopback("192.168.1.5") and not view._loopback("example.org")
