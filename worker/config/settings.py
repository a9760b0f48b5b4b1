"""Configuration: msgspec Structs loaded from one YAML file, with environment overrides.

- Unknown keys and bad values are errors that name the key's path (``$.batching.lanes[0].max_wait_ms``)
  and what was expected; the CLI turns them into exit code 2.
- ``WORKER__SECTION__KEY=value`` overrides any key (``WORKER__KAFKA__GROUP_ID=g``;
  list items by index: ``WORKER__BATCHING__LANES__0__MAX_WAIT_MS=5``). Values are parsed as YAML, except for
  keys that take text. Under ``kafka.consumer`` / ``kafka.producer`` underscores become dots, so
  ``WORKER__KAFKA__CONSUMER__SESSION_TIMEOUT_MS=10000`` sets librdkafka's ``session.timeout.ms``, and the
  value stays text (librdkafka parses it).
- String values may reference secrets instead of holding them: ``${env:NAME}`` or ``${file:/path}``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from worker.config.env import apply_env, blame
from worker.config.env import name_overrides as _name_overrides
from worker.config.errors import ConfigError
from worker.config.redaction import SECRET_WORDS, redact, redact_config
from worker.config.secrets import resolve_secrets
from worker.config.semantics import passthrough_problems, redis_url_problem, semantic_problems
from worker.config.shape import check_shape, explain, merge, shape_problems
from worker.config.yaml_file import read_yaml
from worker.core.lane_settings import LaneSettings

PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
Fraction = Annotated[float, msgspec.Meta(gt=0, lt=1)]
# Names the worker hands to Kafka: an empty one is no name (an empty group.id fails a C assertion in
# librdkafka, an empty bootstrap list makes a client that waits forever, an empty topic fails subscribe).
Name = Annotated[str, msgspec.Meta(min_length=1)]
KafkaProps = dict[str, str | int | float | bool]


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    def __repr__(self) -> str:
        # Configs end up in tracebacks and debug output: secret-looking keys and URL credentials are masked
        # (the password of RedisConfig, sasl.password under kafka.consumer, redis://:pw@host, ...).
        fields = ", ".join(f"{f}={redact_config(getattr(self, f), f)!r}" for f in self.__struct_fields__)
        return f"{type(self).__name__}({fields})"


class KafkaConfig(_Strict):
    bootstrap_servers: Name = "127.0.0.1:9092"
    group_id: Name = "kafka-inference-worker"
    # Topics for the default lane when no lane lists its own topics.
    input_topics: list[Name] = msgspec.field(default_factory=list)
    output_topic: Name = "inference-results"
    dlq_topic: Name = "inference-dlq"
    # Any librdkafka property, passed through verbatim (SASL/SSL settings go here).
    consumer: KafkaProps = msgspec.field(default_factory=dict)
    producer: KafkaProps = msgspec.field(default_factory=dict)
    # At most 1,000,000: the runner takes a turn's records after the first with consume(n - 1), and
    # confluent-kafka's consume() raises (ValueError, exit 1 at the first record) for more than that.
    poll_max_records: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 1000
    poll_timeout_ms: PosInt = 20
    commit_interval_ms: PosInt = 1000
    # A consumer out of its group (after a lost assignment, or since it subscribed) this long is replaced by a
    # new one (worker/core/membership.py: librdkafka can stay stuck after a broker restart). None: the
    # rebalance timeout plus a session timeout (consumer max.poll.interval.ms + session.timeout.ms, 345 s
    # with librdkafka's defaults). 0: never.
    rejoin_timeout_ms: Annotated[int, msgspec.Meta(ge=0)] | None = None

    def rejoin_timeout_s(self) -> float:
        if self.rejoin_timeout_ms is not None:
            return self.rejoin_timeout_ms / 1000.0
        return (_ms_property(self.consumer, "max.poll.interval.ms", 300_000)
                + _ms_property(self.consumer, "session.timeout.ms", 45_000)) / 1000.0


def _ms_property(props: KafkaProps, key: str, default: int) -> float:
    """A librdkafka duration property as given (a number or a numeric string); the default otherwise (the
    client refuses a bad one when it is made)."""
    v = props.get(key, default)
    try:
        return max(float(v), 0.0)
    except (TypeError, ValueError):
        return float(default)


class LaneConfig(_Strict):
    name: Name
    topics: list[Name] = msgspec.field(default_factory=list)
    # Share of device time under overload relative to other lanes' weights (anti-starvation).
    weight: PosFloat = 1.0
    # Higher is served first when several lanes have work; ties go to the lane listed first.
    priority: int = 0
    max_batch_size: PosInt = 32
    max_wait_ms: NonNegFloat = 10.0
    # Default budget (ms after receipt) for records of this lane that carry no deadline_ms of their own.
    deadline_ms: PosFloat | None = None
    queue_bound: PosInt = 10_000
    # A partial batch of this lane takes the oldest records of lower-priority lanes into its free slots:
    # near-full batches under overload, at b per added record to this lane's latency.
    fill_with_lower: bool = True
    # How far a filled batch grows: to the smallest size whose records/s, by the fitted a + b*n, reach this
    # fraction of a full batch's (1 fills to max_batch_size). Lower trades throughput for priority latency.
    fill_efficiency: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.97
    # Token budget: a batch of this lane costs at most this much, a record costing the model's size_of
    # (e.g. its token count; 1 without one). The record that does not fit opens the next window; a record
    # over the budget alone runs alone. null: no budget (max_batch_size alone bounds a batch).
    max_batch_tokens: PosInt | None = None

    def settings(self) -> LaneSettings:
        """The scheduler's frozen view of this lane (``worker.core.lane_settings``)."""
        return LaneSettings.of(self)


