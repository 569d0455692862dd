"""The rollout viewer: `python -m flows.view [ROOT]`, a local web app over a root's runs.

    python -m flows.view                       # the runs under ./runs, at http://127.0.0.1:8765
    python -m flows.view /data/replay-runs --port 9000

Pages (server-rendered HTML, no script or asset fetched from anywhere; charts are inline SVG):
- `/`: every run under the root: status, steps, held-out accuracy, lineage (fork source, resumes);
- `/run/RUN`: reward, fraction correct, held-out accuracy, staleness and reuse against step; the
  checkpoint tags (each link shows the run as of that tag); the steps, each a link to its groups;
- `/run/RUN/step/S`: the step's groups, each member's reward, frozen advantage and correctness;
- `/run/RUN/rollout/ID`: the prompt, the completion's tokens coloured by their behaviour
  probability (exp of the stored log-prob), the reuse count and the learner steps that used it;
- `/run/RUN/rollouts?versions=LO:HI&correct=1&min_reuse=2`: a filtered page of rollouts;
- `/compare?runs=A,B`: two runs' charts side by side.
Every run page takes `?tag=step-000100` to read the tables as of that checkpoint. The data
comes from replay_pipeline/reports/viewer.py (pushed-down reads, a page at a time); a missing run or a
damaged table gives a page that says so (HTTP 404 or 409), not a traceback. Bound to 127.0.0.1
by default: the tables hold everything the runs generated.
"""

from __future__ import annotations

import argparse
import html
import os
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import quote, urlencode

import flows  # noqa: F401  (the package's environment defaults)
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from replay_pipeline.reports import viewer
from replay_pipeline.reports.viewer import ViewError

STYLE = """body{font-family:sans-serif;margin:1.2em;color:#222}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px;text-align:left}th{background:#f0f0f0}
.tok{font-family:monospace;white-space:pre;padding:1px 0}.charts{display:flex;flex-wrap:wrap;gap:12px}
.err{background:#fee;border:1px solid #c66;padding:1em}nav a{margin-right:1em}.cols{display:flex;gap:24px}
code{background:#f4f4f4}"""


def _page(title: str, body: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
                        f"<style>{STYLE}</style></head><body><nav><a href='/'>runs</a></nav>"
                        f"<h1>{html.escape(title)}</h1>{body}</body></html>", status_code=status)


