"""``worker check-config``: every problem ``worker run`` would stop at, found without loading weights.

Besides what loading the config checks (``worker.config.settings``), the model: the name resolves; a built-in
takes its options; a model file exists and fits its options; a factory imports, takes the options given (read
from its signature: ``out_feature`` where it takes ``out_features`` is refused with the name it takes), and,
when the factory is a class that is no ``torch.nn.Module``, the class is a handler: its five stages
(``setup``, ``decode``, ``collate``, ``forward``, ``split``) are there, and the attributes it declares
(``name``, ``version``, ``input_type``, ``size_of``...) are what the worker uses them as. A function factory
is not called (it may load weights): what it returns is checked when ``worker run`` starts.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any

from worker.config.settings import Config, ConfigError, ModelConfig, load
from worker.config.shape import did_you_mean

_UNKNOWN_OPTION = re.compile(r"^(\$\.model\.options\.(\S+)): unknown option.*\(allowed: ([^)]*)\)$")


@dataclass
class Report:
    """What check-config prints: the config when it is valid, every problem (sorted by path), the notes."""

    cfg: Config | None = None
    model_kind: str = ""
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def check(path: str) -> Report:
    """The config at ``path`` checked as ``worker run`` would check it, without connecting to anything,
    loading weights or needing the pod's secrets and files (those not here are notes)."""
    report = Report()
    model: ModelConfig | None
    try:
        from worker.kafka.clients import config_problem

        report.cfg = load(path, client_check=config_problem, files_elsewhere=True, notes=report.notes)
        model = report.cfg.model
    except ConfigError as e:
        report.problems += e.problems
        model = e.model
    if model is not None:
        kind, problems = model_problems(model)
        report.model_kind = kind
        report.problems += problems
    if report.problems:
        report.problems = ConfigError(report.problems).problems  # one order: by path
        report.cfg = None
    return report


def model_problems(cfg: ModelConfig) -> tuple[str, list[str]]:
    """How ``$.model.name`` resolves (for the report) and every problem with the model section."""
    from worker.models import loaders, registry

    name = cfg.name.strip()
    options = dict(cfg.options)
    try:
        if registry._kind(name) != "factory":  # a built-in or a file: the registry's checks
            return registry.check_model(cfg), []
        factory = loaders.import_callable(name)
    except ConfigError as e:
        return "", [_suggest(p) for p in e.problems]
    problems = _option_problems(name, factory, options)
    if inspect.isclass(factory) and not _is_module_class(factory):
        problems += _handler_problems(name, factory)
    if options.get("state_dict") is not None:
        try:
            loaders.existing_file(str(options["state_dict"]), "$.model.options.state_dict")
        except ConfigError as e:
            problems += e.problems
    return "factory, importable; called at start", problems


def _suggest(problem: str) -> str:
    """A built-in's unknown option with the allowed one closest to it."""
    m = _UNKNOWN_OPTION.match(problem)
    if m is None:
        return problem
    path, given, allowed = m.groups()
    return problem + did_you_mean(given, [a.strip() for a in allowed.split(",")])


def _option_problems(spec: str, factory: Any, options: dict[str, Any]) -> list[str]:
    """The options a factory would refuse when ``worker run`` calls it with them, each named by its key."""
    from worker.models import loaders

    problems = []
    for key, value in options.items():
        if key == "input_shape" and not (isinstance(value, list) and value
                                         and all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                                                 for d in value)):
            problems.append(f"$.model.options.input_shape: expected a list of positive ints, got {value!r}")
        if key == "input_dtype" and value not in loaders.DTYPES:
            problems.append(f"$.model.options.input_dtype: expected one of {sorted(loaders.DTYPES)}, "
                            f"got {value!r}")
    kwargs = {k: v for k, v in options.items() if k not in loaders.RESERVED_OPTIONS}
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return problems  # no signature to read (some C callables): the call at start tells
    params = sig.parameters.values()
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    by_keyword = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not takes_any:
        for key in kwargs:
            if key not in by_keyword:
                known = [*by_keyword, *loaders.RESERVED_OPTIONS]
                problems.append(f"$.model.options.{key}: factory {spec!r} takes no option {key!r} (it takes: "
                                f"{', '.join(by_keyword) or 'none'}){did_you_mean(key, known)}")
    for p in params:
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                               p.KEYWORD_ONLY) and p.name not in kwargs:
            problems.append(f"$.model.options.{p.name}: required by factory {spec!r}, not given")
        elif p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            problems.append(f"$.model.name: factory {spec!r} needs the positional argument {p.name!r}, which "
                            "options cannot give")
    return problems


def _is_module_class(cls: type) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return issubclass(cls, torch.nn.Module)


def _handler_problems(spec: str, cls: type) -> list[str]:
    """What the worker would find wrong with instances of ``cls`` as a handler, told by the class itself."""
    from worker.models import loaders

    missing = [m for m in loaders.HANDLER_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        what = "none of the handler stages" if len(missing) == len(loaders.HANDLER_METHODS) else (
            f"no {', '.join(missing)} method")
        return [f"$.model.name: {spec!r} is a class with {what}: a handler defines "
                f"{', '.join(loaders.HANDLER_METHODS)} (or make the class a torch.nn.Module)"]
    problems = []
    for attr in ("name", "version"):
        value = inspect.getattr_static(cls, attr, None)
        if value is not None and not isinstance(value, str | property):
            problems.append(f"$.model.name: {spec!r}.{attr} is {type(value).__name__} {value!r}; it goes in "
                            "every result as text: make it a str")
    if callable(getattr(cls, "size_of", None)) is False and getattr(cls, "size_of", None) is not None:
        problems.append(f"$.model.name: {spec!r}.size_of is not a method (it gives a "
                        "record's size for bucketing)")
    input_type = inspect.getattr_static(cls, "input_type", None)
    if input_type is not None and not isinstance(input_type, property):
        import msgspec

        from schemas import Request

        try:
            msgspec.json.Decoder(Request[input_type])  # type: ignore[valid-type]
        except (TypeError, ValueError) as e:
            problems.append(f"$.model.name: {spec!r}.input_type {input_type!r} cannot validate requests: {e} "
                            "(use a msgspec Struct or a type msgspec supports)")
    return problems
