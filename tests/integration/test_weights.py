"""The weight store the async loop publishes through, and its control directory, on disk."""

from __future__ import annotations

import multiprocessing as mp

import torch

from replay_pipeline.async_loop import AsyncDir
from replay_pipeline.weights import WeightStore


def _reader(directory: str, rounds: int, out) -> None:
    store = WeightStore(directory)
    seen = []
    for _ in range(rounds):
        version, state = store.load_latest()
        # every tensor of a version holds the version number: a torn read would mix them
        values = {float(t.flatten()[0]) for t in state.values()}
        assert values == {float(version)}, (version, values)
        seen.append(version)
    out.put(seen)


def test_publish_is_atomic_and_readers_see_only_complete_versions(tmp_path):
    store = WeightStore(tmp_path / "weights", keep=2)
    assert store.latest_version() is None
    store.publish({"a": torch.zeros(1000), "b": torch.zeros(10)}, 0)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    reader = ctx.Process(target=_reader, args=(str(tmp_path / "weights"), 200, out))
    reader.start()
    for v in range(1, 60):
        store.publish({"a": torch.full((1000,), float(v)), "b": torch.full((10,), float(v))}, v)
    reader.join(timeout=120)
    assert reader.exitcode == 0
    seen = out.get(timeout=5)
    assert seen == sorted(seen)  # never goes back in time
    assert store.latest_version() == 59
    assert sorted(p.name for p in (tmp_path / "weights").glob("v-*")) == ["v-000058", "v-000059"]
    assert not list((tmp_path / "weights").glob(".tmp-*"))


def test_async_dir_stop_ready_and_stats(tmp_path):
    control = AsyncDir.of(tmp_path)
    control.reset()
    assert not control.stopped() and control.ready() == 0
    control.mark_ready(0)
    control.write_stats(0, {"gen_tokens": 10.0, "gen_seconds": 1.0})
    control.write_stats(1, {"gen_tokens": 5.0})
    assert control.ready() == 1
    assert control.totals(2) == {"gen_tokens": 15.0, "gen_seconds": 1.0}
    control.stop()
    assert control.stopped()
    control.reset()  # a resumed run starts with no STOP flag and no ready marker
    assert not control.stopped() and control.ready() == 0
    assert control.totals(2)["gen_tokens"] == 15.0  # cumulative stats survive
