"""The handlers the loaders wrap a tensor model in: ``TensorModel`` (a ``torch.nn.Module``, TorchScript),
``ExportedModel`` (a torch.export program) and ``OnnxModel`` (an ONNX file on onnxruntime). Inputs are
(nested) lists of numbers, stacked into one batch tensor; one output row per record."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from worker.config.settings import ConfigError
from worker.models.base import split_rows

log = logging.getLogger("worker.models.loaders")

# The input_dtype names a tensor model takes, and the torch dtype each one means.
DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "bfloat16": "bfloat16",
          "float64": "float64", "int64": "int64", "long": "int64", "int32": "int32", "bool": "bool"}


class TensorModel:
    """Wraps a ``torch.nn.Module`` (or TorchScript / exported module): inputs nested lists -> one tensor per
    record, ``torch.stack`` for the batch, ``module(batch)``, one output row per record."""

    input_type: ClassVar[Any] = list[Any]
    output_type: ClassVar[Any] = Any

    def __init__(
        self,
        module: Any,
        *,
        name: str,
        version: str = "0",
        input_shape: Sequence[int] | None = None,
        input_dtype: str = "float32",
        example_input: Any = None,
    ) -> None:
        import torch

        if input_dtype not in DTYPES:
            raise ConfigError(f"$.model.options.input_dtype: expected one of {sorted(DTYPES)}, got "
                              f"{input_dtype!r}")
        self.module = module
        self.name = name
        self.version = version
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        self.dtype = getattr(torch, DTYPES[input_dtype])
        self.example_input = example_input

    def _place(self, device: str) -> Any:
        return self.module.to(device)

    def setup(self, device: str) -> None:
        self.module = self._place(device)
        # exported modules may refuse eval(); they have no train mode anyway
        with contextlib.suppress(NotImplementedError, RuntimeError):
            self.module.eval()

    def decode(self, inputs: Any) -> Any:
        import torch

        try:
            t = torch.tensor(inputs, dtype=self.dtype)
            if not (self.dtype.is_floating_point or self.dtype == torch.bool):
                # torch.tensor([1.7], dtype=torch.int64) is [1]: an input the model cannot take is an error
                raw = torch.tensor(inputs)
                if raw.is_floating_point() and not torch.equal(raw, raw.trunc()):
                    raise ValueError(f"input_dtype is {str(self.dtype).removeprefix('torch.')}: got "
                                     "non-integers")
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"inputs must be a (nested) list of numbers: {e}") from None
        if self.input_shape is not None and tuple(t.shape) != self.input_shape:
            raise ValueError(f"inputs must have shape {list(self.input_shape)}, got {list(t.shape)}")
        return t

    def size_of(self, item: Any) -> int:
        return int(item.shape[0]) if item.dim() else 1

    def collate(self, items: Sequence[Any]) -> Any:
        import torch

        return torch.stack(list(items))

    def forward(self, batch: Any) -> Any:
        return self.module(batch)

    def split(self, output: Any, n: int) -> list[Any]:
        return split_rows(output, n)

    def example_inputs(self) -> list[Any]:
        if self.example_input is not None:
            return [self.example_input]
        if self.input_shape is not None:
            import torch

            return [torch.zeros(self.input_shape, dtype=self.dtype).tolist()]
        return []


def _export_batch_dims(program: Any) -> set[int]:
    """The fixed (int) first dimensions of a torch.export program's user inputs; a dynamic one is a SymInt."""
    try:
        from torch.export.graph_signature import InputKind

        users = {s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
        vals = [n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder" and n.name in users]
    except Exception:  # a torch without these internals: nothing to check
        return set()
    return {v.shape[0] for v in vals if getattr(v, "shape", None) and isinstance(v.shape[0], int)}


def _fixed_batch(fixed: set[int], name: str, how: str) -> int | None:
    """A model file whose batch axis is fixed: at 1, one record per call (the engine caps every lane at it);
    at any other size it cannot run the partial batches a stream makes."""
    if not fixed:
        return None
    if fixed == {1}:
        log.warning("%s has a fixed batch size of 1: every record runs alone (export it with a dynamic batch "
                    "axis to batch: %s)", name, how)
        return 1
    raise ConfigError(f"$.model.name: {name!r} has a fixed batch axis of {sorted(fixed)}: it cannot run the "
                      f"partial batches a stream makes; export it with a dynamic batch axis ({how})")


class ExportedModel(TensorModel):
    """A ``torch.export`` program: moved with ``move_to_device_pass`` (constants included) when available."""

    def __init__(self, program: Any, **kw: Any) -> None:
        self.program = program
        super().__init__(None, **kw)
        self.max_batch = _fixed_batch(_export_batch_dims(program), kw["name"], "torch.export.export(..., "
                                      "dynamic_shapes=({0: torch.export.Dim('batch')},))")

    def _place(self, device: str) -> Any:
        program = self.program
        try:
            from torch.export.passes import move_to_device_pass

            program = move_to_device_pass(program, device)
            return program.module()
        except ImportError:  # older torch
            return program.module().to(device)


class OnnxModel:
    """An ONNX file run by onnxruntime (CUDA provider on ``cuda`` devices when installed). Inputs: nested
    lists for a single-input graph, else ``{input_name: nested list}``; outputs: the row of the single
    output, else ``{output_name: row}``.

    An input with a symbolic axis besides the batch one (a sequence length) takes records of different
    shapes, which cannot be stacked into one array: a batch runs as one ``session.run`` per distinct shape
    and the rows go back in input order (``size_of`` is the first such axis' length, so
    ``batching.bucket_width`` can group equal lengths into the same batch)."""

    input_type: ClassVar[Any] = Any
    output_type: ClassVar[Any] = Any
    uses_torch: ClassVar[bool] = False

    _NP = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
           "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(bool)": "bool",
           "tensor(uint8)": "uint8",
           "tensor(int8)": "int8"}

    def __init__(self, path: Path, *, name: str, version: str, example_input: Any = None) -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise ConfigError(
                f"$.model.name: {str(path)!r} is an ONNX model and needs onnxruntime: "
                "pip install 'kafka-inference-worker[onnx]'"
            ) from None
        import numpy as np

        self._ort = ort
        self._np = np
        self.path = path
        self.name = name
        self.version = version
        self.example_input = example_input
        # Read the signature now (on CPU) so decode works before setup and errors surface at load.
        try:
            probe = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception as e:
            raise ConfigError(f"$.model.name: {str(path)!r} is not a loadable ONNX model: {e}") from None
        unknown = [(i.name, i.type) for i in probe.get_inputs() if i.type not in self._NP]
        if unknown:
            raise ConfigError(f"$.model.name: {path.name!r} input {unknown[0][0]!r} has type "
                              f"{unknown[0][1]}, which the ONNX loader does not map (it takes "
                              f"{', '.join(sorted(self._NP))}); wrap it in a handler (a "
                              "'package.module:callable' factory)")
        self.inputs = [(i.name, self._NP[i.type], i.shape) for i in probe.get_inputs()]
        # (input index, axis of its record) of the first axis not fixed by the graph, if any.
        self._ragged = next(((k, d) for k, (_, _, shape) in enumerate(self.inputs)
                             for d, dim in enumerate(shape[1:] if shape else []) if not isinstance(dim, int)),
                            None)
        self.outputs = [o.name for o in probe.get_outputs()]
        # A fixed batch axis: torch.onnx.export's default without dynamic_axes.
        self.max_batch = _fixed_batch(
            {i.shape[0] for i in probe.get_inputs() if i.shape and isinstance(i.shape[0], int)},
            path.name,
            "torch.onnx.export(..., dynamic_axes={'<input>': {0: 'batch'}})",
        )
        self.session: Any = probe

    def setup(self, device: str) -> None:
        ort = self._ort
        providers = ["CPUExecutionProvider"]
        if device.startswith("cuda"):
            if "CUDAExecutionProvider" in ort.get_available_providers():
                idx = int(device.split(":")[1]) if ":" in device else 0
                providers = [("CUDAExecutionProvider", {"device_id": idx}), "CPUExecutionProvider"]  # type: ignore[list-item]
            else:
                log.warning("onnxruntime has no CUDAExecutionProvider (install "
                            "onnxruntime-gpu); running %s on CPU",
                            self.path.name)
        opts = ort.SessionOptions()
        try:
            import torch

            opts.intra_op_num_threads = torch.get_num_threads()  # the engine's thread budget
        except ImportError:
            pass
        self.session = ort.InferenceSession(str(self.path), sess_options=opts, providers=providers)

    def decode(self, inputs: Any) -> dict[str, Any]:
        np = self._np
        if len(self.inputs) == 1:
            name, dt, _ = self.inputs[0]
            inputs = {name: inputs}
        elif not isinstance(inputs, dict):
            raise ValueError(f"inputs must be an object with keys {[n for n, _, _ in self.inputs]}")
        out = {}
        for name, dt, shape in self.inputs:
            if name not in inputs:
                raise ValueError(f"inputs lacks {name!r}")
            try:
                a = np.asarray(inputs[name], dtype=dt)
                if a.dtype.kind in "iu":
                    # np.asarray([1.7], dtype=int64) is [1]: an input the model cannot take is an error, as in
                    # TensorModel (out-of-range values already raise OverflowError, NaN ValueError).
                    raw = np.asarray(inputs[name])
                    if raw.dtype.kind == "f" and not np.array_equal(raw, np.trunc(raw)):
                        raise ValueError(f"the input's type is {dt}: got non-integers")
            except (TypeError, ValueError, OverflowError) as e:
                raise ValueError(f"inputs[{name!r}] must be a (nested) list of numbers: {e}") from None
            want = shape[1:] if shape else []
            if len(want) != a.ndim or any(isinstance(w, int) and w != g for w, g in zip(want, a.shape,
                                                                                        strict=False)):
                raise ValueError(f"inputs[{name!r}] must have shape {want}, got {list(a.shape)}")
            out[name] = a
        return out

    def size_of(self, item: dict[str, Any]) -> int:
        if self._ragged is None:
            return 1
        k, d = self._ragged
        return int(item[self.inputs[k][0]].shape[d])

    def collate(self, items: Sequence[dict[str, Any]]) -> list[tuple[list[int] | None, dict[str, Any]]]:
        """``[(positions, feeds)]``: one group per distinct input shape (positions None: every item, in
        order)."""
        np = self._np
        names = [name for name, _, _ in self.inputs]
        groups: dict[tuple[Any, ...], list[int]] = {}
        if self._ragged is not None:
            for i, it in enumerate(items):
                groups.setdefault(tuple(it[name].shape for name in names), []).append(i)
        if len(groups) <= 1:
            return [(None, {name: np.stack([it[name] for it in items]) for name in names})]
        return [
            (pos, {name: np.stack([items[i][name] for i in pos]) for name in names})
            for pos in groups.values()
        ]

    def forward(self, batch: list[tuple[list[int] | None,
                                        dict[str, Any]]]) -> list[tuple[list[int] | None, Any]]:
        return [(pos, self.session.run(None, feeds)) for pos, feeds in batch]

    def _rows(self, output: list[Any], n: int) -> list[Any]:
        if len(self.outputs) == 1:
            return split_rows(output[0], n)
        return split_rows(dict(zip(self.outputs, output, strict=True)), n)

    def split(self, output: list[tuple[list[int] | None, Any]], n: int) -> list[Any]:
        if len(output) == 1 and output[0][0] is None:
            return self._rows(output[0][1], n)  # one stack: the engine checks the count
        rows: list[Any] = [None] * n
        for pos, part in output:
            pos = pos or []
            got = self._rows(part, len(pos))
            if len(got) != len(pos):
                from worker.device.engine import OutputCountError

                # As for one stack (the engine's check): a model bug, not the records' (no bisecting).
                raise OutputCountError(f"{self.path.name}: {len(got)} output rows for a group of {len(pos)} "
                                       "inputs of one shape; every output needs a batch axis")
            for i, row in zip(pos, got, strict=True):
                rows[i] = row
        return rows

    def example_inputs(self) -> list[Any]:
        if self.example_input is not None:
            return [self.example_input]
        ex: dict[str, Any] = {}
        for name, dt, shape in self.inputs:
            dims = shape[1:] if shape else []
            if not all(isinstance(d, int) for d in dims):
                return []  # symbolic non-batch dims: no way to guess a valid input
            ex[name] = self._np.zeros(dims, dtype=dt).tolist()
        return [ex[self.inputs[0][0]]] if len(self.inputs) == 1 else [ex]
