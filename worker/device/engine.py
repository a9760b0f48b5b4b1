"""The device side: run a model handler's collate -> forward -> split on one device, safely and fast.

``Engine`` owns one handler on one device: dtype (autocast), ``inference_mode``, optional
``torch.compile``, warm-up, and the stages ``prepare`` / ``launch`` / ``wait`` / ``finish`` that
``DeviceWorker`` (``worker.device.pipeline``) runs on its three threads. ``infer`` is the safe
synchronous entry point; its failure policy (out of memory, poison records, device errors) is
``worker.device.recovery``'s, and the per-lane batch limit it adapts is ``worker.core.batch_limit``'s:
``on_limit(lane, new_max)`` tells the runner each change, down or back up.

Handlers need not be thread-safe: ``forward`` never runs on two threads at once, and neither does
``collate`` nor ``split`` (recovery re-runs them on the device or finish thread while the pipeline runs
the next batch, and a Hugging Face fast tokenizer entered twice raises "Already borrowed"). ``collate`` of
one batch and ``split`` of another do overlap, as the pipeline intends: a handler that uses one
non-thread-safe object in both must lock it itself.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch

from worker.core.batch_limit import LimitPolicy
from worker.core.ports import DecodeFailed
from worker.device.errors import (
    DeviceError,
    OutputCountError,
    is_device_error,
    is_oom,
)
from worker.device.host_pool import HostPool, shared_pool
from worker.device.pinned_pool import PinnedPool
from worker.device.pipeline import DeviceWorker, DoneFn, SwapFn, TakeFn
from worker.device.placement import (
    THREADS_ENV,
    Launched,
    Prepared,
    available_cpus,
    configure_threads,
    map_tensors,
    resolve_device,
    resolve_dtype,
    tensors,
)
from worker.device.recovery import EngineStats, LaneLimits, LimitFn, Recovery, TokensFn

__all__ = [
    "THREADS_ENV", "DeviceError", "DeviceWorker", "DoneFn", "Engine", "EngineStats", "Launched", "LimitFn",
    "OutputCountError", "Prepared", "SwapFn", "TakeFn", "available_cpus", "configure_threads",
    "is_device_error", "is_oom", "resolve_device", "resolve_dtype",
]

log = logging.getLogger("worker.engine")
RAYON_ENV = "RAYON_NUM_THREADS"


class Engine:
    """One model handler on one device. ``infer`` is the safe synchronous entry point; ``prepare`` /
    ``launch`` / ``finish`` are the pipeline stages ``DeviceWorker`` runs on separate threads.

    ``device``: auto|cpu|mps|cuda|cuda:N. ``dtype``: fp32|fp16|bf16 (autocast). ``compile``: wrap the
    handler's forward in ``torch.compile(dynamic=True)``; falls back to eager (warning) if it fails at
    warm-up. ``warmup``: run the handler's ``example_inputs()`` at batch 1 and 8 in ``setup()``.
    ``on_limit(lane, new_max)``: called (from a device thread) whenever a lane's max batch size changes
    after OOM, down or back up; ``max_batch_sizes`` (lane -> configured max) is where it is lifted to.
    ``on_tokens(lane, tokens)`` / ``max_batch_tokens``: the same for a lane's token budget (None: none).
    ``threads``: torch intra-op threads (see ``configure_threads``). ``oom_retries`` /
    ``oom_retry_backoff_s``: retries of a record that runs out of memory alone, after ``backoff * attempt``
    seconds each. ``traceback_every_s``: how often one raising site's traceback is logged.
    ``host_threads``: the process's host threads for a handler's ``decode_batch`` (None: every CPU this
    process may use, see ``available_cpus``); ``host_pool`` overrides the shared pool (tests).
    ``outputs_encoding``: the config's ``delivery.outputs_encoding``; under ``float32`` a handler's optional
    ``split_float32(output, n)`` replaces ``split`` (``worker.models.base.float32_rows``).

    A handler with ``decode_batch`` gets its records' validated inputs as items: ``prepare`` decodes them on
    the host pool before ``collate``, and an input that fails to decode is left out of the batch and gets its
    ``DecodeFailed`` in its place in the results.
    """

    def __init__(
        self,
        model: Any,
        device: str = "auto",
        dtype: str = "fp32",
        compile: bool = False,
        warmup: bool = True,
        *,
        on_limit: LimitFn | None = None,
        grow_after: int = 100,
        grow_factor: float = 1.25,
        threads: int | None = None,
        warmup_iters: int = 2,
        max_batch_sizes: Mapping[str, int] | None = None,
        max_batch_tokens: Mapping[str, int | None] | None = None,
        on_tokens: TokensFn | None = None,
        oom_retries: int = 2,
        oom_retry_backoff_s: float = 0.05,
        traceback_every_s: float = 600.0,
        host_threads: int | None = None,
        host_pool: HostPool | None = None,
        outputs_encoding: str = "lists",
    ) -> None:
        self.model = model
        self.device = resolve_device(device)
        self.dtype_name = dtype
        self.amp_dtype = resolve_dtype(dtype, self.device)
        self.compile = compile
        self.warmup = warmup
        self.warmup_iters = warmup_iters
        self.threads = threads
        self.stats = EngineStats()
        self.uses_torch = bool(getattr(model, "uses_torch", True))
        self.kind = self.device.split(":")[0]
        self.is_cuda = self.kind == "cuda" and self.uses_torch
        self._copy_stream: Any = None
        self._pinned: PinnedPool | None = None  # CUDA: the reused host buffers of the H2D copies
        batch_decode = getattr(model, "decode_batch", None)
        self.decodes_batches = callable(batch_decode)
        self._host: HostPool | None = None
        if self.decodes_batches:
            n = host_threads or available_cpus()
            self._host = host_pool or shared_pool(n)
            # A Rust tokenizer's encode_batch runs on rayon's global pool, sized from this when it starts (at
            # the first batch): host_threads bounds it too, unless the operator set it.
            os.environ.setdefault(RAYON_ENV, str(n))
        # Binary outputs: a handler's split_float32 packs rows from the output's bytes (no Python floats).
        self.packs_float32 = outputs_encoding == "float32" and callable(getattr(model, "split_float32", None))
        self._forward_lock = threading.Lock()
        # collate and split each run on one thread at a time (see the module docstring), host time only.
        self._collate_lock = threading.Lock()
        self._split_lock = threading.Lock()
        policy = LimitPolicy(grow_after=max(1, grow_after), grow_factor=max(1.0, grow_factor))
        # Where a lowered limit is lifted: the lane's configured max, else the largest batch seen.
        self._limits = LaneLimits(lambda: self.name, policy, dict(max_batch_sizes or {}), self.stats,
                                  on_limit, max_batch_tokens, on_tokens)
        self._recovery = Recovery(self, self._limits, self.stats, oom_retries=oom_retries,
                                  oom_retry_backoff_s=oom_retry_backoff_s,
                                  traceback_every_s=traceback_every_s,
                                  size_of=getattr(model, "size_of", None))
        self.ready = False

    # -- lifecycle

    def setup(self) -> None:
        configure_threads(self.kind, self.threads)
        if self.is_cuda:
            torch.cuda.set_device(self.device)
            self._copy_stream = torch.cuda.Stream(self.device)
            self._pinned = PinnedPool()
        self.model.setup(self.device)
        cap = getattr(self.model, "max_batch", None)
        if cap:
            # The model takes at most this many records at once (an ONNX file with a fixed batch axis of 1):
            # every lane's limit, for good (the ceiling it would be lifted back to is the same).
            self._limits.cap(int(cap))
        if self.compile and self.uses_torch:
            eager = self.model.forward
            compiled = torch.compile(eager, dynamic=True)
            if not self.example_items(1):
                # Nothing to verify the compiled forward with now: the first real batch does, and a failure
                # there falls back to eager instead of failing every record in service.
                self.model.forward = self._verified_on_first_use(compiled, eager)
            else:
                self.model.forward = compiled
                try:
                    self._warm(force=True)
                except Exception as e:
                    log.warning("torch.compile of %s failed at warm-up (%s); running eager", self.name, e)
                    self.model.forward = eager
                    self._warm()
        else:
            self._warm()
        self.ready = True

    def _verified_on_first_use(self, compiled: Callable[[Any], Any],
                               eager: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def forward(batch: Any) -> Any:
            try:
                out = compiled(batch)
            except Exception as e:
                if is_oom(e) or is_device_error(e):
                    raise  # the OOM / device-error policy's, not the compiler's
                # The compiler's fault only if eager runs the same batch: a poison record fails both, and must
                # not switch compilation off for good (it raises, is bisected, and the next batch verifies).
                out = eager(batch)
                log.warning("torch.compile of %s failed on a batch eager runs (%s); running eager",
                            self.name, e)
                self.model.forward = eager
                return out
            self.model.forward = compiled  # it works: no wrapper from now on
            return out

        return forward

    @property
    def name(self) -> str:
        return str(getattr(self.model, "name", type(self.model).__name__))

    def example_items(self, n: int) -> list[Any]:
        """``n`` items cycled from the handler's ``example_inputs()`` (empty if it has none), decoded unless
        the handler decodes batches (``prepare`` decodes those)."""
        ex = getattr(self.model, "example_inputs", None)
        inputs = list(ex()) if callable(ex) else []
        if not inputs:
            return []
        decoded = inputs if self.decodes_batches else [self.model.decode(x) for x in inputs]
        return [decoded[i % len(decoded)] for i in range(n)]

    def _warm(self, force: bool = False) -> None:
        if not (self.warmup or force):
            return
        # Not past what the model takes at once: a file exported with a fixed batch axis of 1 takes no batch
        # of 8, and a warm-up that fails keeps the worker from starting.
        items = self.example_items(min(8, getattr(self.model, "max_batch", None) or 8))
        if not items:
            log.info("model %s has no example_inputs(); skipping warm-up", self.name)
            return
        t0 = time.perf_counter()
        for size in sorted({1, len(items)}):
            for _ in range(self.warmup_iters):
                try:
                    self.run(items[:size])
                except Exception as e:
                    if size > 1 and is_oom(e):  # a small device; the OOM policy handles it in service
                        log.warning("warm-up of %s: batch of %d does not fit on %s", self.name, size,
                                    self.device)
                        self.release_memory()
                        break
                    raise RuntimeError(f"warm-up of model {self.name} on {self.device} failed: {e!r}") from e
        log.info("warmed up %s on %s in %.2fs", self.name, self.device, time.perf_counter() - t0)

    # -- stages

    def _ctx(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if self.uses_torch:
            stack.enter_context(torch.inference_mode())
            if self.amp_dtype is not None:
                stack.enter_context(torch.autocast(device_type=self.kind, dtype=self.amp_dtype))
        return stack

    def prepare(self, items: Sequence[Any]) -> Prepared:
        """decode (host threads, for a handler with ``decode_batch``) + collate + start the copy to the
        device (reused pinned buffers, non_blocking, side stream on CUDA)."""
        t0 = time.perf_counter()
        failed: dict[int, BaseException] | None = None
        good: Sequence[Any] = items
        decode_s = 0.0
        if self._host is not None:
            decoded = self._host.decode(self.model.decode_batch, self.model.decode, items)
            failed = {i: x for i, x in enumerate(decoded) if isinstance(x, DecodeFailed)}
            good = [x for x in decoded if not isinstance(x, DecodeFailed)] if failed else decoded
            decode_s = time.perf_counter() - t0
        if not good:  # every record failed to decode: nothing to run
            return Prepared(items, None, None, t0, time.perf_counter() - t0, failed, decode_s)
        with self._collate_lock:
            batch = self.model.collate(good)
        ready = None
        if self.uses_torch and self.kind != "cpu":
            dev = torch.device(self.device)
            if self.is_cuda:
                pinned, taken = self._pinned, cast(list[Any], [])
                assert pinned is not None  # set in setup() on CUDA
                with torch.cuda.stream(self._copy_stream):
                    batch = map_tensors(batch, lambda t: pinned.stage(t, taken).to(dev, non_blocking=True)
                                        if t.device.type == "cpu" else t)
                    ready = torch.cuda.Event()
                    ready.record(self._copy_stream)
                pinned.release(taken, ready)
            else:
                batch = map_tensors(batch, lambda t: t.to(dev))
        return Prepared(items, batch, ready, t0, time.perf_counter() - t0, failed or None, decode_s)

    def launch(self, p: Prepared) -> Launched:
        """forward (on CUDA: queued after the H2D copy) and an async copy of the outputs to the host."""
        t = time.perf_counter()
        if p.batch is None:  # every record failed to decode
            return Launched(p.items, None, p.t0, p.collate_s, 0.0, failed=p.failed)
        started = ended = done = None
        if self.is_cuda:
            stream = torch.cuda.current_stream(self.device)
            if p.ready is not None:
                stream.wait_event(p.ready)
            for x in tensors(p.batch):
                if x.is_cuda:
                    x.record_stream(stream)  # allocated on the copy stream, read on this one
            started = torch.cuda.Event(enable_timing=True)
            started.record(stream)
        with self._ctx(), self._forward_lock:
            # The finish thread also runs forward() when it recovers a batch whose split() failed: handlers
            # are not required to be thread-safe, so two forwards never overlap.
            out = self.model.forward(p.batch)
        if self.is_cuda:
            ended = torch.cuda.Event(enable_timing=True)
            ended.record(stream)
            out = map_tensors(out, lambda x: x.to("cpu", non_blocking=True) if x.is_cuda else x)
            done = torch.cuda.Event()
            done.record(stream)
        elif self.uses_torch and self.kind != "cpu":
            out = map_tensors(out, lambda x: x.cpu())
        lx = Launched(p.items, out, p.t0, p.collate_s, time.perf_counter() - t, p.batch, started, ended,
                      done, failed=p.failed)
        if self._host is not None:
            lx.timings["decode"] = p.decode_s  # part of collate: the host threads' share of it
        return lx

    def wait(self, lx: Launched) -> None:
        """Block (GIL released) until the batch's forward and output copy are done on the device."""
        if lx.done is not None:
            lx.done.synchronize()
            lx.done = None
            if lx.started is not None and lx.ended is not None:
                lx.launch_s = lx.started.elapsed_time(lx.ended) / 1000.0  # device time
                lx.started = lx.ended = None
        lx.keep = None

    def finish(self, lx: Launched) -> list[Any]:
        """Wait for the outputs, split them per record and check the count."""
        self.wait(lx)
        forward_s = lx.launch_s
        t = time.perf_counter()
        failed = lx.failed or {}
        n = len(lx.items) - len(failed)
        outs: Any = []
        if n:
            with self._split_lock:
                split = self.model.split_float32 if self.packs_float32 else self.model.split
                outs = split(lx.output, n)
        if isinstance(outs, tuple):
            outs = list(outs)
        if not isinstance(outs, list):
            # A tensor, array or generator of n rows would pass a count check: name what came back instead.
            raise OutputCountError(
                f"model {self.name}: split() returned a {type(outs).__module__}.{type(outs).__qualname__} "
                f"for a batch of {n}, not a list; it must return a list with exactly one output per input, "
                "in order (e.g. output.tolist(), or worker.models.base.split_rows(output, n))"
            )
        if len(outs) != n:
            raise OutputCountError(
                f"model {self.name}: split() returned {len(outs)} outputs for a batch of {n}; it must return "
                "a list with exactly one output per input, in order"
            )
        if failed:
            rest = iter(outs)
            outs = [failed[i] if i in failed else next(rest) for i in range(len(lx.items))]
        end = time.perf_counter()
        lx.timings.update(collate=lx.collate_s, forward=forward_s, split=end - t,
                          infer=lx.collate_s + forward_s + (end - t), pipeline=end - lx.t0)
        return outs

    def run(self, items: Sequence[Any]) -> list[Any]:
        """collate -> forward -> split, synchronously, no recovery: errors raise (profiling, warm-up)."""
        return self.finish(self.launch(self.prepare(items)))

    # -- safe entry point (the failure policy is worker.device.recovery's)

    def infer(self, items: Sequence[Any], lane: str = "default") -> list[Any | BaseException]:
        """Outputs in input order; a record that fails (alone) gets its exception object instead.
        Batches above the lane's effective max are run in chunks. Raises only OutputCountError and
        DeviceError."""
        return self._recovery.infer(items, lane)

    def recover(self, items: Sequence[Any], lane: str, exc: BaseException) -> list[Any | BaseException]:
        """``exc`` was raised by a batch of ``items``: split it (OOM), bisect it (poison) or, for an error
        that left the device unusable, raise ``DeviceError``."""
        return self._recovery.recover(items, lane, exc)

    def note_success(self, lane: str, n: int) -> None:
        """Count a successful batch; after ``grow_after`` in a row the lane's lowered limit goes up a step."""
        self._recovery.succeeded(lane, n)

    def effective_max(self, lane: str) -> int | None:
        """The engine's max batch size for ``lane`` after OOMs; None = no limit (the configured max
        applies)."""
        return self._limits.effective_max(lane)

    def release_memory(self, collect: bool = False) -> None:
        if collect:
            # Tensors only a reference cycle still holds (the hot path leaves gc to its thresholds).
            gc.collect()
        if self.is_cuda:
            torch.cuda.empty_cache()
