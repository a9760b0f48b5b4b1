"""Engine (OOM split, poison isolation, output count check, dtype) and DeviceWorker (overlap, order,
stop) on CPU with the synthetic model and small fakes. No timed asserts on absolute wall-clock."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from worker.config.settings import ModelConfig
from worker.core.records import Batch, Record, TopicPartition
from worker.device.engine import (
    DeviceWorker,
    Engine,
    OutputCountError,
    configure_threads,
    is_oom,
    resolve_device,
    resolve_dtype,
)
from worker.models.registry import load_model

torch.set_num_threads(1)


def synthetic(**options: Any) -> Any:
    return load_model(ModelConfig(name="synthetic", options={"a_ms": 0, "b_ms": 0, **options}))


def make_batch(items: Sequence[Any], lane: str = "default", offset: int = 0) -> Batch:
    recs = [Record(TopicPartition("t", 0), offset + i, b"", item=it, lane=lane) for i, it in enumerate(items)]
    return Batch(lane=lane, records=recs, opened_at=0.0, closed_at=0.0, reason="count",
                 max_batch_size=len(recs))


# ------------------------------------------------------------------------------------------ devices/dtype


def test_resolve_device() -> None:
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") in ("cpu", "mps", "cuda:0")
    with pytest.raises(ValueError, match=r"\$\.model\.device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda:1")


def test_resolve_dtype_on_cpu() -> None:
    assert resolve_dtype("fp32", "cpu") is None
    assert resolve_dtype("bf16", "cpu") is torch.bfloat16
    with pytest.warns(RuntimeWarning, match="fp16"):
        assert resolve_dtype("fp16", "cpu") is None



def test_bf16_on_a_gpu_older_than_ampere_falls_back_to_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """is_bf16_supported() counts emulation (True on a pre-Ampere GPU) and asks about the current device, not
    the engine's: the documented fp32 fallback never happened. The engine's own device's capability
    decides."""
    caps = {"cuda:0": (7, 5), "cuda:1": (8, 0)}
    asked: list[object] = []

    def capability(device: object = None) -> tuple[int, int]:
        asked.append(device)
        return caps[str(device)]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.warns(RuntimeWarning, match="bf16 is not supported on cuda:0; running fp32"):
        assert resolve_dtype("bf16", "cuda:0") is None
    assert resolve_dtype("bf16", "cuda:1") is torch.bfloat16
    assert asked == ["cuda:0", "cuda:1"]

def test_bf16_on_cpu_runs_under_autocast() -> None:
    seen: list[torch.dtype] = []

    class Probe:
        name, version, input_type, output_type = "probe", "1", list[float], list[float]

        def setup(self, device: str) -> None:
            self.lin = torch.nn.Linear(4, 2).to(device)

        def decode(self, x: Any) -> Any:
            return x

        def collate(self, items: Sequence[Any]) -> torch.Tensor:
            return torch.tensor(items)

        def forward(self, b: torch.Tensor) -> torch.Tensor:
            y = self.lin(b)
            seen.append(y.dtype)
            return y.float()

        def split(self, out: torch.Tensor, n: int) -> list[Any]:
            return out.tolist()

    eng = Engine(Probe(), "cpu", dtype="bf16", warmup=False, threads=1)
    eng.setup()
    out = eng.infer([[1.0, 2.0, 3.0, 4.0]] * 3)
    assert len(out) == 3 and seen == [torch.bfloat16]
    tiny = Engine(load_model(ModelConfig(name="tiny")), "cpu", dtype="bf16", threads=1)
    tiny.setup()  # warm-up from example_inputs()
    res: list[Any] = tiny.infer(tiny.example_items(5))
    assert len(res) == 5 and all(abs(sum(r) - 1) < 1e-2 for r in res)


def test_configure_threads_respects_explicit_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        assert configure_threads("cpu", 1) == 1
        monkeypatch.setenv("WORKER_TORCH_THREADS", "1")
        assert configure_threads("cpu") == 1
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------------------- OOM and poison


def test_oom_splits_lowers_the_lane_limit_and_raises_it_back() -> None:
    m = synthetic(oom_above=8)
    limits: list[tuple[str, int]] = []
    eng = Engine(m, "cpu", on_limit=lambda lane, n: limits.append((lane, n)), grow_after=5, warmup=False)
    eng.setup()
    items = [m.decode({"i": i}) for i in range(32)]
    out = eng.infer(items, "hi")
    assert out == [{"i": i} for i in range(32)]  # every record, in order
    assert eng.effective_max("hi") == 8
    assert limits == [("hi", 16), ("hi", 8)]
    assert eng.effective_max("other") is None  # per lane
    assert eng.stats.oom == 2
    # Memory frees up: after grow_after good batches per step the limit climbs back and is lifted at 32.
    m.opts.oom_above = None
    for _ in range(40):
        assert eng.infer(items, "hi") == [{"i": i} for i in range(32)]
        if eng.effective_max("hi") is None:
            break
    assert eng.effective_max("hi") is None
    assert eng.stats.limit_changes == len(limits)
    assert [n for _, n in limits[2:]] == sorted(n for _, n in limits[2:])  # only upwards
    assert limits[-1] == ("hi", 32)


def test_limit_is_lifted_to_the_configured_lane_max() -> None:
    m = synthetic(oom_above=4)
    limits: list[tuple[str, int]] = []
    eng = Engine(m, "cpu", on_limit=lambda lane, n: limits.append((lane, n)), grow_after=1, warmup=False,
                 max_batch_sizes={"a": 64})
    eng.infer([m.decode(i) for i in range(8)], "a")  # batches of 8 so far, but the lane may take 64
    assert limits[0] == ("a", 4)
    m.opts.oom_above = None
    for _ in range(30):
        eng.infer([m.decode(i) for i in range(8)], "a")
    assert eng.effective_max("a") is None and limits[-1] == ("a", 64)


def test_a_failing_on_limit_callback_is_logged_and_the_limit_still_changes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    m = synthetic(oom_above=4)
    calls: list[int] = []

    def on_limit(lane: str, n: int) -> None:
        calls.append(n)
        raise RuntimeError("the runner's side broke")

    eng = Engine(m, "cpu", on_limit=on_limit, warmup=False, max_batch_sizes={"default": 8})
    with caplog.at_level("WARNING", logger="worker.engine"):
        out = eng.infer([m.decode(i) for i in range(8)])
    assert out == list(range(8))  # not raised into the caller (a device thread)
    assert calls == [4] and eng.effective_max("default") == 4 and eng.stats.limit_changes == 1
    assert "on_limit callback failed" in caplog.text and "max batch size 8 -> 4" in caplog.text


def test_oom_with_a_record_that_does_not_fit_alone() -> None:
    m = synthetic(oom_above=0)
    eng = Engine(m, "cpu", warmup=False, oom_retry_backoff_s=0)
    eng.setup()
    out = eng.infer([m.decode(x) for x in (1, 2, 3)])
    assert all(is_oom(e) for e in out)
    # Every record runs out of memory alone, each after 2 retries: no batch size would help, so the lane's
    # limit is not left lowered (it used to stay at 1).
    assert eng.effective_max("default") is None


def test_poison_record_is_isolated_at_its_index() -> None:
    m = synthetic(fail_on="POISON")
    eng = Engine(m, "cpu", warmup=False)
    eng.setup()
    inputs: list[Any] = [{"i": i} for i in range(64)]
    inputs[37] = {"i": "POISON"}
    out = eng.infer([m.decode(x) for x in inputs])
    errors = [i for i, o in enumerate(out) if isinstance(o, BaseException)]
    assert errors == [37] and isinstance(out[37], ValueError)
    assert [o for i, o in enumerate(out) if i != 37] == [x for i, x in enumerate(inputs) if i != 37]
    assert eng.stats.poison == 1
    assert m.calls <= 1 + 2 * 6  # bisection: O(log n) forwards


def test_poison_and_oom_together() -> None:
    m = synthetic(fail_on="P", oom_above=4)
    eng = Engine(m, "cpu", warmup=False)
    eng.setup()
    inputs = ["a", "P", "b", "c", "d", "e", "f", "P", "g", "h"]
    out = eng.infer([m.decode(x) for x in inputs])
    assert [isinstance(o, ValueError) for o in out] == [x == "P" for x in inputs]
    assert [o for o in out if not isinstance(o, BaseException)] == [x for x in inputs if x != "P"]


class Fake:
    """A fake handler whose collate and forward sleep (like a GPU wait: the GIL is released)."""

    name, version, input_type, output_type = "fake", "1", Any, Any
    uses_torch = False

    def __init__(self, collate_s: float = 0.0, forward_s: float = 0.0, extra: int = 0) -> None:
        self.collate_s, self.forward_s, self.extra = collate_s, forward_s, extra
        self.log: list[tuple[str, int, float, float]] = []  # (stage, first item, start, end)
        self.lock = threading.Lock()

    def setup(self, device: str) -> None:
        pass

    def decode(self, x: Any) -> Any:
        return x

    def collate(self, items: Sequence[Any]) -> list[Any]:
        t = time.perf_counter()
        time.sleep(self.collate_s)
        with self.lock:
            self.log.append(("collate", items[0], t, time.perf_counter()))
        return list(items)

    def forward(self, batch: list[Any]) -> list[Any]:
        t = time.perf_counter()
        time.sleep(self.forward_s)
        with self.lock:
            self.log.append(("forward", batch[0], t, time.perf_counter()))
        return [x * 10 for x in batch]

    def split(self, out: list[Any], n: int) -> list[Any]:
        return out + [0] * self.extra


def test_split_count_mismatch_is_a_clear_error() -> None:
    eng = Engine(Fake(extra=1), "cpu", warmup=False)
    eng.setup()
    with pytest.raises(OutputCountError, match=r"split\(\) returned 3 outputs for a batch of 2"):
        eng.infer([1, 2])


# ------------------------------------------------------------------------------------------ DeviceWorker


class Feeder:
    """A thread-safe take(): hands out the given batches, then None."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = list(batches)
        self.lock = threading.Lock()
        self.results: dict[int, tuple[Batch, list[Any], dict[str, float]]] = {}
        self.all_done = threading.Event()
        self.expected = len(batches)

    def take(self, timeout: float) -> Batch | None:
        with self.lock:
            if self.batches:
                return self.batches.pop(0)
        time.sleep(min(timeout, 0.005))
        return None

    def done(self, batch: Batch, results: list[Any], timings: dict[str, float]) -> None:
        with self.lock:
            self.results[batch.records[0].offset] = (batch, results, timings)
            if len(self.results) == self.expected:
                self.all_done.set()


