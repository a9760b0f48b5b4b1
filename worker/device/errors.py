"""What failed: a record, the batch size, or the device itself.

- ``is_oom``: out of memory, in torch's words or another runtime's (the batch size may be the cause).
- ``is_device_error``: a CUDA error other than out of memory (device-side assert, illegal memory access, ECC
  error, ``torch.AcceleratorError``). Whether the context survived it is the recovery's probe's call.
- ``OutputCountError``: the handler's split() broke its contract (a model bug, never a record's).
- ``DeviceError``: the device's context is unusable; the worker stops rather than dead-letter every record.
"""

from __future__ import annotations

import torch


class OutputCountError(RuntimeError):
    """The handler's split() returned a different number of outputs than it was given inputs."""


class DeviceError(RuntimeError):
    """The device's context is unusable (a sticky CUDA error): nothing runs on it until the process
    restarts. Not a record's fault: the worker must stop rather than dead-letter every record from now on."""


def first_line(exc: BaseException) -> str:
    """The first line of the exception's message (empty when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def drop_frames(exc: BaseException) -> None:
    """Drop the tracebacks of ``exc`` and its causes: their frames pin the failed forward's device tensors."""
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

