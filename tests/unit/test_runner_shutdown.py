"""Runner.run end to end on the fakes: graceful stop (pause, flush open windows, finish in-flight work,
final commit, exit 0), the shutdown timeout, fatal consumer errors, and the loop's bookkeeping."""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import pytest
from confluent_kafka import KafkaError
from confluent_kafka import TopicPartition as KTP

from tests.unit.fakes_kafka import FakeMessage, Harness, make_config, request
from worker.core.records import Batch, TopicPartition

IN0, IN1 = TopicPartition("in", 0), TopicPartition("in", 1)
OPEN_WINDOWS = {"lanes": [{"name": "default", "max_batch_size": 100, "max_wait_ms": 60_000}]}


def test_stop_pauses_flushes_windows_finishes_in_flight_work_and_commits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = Harness(monkeypatch, make_config(batching=OPEN_WINDOWS))
    h.send(3)
    h.c.schedule(lambda: h.c.assign(("in", 0), ("in", 1)))
    batches: list[Batch] = []
    at_stop: dict[str, object] = {}

    def device_takes_0_to_2() -> None:  # read in turn 1; 3 and 4 arrive while they run
        b = h.device.take()
        assert b is not None and len(b.records) == 3
        batches.append(b)
        h.send(2)

    def stop() -> None:
        assert h.runner.scheduler.queued("default") == 2  # 3, 4 in an open window: the device is busy
        h.runner.stop()

    def drain() -> None:  # the device finishes its batch, then runs the flushed window
        if "paused" not in at_stop:
            at_stop["paused"] = set(h.c.paused)
            h.send(1)  # arrives while draining: never read
        for b in batches:
            h.device.finish(b)
        batches.clear()
        while (b := h.device.take()) is not None:
            at_stop.setdefault("reason", b.reason)
            h.device.finish(b)

    h.on_polls({2: device_takes_0_to_2, 3: stop}, then=drain)
    assert h.run() == 0
    assert at_stop["paused"] == {IN0, IN1}
    assert at_stop["reason"] == "flush"
    assert [r["source"]["offset"] for r in h.p.results()] == [0, 1, 2, 3, 4]
    assert h.committed() == 5  # everything read was finished and committed; offset 5 left for later
    assert h.runner.stats.records_in == 5
    assert h.c.closed and h.device.stopped and h.p.flush_calls >= 1
    assert h.runner.fatal is None