def test_device_worker_overlaps_collate_with_forward() -> None:
    c = f = 0.03
    n = 8
    model = Fake(collate_s=c, forward_s=f)
    feeder = Feeder([make_batch([i * 4 + k for k in range(4)], offset=i * 4) for i in range(n)])
    w = DeviceWorker(Engine(model, "cpu", warmup=False), feeder.take, feeder.done, poll_s=0.01)
    w.start()
    assert feeder.all_done.wait(30)
    assert w.stop(5)
    # Every batch's results, in record order.
    for i in range(n):
        batch, results, timings = feeder.results[i * 4]
        assert results == [10 * r.item for r in batch.records]
        assert {"collate", "forward", "split", "infer", "wait", "pipeline"} <= set(timings)
        assert timings["infer"] <= timings["pipeline"] + 1e-6
    # Structure: collate of batch k+1 ran while forward of batch k was running.
    spans = {(stage, first): (s, e) for stage, first, s, e in model.log}
    overlapped = sum(
        1 for i in range(n - 1)
        if spans[("collate", (i + 1) * 4)][0] < spans[("forward", i * 4)][1]
        and spans[("collate", (i + 1) * 4)][1] > spans[("forward", i * 4)][0]
    )
    assert overlapped >= (n - 1) // 2  # (what overlapping gains in time is measured by make bench, 7.2)


