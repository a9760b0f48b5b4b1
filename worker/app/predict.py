"""``worker predict``: requests through the configured model without Kafka, one result per line.

Each request takes the path a consumed record takes in ``worker run``: the intake's size check, decoding and
validation into ``Request[model.input_type]``, lane routing and deadline, the model's ``decode``; the engine's
``collate``/``forward``/``split`` in batches of the lane's ``max_batch_size`` (with its failure policy: a
batch that fails is bisected down to the record that fails it); the emitter's result encoding, with its
handling of outputs that cannot be encoded and results over ``message.max.bytes``. The emitter sends to a
collector instead of a producer: the result it would put on the output topic is the line printed.

Requests and results are JSON whatever ``delivery.format`` says. A result's ``source`` is the topic the
request is taken to come from (``--topic``, by default the first input topic of the default lane; the topic
picks the lane), partition
0, and the request's index in the input as its offset.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import msgspec

from worker.config.settings import Config
from worker.core.records import Outcome, Record, TopicPartition
from worker.core.step_scheduler import Expired

log = logging.getLogger("worker.predict")

CHUNK = 1024  # requests admitted, run and printed at a time: output flows while a long file is processed
BAD_LINES_SHOWN = 20
DEFAULT_TOPIC = "predict"  # the source topic of a config that lists no input topic
_json_syntax = msgspec.json.Decoder()


class InputError(ValueError):
    """The input cannot be read as requests (exit 2): the file is missing, or a line is not JSON at all."""


@dataclass(frozen=True, slots=True)
class Request:
    where: str  # "--input", or "requests.jsonl line 3": what error messages call it
    value: bytes


def read_requests(text: str | None, file: str | None, stdin: IO[bytes] | None = None) -> list[Request]:
    """The requests of ``--input`` (one JSON document) or ``--file`` (JSON lines; ``-`` reads stdin; blank
    lines are skipped). A line that is not JSON is an InputError naming its line number, each such line in
    one message: in ``worker run`` it would get no result at all, only a dead letter."""
    if text is not None:
        reqs = [Request("--input", text.encode())]
    else:
        assert file is not None
        try:
            data = (stdin or sys.stdin.buffer).read() if file == "-" else Path(file).read_bytes()
        except OSError as e:
            raise InputError(f"cannot read requests file {file!r}: {e.strerror}") from None
        name = "stdin" if file == "-" else file
        data = data.removeprefix(b"\xef\xbb\xbf")  # a BOM is no part of the first request
        reqs = [
            Request(f"{name} line {n}", line) for n, line in enumerate(data.split(b"\n"), 1) if line.strip()
        ]
        if not reqs:
            raise InputError(f"{name}: no requests (expected one JSON request per line)")
    bad = []
    for r in reqs:
        try:
            _json_syntax.decode(r.value)
        except (msgspec.DecodeError, RecursionError) as e:
            bad.append(f"{r.where}: not JSON: {e}")
    if bad:
        more = f"\n... and {len(bad) - BAD_LINES_SHOWN} more" if len(bad) > BAD_LINES_SHOWN else ""
        raise InputError("\n".join(bad[:BAD_LINES_SHOWN]) + more)
    return reqs


class Collector:
    """What the emitter sends to in place of a producer: keeps each message; every message is delivered at
    once (nothing is ever outstanding, so the emitter confirms what it sent at its next flush)."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes | None]] = []

    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None, partition: int = -1,
                on_delivery: Any = None, headers: Any = None) -> None:
        self.messages.append((topic, value))

    def poll(self, timeout: float = 0.0) -> int:
        return 0

    def flush(self, timeout: float = 0.0) -> int:
        return 0

    def __len__(self) -> int:
        return 0


