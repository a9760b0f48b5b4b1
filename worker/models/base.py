"""Helpers shared by the handlers: option parsing with config-path errors, per-row output splitting, and
per-row packing for binary outputs (``float32_rows``)."""

from __future__ import annotations

import ctypes
import re
import sys
from array import array
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from schemas import Float32Tensor
from worker.config.settings import ConfigError

S = TypeVar("S")


def parse_options(options: Mapping[str, Any], spec: type[S], model: str) -> S:
    """Validate ``model.options`` against a strict Struct; errors name ``$.model.options.<key>``."""
    try:
        return msgspec.convert(dict(options), spec, strict=False)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = re.match(r"Object contains unknown field `([^`]+)`", msg)
        if m:
            allowed = ", ".join(spec.__struct_fields__) or "none"  # type: ignore[attr-defined]
            raise ConfigError(
                f"$.model.options.{m.group(1)}: unknown option for model {model!r} (allowed: {allowed})"
            ) from None
        m = re.match(r"(.*) - at `\$(.*)`$", msg)
        if m:
            raise ConfigError(f"$.model.options{m.group(2)}: {m.group(1)}") from None
        raise ConfigError(f"$.model.options: {msg}") from None


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of the built-ins' option structs."""


def split_rows(output: Any, n: int) -> list[Any]:
    """One JSON-able value per row of a (CPU) batch output.

    - a tensor/ndarray: its rows;
    - a dict, or a tuple, of such parts: output heads, each split into rows (a row is a dict, or a list with
      one value per head);
    - a list: one output per record already (``list(x)``, ``unbind``, a torchvision-style list of dicts), so
      it must hold exactly ``n`` items; each is made JSON-able as it is. A list is never taken for heads: read
      as heads, a list of per-record outputs hands record 0 the first value of every record's output.

    Every part must have exactly ``n`` rows: a part with another count (a per-batch value next to per-row
    ones) would otherwise be cut or padded into the wrong records' results. A list of another length is
    refused with ``OutputCountError`` (heads returned as a list are told to use a tuple)."""
    if isinstance(output, list) and len(output) != n:
        from worker.device.engine import OutputCountError

        # Not a record's fault (no bisecting): the model returns something split_rows cannot read.
        raise OutputCountError(
            f"split_rows: the output is a list of {len(output)} for a batch of {n}; a list is read as one "
            "output per record: return a tuple (or a dict) for several output heads, or write split()"
        )
    return _split_rows(output, n)  # (any other wrong count at the top is the engine's OutputCountError)


def _split_rows(output: Any, n: int, where: str = "output") -> list[Any]:
    if isinstance(output, Mapping):
        cols = {k: _rows_of(v, n, f"{where}[{k!r}]") for k, v in output.items()}
        return [{k: c[i] for k, c in cols.items()} for i in range(n)]
    if isinstance(output, list):
        return [_jsonable(v) for v in output]  # one item per record (the caller checks the count)
    if (
        isinstance(output, tuple)
        and output
        and all(hasattr(v, "tolist") or isinstance(v, Mapping | list) for v in output)
    ):
        parts = [_rows_of(v, n, f"{where}[{i}]") for i, v in enumerate(output)]
        return [[p[i] for p in parts] for i in range(n)]
    tolist = getattr(output, "tolist", None)
    if tolist is not None:
        rows = tolist()
        return rows if isinstance(rows, list) else [rows]
    return list(output)


def _jsonable(value: Any) -> Any:
    """One record's output as JSON-able values: tensors/arrays as (nested) lists, containers walked."""
    tolist = getattr(value, "tolist", None)
    if tolist is not None:
        return tolist()
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def _rows_of(part: Any, n: int, where: str) -> list[Any]:
    rows = _split_rows(part, n, where)
    if len(rows) != n:
        raise ValueError(f"split_rows: {where} has {len(rows)} rows for a batch of {n}; every part of a "
                         "batch output needs one row per record (write split() for per-batch values)")
    return rows


def float32_rows(output: Any, n: int) -> list[Float32Tensor]:
    """One ``Float32Tensor`` per row of a CPU tensor (or numpy array) of ``n`` rows, packed straight from its
    bytes: the same result ``delivery.outputs_encoding: float32`` makes of the row's list of floats, without
    the Python floats. A handler's ``split_float32`` (used in place of ``split`` under that encoding) returns
    this for an output that is one float tensor of ``n`` rows."""
    shape_of = getattr(output, "shape", None)
    if shape_of is None or len(shape_of) < 1 or int(shape_of[0]) != n:
        raise ValueError(f"float32_rows: an output of shape {list(shape_of or [])} for a batch of {n}; it "
                         "needs one row per record")
    shape = [int(d) for d in shape_of[1:]]
    if hasattr(output, "data_ptr"):  # a torch tensor: its bytes without numpy (not a worker dependency)
        import torch

        t = output.detach().to(torch.float32).contiguous()
        data = ctypes.string_at(t.data_ptr(), t.numel() * 4)
        if sys.byteorder == "big":
            swapped = array("f", data)
            swapped.byteswap()
            data = swapped.tobytes()
    else:
        data = output.astype("<f4").tobytes(order="C")
    step = len(data) // n if n else 0
    return [Float32Tensor(shape=shape, data=data[i * step:(i + 1) * step]) for i in range(n)]