def test_device_worker_swaps_a_prefetched_batch_just_before_starting_it() -> None:
    model = Fake(forward_s=0.05)
    first, low, high = (
        make_batch([1], offset=0),
        make_batch([2], "lo", offset=10),
        make_batch([3], "hi", offset=20),
    )
    feeder = Feeder([first, low])
    feeder.expected = 3
    offered: list[Batch] = []

    def swap(b: Batch) -> Batch | None:
        offered.append(b)
        if b is low and high not in offered:
            offered.append(high)
            with feeder.lock:
                feeder.batches.insert(0, low)  # given back to the scheduler: taken again later
            return high
        return None

    w = DeviceWorker(Engine(model, "cpu", warmup=False), feeder.take, feeder.done, poll_s=0.01, swap=swap)
    w.start()
    assert feeder.all_done.wait(30)
    assert w.stop(5)
    # ``low`` was prefetched while ``first`` ran; just before it started, ``high`` took its place.
    forwards = [
        first_item
        for stage, first_item, _s, _e in sorted(model.log, key=lambda x: x[2])
        if stage == "forward"
    ]
    assert forwards == [1, 3, 2]
    assert feeder.results[20][1] == [30] and feeder.results[10][1] == [20]
    assert offered[0] is first and offered[1] is low


def test_device_worker_isolates_poison_and_oom_and_reports_mismatch() -> None:
    m = synthetic(fail_on="BAD", oom_above=4)
    eng = Engine(m, "cpu", warmup=False)
    inputs: list[Any] = [f"r{i}" for i in range(10)]
    inputs[3] = "BAD"
    feeder = Feeder([make_batch([m.decode(x) for x in inputs], lane="lo"),
                     make_batch([m.decode("x")], offset=100)])
    w = DeviceWorker(eng, feeder.take, feeder.done, poll_s=0.01)
    w.start()
    assert feeder.all_done.wait(30)
    w.stop(5)
    _, res, _ = feeder.results[0]
    assert [isinstance(r, ValueError) for r in res] == [x == "BAD" for x in inputs]
    limit = eng.effective_max("lo")
    assert limit is not None and limit <= 4
    assert feeder.results[100][1] == ["x"]

    bad = Fake(extra=2)
    feeder2 = Feeder([make_batch([1, 2, 3])])
    w2 = DeviceWorker(Engine(bad, "cpu", warmup=False), feeder2.take, feeder2.done, poll_s=0.01)
    w2.start()
    assert feeder2.all_done.wait(30)
    w2.stop(5)
    res2 = feeder2.results[0][1]
    assert len(res2) == 3 and all(isinstance(r, OutputCountError) for r in res2)


def test_device_worker_stop_finishes_held_batches() -> None:
    model = Fake(forward_s=0.02)
    feeder = Feeder([make_batch([i], offset=i) for i in range(3)])
    w = DeviceWorker(Engine(model, "cpu", warmup=False), feeder.take, feeder.done, poll_s=0.01)
    w.start()
    assert w.alive
    while feeder.batches:  # all taken
        time.sleep(0.005)
    assert w.stop(10)
    assert not w.alive
    assert sorted(feeder.results) == [0, 1, 2]


def test_several_workers_share_one_take() -> None:
    models = [Fake(forward_s=0.01), Fake(forward_s=0.01)]
    feeder = Feeder([make_batch([i], offset=i) for i in range(12)])
    workers = [DeviceWorker(Engine(m, "cpu", warmup=False), feeder.take, feeder.done, poll_s=0.01,
                            name=f"w{i}")
               for i, m in enumerate(models)]
    for w in workers:
        w.start()
    assert feeder.all_done.wait(30)
    for w in workers:
        assert w.stop(5)
    assert sorted(feeder.results) == list(range(12))
    assert all(m.log for m in models)  # both devices got work


class CollatePoison(Fake):
    def collate(self, items: Sequence[Any]) -> list[Any]:
        if "X" in items:
            raise TypeError("cannot collate X")
        return list(items)

    def forward(self, batch: list[Any]) -> list[Any]:
        return [f"{x}!" for x in batch]


def test_device_worker_collate_failure_is_bisected() -> None:
    feeder = Feeder([make_batch(["a", "X", "b", "c"])])
    w = DeviceWorker(Engine(CollatePoison(), "cpu", warmup=False), feeder.take, feeder.done, poll_s=0.01)
    w.start()
    assert feeder.all_done.wait(30)
    w.stop(5)
    res = feeder.results[0][1]
    assert res[0] == "a!" and isinstance(res[1], TypeError) and res[2:] == ["b!", "c!"]
    assert {"infer", "pipeline"} <= set(feeder.results[0][2])


def test_compile_wraps_forward_and_falls_back_to_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[Any] = []

    def fake_compile(fn: Any, **kw: Any) -> Any:
        compiled.append(kw)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    eng = Engine(load_model(ModelConfig(name="tiny")), "cpu", compile=True, warmup=False, threads=1)
    eng.setup()
    assert compiled == [{"dynamic": True}]
    assert len(eng.infer(eng.example_items(2))) == 2

    def broken_compile(fn: Any, **kw: Any) -> Any:
        def f(*a: Any) -> Any:
            raise RuntimeError("inductor: no compiler")
        return f

    monkeypatch.setattr(torch, "compile", broken_compile)
    eng2 = Engine(load_model(ModelConfig(name="tiny")), "cpu", compile=True, threads=1)
    eng2.setup()  # warns and runs eager
    assert len(eng2.infer(eng2.example_items(3))) == 3

    # A handler without example_inputs(): nothing to try the compiled forward on at start. The first real
    # batch does; it used to fail every record in service instead of falling back.
    tiny = load_model(ModelConfig(name="tiny"))
    items = Engine(tiny, "cpu", warmup=False, threads=1).example_items(4)
    tiny.example_inputs = lambda: []
    eng3 = Engine(tiny, "cpu", compile=True, threads=1)
    eng3.setup()
    outs = eng3.infer(items)
    assert len(outs) == 4 and not any(isinstance(o, BaseException) for o in outs)
    assert eng3.stats.poison == 0



class NegativeIsPoison:
    """A handler without example_inputs() whose forward refuses a negative record (as eager and compiled)."""

    name, version, input_type, output_type = "neg", "1", Any, Any

    def setup(self, device: str) -> None:
        pass

    def decode(self, x: Any) -> Any:
        return x

    def collate(self, items: Sequence[Any]) -> torch.Tensor:
        return torch.tensor(items)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if (batch < 0).any():
            raise ValueError("negative input")
        return batch * 2

    def split(self, out: torch.Tensor, n: int) -> list[Any]:
        return out.tolist()


