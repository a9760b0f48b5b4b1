"""``synthetic-lm``: a generative stand-in whose decode step costs ``a_ms + b_ms * active`` milliseconds.

``step`` sleeps (``time.sleep`` releases the GIL, as a GPU kernel wait does), so the iteration-level
scheduler, lanes and deadlines can be measured and tested without a GPU or weights. Tokens are bytes
(id = byte + 3; 0 pad, 1 bos, 2 eos): ``encode`` / ``decode`` round-trip any UTF-8 text. The generated
tokens are lowercase letters and spaces, a function of the sequence's seed and position only, so a record's
output is the same on every run and every worker.

Options: ``a_ms``, ``b_ms`` (the step cost), ``prefill_ms_per_token`` (added per prompt token of a
sequence's first step), ``max_context`` (prompt + generated tokens), ``eos_after`` (a sequence emits EOS
after ``seed % eos_after + 1`` tokens; 0: never, generation runs to ``max_new_tokens``), ``fail_on`` (a
prompt containing this string makes every step that includes it raise ValueError: a poison request).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

import msgspec

from worker.core.step_model import GenParams
from worker.models.base import Options, parse_options
from worker.models.synthetic import Millis

EOS_ID = 2
OFFSET = 3  # ids 0..2 are specials
_ALPHABET = b"abcdefghijklmnopqrstuvwxyz     "


class SyntheticLMOptions(Options):
    a_ms: Millis = 5.0
    b_ms: Millis = 0.2
    prefill_ms_per_token: Millis = 0.0
    max_context: Annotated[int, msgspec.Meta(ge=2, le=1_000_000)] = 4096
    eos_after: Annotated[int, msgspec.Meta(ge=0)] = 0
    fail_on: str | None = None


class _Seq:
    __slots__ = ("seed", "n", "prefill", "poison")

    def __init__(self, seed: int, prefill: int, poison: bool) -> None:
        self.seed = seed
        self.n = 0
        self.prefill = prefill
        self.poison = poison


class SyntheticLM:
    """The StepModel (``worker.core.step_model``)."""

    def __init__(self, opts: SyntheticLMOptions) -> None:
        self.opts = opts
        self._seqs: dict[int, _Seq] = {}
        self.steps: list[int] = []  # active sequences of every step, for tests and the bench

    @property
    def eos_token_id(self) -> int | None:
        return EOS_ID

    @property
    def max_context(self) -> int:
        return self.opts.max_context

    def encode(self, text: str) -> list[int]:
        return [b + OFFSET for b in text.encode()]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i - OFFSET for i in ids if OFFSET <= i < OFFSET + 256).decode("utf-8", "replace")

    def start(self, seq_id: int, prompt_ids: Sequence[int], params: GenParams) -> None:
        seed = params.seed if params.seed is not None else seq_id
        poison = False
        if self.opts.fail_on is not None:
            poison = self.opts.fail_on in self.decode(prompt_ids)
        self._seqs[seq_id] = _Seq(seed, len(prompt_ids), poison)

    def step(self, seq_ids: Sequence[int]) -> list[int]:
        o = self.opts
        seqs = [self._seqs[i] for i in seq_ids]
        self.steps.append(len(seqs))
        prefill = sum(s.prefill for s in seqs if s.n == 0)
        time.sleep((o.a_ms + o.b_ms * len(seqs) + o.prefill_ms_per_token * prefill) / 1000.0)
        if any(s.poison for s in seqs):
            raise ValueError(f"synthetic-lm poison request (prompt contains {o.fail_on!r})")
        out = []
        for s in seqs:
            if o.eos_after and s.n >= s.seed % o.eos_after + 1:
                out.append(EOS_ID)
            else:
                out.append(_ALPHABET[(s.seed * 7919 + s.n * 13 + s.n * s.n) % len(_ALPHABET)] + OFFSET)
            s.n += 1
        return out

    def release(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    @property
    def active(self) -> int:
        return len(self._seqs)


class SyntheticLMHandler:
    """The ``GenerativeHandler`` (``worker.core.step_model``) for ``synthetic-lm``."""

    kind: ClassVar[str] = "generative"
    name: ClassVar[str] = "synthetic-lm"

    def __init__(self, **options: Any) -> None:
        self.opts = parse_options(options, SyntheticLMOptions, self.name)
        self.version = f"a{self.opts.a_ms:g}-b{self.opts.b_ms:g}"
        self._model: SyntheticLM | None = None

    def setup(self, device: str) -> None:
        self._model = SyntheticLM(self.opts)

    def step_model(self) -> SyntheticLM:
        if self._model is None:
            raise RuntimeError("synthetic-lm: setup(device) first")
        return self._model

