"""The rollout viewer: `python -m flows.view [ROOT]`, a local web app over a root's runs.

    python -m flows.view                       # the runs under ./runs, at http://127.0.0.1:8765
    python -m flows.view /data/replay-runs --port 9000

Pages (HTML from the Jinja2 templates in replay_pipeline/reports/templates/, autoescaped; no
script or asset fetched from anywhere; charts are inline SVG, drawn on the server):
- `/`: every run under the root: status, steps, held-out accuracy, lineage (fork source, resumes);
- `/run/RUN`: charts against step (accuracy, held-out and of the rollouts; mean reward; the
  learner's loss; staleness and reuse of the rollouts used), with axes, round ticks, a legend
  where lines share a chart, each point's value on hover and a link to its step; the checkpoint
  tags (each link shows the run as of that tag); a step table 50 steps a page (`?from=STEP`,
  `&size=N` for another page size) with a jump-to-step field;
- `/run/RUN/step/S`: the step's groups, each member's reward, frozen advantage, correctness and
  reuse count (`/run/RUN/step?step=S` redirects there: the jump field);
- `/run/RUN/rollout/ID`: the prompt, the completion's tokens coloured by their behaviour
  probability (exp of the stored log-prob), the reuse count and the learner steps that used it;
- `/run/RUN/rollouts?versions=LO:HI&steps=LO:HI&correct=1&min_reuse=2`: a filtered page of rollouts;
- `/compare?runs=A,B`: two runs' series on shared charts, one line a run.
Every run page takes `?tag=step-000100` to read the tables as of that checkpoint. The numbers
come from replay_pipeline/reports/viewer.py (pushed-down reads, a page at a time; the charts'
geometry and the decision for server-side SVG are described there); a missing run or a damaged
table gives a page that says so (HTTP 404 or 409), not a traceback.

Loopback only: the tables hold everything the runs generated, so the server binds 127.0.0.1
(or another loopback address given with --host) and refuses any other; to look from another
machine, forward the port (`ssh -L 8765:127.0.0.1:8765 HOST`).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import flows  # noqa: F401  (the package's environment defaults)
from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from jinja2 import Environment, PackageLoader, StrictUndefined

from replay_pipeline.reports import viewer
from replay_pipeline.reports.viewer import ViewError


def _num(value: Any, digits: int = 3) -> str:
    """A cell's text: floats to `digits` decimals, None as nothing."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _query(*params: dict[str, Any], **more: Any) -> str:
    """`?k=v&...` of the non-empty parameters (a tag, a filter, where a page starts), or ''."""
    merged = {k: v for d in (*params, more) for k, v in d.items() if v is not None and v != ""}
    return f"?{urlencode(merged)}" if merged else ""


def _probability_colour(p: float) -> str:
    """A token's background: low behaviour probability red, high green."""
    p = min(max(p, 0.0), 1.0)
    return f"hsl({int(120 * p)},70%,80%)"


