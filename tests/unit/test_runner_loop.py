"""The loop thread's turn: how long it may wait in consumer.poll()."""

from __future__ import annotations

import threading

import pytest

from tests.unit.fakes_kafka import Harness, make_config

SHORT = 0.002


def test_the_loop_polls_in_short_steps_while_anything_is_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device that finishes cannot wake consumer.poll(): while a record is queued, on the device or waiting
    for its delivery to settle, the loop must come back within SHORT to emit and confirm it, not wait out
    poll_timeout_ms for the next record to arrive. Idle, it waits the whole poll_timeout_ms."""
    h = Harness(monkeypatch, make_config(kafka={"poll_timeout_ms": 20})).start()
    h.c.assign(("in", 0))
    polls = h.c.poll_timeouts

    h.iterate()
    assert polls[-1] == 0.02  # nothing read: idle
    h.send(1)
    h.iterate()  # read and queued; the device has not taken it yet
    h.iterate()
    assert polls[-1] == SHORT
    batch = h.device.take()
    assert batch is not None
    h.iterate()
    assert polls[-1] == SHORT  # on the device
    h.p.hold = True
    h.device.finish(batch)
    h.iterate()  # emitted; its delivery not acknowledged yet
    h.iterate()
    assert h.p.produced and polls[-1] == SHORT
    h.p.hold = False
    h.iterate()  # acknowledged and confirmed
    h.iterate()
    assert h.runner.tracker.in_flight() == 0 and polls[-1] == 0.02


def test_a_batch_whose_records_expired_before_its_device_started_it_is_not_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The device takes its next batch while it still runs the current one (prefetch) and checks it just
    before starting (Dispatch.swap): records past their deadline by then get expired results, not
    inference."""
    cfg = make_config(batching={"lanes": [{"name": "default", "max_batch_size": 4, "deadline_ms": 50}]})
    h = Harness(monkeypatch, cfg).start()
    h.c.assign(("in", 0))
    h.send(2)
    h.iterate()
    batch = h.device.take()
    assert batch is not None and len(batch.records) == 2
    h.clock.advance(0.1)  # the batch ahead of it took that long
    trimmed = h.runner.dispatch.swap(batch)
    assert trimmed is not None and trimmed.records == []
    h.device.finish(trimmed)
    h.process()
    h.commit()
    assert [r["status"] for r in h.p.results()] == ["expired", "expired"]
    assert h.model.forward_calls == [[]] and h.committed() == 2