class GaugeMetrics:
    """Metrics that keep the last value of each gauge (name, sorted labels) in ``gauges`` and ignore the
    rest."""

    def __init__(self, gauges: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> None:
        self.gauges = gauges

    def __getattr__(self, name: str) -> object:
        return lambda *a, **kw: None

    def gauge(self, name: str, value: float, **labels: str) -> None:
        self.gauges[(name, tuple(sorted(labels.items())))] = value


def _stuck(monkeypatch: pytest.MonkeyPatch, **cfg: Any) -> Harness:
    """Four records in in[0], batches of 2, partition assigned at the first poll: what the tests below start
    from before one batch gets stuck on the device (``_one_done_one_stuck``)."""
    h = Harness(monkeypatch, make_config(batching={"lanes": [{"name": "default",
                                                              "max_batch_size": 2}]}, **cfg))
    h.send(4)
    h.c.schedule(lambda: h.c.assign(("in", 0)))
    return h


def _one_done_one_stuck(h: Harness) -> Batch:
    """Offsets 0, 1 finish; 2, 3 are taken by a device that never finishes them (returned)."""
    first = h.device.take()
    assert first is not None
    h.device.finish(first)
    stuck = h.device.take()
    assert stuck is not None
    return stuck


def test_shutdown_timeout_commits_the_done_prefix_and_still_exits_0(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    h = _stuck(monkeypatch, delivery={"shutdown_timeout_s": 3})
    stuck: list[Batch] = []

    def hang() -> None:
        stuck.append(_one_done_one_stuck(h))  # 2, 3 never finish (a hung device)

    h.on_polls({2: hang, 4: h.runner.stop})
    t0 = h.clock.t
    with caplog.at_level(logging.WARNING, logger="worker.runner"):
        assert h.run() == 0
    assert 3.0 <= h.clock.t - t0 < 10.0  # waited shutdown_timeout_s (fake time), not forever
    assert h.committed() == 2
    assert "shutdown timeout" in caplog.text
    assert [r["source"]["offset"] for r in h.p.results()] == [0, 1]


def test_stop_before_any_assignment_exits_0(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch)
    h.on_polls({2: h.runner.stop})
    assert h.run() == 0
    assert h.c.closed and h.c.commit_calls == [] and h.p.produced == []
    assert h.c.topics == ["in"] and h.consumer.config["group.id"] == "g"


def test_a_fatal_consumer_error_stops_with_exit_1(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch)
    h.send(2)
    h.c.schedule(lambda: h.c.assign(("in", 0)))
    h.device.auto = True
    h.c.hooks.append(h.device.hook)

    h.on_polls({3: lambda: h.c.inject_error(KafkaError(KafkaError._FATAL,
                                                       "fatal: fenced consumer", fatal=True))})
    assert h.run() == 1
    assert "fatal consumer error" in (h.runner.fatal or "")
    assert h.committed() == 2  # work done before the error is still committed on the way out


@pytest.mark.parametrize("missing, key", [("out", "kafka.output_topic"), ("dlq", "kafka.dlq_topic")])
def test_a_topic_the_producer_refuses_stops_with_exit_1_and_a_clear_error(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, missing: str, key: str) -> None:
    """A missing output or DLQ topic on a broker that does not create topics: produce() raises. The worker
    warns at start, then stops with an error that names the config key, instead of a traceback; nothing at
    or past the refused record is committed."""
    h = Harness(monkeypatch)
    h.p.unknown_topics.add(missing)
    h.c.append("in", 0, b"{not json", key=b"bad")  # a dead letter, at offset 0
    h.send(3)
    h.c.schedule(lambda: h.c.assign(("in", 0)))
    h.device.auto = True
    h.c.hooks.append(h.device.hook)
    with caplog.at_level(logging.WARNING, logger="worker.runner"):
        assert h.run() == 1
    fatal = h.runner.fatal or ""
    assert f"cannot produce to '{missing}' ({key})" in fatal and "does not exist" in fatal
    assert f"{key} '{missing}' does not exist on the broker" in caplog.text
    # Offset 0 owes only a dead letter, offsets 1-3 only results: the commit stops before the first refused.
    assert (h.committed() or 0) <= (0 if missing == "dlq" else 1)
    assert h.c.closed


def test_transient_consume_errors_and_partition_eof_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0))
    h.c.inject_error(KafkaError(KafkaError._PARTITION_EOF, "eof"))
    h.c.inject_error(KafkaError(KafkaError._TRANSPORT, "broker down"))
    h.send(1)
    h.process()
    h.commit()
    assert h.committed() == 1 and h.runner.fatal is None


def test_messages_of_unassigned_partitions_in_a_fetch_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0))
    h.send(1, partition=0)
    h.c.schedule(lambda: h.c.revoke(("in", 0)))  # revoked inside the poll that returns its record
    h.iterate()
    assert h.runner.stats.records_in == 0 and h.runner.tracker.in_flight() == 0


def test_lag_report_reads_watermarks_of_assigned_partitions(monkeypatch: pytest.MonkeyPatch) -> None:
    gauges: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    h = Harness(monkeypatch, metrics=GaugeMetrics(gauges)).start()
    h.c.assign(("in", 0))
    h.send(5)
    h.iterate()  # the first turn reports (lag_interval_s counts from the start)
    h.device.run_all()
    h.iterate()
    h.commit()
    h.runner.lag.report(h.clock.t)
    assert gauges[("consumer_lag", (("partition", "0"), ("topic", "in")))] == 0
    assert gauges[("in_flight", ())] == 0


