"""Whether resource bundles fit a Ray cluster's nodes, and how to say so: pure functions over
resource dicts ({"CPU": 1.0, "GPU": 1.0}), no Ray import, so the pre-flight can refuse a
placement before any work and the tests can work the cases out by hand. The Ray engine
(replay_pipeline/run/ray_engine.py) feeds them the generators' bundles (and any others, such
as a learner's ranks) and the alive nodes' total resources.

A bundle is never split across nodes (Ray places each bundle on one node), so enough CPUs in
all is not enough: `placement_problem` first compares the totals, then places the bundles
first-fit from the largest, which is what any strategy (PACK, SPREAD) needs at the least.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

_SHOWN = ("CPU", "GPU")  # resources named when describing a node, besides those a bundle asks for


def amounts(resources: dict[str, float], keys: Any = None) -> str:
    """`{CPU: 1, GPU: 1}`: `keys` (zeros too), or every resource that is not zero."""
    keys = [k for k in resources if resources.get(k)] if keys is None else list(keys)
    return "{" + ", ".join(f"{k}: {resources.get(k, 0):g}" for k in keys) + "}"


def _sum(items: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        for key, value in item.items():
            out[key] = out.get(key, 0.0) + float(value)
    return out


def describe_cluster(nodes: list[dict[str, float]], where: str, keys: Any = ()) -> str:
    """`the cluster at WHERE has 2 CPUs on 2 nodes ({CPU: 1}, {CPU: 1})`."""
    shown = [*_SHOWN, *(k for k in keys if k not in _SHOWN)]
    total = _sum(nodes)
    has = ", ".join(f"{total.get(k, 0):g} {k}s" for k in shown if total.get(k) or k in keys) or "no CPUs"
    each = ", ".join(amounts(n, [k for k in shown if n.get(k)]) for n in nodes)
    return f"the cluster at {where} has {has} on {len(nodes)} node(s) ({each or 'none alive'})"


def placement_problem(bundles: list[dict[str, float]], what: list[str], nodes: list[dict[str, float]],
                      where: str) -> str | None:
    """None when `bundles` (named by `what`) fit the alive `nodes` (each node's total
    resources): every bundle on one node, first-fit from the largest. Else one sentence naming
    what is missing and what the cluster has. Pure."""
    keys = sorted(_sum(bundles))
    cluster = describe_cluster(nodes, where, keys)
    groups = Counter((name.rstrip("0123456789").strip(), amounts(bundle)) for name, bundle in zip(what, bundles))
    asked = " and ".join(f"{n} {kind} bundle(s) of {shape}" for (kind, shape), n in groups.items())
    need, have = _sum(bundles), _sum(nodes)
    short = [f"{need[k]:g} {k}s" for k in keys if need[k] > have.get(k, 0)]
    if short:
        return f"{asked} need {' and '.join(short)}; {cluster}"
    free = [dict(n) for n in nodes]
    for name, bundle in sorted(zip(what, bundles), key=lambda nb: [-nb[1].get(k, 0) for k in keys]):
        node = next((n for n in free if all(n.get(k, 0) >= v for k, v in bundle.items())), None)
        if node is None:
            return (f"{asked} do not fit: {name}'s bundle {amounts(bundle)} finds no node with that much "
                    f"left (a bundle is never split across nodes); {cluster}")
        for key, value in bundle.items():
            node[key] -= value
    return None


def placement_fix(address: str | None) -> str:
    """What to change when the generators' bundles do not fit: the local instance's size, or
    the cluster at `address`."""
    if address is None:
        return ("raise ray.num_cpus (or ray.num_gpus) for the local instance, or lower loop.workers or "
                "loop.worker_threads")
    return (f"add nodes (`ray start --address={address} --num-cpus N` on another machine), or lower "
            "loop.workers or loop.worker_threads")