def test_a_poison_record_in_the_first_compiled_batch_does_not_switch_compile_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without example inputs the first batch verifies the compiled forward; a record that fails eager too
    made it fall back to eager for good. Only a batch that eager runs and the compiled forward does not
    does."""
    calls: list[str] = []

    def fake_compile(fn: Any, **kw: Any) -> Any:
        def compiled(batch: Any) -> Any:
            calls.append("compiled")
            return fn(batch)
        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    m = NegativeIsPoison()
    eng = Engine(m, "cpu", compile=True, threads=1)
    eng.setup()
    out = eng.infer([1.0, -1.0, 3.0])
    assert out[0] == 2.0 and isinstance(out[1], ValueError) and out[2] == 6.0
    assert getattr(m.forward, "__name__", "") == "compiled"  # verified by a good chunk, still compiled
    calls.clear()
    assert eng.infer([4.0]) == [8.0] and calls == ["compiled"]

    def broken_compile(fn: Any, **kw: Any) -> Any:
        def compiled(batch: Any) -> Any:
            raise RuntimeError("inductor: no compiler")
        return compiled

    monkeypatch.setattr(torch, "compile", broken_compile)
    m2 = NegativeIsPoison()
    eng2 = Engine(m2, "cpu", compile=True, threads=1)
    eng2.setup()
    trial = m2.forward
    out = eng2.infer([-1.0])  # fails both ways: the record's fault, the compiled forward is still on trial
    assert isinstance(out[0], ValueError) and m2.forward is trial
    assert eng2.infer([1.0, 2.0]) == [2.0, 4.0]  # eager runs what the compiled forward cannot: eager for good
    assert getattr(m2.forward, "__func__", None) is NegativeIsPoison.forward

def test_failed_forward_frames_are_released_before_the_retry() -> None:
    """An OOM's traceback keeps the failed forward's locals (its activations) alive; the retry must not
    run while they are pinned."""
    import gc
    import weakref

    refs: list[Any] = []

    class Big:
        pass

    class Leaky(Fake):
        def forward(self, batch: list[Any]) -> list[Any]:
            activations = Big()  # stands in for the device tensors of a failed forward
            refs.append(weakref.ref(activations))
            if len(batch) > 2:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
            alive = sum(r() is not None for r in refs[:-1])
            assert alive == 0, f"{alive} failed forwards still pinned"
            return [x * 10 for x in batch]

    eng = Engine(Leaky(), "cpu", warmup=False)
    gc.disable()  # only reference counting may free them, as it must on the hot path
    try:
        assert eng.infer([1, 2, 3, 4, 5, 6, 7, 8]) == [10, 20, 30, 40, 50, 60, 70, 80]
    finally:
        gc.enable()


def test_device_worker_passes_empty_batches_through() -> None:
    feeder = Feeder([make_batch([])])
    feeder.expected = 1
    seen: list[Any] = []

    def done(batch: Batch, results: list[Any], timings: dict[str, float]) -> None:
        seen.append(results)
        feeder.all_done.set()

    w = DeviceWorker(Engine(Fake(), "cpu", warmup=False), feeder.take, done, poll_s=0.01)
    w.start()
    assert feeder.all_done.wait(10)
    w.stop(5)
    assert seen == [[]]


class Exits(Fake):
    """A handler that ends its thread: SystemExit from forward (a library calling sys.exit(), say)."""

    def forward(self, batch: list[Any]) -> list[Any]:
        if 99 in batch:
            raise SystemExit(3)
        return super().forward(batch)


# the thread dies: intended
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_pipeline_thread_that_dies_is_reported_in_error() -> None:
    # The runner reads .error every loop turn and stops the worker (tests/unit/test_runner_loop.py): the
    # batches the dead thread held would never reach done().
    feeder = Feeder([make_batch([1], offset=0), make_batch([99], offset=1), make_batch([2], offset=2)])
    w = DeviceWorker(Engine(Exits(), "cpu", warmup=False), feeder.take, feeder.done, poll_s=0.01)
    w.start()
    deadline = time.monotonic() + 10
    while w.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    w.stop(5)
    assert isinstance(w.error, SystemExit) and not w.alive
    assert 1 not in feeder.results  # the batch it held never came back


def _error_of(w: DeviceWorker) -> BaseException | None:
    """Run ``w`` until it reports an error (10 s at most); the error."""
    w.start()
    deadline = time.monotonic() + 10
    while w.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    w.stop(5)
    return w.error


def test_a_take_done_or_swap_that_raises_is_reported_in_error() -> None:
    # Each may lose a batch that already left the scheduler (its records then stay in flight for good; swap
    # may also have put one back that then runs twice): the runner must stop (exit 1), not go on with a
    # partition that never commits again. They were only logged.
    def bad_take(timeout: float) -> Batch | None:
        raise RuntimeError("store said no")

    def bad_done(batch: Batch, results: list[Any], timings: dict[str, float]) -> None:
        raise KeyError("gone")

    def bad_swap(batch: Batch) -> Batch | None:
        raise ValueError("count_dispatch failed after preempt() took the better batch")

    def feeder() -> Feeder:
        return Feeder([make_batch([1], offset=0)])

    assert isinstance(_error_of(DeviceWorker(Engine(Fake(), "cpu", warmup=False), bad_take, feeder().done,
                                             poll_s=0.01)), RuntimeError)
    assert isinstance(_error_of(DeviceWorker(Engine(Fake(), "cpu", warmup=False), feeder().take, bad_done,
                                             poll_s=0.01)), KeyError)
    f = feeder()
    assert isinstance(_error_of(DeviceWorker(Engine(Fake(), "cpu", warmup=False), f.take, f.done, poll_s=0.01,
                                             swap=bad_swap)), ValueError)


class Blocks(Fake):
    """A forward that waits until the test lets it go (a hung kernel, as far as the worker can tell)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def forward(self, batch: list[Any]) -> list[Any]:
        self.go.wait(10)
        return super().forward(batch)


