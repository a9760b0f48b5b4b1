"""Runner + store: the delivered-id ledger skips records whose result was
already delivered (acked without a new result), attempt counters quarantine a record that was in flight
during too many crashes, and result-cache hits skip the model. The in-memory store stands in for Redis
(same interface); ``redis.url`` is set where the runner needs it to count attempts."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.fakes_kafka import FakeModel, Harness, make_config, request
from worker.core.records import TopicPartition
from worker.pipeline.store_gate import model_fingerprint
from worker.store.memory_store import MemoryStore

IN0 = TopicPartition("in", 0)
REDIS_URL = "redis://store-is-injected:6379"  # never connected to: the test passes the store itself


def test_ledger_skips_already_delivered_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore(cache=False)
    store.mark_delivered(["out:in-0-1"])
    h = Harness(monkeypatch, make_config(redis={"ledger": True}), store=store).start()
    h.c.assign(("in", 0))
    h.send(3)
    h.iterate()
    assert h.runner.tracker.pending(IN0) == 2  # 1 is done at once: acked without a result
    h.device.run_all()
    h.iterate()
    h.commit()
    assert h.result_ids() == ["in-0-0", "in-0-2"]
    assert h.model.forward_calls == [[0, 2]]
    assert h.committed() == 3 and h.runner.stats.ledger_skips == 1
    # Recorded after delivery, under the output topic (see test_deployments_sharing_a_store_...).
    assert store.delivered_many(["out:in-0-0", "out:in-0-2"]) == {"out:in-0-0", "out:in-0-2"}


def test_ledger_is_off_in_exactly_once_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore(cache=False)
    store.mark_delivered(["out:in-0-0"])
    cfg = make_config(redis={"ledger": True}, delivery={"mode": "exactly_once", "transactional_id": "t"})
    h = Harness(monkeypatch, cfg, store=store).start()
    h.c.assign(("in", 0))
    h.send(1)
    h.process()
    h.commit()
    assert h.result_ids() == ["in-0-0"] and h.runner.stats.ledger_skips == 0


def test_deployments_sharing_a_store_keep_their_own_ledger_and_attempts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two deployments (their own group and output topic) reading the same input share one Redis and
    key_prefix. B must answer on its own topic the ids A answered on A's, and must not quarantine a record
    that crashed A's model; a second group writing to A's output topic skips what A delivered there."""
    store = MemoryStore(cache=False)
    a_cfg = make_config(redis={"url": REDIS_URL, "ledger": True}, delivery={"max_attempts": 2})
    b_cfg = make_config(kafka={"group_id": "g-b", "output_topic": "out-b"},
                        redis={"url": REDIS_URL, "ledger": True}, delivery={"max_attempts": 2})

    def deployment(cfg: Any) -> Harness:
        h = Harness(monkeypatch, cfg, store=store).start()
        h.c.assign(("in", 0))
        h.send(3)
        return h

    a = deployment(a_cfg)
    a.process()
    a.commit()
    assert a.result_ids() == ["in-0-0", "in-0-1", "in-0-2"]
    for _ in range(2):  # then two of A's processes die with in[0]@3 on the device
        a = deployment(a_cfg)
        a.c.append("in", 0, request("in-0-3", 3.0))
        a.iterate()
        assert a.device.take() is not None

    b = deployment(b_cfg)
    b.c.append("in", 0, request("in-0-3", 3.0))
    b.process()
    b.commit()
    assert b.p.dead_letters() == [] and b.runner.stats.ledger_skips == 0
    assert [p.json()["id"] for p in b.p.visible("out-b")] == ["in-0-0", "in-0-1", "in-0-2", "in-0-3"]
    assert b.model.calls >= 1 and b.committed() == 4 and b.result_ids() == []  # nothing on A's topic

    same_topic = deployment(make_config(kafka={"group_id": "g-c"}, redis={"url": REDIS_URL, "ledger": True}))
    same_topic.process()
    assert same_topic.result_ids() == [] and same_topic.runner.stats.ledger_skips == 3
    assert store.get_attempts_many(["g:in:0:3"]) == [2]  # A's count, for A's next process


class _IncrReplyLost(MemoryStore):
    """Redis applied the INCRs, but their reply timed out: the store reports "unknown" (0) for each."""

    def incr_attempts_many(self, attempt_keys: Any) -> list[int]:
        super().incr_attempts_many(attempt_keys)
        return [0] * len(list(attempt_keys))