def test_a_batch_taken_ahead_that_lost_records_to_their_deadline_is_topped_up_when_its_device_starts_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Dispatch.swap -> PriorityScheduler.top_up: the batch taken ahead lost two records to their deadline by
    the time the device could start it, and its lane received two more meanwhile. It runs with them (one batch
    of four instead of a batch of two and another of two), and every record gets one result."""
    cfg = make_config(batching={"lanes": [{"name": "default", "max_batch_size": 4, "max_wait_ms": 10,
                                           "deadline_ms": 50}]})
    h = Harness(monkeypatch, cfg).start()
    h.c.assign(("in", 0))
    h.send(4)
    h.iterate()
    running = h.device.take()  # the device is free: it runs offsets 0-3
    assert running is not None and len(running.records) == 4
    h.send(2)
    h.iterate()
    h.clock.advance(0.030)
    h.send(2)
    h.iterate()
    ahead = h.device.take()  # the device is busy: the full batch 4-7 is taken ahead
    assert ahead is not None and [r.offset for r in ahead.records] == [4, 5, 6, 7]
    h.clock.advance(0.005)
    h.send(2)  # 8-9 arrive while the device is busy
    h.iterate()
    h.clock.advance(0.025)  # 4 and 5 are past their 50 ms deadline now
    h.device.finish(running)
    started = h.runner.dispatch.swap(ahead)
    assert started is not None and [r.offset for r in started.records] == [6, 7, 8, 9]
    assert h.device.take() is None  # nothing was left behind
    h.device.finish(started)
    h.process()
    h.commit()
    statuses = {r["source"]["offset"]: r["status"] for r in h.p.results()}
    assert statuses == {**{o: "ok" for o in range(10)}, 4: "expired", 5: "expired"}
    assert len(h.p.results()) == 10
    assert [len(c) for c in h.model.forward_calls] == [4, 4] and h.committed() == 10


def test_readiness_follows_the_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    """/readyz's broker check: false when the broker does not answer at start (it used to turn true at the
    first lag report), false when librdkafka reports all brokers down (through error_cb: such errors never
    come back from poll), and true again once metadata can be fetched, even with nothing to consume."""
    from confluent_kafka import KafkaError

    from worker.observability.health import HealthState

    health = HealthState()
    h = Harness(monkeypatch, make_config(metrics={"lag_interval_s": 1}), health=health)
    h.c.broker_down = True
    h.start()
    assert health.broker_reachable is False
    h.iterate()  # the first lag report
    assert health.broker_reachable is False
    h.c.broker_down = False
    h.clock.advance(1.1)
    h.iterate()
    assert health.broker_reachable is True
    h.consumer.config["error_cb"](KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))
    assert health.broker_reachable is False
    h.c.broker_down = True
    h.clock.advance(1.1)
    h.iterate()
    assert health.broker_reachable is False
    h.c.broker_down = False
    h.clock.advance(1.1)
    h.iterate()
    assert health.broker_reachable is True


def test_the_loop_is_alive_while_it_waits_for_room_in_a_full_producer_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """produce() into a full local queue waits for the messages ahead to be delivered or time out (up to
    message.timeout.ms, 120 s): the liveness heartbeat is kept fresh meanwhile. It went stale after 30 s, and
    the kubelet restarted a worker that was only waiting for a slow broker."""
    from worker.observability.health import HealthState

    health = HealthState()
    h = Harness(monkeypatch, health=health).start()
    h.c.assign(("in", 0))
    h.send(5)
    h.p.queue_limit, h.p.hold = 2, True  # the broker acknowledges nothing for a while
    seen: list[float] = []

    def poll_hook() -> None:
        if len(h.p.pending) < h.p.queue_limit:
            return  # not a wait for room
        seen.append(health.heartbeat)
        health.heartbeat = -1.0  # stale unless the loop beats again before its next poll
        if len(seen) >= 10:
            h.p.hold = False

    h.p.hooks.append(poll_hook)
    h.process()
    assert len(seen) >= 10 and -1.0 not in seen
    assert sorted(h.result_ids()) == [f"in-0-{i}" for i in range(5)]


def test_a_model_object_is_not_spread_over_several_devices() -> None:
    """Runner(cfg, model) with several devices set the object up on the first and loaded cfg.model on the
    others, which may be another model."""
    from tests.unit.fakes_kafka import FakeModel
    from worker.pipeline.runner import Runner

    r = Runner(make_config(model={"name": "identity", "devices": ["cpu", "cpu"]}), FakeModel())
    with pytest.raises(ValueError, match="runs one device, but the config lists 2"):
        r.start()


def test_a_busy_device_leaves_an_open_window_to_a_free_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each device's collate stage asks for its next batch while its device runs one. With two devices the
    runner counted busy batches across both: device 0, busy, was taken for free and took the open window,
    which then waited behind its running batch while device 1 sat idle."""
    h = Harness(monkeypatch, make_config(batching={"lanes": [{"name": "default", "max_wait_ms": 60_000}]}),
                devices=2).start()
    h.c.assign(("in", 0))
    h.send(1)
    h.iterate()
    first = h.devices[0].take()
    assert first is not None  # device 0 was free: it took the open window at once
    h.send(1)
    h.iterate()
    assert h.devices[0].take() is None  # busy: an open window is left to fill ...
    second = h.devices[1].take()  # ... and the free device takes it
    assert second is not None and [r.offset for r in second.records] == [1]


def test_no_busy_wait_while_a_suspect_runs_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a suspect runs alone no batch is taken, so no window is closed: the scheduler's next wake-up
    stayed overdue, and the collate stage waited 0.2 ms at a time on the lock for as long as the suspect
    ran."""
    h = Harness(monkeypatch, make_config(batching={"lanes": [{"name": "default", "max_wait_ms": 5}]})).start()
    h.c.assign(("in", 0))
    h.send(1)
    h.iterate()  # a record in a window
    h.clock.advance(0.01)  # the window is overdue
    waits: list[float] = []

    class Counting(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            waits.append(timeout or 0.0)
            h.clock.advance(timeout or 0.0)  # nothing notifies: the whole timeout passes
            return False

    h.runner.dispatch.cv = Counting()
    h.runner.dispatch.isolated = 1  # a suspect is on the device
    assert h.runner.dispatch.next_batch(0.05, worker=0) is None
    assert len(waits) == 1 and waits[0] == pytest.approx(0.05)  # one wait for a notify (or the timeout)