class BatchingConfig(_Strict):
    policy: Literal["fixed", "adaptive"] = "fixed"
    lanes: list[LaneConfig] = msgspec.field(default_factory=lambda: [LaneConfig(name="default")])
    default_lane: str = "default"
    # Group records of similar size (e.g. token count) into the same batch: size // bucket_width is the
    # bucket. 0 turns bucketing off.
    bucket_width: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Backpressure: pause the partitions when this many records are in flight; resume below resume_ratio*it.
    max_in_flight: PosInt = 20_000
    resume_ratio: Fraction = 0.5
    # Per partition: records read since its oldest unfinished one, done or not. max_in_flight counts only the
    # unfinished; behind one stuck record (a batch on a hung device, a delivery being retried) the finished
    # ones pile up uncommitted: memory, and duplicates after a crash. Pause the partition at this many.
    max_uncommitted: PosInt = 50_000


class GenerationConfig(_Strict):
    """Generative handlers only (``kind = "generative"``): the limits requests are validated against and
    the continuous batch's size."""

    max_new_tokens: PosInt = 512  # the most a request may ask for
    default_max_new_tokens: PosInt = 64  # what a request that names none gets (capped at max_new_tokens)
    max_stop: Annotated[int, msgspec.Meta(ge=0)] = 4  # stop strings per request
    max_stop_chars: PosInt = 64  # characters per stop string
    max_prompt_chars: PosInt = 100_000
    max_sequences: PosInt = 32  # sequences decoded together in one step
    # Tokens the running sequences' caches may hold in all, the KV-cache bound.
    max_batch_tokens: PosInt = 16_384
    # Of max_batch_tokens, kept free for the highest-priority lane (its time to first token under overload).
    priority_headroom_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    # grow: tokens as the caches hold them, with preemption (and recompute) of the lowest lane's latest
    # sequence when they outgrow the budget; reserve: prompt + max_new_tokens held from admission.
    admission: Literal["reserve", "grow"] = "grow"