# With the reply lost, the count used to stay until attempts_ttl_s: a later crash counted one attempt too
# many.
@pytest.mark.parametrize("store_type", [MemoryStore, _IncrReplyLost])
def test_attempts_are_counted_at_dispatch_and_cleared_after_delivery(monkeypatch: pytest.MonkeyPatch,
                                                                     store_type: type[MemoryStore]) -> None:
    store = store_type()
    h = Harness(monkeypatch, make_config(redis={"url": REDIS_URL}), store=store).start()
    h.c.assign(("in", 0))
    h.send(2)
    h.iterate()
    keys = ["g:in:0:0", "g:in:0:1"]
    assert store.get_attempts_many(keys) == [0, 0]  # fetched is not an attempt (thousands are fetched ahead)
    b = h.device.take()
    assert b is not None and len(b.records) == 2
    assert store.get_attempts_many(keys) == [1, 1]  # on the device: if the process dies now, these count
    h.device.finish(b)
    h.iterate()
    h.commit()
    assert h.result_ids() == ["in-0-0", "in-0-1"]
    assert store.get_attempts_many(keys) == [0, 0]  # delivered: cleared


def test_attempts_at_max_attempts_are_quarantined_to_the_dlq(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    for _ in range(3):  # three processes died with in[0]@1 on the device
        store.incr_attempts("g:in:0:1")
    cfg = make_config(redis={"url": REDIS_URL}, delivery={"max_attempts": 3})
    h = Harness(monkeypatch, cfg, store=store).start()
    h.c.assign(("in", 0))
    h.send(3)
    h.process()
    h.commit()
    assert h.model.forward_calls == [[0, 2]]  # the model never sees it again
    results = {r["id"]: r for r in h.p.results()}
    assert results["in-0-1"]["status"] == "error" and "quarantined" in results["in-0-1"]["error"]
    assert "died 3 times" in results["in-0-1"]["error"]
    [dead] = h.p.dead_letters()
    assert (dead.header("x-error-stage"), dead.header("x-source-offset"), dead.header("x-attempts")) == (
        "quarantine", "1", "3")
    assert h.committed() == 3
    assert store.get_attempts_many(["g:in:0:1"]) == [3]  # kept until attempts_ttl_s (see the next test)


def test_two_records_that_each_kill_the_process_are_both_quarantined(monkeypatch: pytest.MonkeyPatch) -> None:
    """A quarantined record's count was cleared once its dead letter was delivered, before its offset was
    committed (a record before it still waited behind the other suspect). The other poison record then killed
    the process, the next one read the first again with no count and died on it: they took turns for good."""
    store = MemoryStore()
    cfg = make_config(redis={"url": REDIS_URL}, delivery={"max_attempts": 2})
    poison = {1, 2}
    processes = 0
    while processes < 12:
        processes += 1
        h = Harness(monkeypatch, cfg, store=store).start()
        h.c.assign(("in", 0))
        h.send(3)  # nothing of in[0] is ever committed before a crash: every process reads 0, 1, 2 again
        h.iterate()
        crashed = False
        while (b := h.device.take()) is not None:
            if any(r.offset in poison for r in b.records):
                crashed = True  # the process dies with this batch on the device
                break
            h.device.finish(b)
            h.iterate()
        if not crashed:
            break
    h.commit()
    assert processes <= 2 * 2 + 1 and h.committed() == 3
    assert sorted(int(p.header("x-source-offset") or -1) for p in h.p.dead_letters()) == [1, 2]


def test_suspects_are_isolated_and_clear_their_count_when_they_come_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A record with a count (it was on the device when a process died) goes to the device alone, once no
    other batch is in flight, so only a record that kills the process on its own keeps counting."""
    store = MemoryStore()
    store.incr_attempts("g:in:0:1")
    store.incr_attempts("g:in:0:2")
    cfg = make_config(redis={"url": REDIS_URL}, delivery={"max_attempts": 3})
    h = Harness(monkeypatch, cfg, store=store).start()
    h.c.assign(("in", 0))
    h.send(4)
    h.iterate()
    for offset in (1, 2):
        alone = h.device.take()
        assert (
            alone is not None and alone.reason == "isolate" and [r.offset for r in alone.records] == [offset]
        )
        assert store.get_attempts_many([f"g:in:0:{offset}"]) == [2]  # this dispatch counts too
        h.device.finish(alone)
        assert store.get_attempts_many([f"g:in:0:{offset}"]) == [0]  # it came back: cleared at once
    rest = h.device.take()
    assert rest is not None and [r.offset for r in rest.records] == [0, 3]
    h.device.finish(rest)
    h.iterate()
    h.commit()
    assert h.committed() == 4 and h.p.dead_letters() == []


@pytest.mark.parametrize("devices", [1, 2])
def test_nothing_runs_beside_a_suspect(monkeypatch: pytest.MonkeyPatch, devices: int) -> None:
    """_next_batch promises a suspect "runs alone on an otherwise idle device (all devices)" and that "the
    next batch is only taken after _done cleared its counter". With one device the collate stage asks for
    the next batch while the suspect is on the device (pipelining); with two, the other device asks."""
    store = MemoryStore()
    store.incr_attempts("g:in:0:1")
    cfg = make_config(redis={"url": REDIS_URL}, delivery={"max_attempts": 3},
                      batching={"lanes": [{"name": "default", "max_batch_size": 2}]})  # 0, 2: a closed batch
    h = Harness(monkeypatch, cfg, store=store, devices=devices).start()
    h.c.assign(("in", 0))
    h.send(3)
    h.iterate()
    alone = h.device.take()
    assert alone is not None and alone.reason == "isolate"
    beside = h.devices[-1].take()
    assert beside is None, f"{[r.offset for r in beside.records]} dispatched beside the suspect"


def test_only_the_record_that_kills_the_process_is_quarantined(monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes share the store (Redis); a "crash" is a harness dropped while a batch is on its device."""
    store = MemoryStore()
    cfg = make_config(redis={"url": REDIS_URL}, delivery={"max_attempts": 2})

    def process() -> Harness:
        h = Harness(monkeypatch, cfg, store=store).start()
        h.c.assign(("in", 0))
        h.send(3)  # in-0-1 kills the process whenever it is on the device
        h.iterate()
        return h

    h = process()
    assert h.device.take() is not None  # 0, 1, 2 on the device together: crash (count 1 each)
    h = process()
    first = h.device.take()  # all three are suspects now: one at a time
    assert first is not None and first.reason == "isolate" and [r.offset for r in first.records] == [0]
    h.device.finish(first)  # innocent: back, cleared
    second = h.device.take()
    assert second is not None and [r.offset for r in second.records] == [1]  # crash again (count 2)
    h = process()
    h.process()
    h.device.run_all()
    h.iterate()
    h.commit()
    assert [int(p.header("x-source-offset") or -1) for p in h.p.dead_letters()] == [1]
    assert {r["id"]: r["status"] for r in h.p.results()} == {"in-0-0": "ok", "in-0-1": "error",
                                                             "in-0-2": "ok"}
    assert h.committed() == 3


def test_attempts_need_a_redis_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-process counters cannot count crashes: without redis.url the runner does not use them."""
    store = MemoryStore()
    for _ in range(5):
        store.incr_attempts("g:in:0:0")
    h = Harness(monkeypatch, make_config(), store=store).start()
    h.c.assign(("in", 0))
    h.send(1)
    h.process()
    assert h.p.dead_letters() == [] and h.result_ids() == ["in-0-0"]


def test_a_delivered_record_redelivered_after_crashes_is_never_quarantined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Crash loop elsewhere (e.g. a poison record further on): the delivered record is redelivered to each
    new process, skipped by the ledger every time, and must never end up in the DLQ (it did while attempts
    were counted at fetch and ledger skips never cleared them)."""
    store = MemoryStore(cache=False)
    cfg = make_config(redis={"url": REDIS_URL, "ledger": True}, delivery={"max_attempts": 3})
    for _process in range(6):  # each process delivers or skips in[0]@0, then dies before committing
        h = Harness(monkeypatch, cfg, store=store).start()
        h.c.assign(("in", 0))
        h.send(1)
        h.process()
        assert h.p.dead_letters() == [], f"quarantined in process {_process + 1}"
    assert h.runner.stats.ledger_skips == 1
    assert store.get_attempts_many(["g:in:0:0"]) == [0]


def test_cache_hits_skip_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore(ledger=False)
    h = Harness(monkeypatch, make_config(redis={"cache": True}), store=store).start()
    h.c.assign(("in", 0))
    h.c.append("in", 0, request("a", {"v": [1, 2]}))
    h.process()
    assert h.model.calls == 1
    h.c.append("in", 0, request("b", {"v": [1, 2]}))  # the same inputs, another request
    h.c.append("in", 0, request("c", {"v": [3]}))
    h.process()
    h.commit()
    assert h.model.forward_calls == [[{"v": [1, 2]}], [{"v": [3]}]]  # b came from the cache
    results: dict[str, Any] = {r["id"]: r for r in h.p.results()}
    assert results["b"]["outputs"] == results["a"]["outputs"] == {"echo": {"v": [1, 2]}}
    assert results["b"]["cached"] is True and results["b"]["batch_size"] == 0
    assert "cached" not in results["a"] and "cached" not in results["c"]  # omitted when false
    assert h.runner.stats.cache_hits == 1 and h.committed() == 3


def test_models_with_the_same_name_and_version_do_not_share_cached_results(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two weight sets reporting the same name and version (minilm versioned by its folder's name, factory
    models all version "0"): the configured options and dtype are part of the cache key."""
    store = MemoryStore(ledger=False)

    def run(**model: Any) -> Harness:
        h = Harness(monkeypatch, make_config(redis={"cache": True}, model=model), store=store).start()
        h.c.assign(("in", 0))
        h.c.append("in", 0, request("a", {"text": "hi"}))
        h.process()
        return h

    assert run(options={"path": "/models/team-a/current"}).model.calls == 1
    # the same model: a hit
    assert run(options={"path": "/models/team-a/current"}).runner.stats.cache_hits == 1
    for model in ({"options": {"path": "/models/team-b/current"}},
                  {"options": {"path": "/models/team-a/current"},
                                                                    "dtype": "fp16"}):
        h = run(**model)
        assert h.runner.stats.cache_hits == 0 and h.model.calls == 1, model


def test_the_model_fingerprint_ignores_key_order_and_takes_any_yaml_keys() -> None:
    from worker.config.settings import ModelConfig

    a = ModelConfig(options={"labels": {0: "neg", 1: "pos"}, "max_tokens": 128})  # int keys: valid YAML
    b = ModelConfig(options={"max_tokens": 128, "labels": {1: "pos", 0: "neg"}})
    assert (
        model_fingerprint(a)
        == model_fingerprint(b)
        != model_fingerprint(ModelConfig(options={"max_tokens": 128}))
    )


def test_a_corrupt_cache_entry_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore(ledger=False)
    h = Harness(monkeypatch, make_config(redis={"cache": True}), store=store).start()
    h.c.assign(("in", 0))
    h.c.append("in", 0, request("a", 5))
    h.iterate()
    b = h.device.take()
    assert b is not None and b.records[0].cache_key
    h.device.finish(b)
    h.iterate()  # the result is cached now ...
    key = f"{model_fingerprint(h.cfg.model)}:{b.records[0].cache_key}"
    assert store.get_cached(key) is not None
    store.put_cached(key, b"\xc1 not msgpack")  # ... and then corrupted
    h.c.append("in", 0, request("b", 5))
    h.process()
    assert h.model.calls == 2 and h.runner.stats.cache_hits == 0
    assert [r["status"] for r in h.p.results()] == ["ok", "ok"]


def test_errors_are_not_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore(ledger=False)
    h = Harness(monkeypatch, make_config(redis={"cache": True}), store=store).start()
    h.c.assign(("in", 0))
    h.c.append("in", 0, request("a", "poison"))
    h.process()
    assert store.sizes()["cache"] == 0
    h.c.append("in", 0, request("b", "poison"))
    h.process()
    assert h.model.calls == 2 and [r["status"] for r in h.p.results()] == ["error", "error"]


def test_a_preempted_batch_goes_back_and_its_records_are_not_counted_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = make_config(kafka={"input_topics": []}, redis={"url": REDIS_URL},
                      batching={"lanes": [{"name": "hi", "topics": ["in-hi"], "priority": 1,
                                           "max_batch_size": 2, "fill_with_lower": False},
                                          {"name": "lo", "topics": ["in-lo"], "max_batch_size": 2}],
                                "default_lane": "lo"})
    store = MemoryStore()
    h = Harness(monkeypatch, cfg, store=store).start()
    h.c.assign(("in-hi", 0), ("in-lo", 0))
    h.send(4, topic="in-lo")
    h.iterate()
    running = h.device.take()  # on the device
    prefetched = h.device.take()  # taken ahead while the device is busy
    assert running is not None and prefetched is not None and prefetched.lane == "lo"
    lo_keys = [f"g:in-lo:0:{r.offset}" for r in prefetched.records]
    assert store.get_attempts_many(lo_keys) == [1, 1]
    h.send(1, topic="in-hi")
    h.iterate()
    # its window is still open: it goes after the prefetched batch
    assert h.runner.dispatch.swap(prefetched) is None
    h.clock.advance(1.0)  # past max_wait: the high lane's batch is closed
    # Just before the device starts the prefetched batch, the high lane's batch goes first.
    urgent = h.runner.dispatch.swap(prefetched)
    assert urgent is not None and urgent.lane == "hi" and [r.offset for r in urgent.records] == [0]
    assert store.get_attempts_many(["g:in-hi:0:0"]) == [1]
    assert h.runner.scheduler.queued("lo") == 2  # the prefetched records are queued again
    h.device.finish(running)
    h.device.finish(urgent)
    again = h.device.take()
    assert again is not None and [r.offset for r in again.records] == [r.offset for r in prefetched.records]
    assert store.get_attempts_many(lo_keys) == [1, 1]  # counted when first taken, not again
    h.device.finish(again)
    h.iterate()
    h.commit()
    assert sorted(h.result_ids()) == ["in-hi-0-0"] + [f"in-lo-0-{i}" for i in range(4)]
    assert h.committed("in-lo") == 4 and h.committed("in-hi") == 1


def test_an_output_the_cache_cannot_hold_is_still_delivered(monkeypatch: pytest.MonkeyPatch) -> None:
    # msgpack writes no int beyond 64 bits (OverflowError); JSON results do. Raised from cache_put, it stopped
    # the loop before the batch's results were sent, on every restart.
    store = MemoryStore()
    model = FakeModel(output=lambda x: {"hash": 2**70 + x})
    h = Harness(monkeypatch, make_config(redis={"cache": True}), store=store, model=model).start()
    h.c.assign(("in", 0))
    h.send(2)
    h.process()
    h.commit()
    assert [r["outputs"] for r in h.p.results()] == [{"hash": 2**70}, {"hash": 2**70 + 1}]
    assert h.committed() == 2


def test_ledger_holds_ok_results_only_so_a_failed_request_may_be_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = MemoryStore(cache=False)
    h = Harness(monkeypatch, make_config(redis={"ledger": True}), store=store).start()
    h.c.assign(("in", 0))
    h.c.append("in", 0, request("fine", 1.0))
    h.c.append("in", 0, request("late", 1.0, deadline_ms=h.clock.time_ms() - 1))
    h.c.append("in", 0, request("broken", "poison"))
    h.process()
    h.commit()
    assert {r["id"]: r["status"] for r in h.p.results()} == {"fine": "ok", "late": "expired",
                                                             "broken": "error"}
    assert store.delivered_many(["out:fine", "out:late", "out:broken"]) == {"out:fine"}
    # The senders retry under the same ids: the failed ones are processed again, the ok one is not.
    for rid in ("fine", "late", "broken"):
        h.c.append("in", 0, request(rid, 2.0))
    h.process()
    h.commit()
    assert [(r["id"], r["status"]) for r in h.p.results()][3:] == [("late", "ok"), ("broken", "ok")]
    assert h.committed() == 6 and h.runner.stats.ledger_skips == 1


def test_ledger_skips_and_isolated_suspects_are_counted_on_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.observability.metrics import PrometheusMetrics

    m = PrometheusMetrics()
    store = MemoryStore()
    store.mark_delivered(["out:in-0-0", "out:in-0-1"])
    store.incr_attempts("g:in:0:3")
    cfg = make_config(redis={"url": REDIS_URL, "ledger": True}, delivery={"max_attempts": 3})
    h = Harness(monkeypatch, cfg, store=store, metrics=m).start()
    h.c.assign(("in", 0))
    h.send(4)
    h.iterate()
    assert m.registry.get_sample_value("kiw_ledger_skips_total") == 2
    assert m.registry.get_sample_value("kiw_suspects_isolated_total") == 1
