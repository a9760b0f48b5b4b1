"""Configuration: msgspec Structs loaded from one YAML file, with environment overrides.

- Unknown keys and bad values are errors that name the key's path (``$.batching.lanes[0].max_wait_ms``)
  and what was expected; the CLI turns them into exit code 2.
- ``WORKER__SECTION__KEY=value`` overrides any key (``WORKER__KAFKA__GROUP_ID=g``;
  list items by index: ``WORKER__BATCHING__LANES__0__MAX_WAIT_MS=5``). Values are parsed as YAML, except for
  keys that take text. Under ``kafka.consumer`` / ``kafka.producer`` underscores become dots, so
  ``WORKER__KAFKA__CONSUMER__SESSION_TIMEOUT_MS=10000`` sets librdkafka's ``session.timeout.ms``, and the value
  stays text (librdkafka parses it).
- String values may reference secrets instead of holding them: ``${env:NAME}`` or ``${file:/path}``.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

from worker.config_shape import shape_problems
from worker.core.lane_settings import LaneSettings
from worker.logs import is_secret_key
from worker.logs import redact as redact_log

PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
Fraction = Annotated[float, msgspec.Meta(gt=0, lt=1)]
# Names the worker hands to Kafka: an empty one is no name (an empty group.id fails a C assertion in librdkafka,
# an empty bootstrap list makes a client that waits forever, an empty topic fails subscribe).
Name = Annotated[str, msgspec.Meta(min_length=1)]
KafkaProps = dict[str, str | int | float | bool]


class ConfigError(ValueError):
    """Configuration problems: one message per line, sorted by the key path each starts with, naming what was
    expected. ``problems`` holds the messages; ``model`` the model section, when it validated (check-config
    checks the model even where other sections are wrong)."""

    def __init__(self, problems: str | list[str], model: ModelConfig | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else sorted(dict.fromkeys(problems), key=_path_key)
        self.model = model
        super().__init__("\n".join(self.problems))


def _path_key(problem: str) -> tuple[str, str]:
    """Sorts ``$.a.b[2]: ...`` messages by path: list indexes in numeric order."""
    path = problem.split(": ", 1)[0]
    return re.sub(r"\[(\d+)\]", lambda m: f"[{int(m.group(1)):09d}]", path), problem


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
    # A partial batch of this lane takes the oldest records of lower-priority lanes into its free slots
    # (up to max_batch_size): full batches under overload, at b per added record to this lane's latency.
    fill_with_lower: bool = False

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
    # Tokens reserved by the running sequences (prompt + max_new_tokens each), the KV-cache bound.
    max_batch_tokens: PosInt = 16_384
    # Of max_batch_tokens, kept free for the highest-priority lane (its time to first token under overload).
    priority_headroom_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    # reserve: prompt + max_new_tokens held from admission; grow: tokens as the caches hold them, with
    # preemption (and recompute) of the lowest lane's latest sequence when they outgrow the budget.
    admission: Literal["reserve", "grow"] = "reserve"


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


_SECRET_REF = re.compile(r"\$\{(env|file):([^}]+)\}")
_PASSTHROUGH = {("kafka", "consumer"), ("kafka", "producer")}
# Matched by logs.is_secret_key ("-" and "." read as "_"); fewer sasl keys than the log redactor masks:
# sasl.mechanisms and sasl.username stay visible.
SECRET_WORDS = ("password", "passwd", "secret", "token", "sasl_jaas", "sasl_oauthbearer_config", "key_pem",
                "private", "credential", "api_key", "apikey", "authorization")
# librdkafka reads a boolean property as true from "true", "t" or "1" (any case); only these read as false.
_FALSE = ("false", "f", "0")
# Properties the worker sets per client from its own keys. Given in the pass-through, one would override some
# clients' value and not others' (or be overridden itself) without a word.
_OWNED = {
    ("consumer", "group.id"): (
        "set kafka.group_id instead: each client's group is derived from it (worker run ignored this one, while "
        "backfill's snapshot read the live group's commits with it)"),
    ("producer", "transactional.id"): (
        "set delivery.transactional_id (with delivery.mode: exactly_once) instead: a transactional producer "
        "refuses every record sent outside a transaction, which at_least_once does (exactly_once ignored it)"),
}


def _resolve_secrets(value: Any, path: str, environ: dict[str, str], missing: dict[str, str]) -> Any:
    """``value`` with its ``${env:...}`` / ``${file:...}`` references replaced. One that cannot be resolved is
    left as written, and ``missing`` gets its path and the reason."""
    if isinstance(value, dict):
        return {k: _resolve_secrets(v, f"{path}.{k}", environ, missing) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve_secrets(v, f"{path}[{i}]", environ, missing) for i, v in enumerate(value)]
    if isinstance(value, str) and "${" in value:
        def sub(m: re.Match[str]) -> str:
            kind, ref = m.group(1), m.group(2).strip()
            if kind == "env":
                if ref not in environ:
                    missing.setdefault(path, f"{path}: environment variable {ref!r} is not set")
                    return m.group(0)
                return environ[ref]
            try:
                return _read_utf8(Path(ref)).strip()
            except OSError as e:
                missing.setdefault(path, f"{path}: cannot read secret file {ref!r}: {e.strerror}")
            except UnicodeDecodeError as e:
                missing.setdefault(path, f"{path}: cannot read secret file {ref!r}: {_not_utf8(e)}")
            return m.group(0)
        return _SECRET_REF.sub(sub, value)
    return value


def _read_utf8(p: Path) -> str:
    # Not the locale's encoding (read_text's default): the same file must read the same on every machine.
    return p.read_bytes().decode("utf-8-sig")  # -sig: a BOM (Notepad) is no part of a secret


def _not_utf8(e: UnicodeDecodeError) -> str:
    """Where the first byte that is not UTF-8 is (not the byte: a secret file's content stays out of errors)."""
    line = e.object[:e.start].count(b"\n") + 1
    return f"not UTF-8 (line {line}, byte offset {e.start}); save it as UTF-8"


def _field_type(parts: list[str]) -> Any:
    """The type the config declares at a key path (``["kafka", "group_id"]``), None where it declares none."""
    t: Any = msgspec.inspect.type_info(Config)
    for part in parts:
        t = _child_type(t, part)
    return t


def _child_type(t: Any, part: str) -> Any:
    """The type declared one key below ``t`` (a field, a list item, a dict value); None where none is."""
    if isinstance(t, msgspec.inspect.StructType):
        t = next((f.type for f in t.fields if f.name == part), None)
    elif isinstance(t, msgspec.inspect.ListType):
        t = t.item_type
    elif isinstance(t, msgspec.inspect.DictType):
        t = t.value_type
    else:
        return None
    while isinstance(t, msgspec.inspect.Metadata):
        t = t.type
    return t


def _wants_text(parts: list[str]) -> bool:
    """The key takes a string, and no number or boolean: ``str`` or ``str | None``."""
    t = _field_type(parts)
    if isinstance(t, msgspec.inspect.UnionType):
        kinds = {type(x) for x in t.types} - {msgspec.inspect.NoneType}
        return kinds == {msgspec.inspect.StrType}
    return isinstance(t, msgspec.inspect.StrType)


def _env_value(name: str, raw: str, parts: list[str], path: str) -> Any:
    """An override's value: YAML (``5``, ``true``, ``[a, b]``), except where the key takes text, so that
    ``WORKER__KAFKA__GROUP_ID=123`` or ``WORKER__MODEL__VERSION=2024-06-01`` mean the text as written, and for
    a librdkafka property, which librdkafka parses itself from text: read as YAML, the password 0123 became 83,
    12:30 became 750 (a base-60 number), on became true and 1.50 became 1.5."""
    if raw == "":
        return ""
    if _wants_text(parts) or (len(parts) > 2 and tuple(parts[:2]) in _PASSTHROUGH):
        return raw
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path} (from {name}): not a valid YAML value ({problem}); "
                          "to pass it as text, put it in quotes") from None