class Predictor:
    """The configured model behind the intake and in front of the emitter, as ``worker run`` builds them."""

    def __init__(self, cfg: Config, device: str) -> None:
        from worker.device.engine import Engine
        from worker.models.registry import load_model
        from worker.output.emit import Emitter
        from worker.pipeline.intake import Intake

        self.cfg = cfg
        self.model = load_model(cfg.model)
        self.lanes = {lane.name: lane for lane in cfg.batching.lanes}
        self.generation: Any = None
        if getattr(self.model, "kind", None) == "generative":
            from worker.pipeline.generation import GenerationEngine, lane_rules

            # Sequences join and leave one continuous batch, as in ``worker run``.
            self.generation = GenerationEngine(self.model, device, lane_rules(cfg.batching.lanes))  # type: ignore[arg-type]
            self.generation.setup()
        self.engine = None if self.generation is not None else Engine(self.model, device,
                                                                      dtype=cfg.model.dtype,
                                                                      compile=cfg.model.compile,
                             warmup=cfg.model.warmup,
                             max_batch_sizes={n: ln.max_batch_size for n, ln in self.lanes.items()})
        if self.engine is not None:
            self.engine.setup()
        self.intake = Intake(cfg, self.model)
        self.sink = Collector()
        self.emitter = Emitter(self.sink, cfg.kafka.output_topic, cfg.kafka.dlq_topic,
                               getattr(self.model, "name", "model"),
                               cfg.model.version or getattr(self.model, "version", None), "json",
                               on_done=lambda _r: None, on_failed=lambda _r, _e: None,
                               max_message_bytes=int(cfg.kafka.producer.get("message.max.bytes", 1_000_000)),
                               outputs_encoding=cfg.delivery.outputs_encoding)

    def run(self, requests: Sequence[Request], topic: str,
            first_offset: int = 0) -> list[tuple[Outcome, bytes]]:
        """One (final outcome, result JSON) per request, in order."""
        outcomes: list[Outcome | None] = [None] * len(requests)
        by_lane: dict[str, list[int]] = {}
        records = []
        for i, req in enumerate(requests):
            now = time.monotonic()
            rec = Record(TopicPartition(topic, 0), first_offset + i, req.value, received_at=now)
            records.append(rec)
            rejected = self.intake.admit(rec, now)
            if rejected is not None:
                outcomes[i] = rejected
            else:
                by_lane.setdefault(rec.lane, []).append(i)
        for lane, idx in by_lane.items():
            size = self.lanes[lane].max_batch_size
            for start in range(0, len(idx), size):
                part = idx[start:start + size]
                closed = time.monotonic()
                if self.generation is not None:
                    outs = self.generation.generate([records[i] for i in part])
                else:
                    assert self.engine is not None
                    outs = self.engine.infer([records[i].item for i in part], lane)
                infer_s = time.monotonic() - closed
                for i, out in zip(part, outs, strict=True):
                    rec = records[i]
                    timings = {"queue": closed - rec.received_at, "infer": infer_s}
                    if isinstance(out, Expired):
                        outcomes[i] = Outcome(rec, "expired", output=out.output, error=out.error,
                                              dlq_stage="expired", batch_size=len(part), timings=timings)
                    elif isinstance(out, BaseException):
                        outcomes[i] = Outcome(rec, "error", error=f"{type(out).__name__}: {out}",
                                              dlq_stage="inference", batch_size=len(part), timings=timings)
                    else:
                        outcomes[i] = Outcome(rec, "ok", output=out, batch_size=len(part), timings=timings)
        return [self._emit(o) for o in outcomes if o is not None]

    def _emit(self, o: Outcome) -> tuple[Outcome, bytes]:
        """The outcome as the emitter sends it, and its result as it would be on the output topic. A request
        whose id could not be read gets no result in ``worker run`` (its dead letter says why); here it gets
        the result it would have had, with an empty id, so that each request has its line."""
        self.sink.messages.clear()
        wall_ms = time.time() * 1000.0
        now = time.monotonic()
        final = self.emitter.emit(o, now, wall_ms)
        self.emitter.flush(0)
        value = next((v for t, v in self.sink.messages if t == self.cfg.kafka.output_topic and v is not None),
                     None)
        if value is None:
            value = self.emitter.result_bytes(final, now, wall_ms)
        return final, value


def default_topic(cfg: Config) -> str:
    """The first input topic of the default lane, else the first input topic (the config has one)."""
    lanes = cfg.lane_topics()
    return next((t for t, lane in lanes.items() if lane == cfg.batching.default_lane),
                next(iter(lanes), DEFAULT_TOPIC))


def predict(cfg: Config, requests: Sequence[Request], *, device: str, topic: str | None = None,
            out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """Prints one result per request on ``out``, and a line on ``err`` for each that is not ok. Returns 0
    when every result is ok, 1 otherwise."""
    out = out or sys.stdout
    err = err or sys.stderr
    topic = topic or default_topic(cfg)
    predictor = Predictor(cfg, device)
    failed = 0
    for start in range(0, len(requests), CHUNK):
        chunk = requests[start:start + CHUNK]
        for req, (o, value) in zip(chunk, predictor.run(chunk, topic, start), strict=True):
            out.write(value.decode() + "\n")
            if o.status != "ok":
                failed += 1
                stage = f" ({o.dlq_stage})" if o.dlq_stage else ""
                err.write(f"{req.where}: {o.status}{stage}: {o.error}\n")
        out.flush()
    if predictor.generation is not None:
        predictor.generation.close()
    if failed:
        err.write(f"{failed} of {len(requests)} request(s) failed\n")
    return 1 if failed else 0
