"""The gpu_feed scenario's CPU-per-thread accounting: the worker's OS thread names reach /proc, and each
thread is counted under its class."""

from __future__ import annotations

import os
import threading
import time

from tests.bench.gpu_feed import corpus, per_record_us, thread_class, thread_cpu
from worker.adapters.host_pool import name_os_thread


def test_a_named_thread_is_counted_under_its_class() -> None:
    stop, spun = threading.Event(), threading.Event()

    def spin() -> None:
        name_os_thread("kiw-collate")
        end = time.monotonic() + 10  # a busy machine gives it less than a core
        while time.thread_time() < 0.2 and time.monotonic() < end:
            pass  # CPU time for the collate class
        spun.set()
        stop.wait(10)

    t = threading.Thread(target=spin)
    t.start()
    try:
        assert spun.wait(15)
        cpu = thread_cpu(os.getpid())
    finally:
        stop.set()
        t.join()
    assert cpu.get("collate", 0.0) >= 0.1, cpu
    assert "loop" in cpu  # this test's own (main) thread


def test_thread_classes() -> None:
    assert thread_class(7, 7, "python") == "loop"
    assert [thread_class(8, 7, c) for c in ("kiw-collate", "kiw-device", "kiw-finish", "kiw-host",
                                            "rdk:broker1", "python")] == [
        "collate", "device", "finish", "host pool", "kafka client", "other"]


def test_cpu_per_record_is_the_difference_over_the_records() -> None:
    got = per_record_us({"loop": 1.0}, {"loop": 3.0, "other": 1.0}, 1_000_000)
    assert got == {"loop": 2.0, "other": 1.0, "total": 3.0}


def test_the_corpus_is_the_load_generators() -> None:
    texts = corpus(3)
    assert len(texts) == 3 and texts[0].endswith(" #0") and texts[2].endswith(" #2")