def _esc(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _fmt(value: Any, digits: int = 3) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return _esc(value)


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
    return (f"<table class='{cls}'><tr>" + "".join(f"<th>{_esc(h)}</th>" for h in head) + "</tr>"
            + "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows) + "</table>")


def svg_chart(title: str, xs: Sequence[float], ys: Sequence[float], width: int = 360, height: int = 180) -> str:
    """A line chart as inline SVG (axes' ranges printed at the corners)."""
    points = [(float(x), float(y)) for x, y in zip(xs, ys) if y is not None]
    if not points:
        return f"<div><b>{_esc(title)}</b><br><i>no data yet</i></div>"
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    sx = (width - 50) / ((x1 - x0) or 1.0)
    sy = (height - 40) / ((y1 - y0) or 1.0)
    path = " ".join(f"{40 + (x - x0) * sx:.1f},{height - 20 - (y - y0) * sy:.1f}" for x, y in points)
    return (f"<div><b>{_esc(title)}</b><br><svg class='chart' width='{width}' height='{height}' role='img' "
            f"aria-label='{_esc(title)}'><rect x='40' y='20' width='{width - 50}' height='{height - 40}' fill='none' "
            f"stroke='#ccc'/><polyline fill='none' stroke='#1f77b4' stroke-width='1.5' points='{path}'/>"
            f"<text x='2' y='26' font-size='10'>{y1:.3g}</text><text x='2' y='{height - 20}' font-size='10'>{y0:.3g}</text>"
            f"<text x='40' y='{height - 4}' font-size='10'>{x0:g}</text>"
            f"<text x='{width - 40}' y='{height - 4}' font-size='10'>{x1:g}</text></svg></div>")


def _charts(data: dict[str, Any]) -> str:
    acc = data.get("accuracy") or []
    return "<div class='charts'>" + "".join([
        svg_chart("mean reward by step", data["steps"], data["reward"]),
        svg_chart("fraction correct by step", data["steps"], data["correct"]),
        svg_chart("held-out accuracy (MLflow)", [a for a, _ in acc], [b for _, b in acc]),
        svg_chart("staleness of the rollouts used, by step", data.get("use_steps", []), data.get("staleness", [])),
        svg_chart("mean uses per used rollout, through step", data.get("use_steps", []), data.get("reuse", [])),
    ]) + "</div>"


def _tag_query(tag: str | None) -> str:
    return f"?{urlencode({'tag': tag})}" if tag else ""


def _color(p: float) -> str:
    """Low behaviour probability red, high green."""
    p = min(max(p, 0.0), 1.0)
    return f"hsl({int(120 * p)},70%,80%)"


def create_app(root: str | Path) -> FastAPI:
    root = str(Path(root).expanduser().resolve())
    app = FastAPI(title="replay-pipeline viewer", docs_url=None, redoc_url=None, openapi_url=None)
    tokenizer = lru_cache(maxsize=8)(lambda run_id: viewer.tokenizer_of(root, run_id))

    @app.exception_handler(ViewError)
    async def _view_error(request: Request, exc: ViewError):  # noqa: ARG001
        code = 409 if exc.damaged else 404
        return _page("cannot show this", f"<div class='err'>{_esc(exc)}</div>", status=code)

    @app.get("/", response_class=HTMLResponse)
    def index():
        runs = viewer.runs(root)
        rows = [[f"<a href='/run/{quote(r['run_id'])}'>{_esc(r['run_id'])}</a>", _esc(r.get("status")),
                 f"{_esc(r.get('steps_done'))}/{_esc(r.get('steps_planned'))}", _fmt(r.get("accuracy")),
                 (f"fork of <a href='/run/{quote(str(r['fork_of']))}'>{_esc(r['fork_of'])}</a>@{_esc(r.get('fork_step'))}"
                  if r.get("fork_of") else "") + (f" resumed {r['resumes']}x" if r.get("resumes") else ""),
                 _esc(r.get("started_at"))] for r in runs]
        body = (_table(["run", "status", "steps", "held-out accuracy", "lineage", "started"], rows, "runs")
                if rows else f"<p>No runs under {_esc(root)} yet: <code>python -m flows.train tracking.root_dir="
                              f"{_esc(root)}</code></p>")
        if len(runs) >= 2:
            body += (f"<p><a href='/compare?runs={quote(runs[-2]['run_id'])},{quote(runs[-1]['run_id'])}'>compare "
                     "the two newest runs</a></p>")
        return _page(f"runs under {root}", body)

    @app.get("/run/{run_id}", response_class=HTMLResponse)
    def run_page(run_id: str, tag: str | None = None):
        data = viewer.series(root, run_id, tag)
        tags = viewer.tags(root, run_id)
        tag_links = " ".join(f"<a href='/run/{quote(run_id)}?tag={quote(t)}'>{_esc(t)}</a>" for t in sorted(tags))
        steps = " ".join(f"<a class='step' href='/run/{quote(run_id)}/step/{s}{_tag_query(tag)}'>{s}</a>"
                         for s in data["steps"])
        body = (f"<p>{data['rollouts']} rollouts, {data.get('usage_records', 0)} usage records, rollout table "
                f"version {data['version']}{' (as of tag ' + _esc(tag) + ')' if tag else ''}. "
                f"<a href='/run/{quote(run_id)}/rollouts{_tag_query(tag)}'>browse the rollouts</a></p>"
                + _charts(data) + f"<h2>as of a checkpoint</h2><p>{tag_links or 'no checkpoint tag yet'}"
                + (f" · <a href='/run/{quote(run_id)}'>newest</a>" if tag else "") + "</p>"
                + f"<h2>steps</h2><p>{steps}</p>")
        return _page(f"run {run_id}", body)

    @app.get("/run/{run_id}/step/{step}", response_class=HTMLResponse)
    def step_page(run_id: str, step: int, tag: str | None = None):
        body = ""
        for g in viewer.groups(root, run_id, step, tag):
            rows = [[f"<a class='rollout' href='/run/{quote(run_id)}/rollout/{quote(m['rollout_id'])}'>"
                     f"{m['sample_index']}</a>", _fmt(m["reward"]), _fmt(m["advantage"]),
                     "yes" if m["correct"] else "no", _esc(m["completion"]), _esc(m.get("reward_error"))]
                    for m in g["members"]]
            body += (f"<h3 class='group'>{_esc(g['group_id'])}: mean reward {g['mean_reward']:.3f}</h3>"
                     f"<p><code>{_esc(g['prompt'])}</code></p>"
                     + _table(["sample", "reward", "advantage (frozen)", "correct", "completion", "flagged"], rows))
        return _page(f"run {run_id}, step {step}", body or "<p>no rollouts at this step</p>")

    @app.get("/run/{run_id}/rollout/{rollout_id:path}", response_class=HTMLResponse)
    def rollout_page(run_id: str, rollout_id: str):
        r = viewer.rollout(root, run_id, rollout_id, tokenizer(run_id))
        tokens = "".join(f"<span class='tok' title='log-prob {t['logprob']:.3f} (p {t['p']:.3f}), id {t['id']}' "
                         f"style='background:{_color(t['p'])}'>{_esc(t['text'])}</span>" for t in r["tokens"])
        uses = _table(["learner step", "generation step", "policy version", "staleness"],
                      [[_esc(u["learner_step"]), _esc(u["step"]), _esc(u["policy_version"]), _esc(u["staleness"])]
                       for u in r["uses"]], "uses")
        body = (f"<p>step {r['step']}, policy version {r['policy_version']}, seq {r['seq']}, reward {_fmt(r['reward'])}, "
                f"advantage {_fmt(r['advantage'])}, correct {'yes' if r['correct'] else 'no'}, finish "
                f"{_esc(r['finish_reason'])}, <b class='reuse'>used {r['reuse_count']} times</b></p>"
                f"<h2>prompt</h2><pre>{_esc(r['prompt'])}</pre><h2>completion (colour: behaviour probability, "
                f"red low, green high; hover for the log-prob)</h2><p class='completion'>{tokens}</p>"
                f"<h2>learner steps that used it</h2>{uses}"
                f"<p><a href='/run/{quote(run_id)}/step/{r['step']}'>its step's groups</a></p>")
        return _page(f"rollout {rollout_id}", body)

    @app.get("/run/{run_id}/rollouts", response_class=HTMLResponse)
    def rollouts_page(run_id: str, versions: str = "", correct: str = "", min_reuse: str = "", start: int = 0,
                      tag: str | None = None):
        lo, _, hi = versions.partition(":")
        try:
            bounds = (int(lo) if lo.strip() else None, int(hi) if hi.strip() else None)
            reuse = int(min_reuse) if min_reuse.strip() else None
        except ValueError:
            raise ViewError(f"versions={versions!r} and min_reuse={min_reuse!r} must be numbers (versions LO:HI)")
        want = {"1": True, "0": False}.get(correct)
        data = viewer.page(root, run_id, versions=bounds, correct=want, min_reuse=reuse, start=start, tag=tag)
        rows = [[f"<a class='rollout' href='/run/{quote(run_id)}/rollout/{quote(r['rollout_id'])}'>{r['seq']}</a>",
                 _esc(r["step"]), _esc(r["policy_version"]), _fmt(r["reward"]), _fmt(r["advantage"]),
                 "yes" if r["correct"] else "no", _esc(r["reuse_count"])] for r in data["rows"]]
        form = (f"<form method='get'><label>policy versions <input name='versions' value='{_esc(versions)}' "
                f"placeholder='LO:HI' size='6'></label> <label>correct <select name='correct'>"
                + "".join(f"<option value='{v}'{' selected' if correct == v else ''}>{n}</option>"
                          for v, n in (("", "any"), ("1", "yes"), ("0", "no")))
                + f"</select></label> <label>min reuse <input name='min_reuse' value='{_esc(min_reuse)}' size='3'>"
                  f"</label>" + (f"<input type='hidden' name='tag' value='{_esc(tag)}'>" if tag else "")
                + " <button type='submit'>filter</button></form>")
        more = ""
        if data["next"] is not None:
            query = {k: v for k, v in {"versions": versions, "correct": correct, "min_reuse": min_reuse,
                                       "tag": tag or ""}.items() if v}
            more = f"<p><a class='next' href='?{urlencode({**query, 'start': data['next']})}'>next page</a></p>"
        found = f"<p>{data['matching']} rollouts match the version and correctness filters (by seq from {start})</p>"
        return _page(f"run {run_id}: rollouts", form + found + _table(
            ["seq", "step", "version", "reward", "advantage", "correct", "reuse"], rows, "rollouts") + more)

    @app.get("/compare", response_class=HTMLResponse)
    def compare(runs: str):
        ids = [r for r in runs.split(",") if r][:2]
        cols = "".join(f"<div><h2><a href='/run/{quote(r)}'>{_esc(r)}</a></h2>{_charts(viewer.series(root, r))}</div>"
                       for r in ids)
        return _page(" vs ".join(ids), f"<div class='cols'>{cols}</div>")

    return app


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m flows.view` (main parses with it; the docs' tests read it)."""
    parser = argparse.ArgumentParser(prog="python -m flows.view", description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", default=os.environ.get("REPLAY_PIPELINE_ROOT", "runs"),
                        help="the runs' tracking.root_dir (default: $REPLAY_PIPELINE_ROOT or runs)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8765)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not Path(args.root).expanduser().is_dir():
        print(f"error: no directory {args.root}; pass the runs' tracking.root_dir (python -m flows.view DIR)",
              file=sys.stderr)
        return 2
    import uvicorn  # start-up cost: the server, once the arguments are known

    print(f"viewer of {Path(args.root).resolve()} at http://{args.host}:{args.port}/", flush=True)
    uvicorn.run(create_app(args.root), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
