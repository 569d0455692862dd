"""The project's import graph, read from the source (nothing is imported or run): fails on an
import cycle, on a module of the run (replay_pipeline/run/) over its line budget, on an
import inside a function that does not say why, and on a learner-side module that imports
lancedb, prefect or mlflow (DESIGN.md principle 10).

    python infra/check_imports.py          # the summary; exit 1 with the problems listed
    python infra/check_imports.py --json   # the same as JSON

Edges are every `import` of a project module (replay_pipeline/, flows/), at module level or
inside a function, `if TYPE_CHECKING:` blocks left out. A cycle is a strongly connected
component of more than one module. An import inside a function must carry a comment on its
line or the line above (one comment above a run of consecutive imports covers the run), saying
which optional dependency (vllm, ray, boto3, trl, ...) or start-up cost it defers. tests/unit/test_layout.py runs this.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("replay_pipeline", "flows")
RUN_PACKAGE = "replay_pipeline.run"
RUN_MODULE_LINES = 400
#: Modules that a bare torch + transformers machine runs (GPU-CHECK.md), and what they must not need.
BARE = ("replay_pipeline.training", "replay_pipeline.algo", "replay_pipeline.generation",
        "replay_pipeline.models")
HEAVY = ("lancedb", "lance", "prefect", "mlflow")


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(test)


def imports(name: str, path: Path, known: dict[str, Path]) -> list[dict]:
    """Every import in module `name`: {target, line, inner (inside a function), external
    (top-level name outside the project), commented}."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    out: list[dict] = []

    def visit(node: ast.AST, inner: bool) -> None:
        block_commented = False  # a run of consecutive imports shares the comment above its first
        previous = None
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                targets = []
                if isinstance(child, ast.Import):
                    targets = [a.name for a in child.names]
                else:
                    base = child.module or ""
                    if child.level:
                        parts = name.split(".")
                        keep = len(parts) - child.level + (1 if path.name == "__init__.py" else 0)
                        base = ".".join(parts[:keep] + ([base] if base else []))
                    targets = [f"{base}.{a.name}" for a in child.names] or [base]
                here = lines[child.lineno - 1]
                above = lines[child.lineno - 2] if child.lineno > 1 else ""
                commented = "#" in here or above.strip().startswith("#") or (
                    isinstance(previous, (ast.Import, ast.ImportFrom)) and block_commented)
                block_commented = commented
                for t in targets:
                    top = t.split(".")[0]
                    resolved = _resolve(t, known) if top in PACKAGES else None
                    out.append({"target": resolved or t, "line": child.lineno, "inner": inner,
                                "project": resolved is not None, "commented": commented})
            previous = child
            visit(child, inner)

    visit(tree, False)
    return out


def graph(root: Path = ROOT) -> tuple[dict[str, Path], dict[str, set[str]], dict[str, list[dict]]]:
    known = modules(root)
    found = {m: imports(m, p, known) for m, p in known.items()}
    edges = {m: {i["target"] for i in found[m] if i["project"] and i["target"] != m} for m in known}
    return known, edges, found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10_000)

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def floors(edges: dict[str, set[str]]) -> dict[str, int]:
    """Floor of each module: 1 + the highest floor it imports (ground floor 1); only
    meaningful without cycles."""
    memo: dict[str, int] = {}

    def floor(m: str, seen: frozenset = frozenset()) -> int:
        if m in memo:
            return memo[m]
        if m in seen:
            return 0
        below = [floor(t, seen | {m}) for t in edges.get(m, ()) if t in edges]
        memo[m] = 1 + max(below, default=0)
        return memo[m]

    return {m: floor(m) for m in edges}


def _reaches(edges: dict[str, set[str]], start: str, external: dict[str, set[str]]) -> set[str]:
    """External top-level packages reachable from `start` through module-level project imports."""
    seen, todo, out = set(), [start], set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        out |= external.get(m, set())
        todo += list(edges.get(m, ()))
    return out


def report(root: Path = ROOT) -> dict:
    known, edges, found = graph(root)
    top_edges = {m: {i["target"] for i in found[m] if i["project"] and not i["inner"] and i["target"] != m}
                 for m in known}
    external = {m: {i["target"].split(".")[0] for i in found[m] if not i["project"] and not i["inner"]}
                for m in known}
    sizes = {m: len(p.read_text().splitlines()) for m, p in known.items()}
    run_modules = {m: n for m, n in sizes.items() if m == RUN_PACKAGE or m.startswith(RUN_PACKAGE + ".")}
    problems = []
    found_cycles = cycles(edges)
    problems += [f"import cycle: {' -> '.join(c)}" for c in found_cycles]
    problems += [f"{m}: {n} lines, over the run's budget of {RUN_MODULE_LINES}"
                 for m, n in sorted(run_modules.items()) if n > RUN_MODULE_LINES]
    problems += [f"{known[m].relative_to(root)}:{i['line']}: `import {i['target']}` inside a function says "
                 "not why (a comment naming the optional dependency or the start-up cost it defers)"
                 for m in known for i in found[m] if i["inner"] and not i["commented"]]
    for m in known:
        if any(m == b or m.startswith(b + ".") for b in BARE):
            heavy = sorted(_reaches(top_edges, m, external) & set(HEAVY))
            if heavy:
                problems.append(f"{m} imports {', '.join(heavy)} (through its module-level imports); the "
                                "learner side must run on a machine with only torch and transformers")
    level = floors(edges) if not found_cycles else {}
    return {
        "modules": len(known), "arrows": sum(len(e) for e in edges.values()),
        "floors": max(level.values(), default=0), "cycles": found_cycles,
        "inner_imports": sum(1 for m in known for i in found[m] if i["inner"] and i["project"]),
        "inner_imports_all": sum(1 for m in known for i in found[m] if i["inner"]),
        "largest_run_module": max(run_modules.items(), key=lambda kv: kv[1]) if run_modules else None,
        "largest": sorted(sizes.items(), key=lambda kv: -kv[1])[:5],
        "problems": problems,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    out = report()
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        largest = out["largest_run_module"]
        print(f"modules {out['modules']}, import arrows {out['arrows']}, floors {out['floors']}, "
              f"cycles {len(out['cycles'])}, project imports inside functions {out['inner_imports']} "
              f"(all: {out['inner_imports_all']}); longest module of the run: "
              f"{largest[0]} ({largest[1]} lines)" if largest else "")
        for problem in out["problems"]:
            print(f"  - {problem}")
    return 1 if out["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