def test_a_sigterm_before_run_is_a_graceful_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The handlers are installed when the Runner is built, so a SIGTERM while the model still loads stops the
    worker gracefully (exit 0) instead of killing it with the default disposition."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        h = Harness(monkeypatch, install_signals=True)
        os.kill(os.getpid(), signal.SIGTERM)
        assert h.runner.lifecycle.stop_requested
        h.send(2)
        h.c.schedule(lambda: h.c.assign(("in", 0)))
        assert h.run() == 0
        # Stopped before the clients exist: it does not join the group (nor, in exactly-once mode, fence the
        # previous producer) only to leave it at once.
        assert h.runner.consumer is None and h.result_ids() == []
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_a_dead_device_thread_stops_the_worker_with_exit_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipeline thread that dies (a handler raising SystemExit) never hands back the batch it held. The loop
    used to keep its heartbeat and wait for it forever, reading up to max_in_flight and then nothing. Now
    it stops with exit 1 at once (no shutdown_timeout_s wait), commits what was done, and not the held
    batch."""
    h = _stuck(monkeypatch, delivery={"shutdown_timeout_s": 30})

    def die() -> None:
        _one_done_one_stuck(h)
        h.device.error = SystemExit(3)

    h.on_polls({2: die})
    t0 = h.clock.t
    assert h.run(max_polls=200) == 1
    assert "fake-0: a device pipeline thread failed (SystemExit: 3)" in (h.runner.fatal or "")
    assert h.clock.t - t0 < 3.0  # did not wait out shutdown_timeout_s for the held batch
    assert h.committed() == 2


def test_a_batch_that_never_comes_back_from_the_device_stops_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A forward that never returns (a hung kernel or driver): the threads live, the heartbeat is fresh, and
    the partitions were held forever. Past model.batch_timeout_s the worker exits 1 (restarted), committing
    what was done and not the hung batch."""
    h = _stuck(monkeypatch, model={"batch_timeout_s": 10}, delivery={"shutdown_timeout_s": 1})
    hung_at: list[float] = []

    def hang() -> None:
        _one_done_one_stuck(h)
        h.device.busy_since = h.clock.t
        hung_at.append(h.clock.t)

    h.on_polls({2: hang})
    assert h.run(max_polls=100_000) == 1
    assert "a batch has been on the device for 10 s (model.batch_timeout_s=10)" in (h.runner.fatal or "")
    assert 10 <= h.clock.t - hung_at[0] < 13
    assert h.committed() == 2


@pytest.mark.parametrize("mode,slow_broker", [("at_least_once", False), ("exactly_once", False),
                                              ("exactly_once", True)])
def test_a_graceful_stop_is_bounded_by_shutdown_timeout(monkeypatch: pytest.MonkeyPatch, mode: str,
                                                        slow_broker: bool) -> None:
    # Records stuck on a device: the shutdown waits shutdown_timeout_s (3 s). consumer.close() then revoked
    # the partitions gracefully, which waited revoke_timeout_ms (5 s) again for the same records, and a
    # checkpoint could add a flush of 30 s: the pod outlived its grace period and was killed.
    h = _stuck(monkeypatch, delivery={"shutdown_timeout_s": 3, "revoke_timeout_ms": 5000, "mode": mode,
                                      "transactional_id": "t"})
    t: dict[str, float] = {}

    def hang() -> None:
        _one_done_one_stuck(h)
        if slow_broker:
            h.p.hold = True  # nothing produced from now on is acknowledged

    def stop() -> None:
        t["stop"] = h.clock.t
        h.runner.stop()

    h.on_polls({2: hang, 4: stop})
    h.run()
    # 1 s more at most where a checkpoint's flush gets its minimum of 1 s.
    assert h.clock.t - t["stop"] <= 3 + (1.1 if slow_broker else 0.1)
    assert all(d.stop_requested for d in h.runner.workers)


def test_finished_records_behind_a_stuck_one_pause_their_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    """max_in_flight counts only unfinished records: behind one stuck batch the finished ones piled up
    uncommitted without limit (memory, and duplicates after a crash). batching.max_uncommitted bounds them."""
    cfg = make_config(batching={"lanes": [{"name": "default", "max_batch_size": 2}], "max_uncommitted": 10,
                                "max_in_flight": 1000})
    h = Harness(monkeypatch, cfg).start()
    h.c.assign(("in", 0))
    h.send(8)
    h.iterate()
    stuck = h.device.take()  # offsets 0, 1: on a device that does not finish
    assert stuck is not None
    h.device.run_all()  # 2..7 done and delivered
    h.iterate()
    assert h.runner.tracker.in_flight() == 2 and IN0 not in h.c.paused
    h.send(4)  # 8..11: the span from offset 0 is now 12, past 10
    h.iterate(2)
    h.device.run_all()
    h.iterate()
    assert h.runner.tracker.in_flight() == 2  # far below max_in_flight
    assert IN0 in h.c.paused
    h.device.finish(stuck)
    h.iterate(2)
    h.commit()
    assert IN0 not in h.c.paused and h.committed() == 12