def templates() -> Environment:
    """The viewer's pages (replay_pipeline/reports/templates/), autoescaped: every value a page
    shows from a table (prompts, completions, run ids) is text, never markup."""
    env = Environment(loader=PackageLoader("replay_pipeline.reports", "templates"), autoescape=True,
                      undefined=StrictUndefined, trim_blocks=False, lstrip_blocks=False)
    env.filters.update(num=_num, quote=quote, probability_colour=_probability_colour)
    env.globals.update(q=_query)
    return env


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def create_app(root: str | Path) -> FastAPI:
    root = str(Path(root).expanduser().resolve())
    app = FastAPI(title="replay-pipeline viewer", docs_url=None, redoc_url=None, openapi_url=None)
    tokenizer = lru_cache(maxsize=8)(lambda run_id: viewer.tokenizer_of(root, run_id))
    env = templates()

    def page(name: str, title: str, status: int = 200, **context: Any) -> HTMLResponse:
        return HTMLResponse(env.get_template(name).render(title=title, **context), status_code=status)

    @app.exception_handler(ViewError)
    async def _view_error(request: Request, exc: ViewError):  # noqa: ARG001
        return page("error.html", "cannot show this", status=409 if exc.damaged else 404, message=str(exc))

    @app.get("/", response_class=HTMLResponse)
    def index():
        return page("index.html", f"runs under {root}", runs=viewer.runs(root), root=root)

    @app.get("/run/{run_id}", response_class=HTMLResponse)
    def run_page(run_id: str, tag: str | None = None, first: str = Query("", alias="from"), size: str = ""):
        at, per = _number("from", first), _number("size", size)
        if per is not None and not 1 <= per <= 1000:
            raise ViewError(f"size={per}: the step table shows 1 to 1000 steps a page")
        data = viewer.series(root, run_id, tag)
        return page("run.html", f"run {run_id}", run_id=run_id, tag=tag, data=data, tags=sorted(viewer.tags(root, run_id)),
                    charts=viewer.run_charts(data, run_id), size=per,
                    table=viewer.step_table(data, at, per or viewer.STEPS_PAGE))

    @app.get("/run/{run_id}/step")
    def jump_to_step(run_id: str, step: str = "", tag: str | None = None):
        try:
            number = int(step)
        except ValueError:
            raise ViewError(f"step={step!r}: give a step number") from None
        return RedirectResponse(f"/run/{quote(run_id)}/step/{number}{_query(tag=tag)}", status_code=303)

    @app.get("/run/{run_id}/step/{step}", response_class=HTMLResponse)
    def step_page(run_id: str, step: int, tag: str | None = None):
        groups = viewer.groups(root, run_id, step, tag)
        members = [m for g in groups for m in g["members"]]
        return page("step.html", f"run {run_id}, step {step}", run_id=run_id, step=step, tag=tag, groups=groups,
                    rollouts=len(members), uses=sum(m["reuse_count"] for m in members))

    @app.get("/run/{run_id}/rollout/{rollout_id:path}", response_class=HTMLResponse)
    def rollout_page(run_id: str, rollout_id: str):
        r = viewer.rollout(root, run_id, rollout_id, tokenizer(run_id))
        return page("rollout.html", f"rollout {rollout_id}", run_id=run_id, r=r)

    @app.get("/run/{run_id}/rollouts", response_class=HTMLResponse)
    def rollouts_page(run_id: str, versions: str = "", steps: str = "", correct: str = "", min_reuse: str = "",
                      start: int = 0, tag: str | None = None):
        try:
            reuse = int(min_reuse) if min_reuse.strip() else None
            data = viewer.page(root, run_id, versions=_bounds(versions), steps=_bounds(steps),
                               correct={"1": True, "0": False}.get(correct), min_reuse=reuse, start=start, tag=tag)
        except ValueError:
            raise ViewError(f"versions={versions!r}, steps={steps!r} and min_reuse={min_reuse!r} must be numbers "
                            "(versions and steps as LO:HI)") from None
        form = {"versions": versions, "steps": steps, "correct": correct, "min_reuse": min_reuse}
        return page("rollouts.html", f"run {run_id}: rollouts", run_id=run_id, tag=tag, data=data, form=form,
                    start=start, size=viewer.PAGE)

    @app.get("/compare", response_class=HTMLResponse)
    def compare(runs: str):
        ids = [r for r in runs.split(",") if r][:2]
        charts = viewer.compare_charts([(r, viewer.series(root, r)) for r in ids])
        return page("compare.html", " vs ".join(ids), run_ids=ids, charts=charts)

    return app


def _number(name: str, text: str) -> int | None:
    """A whole-number query parameter (None if empty); ViewError, shown as the page, otherwise."""
    try:
        return int(text) if text.strip() else None
    except ValueError:
        raise ViewError(f"{name}={text!r}: give a whole number") from None


def _bounds(text: str) -> tuple[int | None, int | None]:
    """`LO:HI`, either side may be empty; one number N is N:N (ValueError otherwise)."""
    lo, sep, hi = text.partition(":")
    if not sep:
        hi = lo
    return (int(lo) if lo.strip() else None, int(hi) if hi.strip() else None)


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m flows.view` (main parses with it; the docs' tests read it)."""
    parser = argparse.ArgumentParser(prog="python -m flows.view", description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", default=os.environ.get("REPLAY_PIPELINE_ROOT", "runs"),
                        help="the runs' tracking.root_dir (default: $REPLAY_PIPELINE_ROOT or runs)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="loopback address to bind (default 127.0.0.1: this machine only; others are refused)")
    parser.add_argument("--port", type=int, default=8765)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not _loopback(args.host):
        print(f"error: --host {args.host} is not a loopback address; the viewer serves this machine only "
              f"(from elsewhere: ssh -L {args.port}:127.0.0.1:{args.port} THIS_HOST)", file=sys.stderr)
        return 2
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
