"""One device's generation worker: one thread owns the StepModel and runs the iteration-level loop.

    take_sequences() -> encode prompts -> StepScheduler.submit
    schedule(now) -> model.start(admitted) -> model.step(running) -> update(tokens, now) -> release(finished)
    each finished sequence -> done_sequences(one-record batch): the loop emits it like any batch's output

A finished sequence leaves at once and its slot and tokens go to the next waiting one in the same round; its
record becomes committable through the offset tracker like every other record, so out-of-order completion,
the DLQ and both delivery modes work unchanged. Records are taken from the dispatch room only while fewer
than ``max_sequences`` wait here, so lane priorities keep deciding in the scheduler's queues.

A revoke or rewind (``Dispatch.revoke`` / ``clear`` call ``abandon``) drops the sequences of the released
partitions at once, running ones included: their records are dropped as stale (the new owner processes
them), and their caches are released before the next step. A stop finishes the running and waiting
sequences while the runner drains (``shutdown_timeout_s``); ``stop()`` then ends the thread after the step
in progress.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

from worker.config.settings import GenerationConfig
from worker.core.records import Batch, Record, TopicPartition
from worker.core.step_model import StepModel
from worker.core.step_scheduler import Expired, LaneRule, Seq, SeqState, StepScheduler
from worker.models.generative import GenerativeModel, GenRequest
from worker.models.inputs import GenerationOutput

log = logging.getLogger("worker.generation")

# (timeout_s, sequences in flight here, only these lanes or None: any) -> the next batch of records, or None
TakeFn = Callable[[float, int, frozenset[str] | None], Batch | None]
DoneFn = Callable[[Batch, list[Any], dict[str, float]], None]


class GenerationError(RuntimeError):
    """A step that included the sequence raised: the record gets an error result and a dead letter."""


def default_seed(rec: Record) -> int:
    """A request without a seed: one from its id (else its source position), the same on every run."""
    key = rec.id if rec.id is not None else f"{rec.tp.topic}/{rec.tp.partition}/{rec.offset}"
    return zlib.crc32(key.encode())


class GenerationWorker:
    def __init__(self, model: GenerativeModel, device: str, *, lanes: list[LaneRule],
                 limits: GenerationConfig,
                 take: TakeFn, done: DoneFn, is_current: Callable[[Record], bool],
                 name: str | None = None, poll_s: float = 0.05) -> None:
        self.model = model
        self.device = device
        self.lanes = lanes
        self.limits = limits
        self.take = take
        self.done = done
        self.is_current = is_current
        self.name = name or f"generate-{device}"
        self.poll_s = poll_s
        self.sm: StepModel
        self.sched: StepScheduler
        self.ready = False
        self.error: BaseException | None = None
        self.steps = 0
        self._lock = threading.Lock()  # the scheduler, _started and _release: this thread and abandon()
        self._started: set[int] = set()
        self._release: list[int] = []
        self._isolated: set[int] = set()  # sequences of a suspect (a batch with reason "isolate")
        top = max(r.priority for r in lanes)
        # The lanes at the highest priority, when lower ones exist (else none is more urgent than another).
        self._urgent = frozenset(r.name for r in lanes if r.priority == top) if len(
            {r.priority for r in lanes}) > 1 else frozenset()
        self._step_since: float | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle (the runner's)
    def setup(self) -> None:
        self.model.setup(self.device)
        self.sm = self.model.step_model()
        lim = self.limits
        self.sched = StepScheduler(self.lanes, max_sequences=lim.max_sequences,
                                   max_batch_tokens=lim.max_batch_tokens, max_context=self.sm.max_context,
                                   eos_token_id=self.sm.eos_token_id, detokenize=self.sm.decode,
                                   headroom=lim.priority_headroom_tokens, admission=lim.admission)
        self.ready = True

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{self.name} already started")
        if not self.ready:
            self.setup()
        self._thread = threading.Thread(target=self._guard, name=self.name, daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        self._stopping.set()

    def stop(self, timeout: float | None = None) -> bool:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    def busy_for(self, now: float) -> float:
        """Seconds the step in progress has run (0 between steps): the runner's watchdog for a hung one."""
        since = self._step_since
        return 0.0 if since is None else now - since

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self.sched)

    # ---- the loop thread's
    def abandon(self, tps: set[TopicPartition]) -> list[Record]:
        """Drops the sequences of ``tps`` (released partitions); returns their records."""
        if not self.ready:
            return []
        with self._lock:
            dropped = self.sched.drop(lambda s: s.key.tp in tps, time.monotonic())
            self._forget(dropped)
        if dropped:
            log.info("%s: abandoned %d sequences of released partitions", self.name, len(dropped),
                     extra={"sequences": len(dropped)})
        return [s.key for s in dropped]

    # ---- the thread
    def _guard(self) -> None:
        try:
            self._run()
        except BaseException as e:
            self.error = e
            log.exception("%s died", self.name)
            self._stopping.set()
            raise

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._release_done()
            self._intake()
            with self._lock:
                self._drop_stale()
                plan = self.sched.schedule(time.monotonic())
                self._forget(list(plan.preempted))  # admitted again later: started again then
                for seq in plan.admitted:
                    self._started.add(seq.id)
            self._hand_back(list(plan.ended))
            for seq in plan.admitted:
                self.sm.start(seq.id, seq.prompt_ids, seq.params)
            if not plan.seq_ids:
                continue
            self._step_since = time.monotonic()
            try:
                tokens, failed = self._step(plan.seq_ids)
            finally:
                self._step_since = None
                self.steps += 1
            with self._lock:
                now = time.monotonic()
                ended = [s for err, ids in failed.items() for s in self.sched.fail_running(err, now, ids)]
                ended += self.sched.update(tokens, now)
                self._forget(ended)
            self._hand_back(ended)

    def _step(self, seq_ids: tuple[int, ...]) -> tuple[list[int], dict[str, list[int]]]:
        """The step's tokens, and the sequences that failed, by error. When the batched step raises, each
        sequence is stepped alone, so that only the one that raises alone fails (a poison request), as the
        batch path bisects. A step that raises leaves the caches of its sequences as they were."""
        try:
            return self.sm.step(seq_ids), {}
        except Exception as e:
            log.error("%s: a step over %d sequences failed: %r", self.name, len(seq_ids), e)
            if len(seq_ids) == 1:
                return [0], {f"{type(e).__name__}: {e}": list(seq_ids)}
        tokens: list[int] = []
        failed: dict[str, list[int]] = {}
        for sid in seq_ids:
            try:
                tokens.extend(self.sm.step((sid,)))
            except Exception as e:
                tokens.append(0)  # skipped by update: the sequence failed
                failed.setdefault(f"{type(e).__name__}: {e}", []).append(sid)
        return tokens, failed

    def _intake(self) -> None:
        """Takes records while fewer than max_sequences wait here; waits for one only when nothing runs. With
        the pool full, records of the highest-priority lanes are still taken (the step scheduler admits them
        first): a refill of lower-lane records must not keep an urgent one in the queue behind it."""
        with self._lock:
            in_flight = len(self.sched)
            only = None
            if self.sched.waiting >= self.limits.max_sequences:
                if not self._urgent:
                    return
                only = self._urgent
            batch = self.take(0.0 if in_flight else self.poll_s, in_flight, only)
            if batch is None:
                return
            now = time.monotonic()
            for rec in batch.records:
                req: GenRequest = rec.item
                params = req.params
                if params.seed is None:
                    params = type(params)(max_new_tokens=params.max_new_tokens,
                                          temperature=params.temperature,
                                          top_p=params.top_p, seed=default_seed(rec), stop=params.stop)
                try:
                    ids = self.sm.encode(req.prompt)
                except Exception as e:
                    ids = []
                    log.warning("%s: encode failed: %r", self.name, e)
                seq = self.sched.submit(rec, rec.lane, ids, params, now, rec.deadline)
                if batch.reason == "isolate":
                    self._isolated.add(seq.id)

    def _drop_stale(self) -> None:
        # A rewind or a release that abandon() did not see (the record was between take and submit).
        if len(self.sched):
            self._forget(self.sched.drop(lambda s: not self.is_current(s.key), time.monotonic()))

    def _forget(self, ended: list[Seq]) -> None:
        for seq in ended:
            if seq.id in self._started:
                self._started.discard(seq.id)
                self._release.append(seq.id)

    def _release_done(self) -> None:
        with self._lock:
            ids, self._release = self._release, []
        for sid in ids:
            self.sm.release(sid)

    def _hand_back(self, ended: list[Seq]) -> None:
        for seq in ended:
            rec: Record = seq.key
            isolate = seq.id in self._isolated
            self._isolated.discard(seq.id)
            if seq.state is SeqState.ABANDONED:
                if isolate:  # the suspect's accounting still needs its batch back (empty: nothing to emit)
                    self.done(self._batch(seq, [], isolate), [], {})
                continue
            if seq.state is SeqState.FAILED:
                out: Any = GenerationError(seq.error or "generation failed")
            else:
                res = self.output(seq)
                out = res if seq.state is SeqState.FINISHED else Expired(
                    res, f"deadline passed after {len(seq.tokens)} generated tokens")
            end = seq.ended_at or time.monotonic()
            infer = end - (seq.admitted_at if seq.admitted_at is not None else end)
            self.done(self._batch(seq, [rec], isolate), [out], {"infer": infer, "pipeline": infer})

    def _batch(self, seq: Seq, records: list[Record], isolate: bool) -> Batch:
        closed = seq.admitted_at if seq.admitted_at is not None else (seq.ended_at or seq.arrived_at)
        return Batch(lane=seq.lane, records=records, opened_at=seq.arrived_at, closed_at=closed,
                     reason="isolate" if isolate else "generate", max_batch_size=1)

    def output(self, seq: Seq) -> GenerationOutput:
        rec: Record = seq.key
        text = seq.text if seq.text is not None else self.sm.decode(seq.tokens)
        ttft = None
        if seq.first_token_at is not None:
            ttft = round((seq.first_token_at - rec.received_at) * 1000.0, 3)
        return GenerationOutput(text=text, token_ids=list(seq.tokens), prompt_tokens=len(seq.prompt_ids),
                                generated_tokens=len(seq.tokens), finish_reason=seq.reason or "error",
                                ttft_ms=ttft)


