"""``load_model(cfg)``: the handler named by ``$.model.name`` (a built-in, a factory, or a model file)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker.config.settings import ConfigError, ModelConfig
from worker.core.ports import Model
from worker.models import inputs

# name -> "module:class"; imported lazily so the schema export and a worker running one model do not
# import torch/transformers for the others.
BUILTINS: dict[str, str] = {
    "causal-lm": "worker.models.causal_lm:CausalLM",
    "identity": "worker.models.identity:IdentityModel",
    "minilm": "worker.models.minilm:MiniLMModel",
    "synthetic": "worker.models.synthetic:SyntheticModel",
    "synthetic-lm": "worker.models.synthetic_lm:SyntheticLMHandler",
    "tiny": "worker.models.tiny:TinyModel",
    "tiny-lm": "worker.models.tiny_lm:TinyLM",
}


def builtin_input_types() -> dict[str, Any]:
    """Built-in name -> its ``inputs`` type (``Request[T]``'s T), for
    ``schemas/models/*.request.schema.json``."""
    return {
        "causal-lm": inputs.GenerateInput,
        "identity": inputs.IdentityInput,
        "minilm": inputs.TextInput,
        "synthetic": inputs.SyntheticInput,
        "synthetic-lm": inputs.GenerateInput,
        "tiny": inputs.TinyInput,
        "tiny-lm": inputs.GenerateInput,
    }


def _builtin(name: str) -> Callable[..., Any]:
    mod, _, cls = BUILTINS[name].partition(":")
    return getattr(importlib.import_module(mod), cls)


def expected() -> str:
    from worker.models.loaders import MODEL_FILE_SUFFIXES

    return (
        f"expected a built-in ({', '.join(sorted(BUILTINS))}), a 'package.module:callable' factory, "
        f"or a model file ({', '.join(MODEL_FILE_SUFFIXES)})"
    )


def _kind(name: str) -> str:
    """How ``$.model.name`` resolves: "builtin", "file" or "factory" (ConfigError otherwise)."""
    from worker.models import loaders

    if not name:
        raise ConfigError(f"$.model.name: empty; {expected()}")
    if name in BUILTINS:
        return "builtin"
    if Path(name).suffix.lower() in loaders.MODEL_FILE_SUFFIXES:
        return "file"
    if ":" in name and "/" not in name:
        return "factory"
    raise ConfigError(f"$.model.name: unknown model {name!r}; {expected()}")


def load_model(cfg: ModelConfig) -> Model:
    """Build (not set up) the handler; ``Engine.setup`` moves it to its device. Raises ConfigError (a
    ValueError) naming ``$.model.*`` for unknown names, missing files and bad options."""
    from worker.models import loaders

    name = cfg.name.strip()
    options = dict(cfg.options)
    model: Any
    kind = _kind(name)
    if kind == "builtin":
        model = _builtin(name)(**options)
    elif kind == "file":
        model = loaders.from_file(name, options)
    else:
        model = loaders.from_factory(name, options)
    if getattr(model, "kind", None) == "generative":
        from worker.models.generative import GenerativeModel

        model = GenerativeModel(model, cfg.generation)  # intake's view: input type, request limits
    if cfg.version:
        try:
            model.version = cfg.version
        except AttributeError:
            raise ConfigError("$.model.version: the handler's version cannot be overridden") from None
    return model


def check_model(cfg: ModelConfig) -> str:
    """What ``check-config`` can tell without loading weights or touching a device: the name resolves, a
    built-in accepts its options (built-ins load their weights in ``setup``), a model file exists, a factory
    imports. Returns how the name resolved, for the report. Raises ConfigError like ``load_model``."""
    from worker.models import loaders

    name = cfg.name.strip()
    kind = _kind(name)
    if kind == "builtin":
        _builtin(name)(**dict(cfg.options))
        return "built-in"
    if kind == "file":
        loaders.check_file(name, dict(cfg.options))
        return "model file, found; loaded at start"
    loaders.import_callable(name)
    return "factory, importable; called at start"
