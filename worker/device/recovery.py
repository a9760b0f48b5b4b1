"""Device recovery: what an engine does with a batch whose collate, forward or split raised.

- **Out of memory**: the lane's limit drops (``worker.core.batch_limit``: the largest size known to fit,
  else half the failed batch; with the model's ``size_of``, its token budget too) and the batch is rerun
  in chunks within both. A record that runs out of
  memory alone is retried ``oom_retries`` times after freeing memory (a brief squeeze: another process,
  fragmentation) before it gets the error. When every chunk that ran out of memory during one recovery held
  such a record, that record was the cause, not the batch size: the lane's limit goes back to what it was.
- **Poison records**: any other error is bisected until the failing records are found; they get the
  exception object at their position, every other record its output. The traceback of a handler's
  exception is logged (WARNING) once per raising site every ``traceback_every_s``; the exceptions handed
  out carry none (their frames would pin device memory).
- **Device errors**: a CUDA error other than out of memory whose context does not survive it (a sync on
  the device fails too) raises ``DeviceError``: every later call would fail, and bisecting would
  dead-letter every record from then on. A CUDA error the device survives is bisected like any other, and
  so is any error on another device (no context to lose; its text may be a record's own).
- ``OutputCountError`` (a split that breaks its contract) is a model bug: it is raised, never bisected.

``LaneLimits`` holds one ``BatchLimit`` per lane behind a lock, logs every change and tells the runner
(``on_limit``). Each ``EngineStats`` counter is written under one lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from worker.core.batch_limit import BatchLimit, LimitChange, LimitPolicy, LimitState, chunk_end
from worker.device.errors import (
    DeviceError,
    OutputCountError,
    drop_frames,
    first_line,
    is_device_error,
    is_oom,
)

log = logging.getLogger("worker.engine")

LimitFn = Callable[[str, int], None]
TokensFn = Callable[[str, int | None], None]  # lane, its token budget in force (None: none)
Results = list[Any | BaseException]


@dataclass
class EngineStats:
    batches: int = 0
    records: int = 0
    oom: int = 0  # out-of-memory errors caught (each one split a batch, or retried a record alone)
    poison: int = 0  # records isolated as failing
    limit_changes: int = 0


class LaneLimits:
    """The per-lane batch limits of one engine (``BatchLimit`` each), thread-safe. ``configured``: lane ->
    configured max batch size (where a lowered limit is lifted to); other lanes get an object on first use,
    whose ceiling is the largest batch seen."""

    def __init__(self, model_name: Callable[[], str], policy: LimitPolicy, configured: Mapping[str, int],
                 stats: EngineStats, on_limit: LimitFn | None = None,
                 configured_tokens: Mapping[str, int | None] | None = None,
                 on_tokens: TokensFn | None = None) -> None:
        self._name = model_name  # (read when logging: a handler may name itself in setup())
        self._policy = policy
        self._stats = stats
        self._on_limit = on_limit
        self._on_tokens = on_tokens
        self._lock = threading.Lock()
        tokens = configured_tokens or {}
        self._lanes = {lane: BatchLimit(policy, n, tokens.get(lane)) for lane, n in configured.items()}

    def _lane(self, lane: str) -> BatchLimit:
        """The caller holds ``_lock``."""
        state = self._lanes.get(lane)
        if state is None:
            state = self._lanes[lane] = BatchLimit(self._policy)
        return state

    def effective_max(self, lane: str) -> int | None:
        """The lane's max batch size after OOMs; None = no limit (the configured max applies)."""
        state = self._lanes.get(lane)
        return None if state is None else state.limit

    def effective_tokens(self, lane: str) -> int | None:
        """The lane's token budget after OOMs; None = no budget (none configured, none lowered)."""
        state = self._lanes.get(lane)
        return None if state is None else state.tokens

    def seen(self, lane: str, n: int) -> None:
        with self._lock:
            self._lane(lane).seen(n)

    def cap(self, cap: int) -> None:
        """The model takes at most ``cap`` records at once: every configured lane's ceiling, for good."""
        for lane in list(self._lanes):
            self._announce(lane, self._step(lane, lambda state: state.cap(cap)))

    def succeeded(self, lane: str, n: int, tokens: int | None = None) -> None:
        self._announce(lane, self._step(lane, lambda state: state.succeeded(n, tokens)))

    def out_of_memory(self, lane: str, n: int, tokens: int | None = None) -> None:
        self._announce(lane, self._step(lane, lambda state: state.out_of_memory(n, tokens)))

    def snapshot(self, lane: str) -> LimitState:
        with self._lock:
            return self._lane(lane).snapshot()

    def restore(self, lane: str, state: LimitState) -> None:
        """Back to ``state``: a record, not the batch size, ran out of memory."""
        self._announce(lane, self._step(lane, lambda limit: limit.restore(state)),
                       "a record runs out of memory even alone, so the batch size was not the cause: ")

    def _step(self, lane: str, step: Callable[[BatchLimit], LimitChange | None]) -> LimitChange | None:
        with self._lock:
            change = step(self._lane(lane))
            if change is not None:
                self._stats.limit_changes += 1
        return change

    def _announce(self, lane: str, change: LimitChange | None, why: str = "") -> None:
        if change is None:
            return
        log.warning("model %s lane %s: %smax batch size %s -> %s%s%s", self._name(), lane, why, change.before,
                    change.after, " (limit lifted)" if change.lifted else "",
                    f", max batch tokens {change.tokens_before} -> {change.tokens_after}"
                    if change.tokens_changed else "")
        self._notify(lane, change)

    def _notify(self, lane: str, change: LimitChange) -> None:
        """Tells the runner (``on_limit``) the lane's new max batch size; a failing callback is logged, not
        raised into the device thread."""
        if self._on_limit is not None and change.after is not None:
            try:
                self._on_limit(lane, change.after)
            except Exception:
                log.exception("on_limit callback failed")
        if self._on_tokens is not None and change.tokens_changed:
            try:
                self._on_tokens(lane, change.tokens_after)
            except Exception:
                log.exception("on_tokens callback failed")