def _apply_env(data: dict[str, Any], environ: dict[str, str]) -> dict[str, str]:
    """Applies the ``WORKER__*`` overrides; returns the path each one set, with the variable's name, so an
    error about that key can say where its value came from."""
    set_by: dict[str, str] = {}
    for name, raw in sorted(environ.items()):
        if not name.startswith("WORKER__"):
            continue
        parts = [p.lower() for p in name[len("WORKER__"):].split("__") if p]
        if not parts:
            continue
        node: Any = data
        path = "$"
        for i, part in enumerate(parts[:-1]):
            if tuple(parts[:i]) in _PASSTHROUGH:
                part = parts[i] = part.replace("_", ".")
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"{name}: no list item {part!r} at {path}")
                node = node[int(part)]
                path += f"[{int(part)}]"
                continue
            node = node.setdefault(part, {})
            path += f".{part}"
            if not isinstance(node, dict | list):
                raise ConfigError(f"{name}: {path} is not a section")
        leaf = parts[-1]
        if tuple(parts[:-1]) in _PASSTHROUGH:
            leaf = parts[-1] = leaf.replace("_", ".")
        if isinstance(node, list):
            if not leaf.isdigit() or int(leaf) >= len(node):
                raise ConfigError(f"{name}: no list item {leaf!r} at {path}")
            path += f"[{int(leaf)}]"
            node[int(leaf)] = _env_value(name, raw, parts, path)
        else:
            path += f".{leaf}"
            node[leaf] = _env_value(name, raw, parts, path)
        set_by[path] = name
    return set_by