def test_results_confirmed_by_the_last_flush_reach_the_ledger(monkeypatch: pytest.MonkeyPatch) -> None:
    """At a shutdown timeout the last flush of the producer confirms results that were still unacknowledged.
    Behind a stuck record no commit covers them, and they went into the delivered-id ledger only at the next
    loop turn, which never came: after the restart they were processed and delivered a second time."""
    from worker.store.memory_store import MemoryStore

    store = MemoryStore(cache=False)
    recorded: list[str] = []
    real = store.mark_delivered
    monkeypatch.setattr(store, "mark_delivered", lambda ids: (recorded.extend(ids), real(ids)))
    h = Harness(monkeypatch, make_config(batching={"lanes": [{"name": "default", "max_batch_size": 2}]},
                                         redis={"ledger": True}, delivery={"shutdown_timeout_s": 2}),
                store=store)
    h.send(4)
    h.c.schedule(lambda: h.c.assign(("in", 0)))

    def hang() -> None:
        h.p.hold = True  # the broker acknowledges nothing until the last flush
        stuck, done = h.device.take(), h.device.take()  # 0, 1 never finish; 2, 3 do
        assert stuck is not None and done is not None
        h.device.finish(done)

    def release_on_flush() -> None:
        if h.p.flush_calls:
            h.p.hold = False

    h.p.hooks.append(release_on_flush)
    h.on_polls({2: hang, 4: h.runner.stop})
    assert h.run() == 0
    assert [r["source"]["offset"] for r in h.p.results()] == [2, 3]
    assert h.committed() is None  # behind the stuck record: no commit can cover them...
    # ...the ledger does
    assert len(recorded) == 2 and all(i.endswith(("in-0-2", "in-0-3")) for i in recorded)


def _drain_with(monkeypatch: pytest.MonkeyPatch, mode: str, during_drain: Any) -> Harness:
    """in[0] holds a batch on a slow device, so the worker drains for a while after stop();
    ``during_drain(h)`` runs at the drain's second poll. in[1] has 4 records nobody has committed."""
    cfg = make_config(kafka={"commit_interval_ms": 5}, delivery={"mode": mode, "transactional_id": "t"})
    h = Harness(monkeypatch, cfg)
    h.send(3, partition=0)
    h.send(4, partition=1)
    held: list[Batch] = []

    def hold_batches() -> None:
        while (b := h.device.take()) is not None:
            held.append(b)

    h.c.hooks.append(hold_batches)
    polls = {"drain": 0}

    def drain() -> None:
        if not h.runner.lifecycle.stop_requested:
            return
        polls["drain"] += 1
        if polls["drain"] == 2:
            during_drain(h)
        if polls["drain"] == 40:  # the slow batch comes back
            for b in held:
                h.device.finish(b)
            held.clear()

    h.on_polls({1: lambda: h.c.assign(("in", 0)), 3: h.runner.stop}, then=drain)
    assert h.run() == 0
    assert [r["source"]["offset"] for r in h.p.results() if r["source"]["partition"] == 0] == [0, 1, 2]
    assert h.committed("in", 0) == 3
    return h


