"""Host threads for a handler's batch decode (``decode_batch``), off the loop thread and on every core.

The device's collate thread calls ``HostPool.decode`` with a batch's validated inputs: the batch is cut into
chunks, one per host thread (chunks of at least ``MIN_CHUNK`` inputs), the collate thread decodes the first
chunk itself and the pool the others, at the same time. Handlers whose ``decode_batch`` releases the GIL (a
Rust tokenizer, an image codec) use as many cores as there are chunks; the pool's threads are bounded, so
the work queued on it is at most one batch per device. A chunk whose ``decode_batch`` raises is decoded one
input at a time with ``decode``, and an input that fails alone becomes a ``DecodeFailed`` in its place: the
record's dead letter, the rest of the batch goes on.

One pool per process (``shared_pool``), shared by the devices' engines: ``model.host_threads`` bounds the
host threads of the whole process, not of each device.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from worker.core.ports import DecodeFailed
from worker.device.errors import OutputCountError

log = logging.getLogger("worker.engine")

MIN_CHUNK = 16  # inputs per chunk at least: below that, the handoff costs more than the second core gains
DecodeBatch = Callable[[Sequence[Any]], Sequence[Any]]
DecodeOne = Callable[[Any], Any]

_libc: Any = None


def name_os_thread(name: str) -> None:
    """Give the calling thread an OS name (``/proc/self/task/*/comm``, ``top -H``), at most 15 bytes: the
    bench's CPU-per-thread rows and an operator's ``top`` tell the worker's threads apart by it."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass  # not Linux: names are cosmetic


def decode_chunk(decode_batch: DecodeBatch, decode: DecodeOne, inputs: Sequence[Any]) -> list[Any]:
    """``decode_batch(inputs)``; when it raises, each input alone with ``decode``, a failing one becoming a
    ``DecodeFailed`` in its place. A ``decode_batch`` that returns another count than it was given breaks
    the handler's contract: ``OutputCountError`` (every record of the batch fails with it; no bisecting)."""
    try:
        items = list(decode_batch(inputs))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - a Rust tokenizer's panic is pyo3's PanicException
        log.info("decode_batch of %d inputs raised %s: %s; decoding them one at a time", len(inputs),
                 type(e).__name__, e)
        return [_decode_one(decode, x) for x in inputs]
    if len(items) != len(inputs):
        raise OutputCountError(f"decode_batch returned {len(items)} items for {len(inputs)} inputs; it must "
                               "return exactly one item per input, in order")
    return items


def _decode_one(decode: DecodeOne, x: Any) -> Any:
    try:
        return decode(x)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - see decode_chunk
        return DecodeFailed(e)


class HostPool:
    """``threads`` host threads, named ``kiw-host``. ``decode`` runs on the calling thread and the pool."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        # The calling thread decodes one chunk itself: the pool needs one thread fewer than the chunks.
        self._pool: ThreadPoolExecutor | None = None
        if self.threads > 1:
            self._pool = ThreadPoolExecutor(max_workers=self.threads - 1, thread_name_prefix="kiw-host",
                                            initializer=name_os_thread, initargs=("kiw-host",))

    def chunks(self, n: int) -> list[tuple[int, int]]:
        """(start, end) of each chunk of a batch of ``n``: one per thread, none under ``MIN_CHUNK``."""
        k = max(1, min(self.threads, n // MIN_CHUNK))
        step, extra = divmod(n, k)
        out, start = [], 0
        for i in range(k):
            end = start + step + (1 if i < extra else 0)
            out.append((start, end))
            start = end
        return out

    def decode(self, decode_batch: DecodeBatch, decode: DecodeOne, inputs: Sequence[Any]) -> list[Any]:
        """One item (or ``DecodeFailed``) per input, in order."""
        spans = self.chunks(len(inputs))
        if len(spans) == 1 or self._pool is None:
            return decode_chunk(decode_batch, decode, inputs)
        futures: list[Future[list[Any]]] = [
            self._pool.submit(decode_chunk, decode_batch, decode, inputs[a:b]) for a, b in spans[1:]]
        a, b = spans[0]
        out = decode_chunk(decode_batch, decode, inputs[a:b])
        for f in futures:
            out.extend(f.result())  # the chunk's own exception (OutputCountError), if it raised
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


_shared: dict[int, HostPool] = {}
_shared_lock = threading.Lock()


def shared_pool(threads: int) -> HostPool:
    """The process's pool of ``threads`` threads: the engines of one config (one per device) share it."""
    with _shared_lock:
        pool = _shared.get(threads)
        if pool is None:
            pool = _shared[threads] = HostPool(threads)
        return pool