class ModelConfig(_Strict):
    # A built-in handler ("synthetic", "minilm", "identity", "tiny"), a "package.module:factory" callable,
    # or a file (worker.models.loaders.MODEL_FILE_SUFFIXES): TorchScript (.pt/.pth/.ts/.jit), torch.export
    # program (.pt2), ONNX (.onnx), or weights (.pt/.pth/.bin/.safetensors) with options.factory.
    name: str = "tiny"
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    version: str | None = None
    device: str = "auto"  # auto = cuda, then mps, then cpu
    devices: list[str] = msgspec.field(default_factory=list)  # several devices, one inference thread each
    dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    compile: bool = False
    warmup: bool = True
    # A batch on a device longer than this (a hung kernel or driver, a forward that never returns) ends the
    # worker with exit 1, so that it is restarted instead of holding its partitions forever; 0 = never.
    batch_timeout_s: NonNegFloat = 300.0
    # Host threads per process for handlers that decode a batch at once (``decode_batch``: tokenizing,
    # image decoding), next to the loop and device threads. None: the CPUs this process may use
    # (affinity, capped by a cgroup v2 cpu.max quota in a container).
    host_threads: PosInt | None = None
    # Worker processes sharing the device(s), each a full member of the consumer group
    # (worker/app/supervisor.py): for handlers whose host work holds the GIL. `worker run --processes N`
    # overrides it.
    processes: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    generation: GenerationConfig = msgspec.field(default_factory=GenerationConfig)


class DeliveryConfig(_Strict):
    mode: Literal["at_least_once", "exactly_once"] = "at_least_once"
    # Exactly-once: stable per instance (fencing a zombie with the same id). Default: <group_id>-<hostname>.
    transactional_id: str | None = None
    revoke_timeout_ms: NonNegFloat = 5000.0
    shutdown_timeout_s: NonNegFloat = 30.0
    max_input_bytes: PosInt = 1_048_576
    # A record that crashed the process this many times goes to the DLQ at its next delivery.
    max_attempts: PosInt = 3
    format: Literal["json", "msgpack"] = "json"
    # How a result carries numeric outputs (lists of floats, arrays): "lists" as they are, "float32" as
    # {dtype, shape, data} with data little-endian float32 bytes (a msgpack bin, base64 in JSON).
    outputs_encoding: Literal["lists", "float32"] = "lists"
    # At-least-once: a producer that holds results undelivered this long is replaced, and what it held is sent
    # again on the new one (librdkafka can leave a partition without a leader for good after a broker pause).
    # 0: never. Each replacement counts as one of a record's delivery attempts.
    producer_stall_s: NonNegFloat = 30.0


class RedisConfig(_Strict):
    url: str | None = None  # None: in-memory store (per process)
    password: str | None = None
    tls: bool = False
    tls_ca_file: str | None = None
    key_prefix: str = "kiw:"
    cache: bool = False
    cache_ttl_s: PosInt = 3600
    ledger: bool = False
    ledger_ttl_s: PosInt = 86_400
    attempts_ttl_s: PosInt = 86_400
    timeout_ms: PosInt = 50
    breaker_failures: PosInt = 3
    breaker_reset_s: PosFloat = 5.0


class MetricsConfig(_Strict):
    enabled: bool = True
    host: str = "0.0.0.0"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 9400
    lag_interval_s: PosFloat = 5.0


class LoggingConfig(_Strict):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    format: Literal["json", "text"] = "json"


