"""User models: a ``package.module:factory`` callable, TorchScript (.pt/.ts), torch.export (.pt2), ONNX
(.onnx), or a state dict (``torch.load(weights_only=True)`` / safetensors) loaded into a factory's module.

Only files named in the config are loaded, never anything from a request, and nothing is unpickled
beyond plain tensors (``weights_only=True``).

A factory may return a full handler (an object with ``setup/decode/collate/forward/split``) or a
``torch.nn.Module``, which is wrapped in ``TensorModel``: inputs are (nested) lists of numbers, stacked
into one tensor; each output row goes back as a (nested) list.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker.config.settings import ConfigError
from worker.models.tensor_models import DTYPES, ExportedModel, OnnxModel, TensorModel

__all__ = ["DTYPES", "ExportedModel", "OnnxModel", "TensorModel", "from_factory", "from_file",
           "import_callable"]

log = logging.getLogger(__name__)

TORCHSCRIPT_SUFFIXES = (".pt", ".ts", ".pth", ".jit")
EXPORT_SUFFIXES = (".pt2",)
ONNX_SUFFIXES = (".onnx",)
STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
MODEL_FILE_SUFFIXES = tuple(
    sorted(set(TORCHSCRIPT_SUFFIXES + EXPORT_SUFFIXES + ONNX_SUFFIXES + STATE_DICT_SUFFIXES))
)
HANDLER_METHODS = ("setup", "decode", "collate", "forward", "split")
# Options the loader consumes; every other option is passed to the factory as a keyword argument.
RESERVED_OPTIONS = ("state_dict", "factory", "input_shape", "input_dtype", "example_input")

def file_version(path: Path) -> str:
    """Content hash (first 12 hex of sha256): goes in results and in the cache key."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:12]


def is_handler(obj: Any) -> bool:
    return all(callable(getattr(obj, m, None)) for m in HANDLER_METHODS)


def _import_module(mod_name: str) -> Any:
    """The module, or a ConfigError naming $.model.name. A module that is not found is looked for once more
    with the working folder on sys.path: a model module next to the config is a common layout, and the console
    script does not put the working folder there. A module that is there but broken (a syntax error, an
    exception at import) is the user's code: named with the key that points at it, not a traceback through
    importlib."""
    while True:
        try:
            return importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            cwd = os.getcwd()
            if e.name != mod_name.split(".")[0] or cwd in sys.path:
                raise ConfigError(f"$.model.name: cannot import {mod_name!r}: {e}") from None
            sys.path.append(cwd)
        except Exception as e:
            raise ConfigError(
                f"$.model.name: importing {mod_name!r} failed: {type(e).__name__}: {e}"
            ) from None


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
                          f"{str(e).splitlines()[0] if str(e) else ''}); save the module's state_dict(), not "
                          "the module itself") from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]  # the common {"state_dict": ..., "epoch": ...} checkpoint layout
    if not isinstance(sd, dict):
        raise ConfigError(f"$.model.options.state_dict: {str(path)!r} does not hold a state dict")
    return sd


def _tensor_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {k: options[k] for k in ("input_shape", "input_dtype",
                                                  "example_input") if k in options}
    if "input_shape" in kw and not (
        isinstance(kw["input_shape"], list) and all(isinstance(d, int) and d > 0 for d in kw["input_shape"])
    ):
        raise ConfigError("$.model.options.input_shape: expected a list of positive ints, got "
                          f"{kw['input_shape']!r}")
    return kw


def _complete(model: Any, name: str, version: str) -> Any:
    for attr, default in (("name", name), ("version", version), ("input_type", Any), ("output_type", Any)):
        if getattr(model, attr, None) is None:
            try:
                setattr(model, attr, default)
            except AttributeError:
                raise ConfigError(
                    f"$.model.name: the handler {name!r} has no {attr!r} and it cannot be set"
                ) from None
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
        raise ConfigError(
            f"$.model.options: factory {spec!r} rejected options {sorted(kwargs)}: {e}"
        ) from None
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
            raise ConfigError("$.model.name: a state dict file must end with "
                              f"{', '.join(STATE_DICT_SUFFIXES)}")
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
                f"$.model.name: {str(path)!r} is not a TorchScript file ({e.__class__.__name__}); for a "
                "state dict set options.factory to the 'package.module:callable' that builds the module"
            ) from None
        return TensorModel(module, name=path.name, version=version, **kw)
    raise ConfigError(f"$.model.name: unsupported model file {path.name!r}; expected one of "
                      f"{', '.join(MODEL_FILE_SUFFIXES)}")
