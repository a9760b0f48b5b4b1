"""User models: a ``package.module:factory`` callable, TorchScript (.pt/.ts), torch.export (.pt2), ONNX
(.onnx), or a state dict (``torch.load(weights_only=True)`` / safetensors) loaded into a factory's module.

Only files named in the config are loaded, never anything from a request, and nothing is unpickled
beyond plain tensors (``weights_only=True``).

A factory may return a full handler (an object with ``setup/decode/collate/forward/split``) or a
``torch.nn.Module``, which is wrapped in ``TensorModel``: inputs are (nested) lists of numbers, stacked
into one tensor; each output row goes back as a (nested) list.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import logging
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from worker.config import ConfigError
from worker.models.base import split_rows

log = logging.getLogger(__name__)

TORCHSCRIPT_SUFFIXES = (".pt", ".ts", ".pth", ".jit")
EXPORT_SUFFIXES = (".pt2",)
ONNX_SUFFIXES = (".onnx",)
STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
MODEL_FILE_SUFFIXES = tuple(sorted(set(TORCHSCRIPT_SUFFIXES + EXPORT_SUFFIXES + ONNX_SUFFIXES + STATE_DICT_SUFFIXES)))
HANDLER_METHODS = ("setup", "decode", "collate", "forward", "split")
# Options the loader consumes; every other option is passed to the factory as a keyword argument.
RESERVED_OPTIONS = ("state_dict", "factory", "input_shape", "input_dtype", "example_input")

_DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "bfloat16": "bfloat16",
           "float64": "float64", "int64": "int64", "long": "int64", "int32": "int32", "bool": "bool"}


def file_version(path: Path) -> str:
    """Content hash (first 12 hex of sha256): goes in results and in the cache key."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:12]


