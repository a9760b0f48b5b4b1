"""The device side: run a model handler's collate -> forward -> split on one device, safely and fast.

``Engine`` owns one handler on one device: dtype (autocast), ``inference_mode``, optional
``torch.compile``, warm-up, and the failure policy:

- **Out of memory**: the lane's effective max batch size drops to the largest size known to fit, else to
  half the failed batch (``on_limit(lane, new_max)``), and the batch is rerun in chunks of that size.
  After ``grow_after`` successful batches in a row the limit steps up (x1.25, at least +1) until it
  reaches the largest batch seen, where it is lifted; a step that OOMs again doubles the wait (backoff).
  A record that runs out of memory alone is retried ``oom_retries`` times after freeing memory (a brief
  squeeze: another process, fragmentation) before it gets the error. When every chunk that ran out of
  memory during one recovery held such a record, that record was the cause, not the batch size: the
  lane's limit goes back to what it was before.
- **Poison records**: a batch whose collate/forward/split raises anything else is bisected until the
  failing records are found; they get the exception object at their position, every other record its
  output. The traceback of a handler's exception is logged (WARNING) once per raising site every
  ``traceback_every_s``; the exceptions handed out carry none (their frames would pin device memory).
  A split that returns the wrong number of outputs, or not a list, is a model bug, not a record's: it
  raises ``OutputCountError``.
- **Device errors**: a CUDA error other than out of memory (device-side assert, illegal memory access,
  ECC error, ``torch.AcceleratorError``) leaves the CUDA context unusable: every later call fails, so
  bisecting would dead-letter every record from then on. When a sync on the CUDA device fails too,
  ``DeviceError`` is raised instead: the DeviceWorker thread dies, ``error`` is set and the runner exits 1
  without committing the batch's records, which are processed again after the restart. A CUDA error the
  device survives (a launch configuration one shape cannot use) is bisected like any other, and so is any
  error on another device (no context to lose; its text may be a record's own).

Handlers need not be thread-safe: ``forward`` never runs on two threads at once, and neither does
``collate`` nor ``split`` (recovery re-runs them on the device or finish thread while the pipeline runs
the next batch, and a Hugging Face fast tokenizer entered twice raises "Already borrowed"). ``collate`` of
one batch and ``split`` of another do overlap, as the pipeline intends: a handler that uses one
non-thread-safe object in both must lock it itself.

``DeviceWorker`` is the per-device pipeline of three threads so the device never waits for Python:

    take() -> [collate thread] collate + pinned, non_blocking H2D copy on a side CUDA stream
           -> (one prepared batch) -> [device thread] forward, async D2H copy of the outputs
           -> (at most two launched batches) -> [finish thread] wait for the copy, split, done()

Collate of batch n+1 overlaps forward of batch n, and on CUDA the device thread queues batch n+1's
kernels while the finish thread waits for batch n, so the GPU always has the next batch queued.
The prefetched batch was chosen up to a batch-time before the device can start it; the optional ``swap``
hook lets the device thread exchange it, just before the start, for a batch of a higher-priority lane that
became ready meanwhile (the prefetched one goes back to the scheduler and is collated again later).
Several devices in one process = several DeviceWorkers (one Engine each) sharing one thread-safe
``take``: a batch goes to whichever device is free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import os
import queue
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

from worker.core.records import Batch

log = logging.getLogger("worker.engine")

TakeFn = Callable[[float], Batch | None]
DoneFn = Callable[[Batch, list[Any | BaseException], dict[str, float]], None]
# Called by the device thread just before it starts a prefetched batch: a batch to run instead (the given one
# was given back to the scheduler), or None to run it.
SwapFn = Callable[[Batch], Batch | None]
LimitFn = Callable[[str, int], None]

THREADS_ENV = "WORKER_TORCH_THREADS"


class OutputCountError(RuntimeError):
    """The handler's split() returned a different number of outputs than it was given inputs."""


class DeviceError(RuntimeError):
    """The device's context is unusable (a sticky CUDA error): nothing runs on it until the process restarts.
    Not a record's fault: the worker must stop rather than dead-letter every record from now on."""