def test_busy_for_reports_how_long_the_oldest_batch_has_been_on_the_device() -> None:
    model = Blocks()
    feeder = Feeder([make_batch([1], offset=0)])
    w = DeviceWorker(Engine(model, "cpu", warmup=False), feeder.take, feeder.done, poll_s=0.01)
    assert w.busy_for(time.monotonic()) == 0.0
    w.start()
    deadline = time.monotonic() + 10
    while w.busy_for(time.monotonic()) == 0.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert w.busy_for(time.monotonic()) >= 0.2  # the runner's watchdog compares this with batch_timeout_s
    model.go.set()
    assert feeder.all_done.wait(10)
    w.stop(5)
    assert w.busy_for(time.monotonic()) == 0.0


# ------------------------------------------------------------------------------------ review fixes
class FitsUnder(Fake):
    """Batches over ``limit`` records run out of device memory."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def forward(self, batch: list[Any]) -> list[Any]:
        if len(batch) > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch


def test_an_oom_right_after_the_limit_is_lifted_doubles_the_wait_too() -> None:
    """Only 62 of a lane's configured 64 fit. The lift back to 64 is a step up like the others: an OOM there
    must double the wait before the next try, or the lane runs out of memory every grow_after batches."""
    eng = Engine(FitsUnder(62), "cpu", warmup=False, grow_after=10, max_batch_sizes={"low": 64})
    eng.setup()
    ooms_at: list[int] = []
    calls = 0
    while len(ooms_at) < 5:
        before = eng.stats.oom
        eng.infer(list(range(64)), "low")
        calls += 1
        if eng.stats.oom > before:
            ooms_at.append(calls)
    gaps = [b - a for a, b in zip(ooms_at, ooms_at[1:], strict=False)]
    assert gaps[1:] == [gaps[1] * 2 ** k for k in range(len(gaps) - 1)] and gaps[-1] > gaps[0], gaps


class RuntimeOOM(Exception):
    """What onnxruntime raises on CUDA: not a RuntimeError."""


def test_an_out_of_memory_error_from_another_runtime_splits_instead_of_bisecting() -> None:
    from worker.device.engine import is_oom

    assert is_oom(RuntimeOOM("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : CUDA failure 2: out of memory"))
    assert is_oom(RuntimeOOM("Failed to allocate memory for requested buffer of size 1073741824"))
    assert not is_oom(RuntimeOOM("Unexpected input data type"))



class CPUAllocatorOOM(Fake):
    """Runs out of host memory, for real, above 2 records (torch's CPU allocator raises a plain
    RuntimeError)."""

    def forward(self, batch: list[Any]) -> list[Any]:
        if len(batch) > 2:
            torch.empty(2**60, dtype=torch.uint8)  # past any address space: the allocator refuses it
        return super().forward(batch)


def test_a_cpu_out_of_memory_error_splits_the_batch_and_lowers_the_limit() -> None:
    """"DefaultCPUAllocator: can't allocate memory" was not an OOM: the batch was bisected as if its records
    were poison, and the lane kept a max batch size that does not fit."""
    from worker.device.engine import is_oom

    with pytest.raises(RuntimeError) as info:
        torch.empty(2**60, dtype=torch.uint8)
    assert is_oom(info.value), str(info.value)
    assert is_oom(RuntimeError("[enforce fail at CPUAllocator.cpp:79] data. DefaultCPUAllocator: not enough "
                               "memory: you tried to allocate 1000000 bytes."))
    limits: list[int] = []
    eng = Engine(CPUAllocatorOOM(), "cpu", warmup=False, on_limit=lambda lane, n: limits.append(n))
    eng.setup()
    assert eng.infer(list(range(8))) == [x * 10 for x in range(8)]
    assert eng.stats.oom >= 1 and eng.stats.poison == 0
    assert eng.effective_max("default") == 2 and limits[-1] == 2

def test_a_batch_output_part_without_one_row_per_record_is_an_error_not_a_misattribution() -> None:
    from worker.models.base import split_rows

    n = 3
    with pytest.raises(ValueError, match=r"output\['bias'\] has 8 rows for a batch of 3"):
        split_rows({"logits": torch.zeros(n, 2), "bias": torch.arange(8.0)}, n)
    with pytest.raises(ValueError, match=r"output\[1\] has 1 rows"):
        split_rows((torch.zeros(n), torch.tensor([1.0])), n)
    assert split_rows({"a": torch.zeros(n, 2), "b": torch.ones(n)}, n)[2] == {"a": [0.0, 0.0], "b": 1.0}


class SplitFailsOnce(Fake):
    def __init__(self) -> None:
        super().__init__(forward_s=0.02)
        self.active = 0
        self.most = 0
        self.threads: set[str] = set()

    def forward(self, batch: list[Any]) -> list[Any]:
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
            self.threads.add(threading.current_thread().name)
        time.sleep(self.forward_s)
        with self.lock:
            self.active -= 1
        return batch

    def split(self, out: list[Any], n: int) -> list[Any]:
        if "bad" in out:
            raise ValueError("cannot split")
        return out


def test_forward_never_runs_on_two_threads_at_once() -> None:
    """Recovering a batch whose split() failed re-runs forward on the finish thread while the device thread
    runs the next batch; handlers need not be thread-safe."""
    model = SplitFailsOnce()
    feeder = Feeder([make_batch(["bad" if (k == 0 and i == 3) else i for i in range(8)], offset=k * 8)
                     for k in range(4)])
    w = DeviceWorker(Engine(model, "cpu", warmup=False), feeder.take, feeder.done, poll_s=0.01)
    w.start()
    assert feeder.all_done.wait(30)
    w.stop(5)
    assert len(model.threads) == 2 and model.most == 1, (model.threads, model.most)


def test_a_mapping_batch_keeps_its_type_when_moved() -> None:
    from worker.device.placement import map_tensors

    class Encoding(dict):  # like transformers' BatchEncoding: a dict with attribute access
        def __getattr__(self, k: str) -> Any:
            return self[k]

    moved = map_tensors(Encoding(input_ids=torch.zeros(2, 3)), lambda t: t + 1)
    assert type(moved) is Encoding and moved.input_ids.sum().item() == 6


def test_a_dataclass_batch_is_moved_too() -> None:
    """Only tensors, mappings, tuples and lists used to be moved: a handler's own batch type stayed on the
    CPU, and on a GPU every record failed."""
    import dataclasses as dc

    from worker.device.placement import map_tensors

    @dc.dataclass
    class Inputs:
        ids: torch.Tensor
        lengths: list[int]

    moved = map_tensors(Inputs(torch.zeros(2), [1, 2]), lambda t: t + 1)
    assert isinstance(moved, Inputs) and moved.ids.tolist() == [1.0, 1.0] and moved.lengths == [1, 2]



def test_a_packed_sequence_batch_keeps_its_batch_sizes_on_the_cpu() -> None:
    """Moved as a NamedTuple, a PackedSequence's batch_sizes went to the device too, which its constructor
    refuses ("batch_sizes should always be on CPU"): on a GPU every packed batch failed. The meta device
    stands in for one."""
    from torch.nn.utils.rnn import PackedSequence, pack_sequence

    from worker.device.placement import map_tensors, tensors

    packed = pack_sequence([torch.ones(3, 2), torch.zeros(1, 2)], enforce_sorted=False)
    moved = map_tensors({"x": packed}, lambda t: t.to("meta"))["x"]
    assert isinstance(moved, PackedSequence)
    assert moved.data.device.type == "meta" and moved.batch_sizes.device.type == "cpu"
    assert moved.sorted_indices is not None and moved.sorted_indices.device.type == "meta"
    assert moved.batch_sizes.tolist() == packed.batch_sizes.tolist()
    assert {t.device.type for t in tensors(moved)} == {"meta", "cpu"}  # record_stream skips the CPU one
    sorted_packed = pack_sequence([torch.ones(3, 2), torch.zeros(1, 2)])  # no indices
    again = map_tensors(sorted_packed, lambda t: t.to("meta"))
    assert again.data.device.type == "meta" and again.sorted_indices is None

# ------------------------------------------------------------------------------- device errors, OOM retries
class Sticky(Fake):
    """What a CUDA device-side assert does: one bad record breaks the context, every later call fails."""

    def __init__(self, message: str = "CUDA error: device-side assert triggered\nCUDA kernel errors might be "
                 "asynchronously reported at some other API call") -> None:
        super().__init__()
        self.message = message
        self.broken = False
        self.forwards = 0

    def forward(self, batch: list[Any]) -> list[Any]:
        self.forwards += 1
        if 13 in batch:
            self.broken = True
        if self.broken:
            raise RuntimeError(self.message)
        return [x * 10 for x in batch]


def test_is_device_error_tells_device_errors_from_oom_and_input_errors() -> None:
    from worker.device.engine import is_device_error

    for text in (
        "CUDA error: device-side assert triggered",
        "CUDA error: an illegal memory access was encountered",
        "CUDA error: uncorrectable ECC error encountered",
        "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle)`",
        "cuDNN error: CUDNN_STATUS_EXECUTION_FAILED",
        "[ONNXRuntimeError] : 1 : FAIL : CUDA failure 700: an illegal memory access was encountered",
    ):
        assert is_device_error(RuntimeError(text)), text
    assert not is_device_error(RuntimeError("CUDA error: out of memory"))  # an OOM: split, not fatal
    assert not is_device_error(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_device_error(ValueError("index 7 is out of bounds"))
    accelerator = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    if accelerator is not None:
        assert is_device_error(accelerator("unspecified launch failure"))


def _broken_cuda(monkeypatch: pytest.MonkeyPatch, eng: Engine) -> Engine:
    """The engine as on a CUDA device whose context a sticky error broke: the probe's sync fails too."""
    def sync(device: Any = None) -> None:
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(torch.cuda, "synchronize", sync)
    eng.kind = "cuda"  # what the probe looks at; the handler itself does not use torch
    return eng