def is_handler(obj: Any) -> bool:
    return all(callable(getattr(obj, m, None)) for m in HANDLER_METHODS)


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

        if input_dtype not in _DTYPES:
            raise ConfigError(f"$.model.options.input_dtype: expected one of {sorted(_DTYPES)}, got {input_dtype!r}")
        self.module = module
        self.name = name
        self.version = version
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        self.dtype = getattr(torch, _DTYPES[input_dtype])
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
                    raise ValueError(f"input_dtype is {str(self.dtype).removeprefix('torch.')}: got non-integers")
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
           "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(bool)": "bool", "tensor(uint8)": "uint8",
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
            raise ConfigError(f"$.model.name: {path.name!r} input {unknown[0][0]!r} has type {unknown[0][1]}, which "
                              f"the ONNX loader does not map (it takes {', '.join(sorted(self._NP))}); wrap it "
                              "in a handler (a 'package.module:callable' factory)")
        self.inputs = [(i.name, self._NP[i.type], i.shape) for i in probe.get_inputs()]
        # (input index, axis of its record) of the first axis not fixed by the graph, if any.
        self._ragged = next(((k, d) for k, (_, _, shape) in enumerate(self.inputs)
                             for d, dim in enumerate(shape[1:] if shape else []) if not isinstance(dim, int)), None)
        self.outputs = [o.name for o in probe.get_outputs()]
        # A fixed batch axis: torch.onnx.export's default without dynamic_axes.
        self.max_batch = _fixed_batch({i.shape[0] for i in probe.get_inputs() if i.shape and isinstance(i.shape[0], int)},
                                      path.name, "torch.onnx.export(..., dynamic_axes={'<input>': {0: 'batch'}})")
        self.session: Any = probe

    def setup(self, device: str) -> None:
        ort = self._ort
        providers = ["CPUExecutionProvider"]
        if device.startswith("cuda"):
            if "CUDAExecutionProvider" in ort.get_available_providers():
                idx = int(device.split(":")[1]) if ":" in device else 0
                providers = [("CUDAExecutionProvider", {"device_id": idx}), "CPUExecutionProvider"]  # type: ignore[list-item]
            else:
                log.warning("onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu); running %s on CPU",
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
            if len(want) != a.ndim or any(isinstance(w, int) and w != g for w, g in zip(want, a.shape, strict=False)):
                raise ValueError(f"inputs[{name!r}] must have shape {want}, got {list(a.shape)}")
            out[name] = a
        return out

    def size_of(self, item: dict[str, Any]) -> int:
        if self._ragged is None:
            return 1
        k, d = self._ragged
        return int(item[self.inputs[k][0]].shape[d])

    def collate(self, items: Sequence[dict[str, Any]]) -> list[tuple[list[int] | None, dict[str, Any]]]:
        """``[(positions, feeds)]``: one group per distinct input shape (positions None: every item, in order)."""
        np = self._np
        names = [name for name, _, _ in self.inputs]
        groups: dict[tuple[Any, ...], list[int]] = {}
        if self._ragged is not None:
            for i, it in enumerate(items):
                groups.setdefault(tuple(it[name].shape for name in names), []).append(i)
        if len(groups) <= 1:
            return [(None, {name: np.stack([it[name] for it in items]) for name in names})]
        return [(pos, {name: np.stack([items[i][name] for i in pos]) for name in names}) for pos in groups.values()]

    def forward(self, batch: list[tuple[list[int] | None, dict[str, Any]]]) -> list[tuple[list[int] | None, Any]]:
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
                from worker.adapters.torch_engine import OutputCountError

                # As for one stack (the engine's check): a model bug, not the records' (no bisecting).
                raise OutputCountError(f"{self.path.name}: {len(got)} output rows for a group of {len(pos)} inputs "
                                       "of one shape; every output needs a batch axis")
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


def _import_module(mod_name: str) -> Any:
    """The module, or a ConfigError naming $.model.name. A module that is not found is looked for once more with
    the working folder on sys.path: a model module next to the config is a common layout, and the console script
    does not put the working folder there. A module that is there but broken (a syntax error, an exception at
    import) is the user's code: named with the key that points at it, not a traceback through importlib."""
    while True:
        try:
            return importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            cwd = os.getcwd()
            if e.name != mod_name.split(".")[0] or cwd in sys.path:
                raise ConfigError(f"$.model.name: cannot import {mod_name!r}: {e}") from None
            sys.path.append(cwd)
        except Exception as e:
            raise ConfigError(f"$.model.name: importing {mod_name!r} failed: {type(e).__name__}: {e}") from None


def import_callable(spec: str) -> Callable[..., Any]:
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise ConfigError(f"$.model.name: expected 'package.module:callable', got {spec!r}")
    mod = _import_module(mod_name)
    obj: Any = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"$.model.name: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"$.model.name: {spec!r} is not callable")
    return obj


def _load_state_dict(path: Path, key: str = "$.model.options.state_dict") -> dict[str, Any]:
    """The tensors of a weights file. A file that is not one (a pickled whole module, a corrupt file) is a
    ConfigError naming ``key``, not a raw unpickling or safetensors error."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        import torch

        sd = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(f"{key}: {str(path)!r} is not a loadable state dict ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); save the module's state_dict(), not the "
                          "module itself") from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]  # the common {"state_dict": ..., "epoch": ...} checkpoint layout
    if not isinstance(sd, dict):
        raise ConfigError(f"$.model.options.state_dict: {str(path)!r} does not hold a state dict")
    return sd


def _tensor_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {k: options[k] for k in ("input_shape", "input_dtype", "example_input") if k in options}
    if "input_shape" in kw and not (
        isinstance(kw["input_shape"], list) and all(isinstance(d, int) and d > 0 for d in kw["input_shape"])
    ):
        raise ConfigError(f"$.model.options.input_shape: expected a list of positive ints, got {kw['input_shape']!r}")
    return kw


def _complete(model: Any, name: str, version: str) -> Any:
    for attr, default in (("name", name), ("version", version), ("input_type", Any), ("output_type", Any)):
        if getattr(model, attr, None) is None:
            try:
                setattr(model, attr, default)
            except AttributeError:
                raise ConfigError(f"$.model.name: the handler {name!r} has no {attr!r} and it cannot be set") from None
    return model


def from_factory(spec: str, options: dict[str, Any], state_dict: Path | None = None,
                 key: str = "$.model.name") -> Any:
    """``key``: the config path naming the factory, for the error when calling it fails."""
    factory = import_callable(spec)
    kwargs = {k: v for k, v in options.items() if k not in RESERVED_OPTIONS}
    sd_opt = options.get("state_dict")
    if state_dict is None and sd_opt is not None:
        state_dict = existing_file(str(sd_opt), "$.model.options.state_dict")
    # Options the factory cannot take, told by its signature: a TypeError raised inside its body (a bug, a
    # bad value) is not the options' fault, and was reported as if it were.
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f"$.model.options: factory {spec!r} rejected options {sorted(kwargs)}: {e}") from None
    except ValueError:
        pass  # no signature to read (some C callables): the call itself tells
    try:
        obj = factory(**kwargs)
    except ConfigError:
        raise
    except Exception as e:
        # A ConfigError naming the key (exit 2 at start), not a traceback out of load_model; the traceback is
        # logged, since the cause is somewhere in the user's code.
        log.error("model factory %r raised", spec, exc_info=True)
        raise ConfigError(f"{key}: factory {spec!r} raised {type(e).__name__}: {e}") from e
    import torch

    name = spec.rsplit(":", 1)[1]
    if isinstance(obj, torch.nn.Module):
        version = "0"
        if state_dict is not None:
            key = "$.model.options.state_dict" if sd_opt is not None else "$.model.name"
            try:
                obj.load_state_dict(_load_state_dict(state_dict, key))
            except RuntimeError as e:
                raise ConfigError(f"$.model.options.state_dict: does not fit {spec!r}: {e}") from None
            version = file_version(state_dict)
        return TensorModel(obj, name=name, version=version, **_tensor_kwargs(options))
    if state_dict is not None:
        raise ConfigError(f"$.model.options.state_dict: {spec!r} returned a handler, not a torch.nn.Module")
    if not is_handler(obj):
        raise ConfigError(
            f"$.model.name: {spec!r} returned {type(obj).__name__}; expected a torch.nn.Module or a handler "
            f"with methods {', '.join(HANDLER_METHODS)}"
        )
    return _complete(obj, name, "0")


def existing_file(path: str, key: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{key}: file {path!r} not found")
    return p


def check_file(path_str: str, options: dict[str, Any]) -> Path:
    """What can be told about a model file without loading it (``worker check-config`` and ``from_file``):
    it exists, its suffix fits the options (a weights-only file needs ``factory``), no unknown option."""
    path = existing_file(path_str, "$.model.name")
    suffix = path.suffix.lower()
    if "factory" in options:  # a weights file for the factory's module
        if suffix not in STATE_DICT_SUFFIXES:
            raise ConfigError(f"$.model.name: a state dict file must end with {', '.join(STATE_DICT_SUFFIXES)}")
        import_callable(str(options["factory"]))
        return path
    if suffix in STATE_DICT_SUFFIXES and suffix not in TORCHSCRIPT_SUFFIXES:
        raise ConfigError(f"$.model.name: {path.name!r} holds weights only; set options.factory to the "
                          "'package.module:callable' that builds the module they fit")
    if suffix not in ONNX_SUFFIXES:
        extra = set(options) - set(RESERVED_OPTIONS)
        if extra:
            raise ConfigError(f"$.model.options.{sorted(extra)[0]}: unknown option for a model file")
        _tensor_kwargs(options)
    return path


def from_file(path_str: str, options: dict[str, Any]) -> Any:
    path = check_file(path_str, options)
    suffix = path.suffix.lower()
    if "factory" in options:
        return from_factory(str(options["factory"]), options, state_dict=path, key="$.model.options.factory")
    version = file_version(path)
    if suffix in ONNX_SUFFIXES:
        return OnnxModel(path, name=path.name, version=version, example_input=options.get("example_input"))
    import torch

    kw = _tensor_kwargs(options)
    if suffix in EXPORT_SUFFIXES:
        try:
            program = torch.export.load(str(path))
        except Exception as e:
            raise ConfigError(f"$.model.name: {str(path)!r} is not a torch.export program: {e}") from None
        return ExportedModel(program, name=path.name, version=version, **kw)
    if suffix in TORCHSCRIPT_SUFFIXES:
        try:
            with warnings.catch_warnings():  # TorchScript is deprecated upstream but still what many ship
                warnings.simplefilter("ignore", FutureWarning)
                module = torch.jit.load(str(path), map_location="cpu")
        except Exception as e:
            raise ConfigError(
                f"$.model.name: {str(path)!r} is not a TorchScript file ({e.__class__.__name__}); for a state dict "
                "set options.factory to the 'package.module:callable' that builds the module"
            ) from None
        return TensorModel(module, name=path.name, version=version, **kw)
    raise ConfigError(f"$.model.name: unsupported model file {path.name!r}; expected one of {', '.join(MODEL_FILE_SUFFIXES)}")
