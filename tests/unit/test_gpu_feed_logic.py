"""The gpu_feed scenario's CPU-per-thread accounting (``tests.bench.cpu_threads``): the worker's OS thread
names reach /proc, each thread is counted under its class, and the broker is found by its port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

from tests.bench.cpu_threads import CpuProbe, broker_pid, per_record_us, process_cpu, thread_class
from tests.bench.gpu_feed import VARIANTS, corpus, encoding_of
from worker.device.host_pool import name_os_thread


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
        cpu: dict[str, float] = {}
        process_cpu(os.getpid(), cpu)
    finally:
        stop.set()
        t.join()
    assert cpu.get("collate", 0.0) >= 0.1, cpu
    assert "loop" in cpu  # this test's own (main) thread


def test_thread_classes() -> None:
    assert thread_class(7, 7, "python") == "loop"
    assert [thread_class(8, 7, c) for c in ("kiw-collate", "kiw-device", "kiw-finish", "kiw-host",
                                            "rdk:broker1", "python")] == [
        "collate", "device", "finish", "host pool", "librdkafka", "tokenizer + other"]
    # A supervisor's threads are its own class, whatever their names.
    assert {thread_class(t, 7, c, supervisor=True) for t, c in ((7, "python"), (8, "rdk:main"))} == {
        "supervisor"}


def test_cpu_per_record_is_the_difference_over_the_records() -> None:
    got = per_record_us({"loop": 1.0}, {"loop": 3.0, "other": 1.0}, 1_000_000)
    assert got == {"loop": 2.0, "other": 1.0, "total": 3.0}
    with_broker = per_record_us({"loop": 1.0, "broker": 1.0}, {"loop": 3.0, "broker": 5.0}, 1_000_000)
    assert with_broker == {"loop": 2.0, "total": 2.0, "broker": 4.0, "with broker": 6.0}


def test_the_broker_is_the_process_listening_on_the_bootstrap_port() -> None:
    code = ("import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
            "print(s.getsockname()[1], flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        assert broker_pid(f"127.0.0.1:{port},other:9092") == child.pid
        probe = CpuProbe(os.getpid(), f"127.0.0.1:{port}")
        assert probe.broker == child.pid and "broker" in probe.sample()
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        unused = free.getsockname()[1]  # bound, not listening
        assert broker_pid(f"127.0.0.1:{unused}") is None
    assert broker_pid("no-port") is None


def test_the_supervised_probe_counts_the_children_as_workers() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        cpu = CpuProbe(os.getpid(), "", supervised=True).sample()
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)
    assert "supervisor" in cpu and "loop" in cpu  # this process's threads, and the child's main thread


def test_each_variant_names_its_outputs_encoding() -> None:
    assert [encoding_of(s) for _, s in VARIANTS] == ["lists", "float32", "lists"]
    assert any(s.get("model", {}).get("processes") == 2 for _, s in VARIANTS)


def test_the_corpus_is_the_load_generators() -> None:
    texts = corpus(3)
    assert len(texts) == 3 and texts[0].endswith(" #0") and texts[2].endswith(" #2")


def test_an_empty_assignment_is_not_a_members_partitions() -> None:
    from tests.bench.text_worker import assignments

    log_text = "\n".join([
        '{"msg": "partitions assigned", "partitions": ["in[0]", "in[1]", "in[2]", "in[3]"]}',
        '{"msg": "partitions assigned", "partitions": []}',  # the second child, before the rebalance
        '{"msg": "partitions released", "partitions": ["in[0]", "in[1]"]}',
    ])
    assert assignments(log_text) == 1
    assert assignments(log_text + '\n{"msg": "partitions assigned", "partitions": ["in[1]", "in[0]"]}') == 2


def test_the_kafka_loop_sends_outputs_as_the_worker_does() -> None:
    import torch

    from tests.bench.kafka_loop import outputs_of
    from worker.output.result_encoding import pack_float32

    out = torch.randn(3, 384)
    assert outputs_of(out, "lists") == out.tolist()
    assert outputs_of(out, "float32") == [pack_float32(r) for r in out.tolist()]