# ----------------------------------------------------------------------------------------------- devices


def resolve_device(spec: str) -> str:
    """``auto`` -> ``cuda:0`` if available, then ``mps``, then ``cpu``. ``cuda`` -> ``cuda:0``.
    Raises ValueError naming ``$.model.device`` when the device is absent."""
    s = spec.strip().lower()
    if s == "auto":
        if torch.cuda.is_available():
            return "cuda:0"
        if _mps_available():
            return "mps"
        return "cpu"
    if s == "cpu":
        return "cpu"
    if s == "mps":
        if not _mps_available():
            raise ValueError("$.model.device: 'mps' requested but torch.backends.mps.is_available() is False")
        return "mps"
    if s == "cuda" or s.startswith("cuda:"):
        idx = int(s.split(":", 1)[1]) if ":" in s and s.split(":", 1)[1].isdigit() else (0 if s == "cuda" else -1)
        if idx < 0:
            raise ValueError(f"$.model.device: expected cuda or cuda:N, got {spec!r}")
        if not torch.cuda.is_available():
            raise ValueError(f"$.model.device: {spec!r} requested but CUDA is not available on this machine")
        if idx >= torch.cuda.device_count():
            raise ValueError(f"$.model.device: {spec!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
        return f"cuda:{idx}"
    raise ValueError(f"$.model.device: expected auto, cpu, mps, cuda or cuda:N, got {spec!r}")


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def resolve_dtype(dtype: str, device: str) -> torch.dtype | None:
    """The autocast dtype for ``fp32|fp16|bf16`` on ``device``; None = no autocast (fp32). fp16 on CPU and
    bf16 on a GPU without bf16 fall back to fp32 with a warning."""
    kind = device.split(":")[0]
    if dtype == "fp32":
        return None
    if dtype == "bf16":
        # Compute capability 8 (Ampere) or newer, of this engine's device: is_bf16_supported() asks about the
        # current device, and says True on older GPUs too (it counts emulation, far slower than fp32). ROCm's
        # capability numbers are not CUDA's; its GPUs all take bf16 (what is_bf16_supported() says there).
        if kind == "cuda" and not torch.version.hip and torch.cuda.get_device_capability(device)[0] < 8:
            warnings.warn(f"bf16 is not supported on {device}; running fp32", RuntimeWarning, stacklevel=2)
            return None
        return torch.bfloat16
    if dtype == "fp16":
        if kind == "cpu":
            warnings.warn("fp16 autocast on CPU is slow or unsupported; running fp32 (use bf16 on CPU)",
                          RuntimeWarning, stacklevel=2)
            return None
        return torch.float16
    raise ValueError(f"$.model.dtype: expected fp32, fp16 or bf16, got {dtype!r}")


def available_cpus() -> int:
    """CPUs this process may use: affinity, capped by a cgroup v2 quota (containers)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def configure_threads(device: str, threads: int | None = None) -> int:
    """Set torch's intra-op threads once per process: explicit ``threads`` > ``$WORKER_TORCH_THREADS`` >
    ``$OMP_NUM_THREADS`` (torch already honours it) > on CPU devices all CPUs but one (the loop and
    collate threads need a core; oversubscribing makes every batch slower). Returns the count in use."""
    if threads is None and os.environ.get(THREADS_ENV):
        threads = int(os.environ[THREADS_ENV])
    if threads is None and not os.environ.get("OMP_NUM_THREADS") and device == "cpu":
        threads = max(1, available_cpus() - 1)
    if threads is not None and threads >= 1 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _drop_frames(exc: BaseException) -> None:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__


# Lower-case message parts of out-of-memory errors that are not torch.cuda.OutOfMemoryError: torch's CPU
# allocator raises a plain RuntimeError ("DefaultCPUAllocator: can't allocate memory: you tried to allocate N
# bytes", "... not enough memory" on Windows), MPS "MPS backend out of memory", onnxruntime a RuntimeException
# that is not a RuntimeError ("... CUDA failure 2: out of memory", "Failed to allocate memory").
_OOM_MARKS = ("out of memory", "failed to allocate memory", "defaultcpuallocator: can't allocate memory",
              "defaultcpuallocator: not enough memory")


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError | MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, Exception) and any(mark in text for mark in _OOM_MARKS)


# torch >= 2.8 raises AcceleratorError for CUDA errors; older ones a RuntimeError("CUDA error: ...").
_ACCELERATOR_ERROR: type[BaseException] | None = getattr(torch, "AcceleratorError", None)
# Lower-case message parts of device (not input) errors: torch's, and onnxruntime's CUDA provider's
# ("CUDA failure 700: an illegal memory access was encountered", "CUBLAS failure 14: ...").
_DEVICE_ERROR_MARKS = ("cuda error:", "cuda failure", "device-side assert", "illegal memory access",
                       "cublas_status_", "cublas failure", "cudnn error", "cudnn failure", "ecc error",
                       "unspecified launch failure", "misaligned address", "illegal instruction")


def is_device_error(exc: BaseException) -> bool:
    """An error of the device itself, not out of memory (that one is checked first: "CUDA error: out of
    memory" is an OOM). Whether the context survived it is ``Engine``'s probe's call."""
    if not isinstance(exc, Exception) or is_oom(exc):
        return False
    if _ACCELERATOR_ERROR is not None and isinstance(exc, _ACCELERATOR_ERROR):
        return True
    text = str(exc).lower()
    return any(mark in text for mark in _DEVICE_ERROR_MARKS)


# -------------------------------------------------------------------------------------------- tree maps


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        moved = {k: _map_tensors(v, fn) for k, v in obj.items()}
        if type(obj) is not dict:
            try:  # keep the handler's type (HF BatchEncoding: .input_ids, .to()), as on CPU where nothing moves
                return type(obj)(moved)  # type: ignore[call-arg]
            except Exception:
                pass
        return moved
    if isinstance(obj, PackedSequence):
        # As PackedSequence.to() does: batch_sizes stays on the CPU (its constructor refuses it anywhere else,
        # so a packed batch could not go to a GPU); the rest goes where ``fn`` puts it.
        return type(obj)(fn(obj.data), obj.batch_sizes, *(None if t is None else fn(t)
                                                          for t in (obj.sorted_indices, obj.unsorted_indices)))
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # NamedTuple
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # a handler's own batch type
        return dataclasses.replace(obj, **{f.name: _map_tensors(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, list | tuple):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``, through the containers ``_map_tensors`` moves (record_stream must see each
    tensor the copy stream allocated). All dataclass fields: one set in __post_init__ from moved tensors was
    allocated on the copy stream too."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _tensors(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name, None))
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


# ------------------------------------------------------------------------------------------------ engine


@dataclass(slots=True)
class Prepared:
    """A collated batch, on its way to (or already on) the device."""

    items: Sequence[Any]
    batch: Any
    ready: Any = None  # CUDA event: the H2D copy is done
    t0: float = 0.0  # perf_counter at prepare start
    collate_s: float = 0.0


@dataclass(slots=True)
class Launched:
    """A batch whose forward has been issued; ``output`` is valid once ``done`` has completed."""

    items: Sequence[Any]
    output: Any
    t0: float
    collate_s: float
    launch_s: float  # host time in forward; the device time once wait() has run on CUDA
    keep: Any = None  # the device inputs, alive until the kernels that read them are done
    started: Any = None  # CUDA timing events around forward
    ended: Any = None
    done: Any = None  # CUDA event after the D2H copy of the outputs
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class _OomChain:
    """One OOM recovery on one thread, from the first split of a batch until its records are all done."""

    before: tuple[Any, ...]  # the lane's limit state when it began (Engine._lane_state)
    failed: list[set[int]] = field(default_factory=list)  # ids of the items of each chunk that ran out of memory
    culprits: set[int] = field(default_factory=set)  # ids of the items that ran out of memory alone
    restored: bool = False  # the lane's limit was put back during the recovery already


@dataclass
class EngineStats:
    batches: int = 0
    records: int = 0
    oom: int = 0  # out-of-memory errors caught (each one split a batch, or retried a record alone)
    poison: int = 0  # records isolated as failing
    limit_changes: int = 0


class Engine:
    """One model handler on one device. ``infer`` is the safe synchronous entry point; ``prepare`` /
    ``launch`` / ``finish`` are the pipeline stages ``DeviceWorker`` runs on separate threads.

    ``device``: auto|cpu|mps|cuda|cuda:N. ``dtype``: fp32|fp16|bf16 (autocast). ``compile``: wrap the
    handler's forward in ``torch.compile(dynamic=True)``; falls back to eager (warning) if it fails at
    warm-up. ``warmup``: run the handler's ``example_inputs()`` at batch 1 and 8 in ``setup()``.
    ``on_limit(lane, new_max)``: called (from a device thread) whenever a lane's max batch size changes
    after OOM, down or back up; ``max_batch_sizes`` (lane -> configured max) is where it is lifted to.
    ``threads``: torch intra-op threads (see ``configure_threads``). ``oom_retries`` /
    ``oom_retry_backoff_s``: retries of a record that runs out of memory alone, after ``backoff * attempt``
    seconds each. ``traceback_every_s``: how often one raising site's traceback is logged.
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
        oom_retries: int = 2,
        oom_retry_backoff_s: float = 0.05,
        traceback_every_s: float = 600.0,
    ) -> None:
        self.model = model
        self.device = resolve_device(device)
        self.dtype_name = dtype
        self.amp_dtype = resolve_dtype(dtype, self.device)
        self.compile = compile
        self.warmup = warmup
        self.warmup_iters = warmup_iters
        self.on_limit = on_limit
        self.grow_after = max(1, grow_after)
        self.grow_factor = max(1.0, grow_factor)
        self.threads = threads
        self.stats = EngineStats()
        self.uses_torch = bool(getattr(model, "uses_torch", True))
        self.kind = self.device.split(":")[0]
        self.is_cuda = self.kind == "cuda" and self.uses_torch
        self._copy_stream: Any = None
        self.oom_retries = max(0, oom_retries)
        self.oom_retry_backoff_s = max(0.0, oom_retry_backoff_s)
        self.traceback_every_s = traceback_every_s
        self._lock = threading.Lock()
        self._forward_lock = threading.Lock()
        # collate and split each run on one thread at a time (see the module docstring), host time only.
        self._collate_lock = threading.Lock()
        self._split_lock = threading.Lock()
        self._tl = threading.local()  # .chain: the OOM recovery this thread is in (_OomChain), if any
        self._tb_logged: dict[tuple[str, str, int], float] = {}  # raising site -> when its traceback was logged
        self._limits: dict[str, int] = {}
        # Where a lowered limit is lifted: the lane's configured max, else the largest batch seen.
        self._configured = dict(max_batch_sizes or {})
        self._ceiling: dict[str, int] = dict(self._configured)
        self._ok_streak: dict[str, int] = {}
        self._patience: dict[str, int] = {}  # successes needed before the next step up (backs off)
        self._probing: dict[str, bool] = {}  # the current limit is a step up not yet proven
        self._good: dict[str, int] = {}  # largest batch that ran without OOM per lane (since the last reset)
        self.ready = False

    # -- lifecycle

    def setup(self) -> None:
        configure_threads(self.kind, self.threads)
        if self.is_cuda:
            torch.cuda.set_device(self.device)
            self._copy_stream = torch.cuda.Stream(self.device)
        self.model.setup(self.device)
        cap = getattr(self.model, "max_batch", None)
        if cap:
            # The model takes at most this many records at once (an ONNX file with a fixed batch axis of 1):
            # every lane's limit, for good (the ceiling it would be lifted back to is the same).
            for lane in self._configured:
                self._ceiling[lane] = min(self._ceiling.get(lane, cap), cap)
                if self._configured[lane] > cap:
                    self._set_limit(lane, cap, grow=False)
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

    def _verified_on_first_use(self, compiled: Callable[[Any], Any], eager: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def forward(batch: Any) -> Any:
            try:
                out = compiled(batch)
            except Exception as e:
                if is_oom(e) or is_device_error(e):
                    raise  # the OOM / device-error policy's, not the compiler's
                # The compiler's fault only if eager runs the same batch: a poison record fails both, and must
                # not switch compilation off for good (it raises, is bisected, and the next batch verifies).
                out = eager(batch)
                log.warning("torch.compile of %s failed on a batch eager runs (%s); running eager", self.name, e)
                self.model.forward = eager
                return out
            self.model.forward = compiled  # it works: no wrapper from now on
            return out

        return forward

    @property
    def name(self) -> str:
        return str(getattr(self.model, "name", type(self.model).__name__))

    def example_items(self, n: int) -> list[Any]:
        """``n`` decoded items cycled from the handler's ``example_inputs()`` (empty if it has none)."""
        ex = getattr(self.model, "example_inputs", None)
        inputs = list(ex()) if callable(ex) else []
        if not inputs:
            return []
        decoded = [self.model.decode(x) for x in inputs]
        return [decoded[i % len(decoded)] for i in range(n)]

    def _warm(self, force: bool = False) -> None:
        if not (self.warmup or force):
            return
        # Not past what the model takes at once: a file exported with a fixed batch axis of 1 failed its warm-up
        # with a batch of 8, and the worker could not start.
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
                        log.warning("warm-up of %s: batch of %d does not fit on %s", self.name, size, self.device)
                        self._release_memory()
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
        """collate + start the copy to the device (pinned memory, non_blocking, side stream on CUDA)."""
        t0 = time.perf_counter()
        with self._collate_lock:
            batch = self.model.collate(items)
        ready = None
        if self.uses_torch and self.kind != "cpu":
            dev = torch.device(self.device)
            if self.is_cuda:
                with torch.cuda.stream(self._copy_stream):
                    batch = _map_tensors(
                        batch, lambda t: t.pin_memory().to(dev, non_blocking=True) if t.device.type == "cpu" else t
                    )
                    ready = torch.cuda.Event()
                    ready.record(self._copy_stream)
            else:
                batch = _map_tensors(batch, lambda t: t.to(dev))
        return Prepared(items, batch, ready, t0, time.perf_counter() - t0)

    def launch(self, p: Prepared) -> Launched:
        """forward (on CUDA: queued after the H2D copy) and an async copy of the outputs to the host."""
        t = time.perf_counter()
        started = ended = done = None
        if self.is_cuda:
            stream = torch.cuda.current_stream(self.device)
            if p.ready is not None:
                stream.wait_event(p.ready)
            for x in _tensors(p.batch):
                if x.is_cuda:
                    x.record_stream(stream)  # allocated on the copy stream, read on this one
            started = torch.cuda.Event(enable_timing=True)
            started.record(stream)
        with self._ctx(), self._forward_lock:
            # The finish thread also runs forward() when it recovers a batch whose split() failed: handlers are
            # not required to be thread-safe, so two forwards never overlap.
            out = self.model.forward(p.batch)
        if self.is_cuda:
            ended = torch.cuda.Event(enable_timing=True)
            ended.record(stream)
            out = _map_tensors(out, lambda x: x.to("cpu", non_blocking=True) if x.is_cuda else x)
            done = torch.cuda.Event()
            done.record(stream)
        elif self.uses_torch and self.kind != "cpu":
            out = _map_tensors(out, lambda x: x.cpu())
        return Launched(p.items, out, p.t0, p.collate_s, time.perf_counter() - t, p.batch, started, ended, done)

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
        n = len(lx.items)
        with self._split_lock:
            outs = self.model.split(lx.output, n)
        if isinstance(outs, tuple):
            outs = list(outs)
        if not isinstance(outs, list):
            # A tensor, array or generator of n rows would pass a count check: name what came back instead.
            raise OutputCountError(
                f"model {self.name}: split() returned a {type(outs).__module__}.{type(outs).__qualname__} for a "
                f"batch of {n}, not a list; it must return a list with exactly one output per input, in order "
                "(e.g. output.tolist(), or worker.models.base.split_rows(output, n))"
            )
        if len(outs) != n:
            raise OutputCountError(
                f"model {self.name}: split() returned {len(outs)} outputs for a batch of {n}; it must return a "
                "list with exactly one output per input, in order"
            )
        end = time.perf_counter()
        lx.timings.update(collate=lx.collate_s, forward=forward_s, split=end - t,
                          infer=lx.collate_s + forward_s + (end - t), pipeline=end - lx.t0)
        return outs

    def run(self, items: Sequence[Any]) -> list[Any]:
        """collate -> forward -> split, synchronously, no recovery: errors raise (profiling, warm-up)."""
        return self.finish(self.launch(self.prepare(items)))

    # -- safe entry point and failure policy

    def infer(self, items: Sequence[Any], lane: str = "default") -> list[Any | BaseException]:
        """Outputs in input order; a record that fails (alone) gets its exception object instead.
        Batches above the lane's effective max are run in chunks. Raises only OutputCountError and
        DeviceError."""
        n = len(items)
        if n == 0:
            return []
        self._seen(lane, n)
        out: list[Any | BaseException] = []
        i = 0
        while i < n:
            limit = self.effective_max(lane) or n
            chunk = items[i : i + limit]
            out.extend(self._infer_chunk(chunk, lane))
            i += len(chunk)
        return out

    def _infer_chunk(self, items: Sequence[Any], lane: str) -> list[Any | BaseException]:
        try:
            outs = self.run(items)
        except (OutputCountError, DeviceError):
            raise
        except Exception as e:
            return self.recover(items, lane, e)
        self.note_success(lane, len(items))
        return outs

    def recover(self, items: Sequence[Any], lane: str, exc: BaseException) -> list[Any | BaseException]:
        """``exc`` was raised by a batch of ``items``: split it (OOM), bisect it (poison) or, for an error that
        left the device unusable, raise ``DeviceError``."""
        if isinstance(exc, OutputCountError | DeviceError):
            raise exc
        n = len(items)
        self._seen(lane, n)
        oom = is_oom(exc)
        if not oom and is_device_error(exc) and self._device_lost():
            # Every later call on this CUDA context fails the same way: bisecting would dead-letter each record
            # (and commit it) from now on while /healthz stays green. Stop instead (the runner exits 1).
            log.critical("model %s on %s: device error (%s: %s); the CUDA context is unusable until the process "
                         "restarts: the batch's %d record(s) are not dead-lettered, the worker stops and they are "
                         "processed again after the restart", self.name, self.device, type(exc).__name__,
                         _first_line(exc), n)
            raise DeviceError(f"model {self.name} on {self.device}: {type(exc).__name__}: {_first_line(exc)} "
                              "(the device context is unusable until the process restarts)") from exc
        if not oom:
            self._log_traceback(exc)  # a handler's bug, probably: where it is, before the frames go
        if log.isEnabledFor(logging.DEBUG):
            log.debug("model %s: batch of %d failed", self.name, n, exc_info=exc)
        _drop_frames(exc)  # the failed forward's frames pin its (device) tensors until the exception dies
        if n == 1:
            if oom:
                return self._alone_out_of_memory(items, lane, exc)
            with self._lock:
                self.stats.poison += 1
            log.warning("model %s: record failed alone in lane %s: %r", self.name, lane, exc)
            return [exc]
        del exc
        if oom:
            chain: _OomChain | None = getattr(self._tl, "chain", None)
            top = chain is None
            with self._lock:
                if chain is None:
                    chain = self._tl.chain = _OomChain(self._lane_state(lane))
                chain.failed.append({id(x) for x in items})
                self.stats.oom += 1
                good = self._good.get(lane, 0)
                if good >= n:  # it fitted before; memory got tighter (longer inputs, fragmentation)
                    good = self._good[lane] = 0
                if self._probing.pop(lane, False):  # a step up failed: wait twice as long before the next
                    self._patience[lane] = min(self._patience.get(lane, self.grow_after) * 2, self.grow_after * 64)
            self._release_memory()
            # Back to the largest size known to fit, else half; infer() then runs the batch in chunks.
            self._set_limit(lane, max(1, n // 2, good), grow=False)
            try:
                results = self.infer(items, lane)
            finally:
                if top:
                    self._tl.chain = None
            if top and chain.culprits and all(ids & chain.culprits for ids in chain.failed):
                # Every chunk that ran out of memory held a record that does so even alone: the batch size was
                # not the cause, and a lane left at 1 would take hundreds of batches to climb back.
                self._restore_lane(lane, chain.before)
            return results
        log.info("model %s: batch of %d failed; bisecting to isolate the failing records", self.name, n)
        h = n // 2
        return self.infer(items[:h], lane) + self.infer(items[h:], lane)

    def _alone_out_of_memory(self, items: Sequence[Any], lane: str, exc: BaseException) -> list[Any | BaseException]:
        """A record ran out of memory alone. The memory may have been held only for a moment (another process
        on the GPU, fragmentation, the tensors of the failed forward): free what can be and retry it a few
        times before it gets the error."""
        with self._lock:
            self.stats.oom += 1
        for attempt in range(1, self.oom_retries + 1):
            self._release_memory(collect=True)
            time.sleep(self.oom_retry_backoff_s * attempt)
            try:
                outs = self.run(items)
            except (OutputCountError, DeviceError):
                raise
            except Exception as e:
                if not is_oom(e):
                    return self.recover(items, lane, e)  # poison or a device error after all
                _drop_frames(e)
                with self._lock:
                    self.stats.oom += 1
                exc = e
                continue
            log.info("model %s lane %s: a record that ran out of memory alone ran on retry %d", self.name, lane,
                     attempt)
            self.note_success(lane, 1)
            return outs
        log.warning("model %s: record ran out of memory alone in lane %s (%d retries): %r", self.name, lane,
                    self.oom_retries, exc)
        chain: _OomChain | None = getattr(self._tl, "chain", None)
        if chain is not None:
            chain.culprits.add(id(items[0]))
            if not chain.restored and all(ids & chain.culprits for ids in chain.failed):
                # Now, not only at the end: the rest of the batch would otherwise run one record at a time. Once
                # per recovery, so a device where nothing fits does not split every remaining chunk all over.
                chain.restored = True
                self._restore_lane(lane, chain.before)
        return [exc]

    def _device_lost(self) -> bool:
        """After a device error: is the CUDA context gone? A sticky error (device-side assert, illegal memory
        access, ECC) fails every later call, a sync included; one it survives (an invalid launch configuration)
        does not. Off CUDA there is no context to lose: an error whose text reads like a CUDA one there comes
        from the handler (it may quote a record's own input), and is the record's, bisected like any other; a
        restart would only meet the same record again."""
        if self.kind != "cuda":
            return False
        try:
            torch.cuda.synchronize(self.device)
        except Exception as e:
            log.debug("device probe after an error failed: %r", e)
            return True
        return False

    def _log_traceback(self, exc: BaseException) -> None:
        """WARNING with the traceback, once per raising site (innermost frame) every ``traceback_every_s``: the
        per-record lines carry only the exception, whose frames are dropped to free device memory."""
        tb = exc.__traceback__
        if tb is None:
            return
        while tb.tb_next is not None:
            tb = tb.tb_next
        site = (type(exc).__qualname__, tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        now = time.monotonic()
        with self._lock:
            last = self._tb_logged.get(site)
            if last is not None and now - last < self.traceback_every_s:
                return
            if len(self._tb_logged) >= 256:  # bounded: sites are few unless something is very wrong
                self._tb_logged.clear()
            self._tb_logged[site] = now
        log.warning("model %s raised %s at %s:%d (traceback logged once per site every %.0f s)", self.name,
                    site[0], site[1], site[2], self.traceback_every_s, exc_info=exc)

    def _lane_state(self, lane: str) -> tuple[Any, ...]:
        """(limit, patience, probing, good, streak) of ``lane``; the caller holds ``_lock``."""
        return (self._limits.get(lane), self._patience.get(lane), self._probing.get(lane), self._good.get(lane, 0),
                self._ok_streak.get(lane))

    def _restore_lane(self, lane: str, state: tuple[Any, ...]) -> None:
        limit, patience, probing, good, streak = state
        with self._lock:
            old = self._limits.get(lane)
            for d, v in ((self._limits, limit), (self._patience, patience), (self._probing, probing),
                         (self._ok_streak, streak)):
                if v is None:
                    d.pop(lane, None)
                else:
                    d[lane] = v
            self._good[lane] = max(good, self._good.get(lane, 0))
            if old == limit:
                return
            self.stats.limit_changes += 1
            new = limit if limit is not None else self._ceiling.get(lane)
        log.warning("model %s lane %s: a record runs out of memory even alone, so the batch size was not the cause: "
                    "max batch size %s -> %s%s", self.name, lane, old, new, " (limit lifted)" if limit is None else "")
        if new is not None:
            self._notify_limit(lane, new)

    def _release_memory(self, collect: bool = False) -> None:
        if collect:
            gc.collect()  # tensors only a reference cycle still holds (the hot path leaves gc to its thresholds)
        if self.is_cuda:
            torch.cuda.empty_cache()

    def effective_max(self, lane: str) -> int | None:
        """The engine's max batch size for ``lane`` after OOMs; None = no limit (the configured max applies)."""
        return self._limits.get(lane)

    def _seen(self, lane: str, n: int) -> None:
        if n > self._ceiling.get(lane, 0) and lane not in self._configured:
            with self._lock:
                self._ceiling[lane] = max(n, self._ceiling.get(lane, 0))

    def note_success(self, lane: str, n: int) -> None:
        """Count a successful batch; after ``grow_after`` in a row the lane's lowered limit goes up a step."""
        self._seen(lane, n)
        with self._lock:
            self.stats.batches += 1
            self.stats.records += n
            if n > self._good.get(lane, 0):
                self._good[lane] = n
            limit = self._limits.get(lane)
            if limit is None:
                return
            streak = self._ok_streak.get(lane, 0) + 1
            self._ok_streak[lane] = streak
            if streak < self._patience.get(lane, self.grow_after):
                return
        self._set_limit(lane, max(limit + 1, int(limit * self.grow_factor)), grow=True)

    def _set_limit(self, lane: str, new: int, grow: bool) -> None:
        with self._lock:
            old = self._limits.get(lane)
            ceiling = self._ceiling.get(lane, new)
            self._ok_streak[lane] = 0
            if grow and old is None:
                return
            if not grow and old is not None and new >= old:
                return  # a concurrent split already lowered it further
            if grow and new >= ceiling:
                self._limits.pop(lane, None)
                # The lift is a step up like the others: an OOM at the full size doubles the wait too
                # (patience is kept), or a lane that fits only just under its max would OOM every grow_after.
                self._probing[lane] = True
                new = ceiling
            else:
                self._limits[lane] = new
                self._probing[lane] = grow
            self.stats.limit_changes += 1
        log.warning("model %s lane %s: max batch size %s -> %d%s", self.name, lane, old or ceiling, new,
                    " (limit lifted)" if grow and lane not in self._limits else "")
        self._notify_limit(lane, new)

    def _notify_limit(self, lane: str, new: int) -> None:
        """Tells the runner (``on_limit``) the lane's new max batch size; a failing callback is logged, not raised
        into the device thread."""
        if self.on_limit is not None:
            try:
                self.on_limit(lane, new)
            except Exception:
                log.exception("on_limit callback failed")


# ------------------------------------------------------------------------------------------ device worker

_STOP = object()


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
        engine: Engine,
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
        return bool(self._threads) and all(t.is_alive() for t in self._threads) and not self._stopping.is_set()

    def _guard(self, target: Callable[[], None]) -> None:
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
                self._finishing.put(_Done(batch, results, None, {"infer": took, "pipeline": took, "recovered": 1.0}))
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
    def _safe(fn: Callable[..., list[Any | BaseException]], items: Sequence[Any], *args: Any) -> list[Any | BaseException]:
        try:
            return fn(items, *args)
        except DeviceError:
            raise  # the thread dies, ``error`` is set and the runner exits 1: nothing of the batch is settled
        except Exception as e:  # OutputCountError, or a bug: every record of the batch fails with it
            log.error("batch of %d failed: %r", len(items), e, exc_info=not isinstance(e, OutputCountError))
            return [e] * len(items)
