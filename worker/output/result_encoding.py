"""A finished record's result, as the bytes of its message on the output topic.

One ``ResultEncoder`` per worker holds what every result of the worker shares (model name and version, wire
format, outputs encoding) and reuses one msgspec encoder. ``encode_ok`` encodes the ok results of a whole
batch: the batch's shared values are read once, each record costs one ``Result`` struct, and in JSON the
batch's results are written by one encoder call.

With ``delivery.outputs_encoding: float32`` a numeric output (a list of floats, nested lists of floats of
one shape, or an array with ``astype``/``tobytes``, e.g. numpy's) is sent as ``{"dtype": "float32",
"shape": [...], "data": <bytes>}``: little-endian float32, row-major, a msgpack bin (base64 in JSON). Any
other output (a dict of labels, a string, a number, a list of ints, bools or mixed values) is sent as it is.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any, Literal

import msgspec
from msgspec import Raw

from schemas import Float32Tensor, Result, Source, Timings
from worker.core.records import Record

# What a result's encoder may raise for an output it cannot write: an unsupported type (a tensor, a numpy
# scalar), an int beyond 64 bits (msgpack), nesting deeper than the encoder's recursion limit.
UNENCODABLE = (TypeError, ValueError, OverflowError, RecursionError, msgspec.EncodeError)

OutputsEncoding = Literal["lists", "float32"]

_BIG_ENDIAN = sys.byteorder == "big"


def _shape(rows: list[Any]) -> list[int]:
    """The shape nested lists have if they are regular: the lengths down their first elements."""
    shape: list[int] = []
    x: Any = rows
    while type(x) is list:
        shape.append(len(x))
        if not x:
            break
        x = x[0]
    return shape


def _fill(rows: list[Any], shape: list[int], depth: int, flat: list[float]) -> bool:
    """Appends the floats of ``rows`` to ``flat`` in row-major order; False unless ``rows`` is nested lists
    of exactly ``shape[depth:]`` with floats as leaves."""
    if len(rows) != shape[depth]:
        return False
    if depth == len(shape) - 1:
        if not all(type(x) is float for x in rows):
            return False
        flat.extend(rows)
        return True
    return all(type(r) is list and _fill(r, shape, depth + 1, flat) for r in rows)


def pack_float32(output: Any) -> Any:
    """``output`` as a ``Float32Tensor`` when it is numeric (see the module docstring), else unchanged."""
    if type(output) is list:
        if not output:
            return output
        first = output[0]
        if type(first) is float:
            if not all(type(x) is float for x in output):
                return output
            data = array("f", output)
            shape = [len(output)]
        elif type(first) is list:
            shape = _shape(output)
            flat: list[float] = []
            if not _fill(output, shape, 0, flat):
                return output
            data = array("f", flat)
        else:
            return output
        if _BIG_ENDIAN:
            data.byteswap()
        return Float32Tensor(shape=shape, data=data.tobytes())
    shape_of, astype = getattr(output, "shape", None), getattr(output, "astype", None)
    if shape_of is not None and astype is not None and hasattr(output, "tobytes"):
        try:
            return Float32Tensor(shape=[int(d) for d in shape_of], data=astype("<f4").tobytes())
        except (TypeError, ValueError):
            return output  # an array of strings or objects
    return output


class ResultEncoder:
    """Result bytes for one model on one output topic (``delivery.format``, ``delivery.outputs_encoding``)."""

    def __init__(self, model_name: str, model_version: str | None, fmt: str,
                 outputs_encoding: OutputsEncoding = "lists") -> None:
        self.model_name = model_name
        self.model_version = model_version
        json_encoder = msgspec.json.Encoder() if fmt == "json" else None
        self._encoder = json_encoder or msgspec.msgpack.Encoder()
        # JSON only: one call encodes a list as newline-separated values
        self._encode_lines = json_encoder.encode_lines if json_encoder is not None else None
        self.encode_value = self._encoder.encode
        self.pack = pack_float32 if outputs_encoding == "float32" else None

    def encode(self, rec: Record, status: str, output: Any, error: str | None, batch_size: int,
               queue_s: float, infer_s: float, now: float, now_wall_ms: float, cached: bool = False) -> bytes:
        """One result. Milliseconds keep 3 decimals, truncated (int() is several times cheaper than
        round())."""
        produced = rec.produced_at_ms
        tp = rec.tp
        if self.pack is not None and output is not None:
            output = self.pack(output)
        return self.encode_value(Result(
            id=rec.id or "",
            status=status,  # type: ignore[arg-type]
            outputs=output,
            error=error,
            model=self.model_name,
            model_version=self.model_version,
            lane=rec.lane,
            batch_size=batch_size,
            source=Source(topic=tp.topic, partition=tp.partition, offset=rec.offset),
            timings=Timings(queue_ms=int(queue_s * 1_000_000) / 1000.0,
                            inference_ms=int(infer_s * 1_000_000) / 1000.0,
                            total_ms=int((now - rec.received_at) * 1_000_000) / 1000.0,
                            e2e_ms=int((now_wall_ms - produced) * 1000) / 1000.0 if produced else None),
            meta=rec.meta,
            cached=cached,
        ))

    def encode_ok(self, records: list[Record], outputs: list[Any], batch_size: int, closed_at: float,
                  infer_s: float, now: float, now_wall_ms: float) -> list[bytes | None]:
        """The ok result of each record of a batch, byte for byte what ``encode`` writes; None where the
        encoder rejects the output (the caller sends that record an error instead).

        The loop is ``encode`` inlined: a call frame per record is a good part of the cost in CPython. The
        records of one poll batch share their receive time, and a backlog's records their Kafka timestamp
        to the millisecond: a record with the same two as the one before shares its encoded ``Timings``."""
        pack = self.pack
        name, version = self.model_name, self.model_version
        inference_ms = int(infer_s * 1_000_000) / 1000.0
        results: list[Result] = []
        put = results.append
        unpackable: list[int] = []  # indexes of outputs pack_float32 raised on: rejected like the encoder's
        last_received: float | None = None
        last_produced: int | None = None
        # Timings shared by several records are encoded once (a Raw, which the encoder writes as it is):
        # their floats are a good part of a result's encoding.
        timings: Timings | Raw = Timings()
        shared = False
        encode = self.encode_value
        for rec, out in zip(records, outputs, strict=True):
            tp = rec.tp
            produced = rec.produced_at_ms
            received = rec.received_at
            if received != last_received or produced != last_produced:
                last_received, last_produced = received, produced
                timings = Timings(queue_ms=int((closed_at - received) * 1_000_000) / 1000.0,
                                  inference_ms=inference_ms,
                                  total_ms=int((now - received) * 1_000_000) / 1000.0,
                                  e2e_ms=(int((now_wall_ms - produced) * 1000) / 1000.0 if produced
                                          else None))
                shared = False
            elif not shared:
                timings = Raw(encode(timings))
                shared = True
            if pack is not None and out is not None:
                try:
                    out = pack(out)
                except UNENCODABLE:
                    unpackable.append(len(results))
                    out = None
            put(Result(id=rec.id or "", status="ok", outputs=out, model=name, model_version=version,
                       lane=rec.lane, batch_size=batch_size,
                       source=Source(topic=tp.topic, partition=tp.partition, offset=rec.offset),
                       timings=timings, meta=rec.meta))  # type: ignore[arg-type]
        values = self._encode_all(results)
        for i in unpackable:
            values[i] = None
        return values

    def _encode_all(self, results: list[Result]) -> list[bytes | None]:
        """Each result's bytes; None for one the encoder rejects. JSON: one ``encode_lines`` call for the
        batch, split at its newlines (JSON escapes a newline inside a string, so each line is one result);
        a batch the encoder rejects, or whose lines are not one per result, is encoded one result at a
        time. MessagePack: one ``encode_into`` a reused buffer per result (``encode`` grows a fresh buffer
        for each, about twice the cost)."""
        if self._encode_lines is not None:
            try:
                lines = self._encode_lines(results).split(b"\n")
            except UNENCODABLE:
                pass
            else:
                lines.pop()  # after the last newline
                if len(lines) == len(results):  # else an output held a newline of its own (a msgspec.Raw)
                    return lines  # type: ignore[return-value]
        buf = bytearray(512)
        into = self._encoder.encode_into
        values: list[bytes | None] = []
        put = values.append
        for r in results:
            try:
                into(r, buf)
                put(bytes(buf))
            except UNENCODABLE:
                put(None)
        return values