def _passthrough_problems(data: dict[str, Any]) -> list[str]:
    """librdkafka properties are scalars; msgspec would name the bad one only as ``consumer[...]``."""
    problems = []
    kafka = data.get("kafka")
    for section in ("consumer", "producer"):
        props = kafka.get(section) if isinstance(kafka, dict) else None
        if not isinstance(props, dict):
            continue  # msgspec reports a section that is not a mapping
        for k, v in props.items():
            if not isinstance(v, str | int | float | bool):
                got = "nothing (null)" if v is None else f"a {type(v).__name__}"
                problems.append(f"$.kafka.{section}.{k}: a librdkafka property takes a string, number or "
                                f"boolean, got {got}")
    return problems


def _non_finite(value: Any, path: str) -> str | None:
    """The path of the first float setting that is infinite (YAML's ``.inf``; NaN fails the range checks)."""
    if isinstance(value, float):
        return None if math.isfinite(value) else path
    if isinstance(value, msgspec.Struct):
        for name in value.__struct_fields__:
            found = _non_finite(getattr(value, name), f"{path}.{name}")
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = _non_finite(item, f"{path}[{i}]")
            if found:
                return found
    return None


def _semantic_problems(cfg: Config) -> list[str]:
    """The problems across keys, each named by the key to change."""
    problems: list[str] = []
    add = problems.append
    # An infinite deadline, wait or weight passes "> 0" and then breaks the arithmetic that schedules batches
    # (a deadline of .inf crashed the adaptive fill: the worker exited 1 at every restart).
    bad = _non_finite(cfg, "$")
    if bad:
        add(f"{bad}: must be a finite number (leave the key out for no limit)")
    lanes = [lane.name for lane in cfg.batching.lanes]
    if not lanes:
        add("$.batching.lanes: at least one lane is required")
    dupes = {n for n in lanes if lanes.count(n) > 1}
    if dupes:
        add(f"$.batching.lanes: duplicate lane names {sorted(dupes)}")
    if cfg.batching.default_lane not in lanes:
        add(f"$.batching.default_lane: {cfg.batching.default_lane!r} is not one of the lanes {lanes}")
    seen: dict[str, str] = {}
    for i, lane in enumerate(cfg.batching.lanes):
        for t in lane.topics:
            if t in seen:
                add(f"$.batching.lanes[{i}].topics: topic {t!r} already belongs to lane {seen[t]!r}")
            seen[t] = lane.name
    if not cfg.input_topics():
        add("$.kafka.input_topics: no input topics (set kafka.input_topics or batching.lanes[].topics)")
    inputs = set(cfg.input_topics())
    if cfg.kafka.output_topic in inputs:
        add("$.kafka.output_topic: must differ from the input topics (it would feed itself)")
    if cfg.kafka.dlq_topic in inputs:
        add("$.kafka.dlq_topic: must differ from the input topics (dead letters would be read back "
            "as requests and fail again, forever)")
    if cfg.kafka.dlq_topic == cfg.kafka.output_topic:
        add("$.kafka.dlq_topic: must differ from kafka.output_topic (readers of results would get "
            "the original request bytes of every dead letter)")
    for key in ("enable.auto.commit", "enable.auto.offset.store"):
        # Any spelling but false's: librdkafka also takes "1" or "t" for true (and refuses what is neither).
        if str(cfg.kafka.consumer.get(key, "false")).strip().lower() not in _FALSE:
            add(f"$.kafka.consumer.{key}: must stay false; offsets are committed only after delivery")
    for (section, key), why in _OWNED.items():
        props = cfg.kafka.consumer if section == "consumer" else cfg.kafka.producer
        if key in props:
            add(f"$.kafka.{section}.{key}: {why}")
    for key in ("acks", "request.required.acks"):
        if str(cfg.kafka.producer.get(key, "all")).strip() == "0":
            add(f"$.kafka.producer.{key}: must not be 0: offsets are committed once the broker has "
                "acknowledged the results, and with acks=0 none does (a lost result is committed past)")
    isolation = str(cfg.kafka.consumer.get("isolation.level", "read_committed")).strip().lower()
    if cfg.delivery.mode == "exactly_once" and isolation != "read_committed":
        add("$.kafka.consumer.isolation.level: must stay read_committed with delivery.mode "
            "exactly_once: read_uncommitted would process the records of aborted transactions")
    if cfg.redis.url:
        # The store would refuse it only when the worker starts; check-config should say so first.
        problem = redis_url_problem(cfg.redis.url, tls=cfg.redis.tls)
        if problem:
            add(f"$.redis.url: {problem}")
        if cfg.redis.tls_ca_file and not (cfg.redis.tls or cfg.redis.url.startswith("rediss://")):
            # The store refuses it when the worker starts (exit 1, after the model load).
            add("$.redis.tls_ca_file: set but TLS is off: set redis.tls: true or use a rediss:// URL")
    if cfg.redis.url and cfg.delivery.max_attempts < 2:
        add("$.delivery.max_attempts: must be >= 2 with redis.url set: with 1, every record that was on "
            "a device when a worker process stopped without finishing it (a crash, an OOM kill, a "
            "shutdown timeout) is dead-lettered at its next read, not only the record that killed it")
    for i, dev in enumerate(cfg.model.devices):
        if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", dev):
            add(f"$.model.devices[{i}]: expected cpu, mps, cuda or cuda:N, got {dev!r}")
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", cfg.model.device):
        add(f"$.model.device: expected auto, cpu, mps, cuda or cuda:N, got {cfg.model.device!r}")
    return problems


