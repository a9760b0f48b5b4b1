"""``synthetic``: an accelerator stand-in whose batch costs ``a_ms + b_ms * n``.

``forward`` sleeps (``time.sleep`` releases the GIL, as a GPU kernel wait does), so pipelines, batching
policies and lanes can be measured and tested without a GPU. Outputs echo the inputs. ``host_ms`` adds host
work per record to ``collate``: CPU time burnt in Python with the GIL held, as a tokenizer or feature
extraction in the handler would. The worker collates batch n+1 while batch n is on the device; a serial
batcher pays both.

Test hooks (options): ``fail_on`` - a record whose inputs contain this string makes ``forward`` raise
ValueError (a poison record); ``oom_above`` - a batch larger than this raises a simulated CUDA
out-of-memory error; ``crash_on`` - a record containing this string kills the process (exit 137) in
``forward``, as a segfaulting kernel would.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, NamedTuple

import msgspec

from worker.models.base import Options, parse_options
from worker.models.inputs import SyntheticInput

# Milliseconds, finite (an hour at most): inf or NaN passed the check and failed every forward (time.sleep).
Millis = Annotated[float, msgspec.Meta(ge=0, le=3_600_000)]


class SyntheticOptions(Options):
    a_ms: Millis = 2.0
    b_ms: Millis = 0.1
    host_ms: Millis = 0.0
    fail_on: str | None = None
    oom_above: Annotated[int, msgspec.Meta(ge=0)] | None = None  # 0: not even one record fits
    crash_on: str | None = None


class Item(NamedTuple):
    inputs: Any
    poison: bool = False
    crash: bool = False


def simulated_oom(n: int, limit: int) -> BaseException:
    msg = f"CUDA out of memory (simulated): batch of {n} > oom_above={limit}"
    try:
        import torch

        return torch.cuda.OutOfMemoryError(msg)
    except Exception:  # torch missing or the type not constructible
        return RuntimeError(msg)


def burn_cpu(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU time in the interpreter (GIL held, but for the interpreter's
    regular switches). CPU time, not wall time: a thread that waits for the GIL does no work meanwhile."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class SyntheticModel:
    name: ClassVar[str] = "synthetic"
    input_type: ClassVar[Any] = SyntheticInput
    output_type: ClassVar[Any] = Any
    uses_torch: ClassVar[bool] = False

    def __init__(self, **options: Any) -> None:
        self.opts = parse_options(options, SyntheticOptions, self.name)
        self.version = f"a{self.opts.a_ms:g}-b{self.opts.b_ms:g}" + (
            f"-h{self.opts.host_ms:g}" if self.opts.host_ms else ""
        )
        self.calls = 0  # forward calls, for tests
        self.sizes: list[int] = []  # batch size of every forward call, for tests

    def setup(self, device: str) -> None:
        pass

    def decode(self, inputs: Any) -> Item:
        o = self.opts
        if o.fail_on is None and o.crash_on is None:
            return Item(inputs)
        text = inputs if isinstance(inputs, str) else msgspec.json.encode(inputs).decode()
        return Item(
            inputs,
            poison=o.fail_on is not None and o.fail_on in text,
            crash=o.crash_on is not None and o.crash_on in text,
        )

    def collate(self, items: Sequence[Item]) -> list[Item]:
        if self.opts.host_ms:
            burn_cpu(self.opts.host_ms * len(items) / 1000.0)
        return list(items)

    def forward(self, batch: list[Item]) -> list[Any]:
        n = len(batch)
        self.calls += 1
        self.sizes.append(n)
        if any(it.crash for it in batch):
            os._exit(137)
        if self.opts.oom_above is not None and n > self.opts.oom_above:
            raise simulated_oom(n, self.opts.oom_above)
        if any(it.poison for it in batch):
            raise ValueError(f"synthetic poison record (inputs contain {self.opts.fail_on!r})")
        time.sleep((self.opts.a_ms + self.opts.b_ms * n) / 1000.0)
        return [it.inputs for it in batch]

    def split(self, output: list[Any], n: int) -> list[Any]:
        return output

    def example_inputs(self) -> list[Any]:
        return [{"x": float(i)} for i in range(4)]
