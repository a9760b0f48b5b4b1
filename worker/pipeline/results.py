"""From a device's outputs to confirmed records: outcomes are built, emitted through the delivery mode,
and acknowledged in the tracker once delivered (the emitter's ``on_done`` / ``on_failed``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from itertools import groupby
from operator import attrgetter
from typing import Any

from worker.core.ports import DecodeFailed
from worker.core.records import Batch, Outcome, Record, TopicPartition
from worker.core.step_scheduler import Expired
from worker.pipeline.context import Loop
from worker.pipeline.delivery import DeliveryMode

_received_at = attrgetter("received_at")
_produced_at = attrgetter("produced_at_ms")
_tp = attrgetter("tp")
_epoch = attrgetter("epoch")
_offset = attrgetter("offset")
_FAILED = (BaseException, Expired)  # a device output that is no result: the record's error or expiry


def _by_lane(records: list[Record]) -> Iterable[tuple[str, list[Record]]]:
    groups: dict[str, list[Record]] = {}
    for r in records:
        groups.setdefault(r.lane, []).append(r)
    return groups.items()


class Results:
    def __init__(self, loop: Loop, mode: DeliveryMode) -> None:
        self.loop = loop
        self.mode = mode

    def serve(self, poll_s: float, now: float) -> None:
        """Everything between the device and a confirmed record, once: emit what the devices finished and what
        expired, serve failure reports (waiting up to ``poll_s``), confirm what settled, re-send what failed.
        """
        for batch, outputs, timings in self.loop.dispatch.finished():
            self.complete_batch(batch, outputs, timings)
        self.expire()
        emitter = self.loop.emitter
        emitter.poll(poll_s)
        emitter.settle(now)
        emitter.retry_failed()

    def expire(self) -> None:
        now = self.loop.clock.monotonic()
        expired = self.loop.dispatch.expire(now)
        if expired:
            self.emit_all([Outcome(r, "expired", error="deadline passed before inference",
                                   dlq_stage="expired") for r in expired], now)

    def complete_batch(self, batch: Batch, outputs: list[Any], timings: dict[str, float]) -> None:
        now = self.loop.clock.monotonic()
        n = len(batch.records)
        if n == 0:
            return  # every record of a batch taken ahead expired before it started (see Dispatch.swap)
        loop = self.loop
        metrics, stats = loop.metrics, loop.stats
        stats.batches += 1
        stats.batched_records += n
        infer_s = timings.get("infer", 0.0)
        records = batch.records
        closed = batch.closed_at
        queue_wait = closed - sum(map(_received_at, records)) / n
        metrics.batch(batch.lane, n, batch.fill_ratio, queue_wait, infer_s)
        metrics.event("batches", lane=batch.lane, reason=batch.reason)
        wall_ms = self.loop.clock.time() * 1000.0
        outcomes: list[Outcome] = []
        # Per batch, not per record: the epochs of its partitions now, which outputs are errors.
        epoch_of = loop.partitions.epoch
        if len(outputs) != n:
            raise ValueError(f"{len(outputs)} outputs for a batch of {n} records")
        # A batch holds runs of one partition: a Python step per run, the records of a run looked at in C
        # (groupby, map and set over attrgetters).
        epochs: dict[TopicPartition, int] = {}
        current = True
        for tp, run in groupby(records, _tp):
            epoch = epochs.get(tp)
            if epoch is None:
                epoch = epochs[tp] = epoch_of(tp)
            if current and set(map(_epoch, run)) != {epoch}:
                current = False
        failed_types = any(issubclass(t, _FAILED) for t in set(map(type, outputs)))
        errors = [i for i, out in enumerate(outputs) if isinstance(out, _FAILED)] if failed_types else []
        if current and not errors:
            ok_recs, ok_outs = records, outputs
        else:
            ok_recs, ok_outs = [], []
            failed = set(errors)
            for i, (rec, out) in enumerate(zip(records, outputs, strict=True)):
                if rec.epoch != epochs[rec.tp]:
                    continue  # partition revoked meanwhile: the new owner reprocesses it
                if i in failed:
                    # a generative sequence past its deadline: its partial output
                    if isinstance(out, Expired):
                        outcomes.append(Outcome(rec, "expired", output=out.output, error=out.error,
                                                dlq_stage="expired", batch_size=n,
                                                timings={"queue": closed - rec.received_at,
                                                         "infer": infer_s}))
                        continue
                    decode = isinstance(out, DecodeFailed)  # decode_batch on the host threads: stage decode
                    why = str(out) if decode else f"{type(out).__name__}: {out}"
                    outcomes.append(Outcome(rec, "error", error=why,
                                            dlq_stage="decode" if decode else "inference", batch_size=n,
                                            timings={"queue": closed - rec.received_at, "infer": infer_s}))
                    continue
                ok_recs.append(rec)
                ok_outs.append(out)
        if loop.gate.cache:
            for rec, out in zip(ok_recs, ok_outs, strict=True):
                if rec.cache_key is not None:
                    loop.gate.cache_put(rec, out)
        # Sent by the mode's batch path: no Outcome per record, metrics and stats once per batch.
        declined = self.mode.emit_ok(ok_recs, ok_outs, n, closed, infer_s, now, wall_ms)
        if declined:
            # What the batch path declined (unencodable, oversize; exactly-once: all): the general path.
            outcomes.extend(Outcome(ok_recs[i], "ok", output=ok_outs[i], batch_size=n,
                                    timings={"queue": closed - ok_recs[i].received_at, "infer": infer_s})
                            for i in declined)
            skip = set(declined)
            ok_recs = [r for i, r in enumerate(ok_recs) if i not in skip]
        if ok_recs:
            stats.results_ok += len(ok_recs)
            # A filled batch (lane option fill_with_lower) holds records of other lanes: count each by its
            # own.
            for lane, recs in (_by_lane(ok_recs) if batch.mixed else ((batch.lane, ok_recs),)):
                metrics.records_out(lane, "ok", len(recs))
                e2e_s = [(wall_ms - t) / 1000.0 for t in map(_produced_at, recs) if t]
                if e2e_s:
                    metrics.end_to_end_many(lane, e2e_s)
        if outcomes:
            self.emit_all(outcomes, now)

    def emit_all(self, outcomes: Iterable[Outcome], now: float) -> None:
        wall_ms = self.loop.clock.time() * 1000.0
        loop = self.loop
        st, metrics = loop.stats, loop.metrics
        # Metrics once per lane (and status) as on the batch path: in exactly-once mode every result comes
        # here, and a histogram observe() per record costs about 5 us.
        out_counts: Counter[tuple[str, str]] = Counter()
        e2e_s: dict[str, list[float]] = {}
        current = loop.partitions.is_current
        emit = self.mode.emit

        def count(o: Outcome) -> None:
            # The outcome as sent: an ok one whose output could not be written goes out as an error with an
            # output dead letter.
            if o.status == "ok":
                st.results_ok += 1
            elif o.status == "error":
                st.results_error += 1
            else:
                st.results_expired += 1
            if o.dlq_stage is not None:
                st.dlq += 1
                metrics.dlq(o.dlq_stage)
            rec = o.record
            out_counts[rec.lane, o.status] += 1
            if rec.produced_at_ms:
                e2e_s.setdefault(rec.lane, []).append((wall_ms - rec.produced_at_ms) / 1000.0)

        for o in outcomes:
            if not current(o.record):
                # Its partition was released since it was read (revoke, loss, rewind): the new owner or the
                # rewound reader processes it again. An outcome from here would be a second, conflicting
                # result, and in exactly-once mode it would take the re-read record's place in the order.
                continue
            for sent in emit(o, now, wall_ms):
                count(sent)
        for (lane, status), k in out_counts.items():
            metrics.records_out(lane, status, k)
        for lane, xs in e2e_s.items():
            metrics.end_to_end_many(lane, xs)

    # ---- the emitter's reports
    def record_done(self, rec: Record) -> None:
        loop = self.loop
        if loop.partitions.is_current(rec):
            loop.tracker.ack(rec.tp, rec.offset)
        else:
            loop.tracker.ack_lost(rec.tp, rec.offset)  # its partition was lost: see Membership.resume_lost
        loop.gate.delivered(rec)

    def records_done(self, recs: list[Record]) -> None:
        """``record_done`` for a delivered batch: the tracker is told once per partition."""
        loop = self.loop
        by_tp: dict[TopicPartition, list[Record]] = {}
        for rec in recs:
            group = by_tp.get(rec.tp)
            if group is None:
                group = by_tp[rec.tp] = []
            group.append(rec)
        epoch_of, tracker = loop.partitions.epoch, loop.tracker
        for tp, group in by_tp.items():
            epoch = epoch_of(tp)
            if set(map(_epoch, group)) == {epoch}:  # the common case, in C loops
                tracker.ack_many(tp, map(_offset, group))
                continue
            tracker.ack_many(tp, [r.offset for r in group if r.epoch == epoch])
            for r in group:
                if r.epoch != epoch:
                    tracker.ack_lost(tp, r.offset)  # its partition was lost: see Membership.resume_lost
        loop.gate.delivered_many(recs)

    def record_failed(self, rec: Record, err: str) -> None:
        if not self.loop.partitions.is_current(rec):
            return  # its partition was revoked meanwhile: the new owner processes it again
        self.mode.on_failed(rec, err)