# Set by the store from redis.timeout_ms; redis-py lets a URL's query string override them, which would turn the
# short bounded calls on the loop thread into seconds of blocking during an outage.
_REDIS_URL_OWNED = ("socket_timeout", "socket_connect_timeout")


def redis_url_problem(url: str, tls: bool = False) -> str | None:
    """What redis-py would reject in ``url`` when the store first connects (a ValueError or TypeError that names
    no config key, raised on the first record), found without connecting; None when it is fine. The text never
    quotes the URL where it carries credentials (userinfo before ``@``): a mangled one can put part of the
    password where the port or path is expected."""
    import inspect
    from urllib.parse import parse_qs, urlsplit

    from redis import connection as rc

    # Exactly as written: redis-py takes the scheme in lower case only (REDIS://h fails when it connects).
    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme not in ("redis", "rediss", "unix"):
        got = f"{scheme!r}://" if scheme else "no scheme"
        return f"expected redis://, rediss:// or unix:// (redis://host:port/db, rediss://... for TLS, unix:///path), got {got}"
    quote = "@" not in url  # only then may parts of the URL be shown
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number or out of range
    except ValueError as e:
        if "Port" not in str(e):
            return "not a valid URL (e.g. an unclosed '[' around an IPv6 host)"
        port = parts.netloc.rpartition("@")[2].rpartition(":")[2]
        return "the port must be a number from 0 to 65535" + (f", got {port!r}" if quote else "")
    try:
        options = rc.parse_url(url)
    except ValueError as e:
        # Its messages name the query option ("Invalid value for 'socket_timeout' in connection URL.").
        m = re.search(r"'([^']+)'", str(e))
        if m is None:
            return "redis-py cannot read it"
        name = m.group(1)
        value = parse_qs(parts.query).get(name, [""])[0]
        shown = f", got {value!r}" if quote and not _is_secret(name) else ""
        return f"invalid value for the query option {name!r}{shown}"
    if parts.scheme != "unix" and parts.path.strip("/") and "db" not in options:
        # redis-py ignores a path that is not a number and uses db 0: the data would land in another database.
        return "the path after host:port must be a database number (/0, /1, ...)" + (
            f", got {parts.path!r}" if quote else "")
    scheme = "rediss" if tls and parts.scheme == "redis" else parts.scheme
    conn = {"unix": rc.UnixDomainSocketConnection, "rediss": rc.SSLConnection}.get(scheme, rc.Connection)
    accepted: set[str] = set()
    for cls in (*conn.__mro__, rc.ConnectionPool):
        init = vars(cls).get("__init__")
        if init is not None:
            accepted |= {p.name for p in inspect.signature(init).parameters.values()
                         if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    for name in parse_qs(parts.query):
        if name in _REDIS_URL_OWNED:
            return f"the query option {name!r} is set from redis.timeout_ms; remove it from the URL"
        if name not in accepted:
            return f"unknown query option {name!r} (redis-py would fail on it when it first connects)"
    return None


def _merge(base: Any, over: Any) -> Any:
    """Mappings merge key by key; anything else (lists included) in ``over`` replaces ``base``."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            out[k] = _merge(base[k], v) if k in base else v
        return out
    return over


def _check_shape(value: Any, path: str, above: tuple[int, ...] = ()) -> None:
    """Keys are text, and no mapping or list contains itself. msgspec names a key that is not text only by its
    section ("Expected `str` - at `key` in `$.kafka`"), and a YAML alias to an anchor above it (``kafka: &k
    {consumer: *k}``) makes a structure with no end: the checks after this one would recurse until Python gives
    up (RecursionError, exit 1)."""
    if not isinstance(value, dict | list):
        return
    if id(value) in above:
        raise ConfigError(f"{path}: contains itself (a YAML alias to an anchor around it); copy the values instead")
    if len(above) > 100:
        raise ConfigError(f"{path}: nested more than 100 levels deep")
    above = (*above, id(value))
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_shape(item, f"{path}[{i}]", above)
        return
    for k, v in value.items():
        if not isinstance(k, str):
            shown = "null" if k is None else str(k)
            raise ConfigError(f"{path}: the key {shown} is not text but {type(k).__name__}; in YAML, quote it: "
                              f"'{shown}':")
        _check_shape(v, f"{path}.{k}", above)


def from_dict(data: dict[str, Any] | None, environ: dict[str, str] | None = None, *,
              check_clients: bool = False, files_elsewhere: bool = False, notes: list[str] | None = None) -> Config:
    """The validated config, or a ConfigError with every problem found. ``check_clients``: also make the Kafka
    consumer and producer the config describes, offline, to find what librdkafka would refuse (the CLI does;
    tests that pair the config with fake clients may use values only the fakes take). ``files_elsewhere``: the
    files client properties name (a CA...) may be mounted where the worker runs, not here (check-config); those
    not here are not checked. ``notes`` (check-config): a secret reference that cannot be resolved here (it
    may exist only in the pod) is appended to it instead of being an error; its key is not checked."""
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"$: expected a mapping at the top of the config, got {type(data).__name__}")
    _check_shape(data, "$")
    # Start from the defaults so env overrides can address keys the file leaves out (lanes[0], ...).
    data = _merge(msgspec.to_builtins(Config()), data or {})
    env = dict(os.environ) if environ is None else environ
    set_by = _apply_env(data, env)
    missing: dict[str, str] = {}
    data = _resolve_secrets(data, "$", env, missing)
    if notes is not None:
        notes.extend(f"{m} (not checked here; `worker run` without it exits 2)" for m in missing.values())

    def known(problem: str) -> bool:  # about a key whose value is known (not an unresolved reference)
        path = problem.split(": ", 1)[0]
        return not any(path == m or path.startswith((m + ".", m + "[")) for m in missing)

    # A type error is about the key itself (or a value above it); an unknown key, like the checks across keys,
    # may be about what a variable put under it.
    exact = [p for p in shape_problems(data, Config) + _passthrough_problems(data) if known(p)]
    problems = list(missing.values()) if notes is None else []
    cfg: Config | None = None
    if not exact:
        try:
            cfg = msgspec.convert(data, Config, strict=False)
        except msgspec.ValidationError as e:
            exact = [_explain(str(e))]
    if cfg is not None:
        problems += [p for p in _semantic_problems(cfg) if known(p)]
        if check_clients:
            # A property librdkafka refuses would stop `worker run` with a traceback, after the model load.
            from worker.adapters.kafka_clients import config_problem

            refused = config_problem(cfg, files_elsewhere)
            if refused and known(refused[0]):
                problems.append(f"{refused[0]}: {refused[1]}")
    if exact or problems:
        blamed = [_blame(p, set_by, below="unknown key" in p) for p in exact]
        blamed += [_blame(p, set_by, below=True) for p in problems]
        raise ConfigError(blamed, model=cfg.model if cfg is not None else _model_section(data))
    assert cfg is not None
    return cfg


def _model_section(data: dict[str, Any]) -> ModelConfig | None:
    """The model section on its own, when it is valid: check-config checks the model even where other
    sections have problems."""
    if shape_problems(data.get("model"), ModelConfig, "$.model"):
        return None
    return msgspec.convert(data.get("model") or {}, ModelConfig, strict=False)


def name_overrides(msg: str, environ: dict[str, str] | None = None) -> str:
    """``msg``, an error about a key found after loading (the model and device checks: ``$.model.devices[1]:
    ...``), with the ``WORKER__*`` variables that set the key or a section above it, as from_dict names them."""
    if "\n" in msg:
        return "\n".join(name_overrides(line, environ) for line in msg.split("\n"))
    if "(set by " in msg:
        return msg  # from_dict's own
    env = dict(os.environ) if environ is None else environ
    set_by = {}
    for name in env:
        parts = [p.lower() for p in name[len("WORKER__"):].split("__") if p] if name.startswith("WORKER__") else []
        if parts:
            set_by[_env_path(parts)] = name
    return _blame(msg, set_by, below=False)


def _env_path(parts: list[str]) -> str:
    """The key path a variable's parts address (``["model", "devices", "1"]`` -> ``$.model.devices[1]``), from the
    declared types alone, as _apply_env builds it."""
    t: Any = msgspec.inspect.type_info(Config)
    path = "$"
    for i, part in enumerate(parts):
        if isinstance(t, msgspec.inspect.ListType) and part.isdigit():
            path += f"[{int(part)}]"
        else:
            path += "." + (part.replace("_", ".") if tuple(parts[:i]) in _PASSTHROUGH else part)
        t = _child_type(t, part)
    return path


def _blame(msg: str, set_by: dict[str, str], below: bool) -> str:
    """``msg`` with the ``WORKER__*`` variables behind the key it names: one that set the key or a section
    above it, and with ``below`` one that set a key under it (``WORKER__KAFKAX__FOO`` -> ``$.kafkax``)."""
    path = msg.split(": ", 1)[0]
    if not path.startswith("$"):
        return msg

    def under(inner: str, outer: str) -> bool:
        return inner.startswith((outer + ".", outer + "["))

    names = sorted(name for p, name in set_by.items()
                   if p == path or under(path, p) or (below and under(p, path)))
    return f"{msg} (set by {', '.join(names)})" if names else msg


def _explain(msg: str) -> str:
    # msgspec: "Object contains unknown field `x` - at `$.kafka`" -> put the path first.
    m = re.match(r"(.*) - at `(\$[^`]*)`$", msg)
    if m:
        what, path = m.groups()
        u = re.match(r"Object contains unknown field `([^`]+)`", what)
        if u:
            return f"{path}.{u.group(1)}: unknown key"
        if what == "Expected `str` of length >= 1":
            return f"{path}: must not be empty"
        return f"{path}: {what}"
    u = re.match(r"Object contains unknown field `([^`]+)`", msg)
    if u:
        return f"$.{u.group(1)}: unknown key"
    return f"$: {msg}"


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, mapping: yaml.MappingNode, key: Any, line: int, first: int) -> None:
        super().__init__(f"line {line}: duplicate key {key!r} (first on line {first})")
        self.mapping, self.key, self.line, self.first = mapping, key, line, first

    def describe(self, root: yaml.Node | None) -> str:
        """The message, naming the key by its path from the document's root."""
        parent = _node_path(root, self.mapping, "$") if root is not None else None
        where = f"{parent}.{self.key}" if parent is not None else repr(self.key)
        return (f"line {self.line}: duplicate key {where} (first on line {self.first}); YAML would keep only "
                "the last one")


def _node_path(root: yaml.Node, target: yaml.Node, path: str) -> str | None:
    """The path (``$.batching.lanes[0]``) of ``target`` in the composed document under ``root``. Iterative and
    each node visited once: aliases make the tree a graph (``&x {self: *x}`` is a cycle)."""
    stack: list[tuple[yaml.Node, str]] = [(root, path)]
    seen: set[int] = set()
    while stack:
        node, at = stack.pop()
        if node is target:
            return at
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            stack += [(v, f"{at}.{k.value}" if isinstance(k, yaml.ScalarNode) else f"{at}.?")
                      for k, v in reversed(node.value)]
        elif isinstance(node, yaml.SequenceNode):
            stack += [(v, f"{at}[{i}]") for i, v in reversed(list(enumerate(node.value)))]
    return None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML keeps the last of two equal keys and drops the first without a word: two ``batching:`` sections
    would lose a lane. A config file with a repeated key is an error instead."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # "<<: *anchor": explicit keys may override merged ones; the base class merges
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                if key in first:
                    raise _DuplicateKey(node, key, line, first[key])
                first[key] = line
            except TypeError:
                continue  # an unhashable key: the base class reports it
        return super().construct_mapping(node, deep)


def load(path: str | Path | None, environ: dict[str, str] | None = None, *, check_clients: bool = False,
         files_elsewhere: bool = False, notes: list[str] | None = None) -> Config:
    """The config in the YAML file at ``path`` (the defaults for None), as ``from_dict`` validates it."""
    if path is None:
        return from_dict({}, environ, check_clients=check_clients, files_elsewhere=files_elsewhere, notes=notes)
    p = Path(path)
    try:
        text = _read_utf8(p)
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(p)!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"cannot read config file {str(p)!r}: {_not_utf8(e)}") from None
    # What yaml.load does, keeping the composed tree (to name a repeated key by its path) and the file's
    # name (positions in errors say 'in "worker.yaml", line 3' rather than 'in "<unicode string>"').
    try:
        loader = _UniqueKeyLoader(text)  # checks the characters first: a NUL or another control one is refused
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    loader.name = str(p)
    root: yaml.Node | None = None
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except _DuplicateKey as e:
        raise ConfigError(f"{p}: {e.describe(root)}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    except (ValueError, OverflowError, TypeError, AttributeError) as e:
        # PyYAML's own failures on a value it cannot build: an escape past U+10FFFF ("\U0A0010000"), a date
        # like 2024-13-45, "!!timestamp x", "!!int 0x".
        raise ConfigError(f"{p}: not valid YAML: a value PyYAML cannot read ({type(e).__name__}: {e})") from None
    finally:
        loader.dispose()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"$: expected a mapping at the top of {p}, got {type(data).__name__}")
    return from_dict(data, environ, check_clients=check_clients, files_elsewhere=files_elsewhere, notes=notes)


def _is_secret(key: str) -> bool:
    return is_secret_key(key, SECRET_WORDS)


def redact(props: dict[str, Any]) -> dict[str, Any]:
    """A copy safe to log: values of secret-looking keys are replaced."""
    return {k: ("***" if _is_secret(k) else v) for k, v in props.items()}


def redact_config(value: Any, key: str = "") -> Any:
    """A copy of a config value (``to_dict(cfg)`` for one) safe to print: values of secret-looking keys
    become ``***`` at any depth (an empty one stays visible as such), and so do passwords in URLs."""
    return redact_log(key, value, words=SECRET_WORDS, show_empty=True)


def to_dict(cfg: Config) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)
