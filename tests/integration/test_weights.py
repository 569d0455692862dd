"""The weight store the async loop publishes through, and its control directory, on disk."""

from __future__ import annotations

import multiprocessing as mp
import time

import torch

from replay_pipeline.run.files import AsyncDir
from replay_pipeline.training.weights import WeightFollower, WeightStore


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


def test_the_follower_reads_each_new_version_ahead_and_never_returns_an_old_one(tmp_path):
    store = WeightStore(tmp_path / "weights")
    follower = WeightFollower(store, interval=0.005)
    try:
        assert follower.newest(None) is None  # nothing published yet
        store.publish({"w": torch.zeros(3)}, 0)
        version, state = follower.newest(None)  # read in line if the thread has not yet
        assert version == 0 and torch.equal(state["w"], torch.zeros(3))
        assert follower.newest(0) is None  # the generator holds the newest already
        store.publish({"w": torch.ones(3)}, 1)
        deadline = time.monotonic() + 10
        while follower._loaded is None or follower._loaded[0] != 1:  # read ahead by the thread
            assert time.monotonic() < deadline, "the follower never read version 1"
            time.sleep(0.005)
        version, state = follower.newest(0)
        assert version == 1 and torch.equal(state["w"], torch.ones(3)) and state is follower._loaded[1]
        store.publish({"w": torch.full((3,), 2.0)}, 2)  # newer than what the thread holds: read now
        version, state = follower.newest(1)
        assert version == 2 and torch.equal(state["w"], torch.full((3,), 2.0))
    finally:
        follower.close()
    assert not follower._thread.is_alive()


def test_published_copies_are_snapshots_in_two_reused_buffer_sets(tmp_path):
    store = WeightStore(tmp_path / "weights", keep=5)
    live = {"w": torch.zeros(4), "b": torch.zeros(2)}
    sets = []
    for version in range(4):
        store.publish_copy_in_background(live, version)
        sets.append(store._copies[store._turn][0])
        live["w"].add_(1.0)  # the next optimizer step changes the live weights in place
        live["b"].sub_(1.0)
    store.flush()
    for version in range(4):  # each version holds the weights as they were when it was handed over
        state = torch.load(store.path(version) / "weights.pt", weights_only=True)
        assert torch.equal(state["w"], torch.full((4,), float(version)))
        assert torch.equal(state["b"], torch.full((2,), -float(version)))
    assert sets[0] is sets[2] and sets[1] is sets[3] and sets[0] is not sets[1]  # no allocation per version
    assert all(sets[0][k].data_ptr() != live[k].data_ptr() for k in live)