class Config(_Strict):
    kafka: KafkaConfig = msgspec.field(default_factory=KafkaConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    batching: BatchingConfig = msgspec.field(default_factory=BatchingConfig)
    delivery: DeliveryConfig = msgspec.field(default_factory=DeliveryConfig)
    redis: RedisConfig = msgspec.field(default_factory=RedisConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)

    def lane_topics(self) -> dict[str, str]:
        """topic -> lane name."""
        out: dict[str, str] = {}
        for lane in self.batching.lanes:
            for t in lane.topics:
                out[t] = lane.name
        for t in self.kafka.input_topics:
            out.setdefault(t, self.batching.default_lane)
        return out

    def input_topics(self) -> list[str]:
        return list(self.lane_topics())


# What a client check returns: the key librdkafka refuses and why, or None.
ClientCheck = Callable[[Config, bool], tuple[str, str] | None]
__all__ = ["SECRET_WORDS", "ClientCheck", "Config", "ConfigError", "from_dict", "load", "name_overrides",
           "redact", "redact_config", "redis_url_problem", "to_dict"]


def from_dict(data: dict[str, Any] | None, environ: dict[str, str] | None = None, *,
              client_check: ClientCheck | None = None, files_elsewhere: bool = False,
              notes: list[str] | None = None) -> Config:
    """The validated config, or a ConfigError with every problem found. ``client_check``: also ask it what the
    Kafka clients the config describes would refuse (the CLI passes ``kafka.clients.config_problem``, which
    makes them offline; tests that pair the config with fake clients may use values only the fakes take).
    ``files_elsewhere``: the files client properties name (a CA...) may be mounted where the worker runs,
    not here (check-config); those not here are not checked. ``notes`` (check-config): a secret reference that
    cannot be resolved here (it may exist only in the pod) is appended to it instead of being an error; its
    key is not checked."""
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"$: expected a mapping at the top of the config, got {type(data).__name__}")
    check_shape(data, "$")
    # Start from the defaults so env overrides can address keys the file leaves out (lanes[0], ...).
    data = merge(msgspec.to_builtins(Config()), data or {})
    env = dict(os.environ) if environ is None else environ
    set_by = apply_env(Config, data, env)
    missing: dict[str, str] = {}
    data = resolve_secrets(data, "$", env, missing)
    if notes is not None:
        notes.extend(f"{m} (not checked here; `worker run` without it exits 2)" for m in missing.values())

    def known(problem: str) -> bool:  # about a key whose value is known (not an unresolved reference)
        path = problem.split(": ", 1)[0]
        return not any(path == m or path.startswith((m + ".", m + "[")) for m in missing)

    # A type error is about the key itself (or a value above it); an unknown key, like the checks across keys,
    # may be about what a variable put under it.
    exact = [p for p in shape_problems(data, Config) + passthrough_problems(data) if known(p)]
    problems = list(missing.values()) if notes is None else []
    cfg: Config | None = None
    if not exact:
        try:
            cfg = msgspec.convert(data, Config, strict=False)
        except msgspec.ValidationError as e:
            exact = [explain(str(e))]
    if cfg is not None:
        problems += [p for p in semantic_problems(cfg) if known(p)]
        if client_check is not None:
            # A property librdkafka refuses would stop `worker run` with a traceback, after the model load.
            refused = client_check(cfg, files_elsewhere)
            if refused and known(refused[0]):
                problems.append(f"{refused[0]}: {refused[1]}")
    if exact or problems:
        blamed = [blame(p, set_by, below="unknown key" in p) for p in exact]
        blamed += [blame(p, set_by, below=True) for p in problems]
        raise ConfigError(blamed, model=cfg.model if cfg is not None else _model_section(data))
    assert cfg is not None
    return cfg


def _model_section(data: dict[str, Any]) -> ModelConfig | None:
    """The model section on its own, when it is valid: check-config checks the model even where other
    sections have problems."""
    if shape_problems(data.get("model"), ModelConfig, "$.model"):
        return None
    return msgspec.convert(data.get("model") or {}, ModelConfig, strict=False)


def load(path: str | Path | None, environ: dict[str, str] | None = None, *,
         client_check: ClientCheck | None = None, files_elsewhere: bool = False,
         notes: list[str] | None = None) -> Config:
    """The config in the YAML file at ``path`` (the defaults for None), as ``from_dict`` validates it."""
    if path is None:
        return from_dict({}, environ, client_check=client_check, files_elsewhere=files_elsewhere, notes=notes)
    data = read_yaml(path)
    return from_dict(data, environ, client_check=client_check, files_elsewhere=files_elsewhere, notes=notes)


def name_overrides(msg: str, environ: dict[str, str] | None = None) -> str:
    """``msg``, an error about a key found after loading (the model and device checks:
    ``$.model.devices[1]: ...``), with the ``WORKER__*`` variables that set the key or a section above it, as
    from_dict names them."""
    return _name_overrides(Config, msg, environ)


def to_dict(cfg: Config) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)
