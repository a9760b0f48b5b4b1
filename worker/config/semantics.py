"""The checks across keys, run on a config whose every key has the right type; each problem names the key to
change."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

import msgspec

from worker.config.redaction import is_secret

if TYPE_CHECKING:
    from worker.config.settings import Config

# librdkafka reads a boolean property as true from "true", "t" or "1" (any case); only these read as false.
_FALSE = ("false", "f", "0")
# Properties the worker sets per client from its own keys. Given in the pass-through, one would override some
# clients' value and not others' (or be overridden itself) without a word.
_OWNED = {
    ("consumer", "group.id"): (
        "set kafka.group_id instead: each client's group is derived from it (worker run ignored this one, "
        "while backfill's snapshot read the live group's commits with it)"),
    ("producer", "transactional.id"): (
        "set delivery.transactional_id (with delivery.mode: exactly_once) instead: a transactional "
        "producer refuses every record sent outside a transaction, which at_least_once does "
        "(exactly_once ignored it)"),
}


def passthrough_problems(data: dict[str, Any]) -> list[str]:
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


def semantic_problems(cfg: Config) -> list[str]:
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


# Set by the store from redis.timeout_ms; redis-py lets a URL's query string override them, which would turn
# the short bounded calls on the loop thread into seconds of blocking during an outage.
_REDIS_URL_OWNED = ("socket_timeout", "socket_connect_timeout")


def redis_url_problem(url: str, tls: bool = False) -> str | None:
    """What redis-py would reject in ``url`` when the store first connects (a ValueError or TypeError that
    names no config key, raised on the first record), found without connecting; None when it is fine. The text
    never quotes the URL where it carries credentials (userinfo before ``@``): a mangled one can put part of
    the password where the port or path is expected."""
    import inspect
    from urllib.parse import parse_qs, urlsplit

    from redis import connection as rc

    # Exactly as written: redis-py takes the scheme in lower case only (REDIS://h fails when it connects).
    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme not in ("redis", "rediss", "unix"):
        got = f"{scheme!r}://" if scheme else "no scheme"
        return ("expected redis://, rediss:// or unix:// (redis://host:port/db, rediss://... for TLS, "
                f"unix:///path), got {got}")
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
        shown = f", got {value!r}" if quote and not is_secret(name) else ""
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