@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
def test_a_partition_assigned_while_draining_is_paused_and_not_committed_past(
        monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """A peer leaves during this worker's drain (rolling deploy) and its partition comes here. It was resumed,
    the drain's poll(0) returned its records and dropped them, and the drain's periodic commit stepped the
    partition's commit over them to the consumer's position: 4 records lost."""
    seen: dict[str, bool] = {}

    def assign(h: Harness) -> None:
        h.c.assign(("in", 1))
        h.c.schedule(
            lambda: seen.setdefault("paused", IN1 in h.c.paused and IN1 in h.runner.partitions.paused)
        )

    h = _drain_with(monkeypatch, mode, assign)
    assert seen == {"paused": True}
    assert not [r for r in h.p.results() if r["source"]["partition"] == 1]
    assert not h.committed("in", 1)


def test_a_record_a_drain_turn_polls_anyway_is_not_committed_past(monkeypatch: pytest.MonkeyPatch) -> None:
    """Should a drain turn's poll(0) return a record (a partition resumed behind the runner's back), the turn
    drops it untracked: its commits must not step over it to the consumer's position."""
    def assign_and_resume(h: Harness) -> None:
        h.c.assign(("in", 1))
        h.c.resume([KTP("in", 1)])

    h = _drain_with(monkeypatch, "at_least_once", assign_and_resume)
    assert h.c.app_positions.get(IN1, 0) > 0  # the drain did read in[1]
    assert not h.committed("in", 1)


def test_a_record_whose_headers_the_client_cannot_decode_is_processed_without_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """confluent-kafka decodes header names as UTF-8 and does not check the result: a name another client
    wrote in another encoding makes Message.headers() raise (SystemError: "returned a result with an exception
    set"). Raised in the loop, it stopped the worker at every restart."""
    class Undecodable(FakeMessage):
        __slots__ = ()

        def headers(self) -> list[tuple[str, bytes | None]] | None:
            raise SystemError("<built-in method headers> returned a result with an exception set")

    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0))
    h.send(1)
    h.c.append("in", 0, request("odd", 1))
    good = h.c.logs[IN0][1]
    h.c.logs[IN0][1] = Undecodable("in", 0, 1, good.value(), good.key())
    h.send(1)
    h.process()
    h.commit()
    assert h.runner.fatal is None and h.committed() == 3
    assert [r["id"] for r in h.p.results()] == ["in-0-0", "odd", "in-0-2"]


def test_an_exactly_once_checkpoint_while_draining_ends_by_the_shutdown_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The drain's periodic checkpoint flushed for 30 s and commit_transaction waited 30 s per call (3 calls),
    whatever was left of shutdown_timeout_s: a batch that finished 29 s into a 30 s drain, just as the broker
    stopped acknowledging, made the stop take 60 s and more, past the pod's grace period (SIGKILL in the
    middle of a transaction). Now every wait ends by the deadline; the transaction is aborted and the records
    are read again after the restart."""
    h = _stuck(monkeypatch, delivery={"shutdown_timeout_s": 30, "mode": "exactly_once",
                                      "transactional_id": "t"},
               kafka={"commit_interval_ms": 1000})
    t: dict[str, Any] = {}

    def take() -> None:
        t["stuck"] = _one_done_one_stuck(h)

    def stop() -> None:
        t["stop"] = h.clock.t
        h.runner.stop()

    def drain() -> None:
        if "stuck" in t and h.clock.t - t["stop"] >= 29:
            h.p.hold = True  # the broker stops acknowledging just as the slow batch comes back
            h.device.finish(t.pop("stuck"))
        else:
            h.clock.advance(0.5)

    h.on_polls({2: take, 3: stop}, then=drain)
    h.run()
    assert h.clock.t - t["stop"] <= 30 + 1.1  # a flush's minimum of 1 s past the deadline at most
    assert h.committed() == 2 and not [r for r in h.p.results() if r["source"]["offset"] >= 2]


def test_the_lag_of_a_paused_partition_follows_the_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    """librdkafka's cached high watermark comes with fetch responses: a partition paused by backpressure kept
    the lag it had when it was paused, and kiw_consumer_lag / kiw_drain_seconds (the HPA's metric) stayed low
    under exactly the overload that should scale the worker out."""
    gauges: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    h = Harness(monkeypatch, metrics=GaugeMetrics(gauges)).start()
    h.c.assign(("in", 0), ("in", 1))
    h.send(5)
    h.send(5, partition=1)
    h.process()
    h.commit()
    h.runner.consumer.pause([KTP("in", 0)])  # as _backpressure pauses it
    h.runner.partitions.set_paused([IN0])
    h.send(1000)  # arrives while in[0] is paused
    h.send(7, partition=1)
    h.c.poll(0)  # a fetch: in[1]'s cached watermark moves, in[0]'s does not
    h.runner.lag.report(h.clock.t)

    def lag(p: int) -> float:
        return gauges[("consumer_lag", (("partition", str(p)), ("topic", "in")))]

    assert lag(0) == 1000  # asked the broker: the cache still says 5
    assert h.c.watermark_queries == [IN0]  # only the paused partition costs a round trip
    assert lag(1) == 7  # fetching: the cache is current