def test_a_sticky_device_error_raises_instead_of_dead_lettering_every_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worker.device.engine import DeviceError

    m = Sticky()
    eng = _broken_cuda(monkeypatch, Engine(m, "cpu", warmup=False))
    with pytest.raises(DeviceError, match="device-side assert.*unusable until the process restarts"):
        eng.infer([1, 13, 2, 3])
    assert m.forwards == 1 and eng.stats.poison == 0  # not bisected into single records
    with pytest.raises(DeviceError):
        eng.infer([4, 5])  # a later batch too: never an exception per record


# the thread dies: intended
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_sticky_device_error_stops_the_device_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """It used to bisect every later batch to single records and hand each an exception: every record
    dead-lettered and committed, /healthz green. Now the thread dies with DeviceError in ``error`` (the runner
    exits 1 on it without committing the batch: tests/unit/test_runner_shutdown.py)."""
    from worker.device.engine import DeviceError

    feeder = Feeder([make_batch([1, 2], offset=0), make_batch([3, 13, 4], offset=10),
                     make_batch([5, 6], offset=20)])
    eng = _broken_cuda(monkeypatch, Engine(Sticky(), "cpu", warmup=False))
    w = DeviceWorker(eng, feeder.take, feeder.done, poll_s=0.01)
    assert isinstance(_error_of(w), DeviceError) and not w.alive
    assert feeder.results[0][1] == [10, 20]
    assert 10 not in feeder.results and 20 not in feeder.results  # nothing settled, nothing dead-lettered
    assert not any(isinstance(r, BaseException) for _, res, _ in feeder.results.values() for r in res)


def test_a_cuda_error_the_device_survives_is_bisected_like_any_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-sticky CUDA error (a launch configuration one input's shape cannot use) leaves the context
    usable: a sync works, so it is the record's, not a reason to restart the worker over and over."""

    class OneShape(Fake):
        def forward(self, batch: list[Any]) -> list[Any]:
            if 13 in batch:
                raise RuntimeError("CUDA error: invalid configuration argument")
            return [x * 10 for x in batch]

    probes: list[Any] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: probes.append(device))
    eng = Engine(OneShape(), "cpu", warmup=False)
    eng.kind = "cuda"  # what the probe looks at; the handler itself does not use torch
    out = eng.infer([1, 13, 2, 3])
    assert out[0] == 10 and isinstance(out[1], RuntimeError) and out[2:] == [20, 30]
    assert probes and eng.stats.poison == 1


