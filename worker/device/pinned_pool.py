"""Reused page-locked host buffers for the host-to-device copy of a batch (CUDA only).

Allocating pinned memory is a driver call that takes far longer than the copy it serves, and each batch of a
stream has a slightly different shape (padded to its longest record). ``PinnedPool`` keeps a few flat
buffers per (dtype, capacity), the capacity being the element count rounded up to a power of two, so that
batches of nearby shapes share buffers: ``stage(t)`` copies ``t`` into a free buffer and returns a view of
``t``'s shape; ``release(buffers, event)`` hands them back once the copy that reads them is queued, and a
buffer is free again only when its event has completed (the copy is done). When every buffer of a key is
still in use, a new one is allocated up to ``per_key``; past that the oldest is waited for. The pool never
holds more than ``max_bytes``: a buffer that would exceed it is allocated and dropped after use.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Alloc = Callable[[int, torch.dtype], torch.Tensor]


def _pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=True)


def capacity(numel: int) -> int:
    """The buffer size a tensor of ``numel`` elements uses: the next power of two (at least 1024)."""
    return max(1024, 1 << max(0, numel - 1).bit_length())


@dataclass(slots=True)
class _Buf:
    flat: torch.Tensor
    event: Any = None  # the copy reading it; None: free


class PinnedPool:
    """See the module docstring. ``alloc(numel, dtype)`` makes a buffer (pinned; tests pass plain memory)."""

    def __init__(self, *, per_key: int = 4, max_bytes: int = 512 << 20, alloc: Alloc = _pinned) -> None:
        self.per_key = max(1, per_key)
        self.max_bytes = max_bytes
        self._alloc = alloc
        self._lock = threading.Lock()
        self._bufs: dict[tuple[torch.dtype, int], deque[_Buf]] = {}
        self.held_bytes = 0
        self.allocations = 0  # buffers allocated so far (a steady stream stops adding to it)

    def stage(self, t: torch.Tensor, taken: list[Any]) -> torch.Tensor:
        """A pinned copy of the CPU tensor ``t`` (same shape and dtype), from a free buffer when there is one;
        the buffer is appended to ``taken``, for ``release``."""
        n = t.numel()
        buf = self._take(t.dtype, capacity(n))
        taken.append(buf)
        view = buf.flat[:n].view(t.shape)
        view.copy_(t)
        return view

    def release(self, taken: list[Any], event: Any) -> None:
        """The copies reading the buffers in ``taken`` are queued; ``event`` (``query()``, ``synchronize()``)
        completes when they are done, and the buffers are free again from then on."""
        with self._lock:
            for b in taken:
                b.event = event
        taken.clear()

    def _take(self, dtype: torch.dtype, cap: int) -> _Buf:
        key = (dtype, cap)
        with self._lock:
            ring = self._bufs.setdefault(key, deque())
            for b in ring:
                if b.event is not _IN_USE and (b.event is None or b.event.query()):
                    b.event = _IN_USE
                    ring.remove(b)
                    ring.append(b)  # most recently used last: the oldest is waited for first
                    return b
            size = cap * torch.empty((), dtype=dtype).element_size()
            if len(ring) >= self.per_key:
                oldest = next((b for b in ring if b.event is not _IN_USE), None)
                if oldest is not None:
                    oldest.event.synchronize()  # every buffer of the key busy: wait for the oldest's copy
                    oldest.event = _IN_USE
                    ring.remove(oldest)
                    ring.append(oldest)
                    return oldest
            keep = len(ring) < self.per_key and self.held_bytes + size <= self.max_bytes
            b = _Buf(self._alloc(cap, dtype), _IN_USE)
            self.allocations += 1
            if keep:
                ring.append(b)
                self.held_bytes += size
            return b


class _InUse:
    """The event of a buffer handed out and not yet released: never done."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        raise RuntimeError("a pinned buffer was waited for before it was released")


_IN_USE = _InUse()
