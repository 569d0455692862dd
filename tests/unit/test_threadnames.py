"""Operating-system thread names (replay_pipeline/system/threadnames.py): what /proc shows for the
project's threads, read back from the kernel."""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from replay_pipeline.buffer.writer import WriteBehind
from replay_pipeline.system.threadnames import name_os_thread, os_named

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc: Linux only")


def os_name(native_id: int) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


def test_a_wrapped_target_names_its_thread_for_the_os():
    seen = {}

    def work(x):
        seen["os"] = os_name(threading.get_native_id())
        return x

    t = threading.Thread(target=os_named(work), args=(1,), name="table-writer")
    t.start()
    t.join()
    assert seen["os"] == "table-writer"
    plain = threading.Thread(target=work, args=(1,), name="table-writer")
    plain.start()
    plain.join()
    assert seen["os"] != "table-writer"  # without the wrapper the OS name is the process's


def test_long_names_are_cut_to_linux_fifteen_bytes():
    got = []
    t = threading.Thread(target=os_named(lambda: got.append(os_name(threading.get_native_id()))),
                         name="window-read-ahead-thread")
    t.start()
    t.join()
    assert got == ["window-read-ahe"]


def test_executor_threads_are_named_by_the_initializer():
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish-weights", initializer=name_os_thread) as pool:
        assert pool.submit(lambda: os_name(threading.get_native_id())).result() == "publish-weights"[:15]


def test_the_table_writer_thread_carries_its_name():
    writes = WriteBehind(enabled=True)
    try:
        writes.submit(lambda: os_name(threading.get_native_id()))
        assert writes.wait() == "table-writer_0"
    finally:
        writes.close()
