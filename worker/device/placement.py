"""Placing work on a device: which device and dtype, how many CPU threads, moving a handler's batch.

``resolve_device`` / ``resolve_dtype`` turn the config's words into torch's (errors name ``$.model.*``),
``configure_threads`` sets torch's intra-op threads once per process, and ``map_tensors`` / ``tensors``
walk a handler's batch through the containers it may use (mappings, NamedTuples, dataclasses, lists,
tuples, PackedSequence). ``Prepared`` and ``Launched`` are a batch between the engine's pipeline stages.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

THREADS_ENV = "WORKER_TORCH_THREADS"


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
        tail = s.split(":", 1)[1] if ":" in s else ""
        idx = int(tail) if tail.isdigit() else (0 if s == "cuda" else -1)
        if idx < 0:
            raise ValueError(f"$.model.device: expected cuda or cuda:N, got {spec!r}")
        if not torch.cuda.is_available():
            raise ValueError(f"$.model.device: {spec!r} requested but CUDA is not available on this machine")
        if idx >= torch.cuda.device_count():
            raise ValueError(f"$.model.device: {spec!r} but only {torch.cuda.device_count()} CUDA device(s) "
                             "exist")
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


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it; containers keep their type where they can."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        moved = {k: map_tensors(v, fn) for k, v in obj.items()}
        if type(obj) is not dict:
            # Keep the handler's type (HF BatchEncoding: .input_ids, .to()), as on CPU where nothing moves.
            try:
                return type(obj)(moved)  # type: ignore[call-arg]
            except Exception:
                pass
        return moved
    if isinstance(obj, PackedSequence):
        # As PackedSequence.to() does: batch_sizes stays on the CPU (its constructor refuses it anywhere else,
        # so a packed batch could not go to a GPU); the rest goes where ``fn`` puts it.
        indices = (None if t is None else fn(t) for t in (obj.sorted_indices, obj.unsorted_indices))
        return type(obj)(fn(obj.data), obj.batch_sizes, *indices)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # NamedTuple
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # a handler's own batch type
        return dataclasses.replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, list | tuple):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``, through the containers ``map_tensors`` moves (record_stream must see each
    tensor the copy stream allocated). All dataclass fields: one set in __post_init__ from moved tensors was
    allocated on the copy stream too."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from tensors(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors(getattr(obj, f.name, None))
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from tensors(v)


@dataclass(slots=True)
class Prepared:
    """A collated batch, on its way to (or already on) the device."""

    items: Sequence[Any]
    batch: Any
    ready: Any = None  # CUDA event: the H2D copy is done
    t0: float = 0.0  # perf_counter at prepare start
    collate_s: float = 0.0  # decode (host threads) + collate + the start of the copy
    # Position in ``items`` -> its decode failure; ``batch`` holds the others only (None when none is left).
    failed: dict[int, BaseException] | None = None
    decode_s: float = 0.0


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
    failed: dict[int, BaseException] | None = None  # as in Prepared: they take no part in forward or split

