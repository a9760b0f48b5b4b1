"""One device's pipeline of three threads, so the device never waits for Python:

    take() -> [collate thread] decode_batch (host threads, for handlers that have one) + collate
              + non_blocking H2D copy from reused pinned buffers on a side CUDA stream
           -> (one prepared batch) -> [device thread] forward, async D2H copy of the outputs
           -> (at most two launched batches) -> [finish thread] wait for the copy, split, done()

Collate of batch n+1 overlaps forward of batch n, and on CUDA the device thread queues batch n+1's
kernels while the finish thread waits for batch n, so the GPU always has the next batch queued.
The prefetched batch was chosen up to a batch-time before the device can start it; the optional ``swap``
hook lets the device thread exchange it, just before the start, for a batch of a higher-priority lane that
became ready meanwhile (the prefetched one goes back to the scheduler and is collated again later).
Several devices in one process = several DeviceWorkers (one Engine each) sharing one thread-safe
``take``: a batch goes to whichever device is free.

A batch over its lane's lowered limit, one whose collate or forward raised, and one whose split raised
go through the engine's recovery (``worker.device.recovery``) on the device or finish thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from worker.core.records import Batch
from worker.device.errors import DeviceError, OutputCountError
from worker.device.host_pool import name_os_thread
from worker.device.placement import Launched, Prepared

log = logging.getLogger("worker.engine")

TakeFn = Callable[[float], Batch | None]
DoneFn = Callable[[Batch, list[Any | BaseException], dict[str, float]], None]
# Called by the device thread just before it starts a prefetched batch: a batch to run instead (the given one
# was given back to the scheduler), or None to run it.
SwapFn = Callable[[Batch], Batch | None]
Results = list[Any | BaseException]


class Stages(Protocol):
    """What the pipeline needs of its engine (``worker.device.engine.Engine``)."""

    ready: bool
    is_cuda: bool

    @property
    def device(self) -> str: ...

    def setup(self) -> None: ...

    def effective_max(self, lane: str) -> int | None: ...

    def prepare(self, items: Sequence[Any]) -> Prepared: ...

    def launch(self, p: Prepared) -> Launched: ...

    def wait(self, lx: Launched) -> None: ...

    def finish(self, lx: Launched) -> list[Any]: ...

    def note_success(self, lane: str, n: int) -> None: ...

    def infer(self, items: Sequence[Any], lane: str = "default") -> Results: ...

    def recover(self, items: Sequence[Any], lane: str, exc: BaseException) -> Results: ...


_STOP = object()
# OS thread names (``top -H``, the bench's CPU per thread): the stage, not the device (15 bytes at most).
_OS_NAMES = {"_collate_loop": "kiw-collate", "_device_loop": "kiw-device", "_finish_loop": "kiw-finish"}


@dataclass(slots=True)
class _Job:
    batch: Batch
    prepared: Prepared | None = None
    error: BaseException | None = None  # prepare failed: recover on the device thread
    t_take: float = 0.0


@dataclass(slots=True)
class _Done:
    batch: Batch
    results: list[Any | BaseException] | None
    launched: Launched | None
    timings: dict[str, float]


class DeviceWorker:
    """One device's pipeline (see the module docstring). ``take(timeout_s)`` blocks up to ``timeout_s`` and
    returns the next Batch or None; it must be thread-safe when several workers share it. ``done(batch,
    results, timings)`` gets one output or exception per record, in order, and timings in seconds:
    ``collate``, ``forward`` (device time on CUDA, from events), ``split``, ``infer`` (the batch's service
    time: collate + forward + split, what a latency model should learn), ``wait`` (prepared, waiting for
    the device) and ``pipeline`` (taken -> results, waits included). A batch that went through OOM or
    poison recovery has only ``infer`` and ``pipeline`` (both wall time). ``done`` runs on this worker's
    finish thread and must not block for long."""

    def __init__(
        self,
        engine: Stages,
        take: TakeFn,
        done: DoneFn,
        *,
        name: str | None = None,
        poll_s: float = 0.05,
        max_launched: int = 2,
        swap: SwapFn | None = None,
    ) -> None:
        self.engine = engine
        self.take = take
        self.done = done
        self.swap = swap
        self.name = name or f"device-{engine.device}"
        self.poll_s = poll_s
        self._stopping = threading.Event()
        self._slot = threading.Semaphore(1)  # one prepared batch waiting for the device, at most
        self._launched = threading.Semaphore(max(1, max_launched))  # batches issued but not finished
        self._prepared: queue.Queue[Any] = queue.Queue()
        self._finishing: queue.Queue[Any] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self.error: BaseException | None = None  # set if a stage thread died
        self.batches = 0
        # Start times of the batches between the device thread and done(), oldest first (finish order is
        # launch order): the runner's watchdog reads the oldest.
        self._running: deque[float] = deque()

    def start(self) -> None:
        if self._threads:
            raise RuntimeError(f"{self.name} already started")
        if not self.engine.ready:
            self.engine.setup()
        for target, suffix in ((self._collate_loop, "-collate"), (self._device_loop, ""),
                               (self._finish_loop, "-finish")):
            t = threading.Thread(target=self._guard, args=(target,), name=self.name + suffix, daemon=True)
            self._threads.append(t)
            t.start()

    def busy_for(self, now: float) -> float:
        """Seconds the oldest batch has been on the device (0 when none): a forward that never returns shows
        here while the threads stay alive."""
        try:
            return now - self._running[0]
        except IndexError:
            return 0.0

    def request_stop(self) -> None:
        """Stop taking batches; ``stop()`` waits for the threads."""
        self._stopping.set()

    def stop(self, timeout: float | None = None) -> bool:
        """Stop taking batches, finish those already taken (done() is called for each), then exit.
        Returns True when every thread has exited within ``timeout``."""
        self._stopping.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    @property
    def alive(self) -> bool:
        threads = self._threads
        return bool(threads) and all(t.is_alive() for t in threads) and not self._stopping.is_set()

    def _guard(self, target: Callable[[], None]) -> None:
        name_os_thread(_OS_NAMES.get(target.__name__, "kiw-device"))
        if self.engine.is_cuda:
            torch.cuda.set_device(self.engine.device)  # per thread: libraries that say "cuda" get ours
        try:
            target()
        except BaseException as e:
            self.error = e
            log.exception("%s: %s died", self.name, threading.current_thread().name)
            self._stopping.set()
            # Unblock the neighbours so stop() returns.
            self._prepared.put(_STOP)
            self._finishing.put(_STOP)
            self._slot.release()
            self._launched.release()
            raise

    def _collate_loop(self) -> None:
        while not self._stopping.is_set():
            if not self._slot.acquire(timeout=self.poll_s):
                continue
            try:
                batch = self.take(self.poll_s)
            except Exception as e:
                # The batch may have left the scheduler already: its records would stay in flight for good and
                # their partitions never commit again. The runner sees ``error`` and exits 1 (nothing is
                # committed past them; they are processed again after the restart).
                log.exception("%s: take() failed", self.name)
                self.error = e
                batch = None
                time.sleep(self.poll_s)
            if batch is None:
                self._slot.release()
                continue
            self._prepared.put(self._prepare(batch))
        self._prepared.put(_STOP)

    def _prepare(self, batch: Batch) -> _Job:
        eng = self.engine
        job = _Job(batch, t_take=time.perf_counter())
        limit = eng.effective_max(batch.lane)
        if batch.records and (limit is None or len(batch.records) <= limit):
            try:
                job.prepared = eng.prepare([r.item for r in batch.records])
            except Exception as e:
                job.error = e
        return job

    def _device_loop(self) -> None:
        eng = self.engine
        while True:
            job = self._prepared.get()
            if job is _STOP:
                self._slot.release()
                break
            self._launched.acquire()
            if self.swap is not None:
                # The job was taken up to a batch-time ago: something more urgent may have come since. (The
                # slot is released only after this, or the collate thread would take the urgent batch first
                # and leave it waiting behind this one.)
                try:
                    better = self.swap(job.batch)
                except Exception as e:
                    # It may have taken another batch from the scheduler and put this one back: running this
                    # one now would run it twice and leave the other in flight for good. The runner exits 1.
                    log.exception("%s: swap() failed", self.name)
                    self.error = e
                    better = None
                if better is not None:
                    job.prepared = None  # discarded; the batch is re-collated when it is taken again
                    job = self._prepare(better)
            self._slot.release()
            batch, lane = job.batch, job.batch.lane
            items = [r.item for r in batch.records]
            self._running.append(time.monotonic())  # every job puts exactly one _Done on _finishing
            t = time.perf_counter()
            if job.prepared is None:  # over the lowered limit, or collate failed: the safe path
                err = job.error
                if err is None:
                    results = self._safe(eng.infer, items, lane)
                else:
                    results = self._safe(eng.recover, items, lane, err)
                took = time.perf_counter() - t
                # Chunks of a batch over its lane's lowered limit, or a recovery: several forwards, not one
                # observation for the latency model (and timed from now, not from when the batch was taken:
                # that included its wait for the device).
                timings = {"infer": took, "pipeline": time.perf_counter() - job.t_take, "recovered": 1.0}
                self._finishing.put(_Done(batch, results, None, timings))
                continue
            try:
                launched = eng.launch(job.prepared)
            except Exception as e:
                job.prepared = None
                results = self._safe(eng.recover, items, lane, e)
                took = time.perf_counter() - job.t_take
                timings = {"infer": took, "pipeline": took, "recovered": 1.0}
                self._finishing.put(_Done(batch, results, None, timings))
                continue
            launched.timings["wait"] = t - (job.prepared.t0 + job.prepared.collate_s)
            launched.t0 = job.t_take
            job.prepared = None
            self._finishing.put(_Done(batch, None, launched, launched.timings))
        self._finishing.put(_STOP)

    def _finish_loop(self) -> None:
        eng = self.engine
        while True:
            d = self._finishing.get()
            if d is _STOP:
                break
            if d.launched is not None:
                lx = d.launched
                lane = d.batch.lane
                released = False
                try:
                    eng.wait(lx)
                    # The device is on to the next batch: let the device thread queue another while we split.
                    self._launched.release()
                    released = True
                    d.results = eng.finish(lx)
                    eng.note_success(lane, len(lx.items))
                except Exception as e:
                    d.results = self._safe(eng.recover, lx.items, lane, e)
                    d.timings["infer"] = d.timings["pipeline"] = time.perf_counter() - lx.t0
                    d.timings["recovered"] = 1.0
                d.launched = None
                if not released:
                    self._launched.release()
            else:
                self._launched.release()
            self.batches += 1
            try:
                self._running.popleft()
            except IndexError:
                pass
            try:
                self.done(d.batch, d.results or [], d.timings)
            except Exception as e:
                log.exception("%s: done() failed", self.name)
                self.error = e  # its records are never settled: the runner exits 1, as for take() above

    @staticmethod
    def _safe(fn: Callable[..., Results], items: Sequence[Any], *args: Any) -> Results:
        try:
            return fn(items, *args)
        except DeviceError:
            raise  # the thread dies, ``error`` is set and the runner exits 1: nothing of the batch is settled
        except Exception as e:  # OutputCountError, or a bug: every record of the batch fails with it
            log.error("batch of %d failed: %r", len(items), e, exc_info=not isinstance(e, OutputCountError))
            return [e] * len(items)