class Squeezed(Fake):
    """Runs out of memory for its first ``bad_calls`` forwards whatever their size (another process held
    the memory for a moment), and always for a batch holding "HUGE"."""

    def __init__(self, bad_calls: int = 0, fits: int | None = None) -> None:
        super().__init__()
        self.left = bad_calls
        self.fits = fits
        self.sizes: list[int] = []

    def forward(self, batch: list[Any]) -> list[Any]:
        self.sizes.append(len(batch))
        if self.left > 0 or "HUGE" in batch or (self.fits is not None and len(batch) > self.fits):
            self.left -= 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch


def test_a_record_that_runs_out_of_memory_for_a_moment_is_retried_not_dead_lettered() -> None:
    m = Squeezed(bad_calls=4)
    eng = Engine(m, "cpu", warmup=False)
    items = [f"r{i}" for i in range(8)]
    assert eng.infer(items) == items  # record 0 used to get the OOM at once, without one retry
    assert m.sizes[:5] == [8, 4, 2, 1, 1]
    m2 = Squeezed(bad_calls=10)
    out = Engine(m2, "cpu", warmup=False, oom_retries=2, oom_retry_backoff_s=0).infer(["a"])
    assert is_oom(out[0]) and m2.sizes == [1, 1, 1]  # bounded: the first try and 2 retries


def test_a_record_too_big_even_alone_does_not_collapse_the_lane_limit() -> None:
    """One oversized record drove its lane's limit to 1, and the lane then took ~400 batches of 64 arrivals
    (1,777 small forwards) to climb back. The OOM was the record's, not the batch size's: the limit goes
    back."""
    m = Squeezed()
    limits: list[int] = []
    eng = Engine(m, "cpu", warmup=False, max_batch_sizes={"default": 64},
                 on_limit=lambda lane, n: limits.append(n))
    batch = [f"r{i}" for i in range(64)]
    batch[40] = "HUGE"
    out = eng.infer(batch)
    assert [i for i, o in enumerate(out) if isinstance(o, BaseException)] == [40]
    assert eng.effective_max("default") is None and limits[-1] == 64
    assert len(m.sizes) < 20  # the rest of the batch did not run one record at a time either
    m.sizes.clear()
    assert eng.infer([f"x{i}" for i in range(64)]) == [f"x{i}" for i in range(64)] and m.sizes == [64]


def test_a_batch_size_oom_next_to_an_oversized_record_keeps_the_lowered_limit() -> None:
    m = Squeezed(fits=16)  # only 16 fit, and one record never does
    eng = Engine(m, "cpu", warmup=False, oom_retry_backoff_s=0, max_batch_sizes={"default": 64})
    batch = [f"r{i}" for i in range(64)]
    batch[40] = "HUGE"
    out = eng.infer(batch)
    assert [i for i, o in enumerate(out) if isinstance(o, BaseException)] == [40]
    limit = eng.effective_max("default")
    assert limit is not None and limit <= 16


class HostRace(Fake):
    """collate and split that notice being entered on two threads at once (what an HF fast tokenizer answers
    with "Already borrowed")."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = {"collate": 0, "split": 0}
        self.most = {"collate": 0, "split": 0}

    def _enter(self, what: str) -> None:
        with self.lock:
            self.inside[what] += 1
            self.most[what] = max(self.most[what], self.inside[what])
        time.sleep(0.005 if what == "collate" else 0.02)  # the finish thread lags: recovery splits meanwhile
        with self.lock:
            self.inside[what] -= 1

    def collate(self, items: Sequence[Any]) -> list[Any]:
        self._enter("collate")
        return list(items)

    def forward(self, batch: list[Any]) -> list[Any]:
        if "BAD" in batch:
            raise ValueError("poison")
        return batch

    def split(self, out: list[Any], n: int) -> list[Any]:
        self._enter("split")
        return out


def test_collate_and_split_never_run_on_two_threads_at_once() -> None:
    """Recovery re-runs collate and split on the device thread while the collate and finish threads handle
    the next batches; handlers need not be thread-safe."""
    model = HostRace()
    batches = []
    for k in range(16):
        items: list[Any] = [f"{k}-{i}" for i in range(16)]
        if k % 2 == 0:
            items[5] = "BAD"
        batches.append(make_batch(items, offset=k * 100))
    feeder = Feeder(batches)
    w = DeviceWorker(Engine(model, "cpu", warmup=False), feeder.take, feeder.done, poll_s=0.01)
    w.start()
    assert feeder.all_done.wait(60)
    w.stop(5)
    assert model.most == {"collate": 1, "split": 1}, model.most
    assert all(isinstance(feeder.results[k * 100][1][5], ValueError) for k in range(0, 16, 2))


@pytest.mark.parametrize(("kind", "name"), [("tensor", "torch.Tensor"), ("numpy", "numpy.ndarray"),
                                            ("generator", "builtins.generator")])
def test_a_split_that_returns_no_list_says_what_it_returned(kind: str, name: str) -> None:
    class Rows(Fake):
        def collate(self, items: Sequence[Any]) -> torch.Tensor:
            return torch.tensor(items, dtype=torch.float32)

        def forward(self, batch: torch.Tensor) -> torch.Tensor:
            return batch * 2

        def split(self, out: torch.Tensor, n: int) -> Any:
            return {"tensor": out, "numpy": out.numpy(), "generator": (float(x) for x in out)}[kind]

    eng = Engine(Rows(), "cpu", warmup=False)
    # It said "returned 3 outputs for a batch of 3; it must return a list".
    with pytest.raises(OutputCountError, match=rf"split\(\) returned a {name} for a batch of 3, not a list"):
        eng.infer([1.0, 2.0, 3.0])


def test_a_handler_exception_is_logged_with_its_traceback_once_per_site(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Buggy(Fake):
        def _lookup(self, x: int) -> int:
            return [1, 2][x]

        def forward(self, batch: list[Any]) -> list[Any]:
            return [self._lookup(x) for x in batch]

    eng = Engine(Buggy(), "cpu", warmup=False)
    with caplog.at_level("WARNING", logger="worker.engine"):
        out = eng.infer([0, 5, 1, 7])
        eng.infer([9])
    assert isinstance(out[1], IndexError) and isinstance(out[3], IndexError) and out[0] == 1
    assert out[1].__traceback__ is None  # the results carry no frames (they would pin device memory)
    with_tb = [r for r in caplog.records if r.exc_info]
    assert len(with_tb) == 1, [r.getMessage() for r in with_tb]  # 4 failures at one site: one traceback
    text = caplog.text
    assert "in _lookup" in text and f"{__file__}:" in with_tb[0].getMessage()
    assert "IndexError" in with_tb[0].getMessage()


def test_tensors_finds_what_map_tensors_moves() -> None:
    """record_stream (CUDA) runs on what ``tensors`` yields: it skipped dataclass batches that ``map_tensors``
    had moved, so the copy stream's allocator could reuse their memory while forward still read it."""
    import dataclasses as dc

    from worker.device.placement import map_tensors, tensors

    @dc.dataclass
    class Inputs:
        ids: torch.Tensor
        extra: dict[str, Any]

    batch = {"a": [Inputs(torch.zeros(1), {"m": torch.ones(2)})], "b": (torch.zeros(3),)}
    moved: list[torch.Tensor] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        moved.append(t)
        return t

    map_tensors(batch, fn)
    assert sorted(id(t) for t in tensors(batch)) == sorted(id(t) for t in moved) and len(moved) == 3


