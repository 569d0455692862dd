"""Shared test set-up: Prefect's ephemeral state in a throw-away home, one warm-start cache for
the whole test run, the tier markers, small configs, and the end of each module's shared
Prefect servers (tests/servers.py).

Tiers, one folder each, marked from the folder (never by hand): `unit` (pure functions, no
I/O beyond tmp files), `integration` (real LanceDB tables, MLflow stores, Prefect flow runs),
`contract` (every generator backend against one suite), `e2e` (`python -m flows.train` and
friends as processes; most of the suite's time), `docs` (README.md and docs/: links, the
commands their code blocks show, the generated reference pages; tests/docs/doccheck.py).
`pytest -m "not e2e"` skips the slow tier.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_home = Path(tempfile.mkdtemp(prefix="rp-prefect-"))
os.environ.setdefault("PREFECT_HOME", str(_home))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "CRITICAL")
# The suite runs in two pytest-xdist workers (pyproject's addopts) on a 2-core machine: every
# torch in it, in-process or in a subprocess, takes one thread, so that two workers never
# spin-wait for each other's core (two threads beside a job: about 2x slower a round,
# docs/performance.md "Threads").
# Set before torch loads anywhere; subprocesses inherit it.
TEST_THREADS = 1
"""torch threads of every run the tests start."""
os.environ.setdefault("OMP_NUM_THREADS", str(TEST_THREADS))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# One warm-start cache for the whole test run (every run root, every subprocess): warm starts
# are content-addressed by their settings, so the tiny test model is trained once per run of
# the suite instead of once per module.
from replay_pipeline.config.tiny import tiny_overrides  # noqa: E402  (after sys.path is set)
from replay_pipeline.system.runs import CACHE_ENV  # noqa: E402

os.environ.setdefault(CACHE_ENV, str(Path(tempfile.mkdtemp(prefix="rp-warmstarts-"))))

TIERS = ("unit", "integration", "contract", "e2e", "docs")


#: The suite's longest files (by the seconds each takes in one of the two workers): started first.
LONGEST_FIRST = ("test_guard_rails", "test_faults", "test_pretrained_model_runs", "test_ray", "test_async",
                 "test_custom_task_runs",
                 "test_servers", "test_viewer", "test_peers", "test_sweep", "test_train_flow")
#: Then whole tiers, slowest first: a worker that ends its last file early idles while the other
#: finishes, so the short files go last, where they fill the gap (docs: four files of seconds to
#: a minute, with the unit tier's).
TIER_ORDER = ("e2e", "integration", "contract", "docs", "unit")


def _tier(item) -> str | None:
    parts = Path(str(item.fspath)).relative_to(ROOT / "tests").parts
    return parts[0] if parts and parts[0] in TIERS else None


def _schedule_key(item) -> tuple[int, int]:
    tier, stem = _tier(item), Path(str(item.fspath)).stem
    return (TIER_ORDER.index(tier) if tier else len(TIER_ORDER),
            LONGEST_FIRST.index(stem) if stem in LONGEST_FIRST else len(LONGEST_FIRST))


def pytest_collection_modifyitems(config, items):
    """Mark every test with its tier, from the folder it is in; order the files longest first
    (the workers take files in this order: pyproject's addopts turn off pytest-xdist's own
    reordering, which put the files with the most tests first, the unit tier's, and left the
    few-test e2e files, the longest, to the end, where one worker ran on alone)."""
    for item in items:
        if tier := _tier(item):
            item.add_marker(getattr(pytest.mark, tier))
    items.sort(key=_schedule_key)  # stable: in-file order kept

# The tiny run (replay_pipeline/config/tiny.py): tests exercise the pipeline, not the learning.
TINY_OVERRIDES = tiny_overrides(TEST_THREADS)


@pytest.fixture(autouse=True, scope="module")
def _shared_prefect_servers_end_with_their_module():
    """A module's shared Prefect servers (tests/servers.py's prefect_env) stop at its end: idle,
    each still costs CPU beside the next module's work."""
    yield
    from tests.servers import stop_prefect_servers

    stop_prefect_servers()
