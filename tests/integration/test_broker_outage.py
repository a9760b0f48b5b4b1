"""A broker restart in the middle of a run, on a real broker of the test's own (the session's broker serves the
other tests): results in flight wait in the producers and go out when the broker is back, nothing is lost,
every offset ends committed, and the worker carries on without a restart of its own."""

from __future__ import annotations

import collections
import time

import msgspec
import pytest

from tests.support.kafka_io import (
    WorkerProcess,
    committed_offsets,
    create_topics,
    decode,
    end_offsets,
    produce_values,
    read_all,
    wait_for,
    worker_config,
)
from worker.local.kafka_broker import LocalKafka

pytestmark = pytest.mark.integration
enc = msgspec.json.encode


def _reqs(n: int, prefix: str) -> list[tuple[bytes, bytes]]:
    return [(f"{prefix}-{i}".encode(), enc({"id": f"{prefix}-{i}", "inputs": {"x": i}})) for i in range(n)]


def test_broker_restart_mid_run_loses_nothing_and_commits_everything(tmp_path):
    n1, n2 = 3000, 1000
    names = {"in": "outage-in", "out": "outage-out", "dlq": "outage-dlq", "run": "outage"}
    with LocalKafka(tmp_path / "kafka") as broker:
        bs = broker.bootstrap
        create_topics(bs, {names["in"]: 4, names["out"]: 4, names["dlq"]: 1})
        produce_values(bs, names["in"], _reqs(n1, "a"))
        # 16 records per 36 ms, ~440/s: the first 3000 take ~7 s, so the broker stops with most still to do.
        cfg = worker_config(bs, names, model={"name": "synthetic", "options": {"a_ms": 20, "b_ms": 1}},
                            batching={"lanes": [{"name": "default", "max_batch_size": 16, "max_wait_ms": 5}]},
                            kafka={"commit_interval_ms": 200})
        w = WorkerProcess(cfg, tmp_path, name="outage").start()
        try:
            w.wait_assigned()
            wait_for(lambda: "partitions assigned" in w.log() and len(read_all(bs, names["out"], timeout=2, idle=0.5))
                     > 200, 60, interval=0.5, what="the first results")
            broker.stop()  # a controlled shutdown, as in a rolling restart; data and ports are kept
            down_at = time.monotonic()
            time.sleep(5)
            assert w.proc is not None and w.proc.poll() is None, f"worker died with the broker:\n{w.log()[-4000:]}"
            broker.start()
            print(f"\n[outage] broker down for {time.monotonic() - down_at:.1f}s")
            produce_values(bs, names["in"], _reqs(n2, "b"))
            expected = {f"a-{i}" for i in range(n1)} | {f"b-{i}" for i in range(n2)}
            results: list[dict] = []

            def all_results() -> bool:
                results[:] = decode(read_all(bs, names["out"], want=n1 + n2, timeout=20))
                return {r["id"] for r in results} >= expected

            wait_for(all_results, 240, interval=1.0, what="a result for every request")
            ids = collections.Counter(r["id"] for r in results)
            assert set(ids) == expected
            # Everything is delivered: the next periodic commit covers every input offset.
            ends = end_offsets(bs, names["in"])
            wait_for(lambda: committed_offsets(bs, cfg["kafka"]["group_id"], names["in"]) == ends, 60,
                     interval=1.0, what="every input offset committed")
            assert w.stop() == 0, w.log()[-4000:]
        finally:
            w.kill()
    dupes = sum(c - 1 for c in ids.values())
    print(f"[outage] {len(ids)} ids, duplicates={dupes} (allowed by at-least-once after a group rejoin)")
    assert all(r["status"] == "ok" for r in results)