def test_a_recovered_batch_is_marked_so_its_time_does_not_feed_the_latency_model() -> None:
    """A batch bisected after an error took several forwards; the runner fed its wall time to the adaptive
    policy's latency model as one batch's, which then over-predicted (and expired records early)."""

    class Poisoned(Fake):
        def forward(self, batch: list[Any]) -> list[Any]:
            if -1 in batch:
                raise ValueError("poison")
            return super().forward(batch)

    feeder = Feeder([make_batch([1, 2, 3, 4], offset=0), make_batch([5, -1, 6, 7], offset=4)])
    w = DeviceWorker(Engine(Poisoned(), "cpu", warmup=False), feeder.take, feeder.done, poll_s=0.01)
    w.start()
    assert feeder.all_done.wait(30)
    assert w.stop(5)
    assert "recovered" not in feeder.results[0][2]
    _, results, timings = feeder.results[4]
    assert timings.get("recovered") == 1.0 and isinstance(results[1], ValueError)


def test_the_runner_does_not_observe_a_recovered_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.unit.fakes_kafka import Harness

    h = Harness(monkeypatch).start()
    seen: list[tuple[str, int, float]] = []
    monkeypatch.setattr(h.runner.scheduler, "observe", lambda lane, n, s: seen.append((lane, n, s)))
    with h.runner.dispatch.cv:
        h.runner.dispatch.busy_on[0] += 2
    h.runner.dispatch.done(make_batch([1, 2]), [10, 20], {"infer": 0.5, "recovered": 1.0}, worker=0)
    h.runner.dispatch.done(make_batch([1, 2]), [10, 20], {"infer": 0.01}, worker=0)
    assert seen == [("default", 2, 0.01)]


def test_off_cuda_an_error_that_reads_like_a_cuda_one_is_the_records() -> None:
    """A handler's message may quote the record ('cannot tokenize "... CUDA error: ..."'): on a CPU engine
    there is no CUDA context to lose, so it is bisected like any error, not a reason to stop the worker (which
    would then restart on the same record for ever)."""

    class Quoting(Fake):
        def forward(self, batch: list[Any]) -> list[Any]:
            if 13 in batch:
                raise ValueError("cannot tokenize 'é CUDA error: device-side assert'")
            return [x * 10 for x in batch]

    out = Engine(Quoting(), "cpu", warmup=False).infer([1, 13, 2])
    assert out[0] == 10 and isinstance(out[1], ValueError) and out[2] == 20


def test_a_prefetched_batch_over_its_lowered_limit_is_not_one_observation_of_the_latency_model() -> None:
    """A batch taken before an OOM lowered its lane's limit runs in chunks on the device thread. Its timings
    had no "recovered" mark, and "infer" ran from when it was taken (its wait behind the previous batch
    included): the runner fed 2 forwards and a wait to the adaptive policy's latency model as one clean batch
    of 4."""

    class Slow:
        name = "slow"
        uses_torch = False

        def setup(self, device: Any) -> None:
            pass

        def decode(self, x: Any) -> Any:
            return x

        def collate(self, items: Sequence[Any]) -> Any:
            return list(items)

        def forward(self, b: Any) -> Any:
            time.sleep(0.05)
            return list(b)

        def split(self, out: Any, n: int) -> list[Any]:
            return list(out)

    def batch(n: int, off: int) -> Batch:
        recs = [Record(TopicPartition("t", 0), off + i, b"", None, [], 0.0, None, 0) for i in range(n)]
        for r in recs:
            r.item = r.offset
        return Batch("default", recs, 0.0, 0.0, "count", n)

    eng = Engine(Slow(), "cpu", warmup=False, max_batch_sizes={"default": 4})
    eng.setup()
    todo = [batch(2, 0), batch(4, 10)]
    got: dict[int, dict[str, float]] = {}
    both = threading.Event()
    lock = threading.Lock()

    def take(timeout: float) -> Batch | None:
        with lock:
            if todo:
                b = todo.pop(0)
                if b.records[0].offset == 10:
                    # An OOM (of a batch of 4, recovered here) lowers the limit to 2 after this one was taken.
                    eng.recover(list(range(4)), "default", torch.cuda.OutOfMemoryError("CUDA out of memory"))
                    assert eng.effective_max("default") == 2
                return b
        time.sleep(timeout)
        return None

    def done(b: Batch, results: list[Any], timings: dict[str, float]) -> None:
        got[b.records[0].offset] = timings
        if len(got) == 2:
            both.set()

    w = DeviceWorker(eng, take, done, poll_s=0.01)
    w.start()
    assert both.wait(10)
    w.stop(2)
    assert "recovered" not in got[0]
    assert got[10]["recovered"] == 1.0 and got[10]["infer"] <= got[10]["pipeline"]