def lane_rules(lanes: list[Any]) -> list[LaneRule]:
    """The step scheduler's lanes from ``batching.lanes``."""
    return [LaneRule(ln.name, ln.priority, ln.weight) for ln in lanes]


def attach(model: Any, device: str, cfg: Any, dispatch: Any, index: int) -> GenerationWorker:
    """The runner's hook: a set-up generation worker for device ``index``, wired to the dispatch room.
    ``model``: a ``GenerativeModel``, or a bare ``GenerativeHandler`` (wrapped with ``model.generation``)."""
    if not isinstance(model, GenerativeModel):
        model = GenerativeModel(model, cfg.model.generation)
    w = GenerationWorker(model, device, lanes=lane_rules(cfg.batching.lanes), limits=cfg.model.generation,
                         take=lambda timeout, n, only: dispatch.take_sequences(timeout, index, n, only),
                         done=lambda b, outs, t: dispatch.done_sequences(b, outs, t, index),
                         is_current=dispatch.is_current, name=f"generate-{device}")
    w.setup()
    dispatch.hold(w.abandon)
    return w


class GenerationEngine:
    """Records in, outputs out, synchronously, through a GenerationWorker's thread: ``worker predict`` and
    ``worker profile`` run a generative model on the path ``worker run`` takes, without Kafka."""

    def __init__(self, model: GenerativeModel, device: str, lanes: list[LaneRule] | None = None) -> None:
        self._cv = threading.Condition()
        self._todo: list[Batch] = []
        self._outs: dict[int, Any] = {}
        self.worker = GenerationWorker(model, device, lanes=lanes or [LaneRule("default")],
                                       limits=model.limits,
                                       take=self._take, done=self._done, is_current=lambda r: True,
                                       poll_s=0.01)

    def setup(self) -> None:
        self.worker.setup()
        self.worker.start()

    def generate(self, records: list[Record], timeout: float | None = None) -> list[Any]:
        """One output per record, in order: a GenerationOutput, an Expired or a GenerationError."""
        now = time.monotonic()
        with self._cv:
            self._todo.append(Batch("default", list(records), now, now, "generate"))
            self._cv.notify_all()
            ok = self._cv.wait_for(
                lambda: all(id(r) in self._outs for r in records) or self.worker.error is not None, timeout
            )
            if self.worker.error is not None or not ok:
                raise RuntimeError(f"{self.worker.name}: generation stopped: {self.worker.error!r}")
            return [self._outs.pop(id(r)) for r in records]

    def close(self) -> None:
        self.worker.stop(5.0)

    def _take(self, timeout: float, in_flight: int, only: frozenset[str] | None) -> Batch | None:
        with self._cv:
            if not self._todo:
                self._cv.wait(timeout)
            return self._todo.pop(0) if self._todo else None

    def _done(self, batch: Batch, outputs: list[Any], timings: dict[str, float]) -> None:
        with self._cv:
            for rec, out in zip(batch.records, outputs, strict=True):
                self._outs[id(rec)] = out
            self._cv.notify_all()