class Runs(Protocol):
    """What recovery needs of its engine: a synchronous run without recovery, and a way to free memory."""

    @property
    def name(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def kind(self) -> str: ...

    def run(self, items: Sequence[Any]) -> list[Any]: ...

    def release_memory(self, collect: bool = False) -> None: ...


@dataclass(slots=True)
class _OomChain:
    """One OOM recovery on one thread, from the first split of a batch until its records are all done."""

    before: LimitState  # the lane's limit state when it began
    # ids of the items of each chunk that ran out of memory
    failed: list[set[int]] = field(default_factory=list)
    culprits: set[int] = field(default_factory=set)  # ids of the items that ran out of memory alone
    restored: bool = False  # the lane's limit was put back during the recovery already

    def culprits_explain_all(self) -> bool:
        """Every chunk that ran out of memory held a record that does so even alone."""
        return bool(self.culprits) and all(ids & self.culprits for ids in self.failed)


class Recovery:
    """The failure policy of one engine (see the module docstring). ``infer`` is the safe entry point:
    chunks to the lane's limit, recovers every chunk that raises."""

    def __init__(self, engine: Runs, limits: LaneLimits, stats: EngineStats, *, oom_retries: int = 2,
                 oom_retry_backoff_s: float = 0.05, traceback_every_s: float = 600.0,
                 size_of: Callable[[Any], int] | None = None) -> None:
        self._engine = engine
        self._size_of = size_of  # the model's cost of an item (its token count), for the token budget
        self._limits = limits
        self._stats = stats
        self.oom_retries = max(0, oom_retries)
        self.oom_retry_backoff_s = max(0.0, oom_retry_backoff_s)
        self.traceback_every_s = traceback_every_s
        self._lock = threading.Lock()  # stats.oom, stats.poison, _tb_logged
        self._tl = threading.local()  # .chain: the OOM recovery this thread is in (_OomChain), if any
        # raising site -> when its traceback was logged
        self._tb_logged: dict[tuple[str, str, int], float] = {}

    def _count_oom(self) -> None:
        with self._lock:
            self._stats.oom += 1

    def infer(self, items: Sequence[Any], lane: str) -> Results:
        """Outputs in input order; a record that fails (alone) gets its exception object instead. Batches
        above the lane's limit run in chunks. Raises only OutputCountError and DeviceError."""
        n = len(items)
        if n == 0:
            return []
        self._limits.seen(lane, n)
        costs = self._costs(items)
        out: Results = []
        i = 0
        while i < n:
            count = self._limits.effective_max(lane) or n
            if costs is None:
                end, tokens = min(n, i + count), None
            else:
                end = chunk_end(costs, i, count, self._limits.effective_tokens(lane))
                tokens = sum(costs[i:end])
            out.extend(self._infer_chunk(items[i:end], lane, tokens))
            i = end
        return out

    def _costs(self, items: Sequence[Any]) -> list[int] | None:
        """Each item's cost (``size_of``, at least 1), or None when the model gives none or it fails."""
        size_of = self._size_of
        if size_of is None:
            return None
        try:
            return [max(1, int(size_of(x))) for x in items]
        except Exception:  # noqa: BLE001 - the batch still runs, chunked by count only
            return None

    def _infer_chunk(self, items: Sequence[Any], lane: str, tokens: int | None = None) -> Results:
        try:
            outs = self._engine.run(items)
        except (OutputCountError, DeviceError):
            raise
        except Exception as e:
            return self.recover(items, lane, e)
        self.succeeded(lane, len(items), tokens)
        return outs

    def succeeded(self, lane: str, n: int, tokens: int | None = None) -> None:
        """Count a successful batch; after ``grow_after`` in a row the lane's lowered limit goes up a step."""
        with self._lock:
            self._stats.batches += 1
            self._stats.records += n
        self._limits.succeeded(lane, n, tokens)

    def recover(self, items: Sequence[Any], lane: str, exc: BaseException) -> Results:
        """``exc`` was raised by a batch of ``items``: split it (OOM), bisect it (poison) or, for an error
        that left the device unusable, raise ``DeviceError``."""
        if isinstance(exc, OutputCountError | DeviceError):
            raise exc
        eng = self._engine
        n = len(items)
        self._limits.seen(lane, n)
        oom = is_oom(exc)
        if not oom and is_device_error(exc) and self._device_lost():
            # Every later call on this CUDA context fails the same way: bisecting would dead-letter each
            # record (and commit it) from now on while /healthz stays green. Stop instead (the runner exits
            # 1).
            log.critical("model %s on %s: device error (%s: %s); the CUDA context is unusable until the "
                         "process restarts: the batch's %d record(s) are not dead-lettered, the worker stops "
                         "and they are processed again after the restart", eng.name, eng.device,
                         type(exc).__name__, first_line(exc), n)
            raise DeviceError(f"model {eng.name} on {eng.device}: {type(exc).__name__}: {first_line(exc)} "
                              "(the device context is unusable until the process restarts)") from exc
        if not oom:
            self._log_traceback(exc)  # a handler's bug, probably: where it is, before the frames go
        if log.isEnabledFor(logging.DEBUG):
            log.debug("model %s: batch of %d failed", eng.name, n, exc_info=exc)
        drop_frames(exc)  # the failed forward's frames pin its (device) tensors until the exception dies
        if n == 1:
            if oom:
                return self._alone_out_of_memory(items, lane, exc)
            with self._lock:
                self._stats.poison += 1
            log.warning("model %s: record failed alone in lane %s: %r", eng.name, lane, exc)
            return [exc]
        del exc
        if oom:
            return self._split(items, lane)
        log.info("model %s: batch of %d failed; bisecting to isolate the failing records", eng.name, n)
        h = n // 2
        return self.infer(items[:h], lane) + self.infer(items[h:], lane)

    def _split(self, items: Sequence[Any], lane: str) -> Results:
        """A batch of several records ran out of memory: lower the lane's limit and rerun it in chunks."""
        chain: _OomChain | None = getattr(self._tl, "chain", None)
        top = chain is None
        if chain is None:
            chain = self._tl.chain = _OomChain(self._limits.snapshot(lane))
        chain.failed.append({id(x) for x in items})
        self._count_oom()
        self._engine.release_memory()
        costs = self._costs(items)
        self._limits.out_of_memory(lane, len(items), None if costs is None else sum(costs))
        try:
            results = self.infer(items, lane)
        finally:
            if top:
                self._tl.chain = None
        if top and chain.culprits_explain_all():
            # The batch size was not the cause, and a lane left at 1 would take hundreds of batches to climb
            # back.
            self._limits.restore(lane, chain.before)
        return results

    def _alone_out_of_memory(self, items: Sequence[Any], lane: str, exc: BaseException) -> Results:
        """A record ran out of memory alone. The memory may have been held only for a moment (another process
        on the GPU, fragmentation, the tensors of the failed forward): free what can be and retry it a few
        times before it gets the error."""
        eng = self._engine
        self._count_oom()
        for attempt in range(1, self.oom_retries + 1):
            eng.release_memory(collect=True)
            time.sleep(self.oom_retry_backoff_s * attempt)
            try:
                outs = eng.run(items)
            except (OutputCountError, DeviceError):
                raise
            except Exception as e:
                if not is_oom(e):
                    return self.recover(items, lane, e)  # poison or a device error after all
                drop_frames(e)
                self._count_oom()
                exc = e
                continue
            log.info("model %s lane %s: a record that ran out of memory alone ran on retry %d", eng.name,
                     lane, attempt)
            self.succeeded(lane, 1)
            return outs
        log.warning("model %s: record ran out of memory alone in lane %s (%d retries): %r", eng.name, lane,
                    self.oom_retries, exc)
        chain: _OomChain | None = getattr(self._tl, "chain", None)
        if chain is not None:
            chain.culprits.add(id(items[0]))
            if not chain.restored and chain.culprits_explain_all():
                # Now, not only at the end: the rest of the batch would otherwise run one record at a time.
                # Once per recovery, so a device where nothing fits does not split every remaining chunk
                # again.
                chain.restored = True
                self._limits.restore(lane, chain.before)
        return [exc]

    def _device_lost(self) -> bool:
        """After a device error: is the CUDA context gone? A sticky error (device-side assert, illegal memory
        access, ECC) fails every later call, a sync included; one it survives (an invalid launch
        configuration) does not. Off CUDA there is no context to lose: an error whose text reads like a CUDA
        one there comes from the handler (it may quote a record's own input), and is the record's, bisected
        like any other; a restart would only meet the same record again."""
        if self._engine.kind != "cuda":
            return False
        try:
            torch.cuda.synchronize(self._engine.device)
        except Exception as e:
            log.debug("device probe after an error failed: %r", e)
            return True
        return False

    def _log_traceback(self, exc: BaseException) -> None:
        """WARNING with the traceback, once per raising site (innermost frame) every ``traceback_every_s``:
        the per-record lines carry only the exception, whose frames are dropped to free device memory."""
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
        log.warning("model %s raised %s at %s:%d (traceback logged once per site every %.0f s)",
                    self._engine.name, site[0], site[1], site[2], self.traceback_every_s, exc_info=exc)
