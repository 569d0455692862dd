"""The async loop's engine settings: refused by validation (pure) or, for what needs the
machine (is dask installed? does a scheduler answer?), by the pre-flight, saying how to fix it.
(In the unit tier: none of these starts a run.)"""

from __future__ import annotations

import socket

import pytest

from replay_pipeline.config import ConfigError, load_config
from replay_pipeline.run.engines import check_dask_scheduler
from replay_pipeline.run.preflight import preflight


@pytest.mark.parametrize("overrides, message", [
    (["loop=async", "loop.engine=ray"], "loop.engine='ray' is not one of ['local', 'dask']"),
    (["loop.engine=dask"], "add loop=async"),
    (["loop=async", "loop.dask_address=tcp://10.0.0.5:8786"], "only used with loop.engine=dask"),
    (["loop=async", "loop.engine=dask", "loop.dask_address=10.0.0.5"], "is not a Dask scheduler address"),
    (["loop=async", "loop.heartbeat_timeout=0.5"], "loop.heartbeat_timeout=0.5 must be >= 1 (seconds; default 180)"),
])
def test_engine_settings_are_validated(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    assert message in str(info.value)


def test_the_dask_engine_without_dask_installed_says_how_to_install_it(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "distributed" else real(name, *a))
    cfg = load_config(["loop=async", "loop.engine=dask", f"tracking.root_dir={tmp_path}"])  # valid configuration
    with pytest.raises(ConfigError, match=r"pip install 'dask\[distributed\]'"):
        preflight(cfg)  # the lookup of what is installed is the pre-flight's
    assert load_config(["loop=async"]).loop.engine == "local"  # the default engine needs no Dask


def test_a_listener_that_is_not_a_dask_scheduler_is_refused():
    with socket.socket() as server:  # accepts the TCP connection, never speaks Dask
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"tcp://127.0.0.1:{server.getsockname()[1]}"
        with pytest.raises(ConfigError, match=r"no Dask scheduler answered within 2 s"):
            check_dask_scheduler(address, timeout=2.0)
