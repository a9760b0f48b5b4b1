"""The configuration reference page (docs/config-reference.md), generated from the config Structs.

Names, types and defaults come from ``worker.config.settings`` itself; the one-line meaning of each key comes
from ``MEANINGS`` below. A key without a meaning, or a meaning for a key that no longer exists, is an error,
so a new config field cannot reach the docs undocumented (``tests/unit/test_docs_site.py`` checks that the
committed page equals what this module generates).

    python -m tests.support.config_reference           # rewrite docs/config-reference.md
    python -m tests.support.config_reference --check   # exit 1 when the committed page is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import msgspec
import yaml

from worker.config.settings import Config

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config-reference.md"

MEANINGS: dict[str, str] = {
    "kafka.bootstrap_servers": "brokers to connect to, `host:port[,host:port...]`",
    "kafka.group_id": "consumer group every replica joins; partitions are divided among its members",
    "kafka.input_topics": "topics of the default lane (required unless `batching.lanes[].topics` lists some)",
    "kafka.output_topic": "topic the results are produced to (same key as the request)",
    "kafka.dlq_topic": "dead-letter topic: original bytes plus `x-error*` headers",
    "kafka.consumer": "any librdkafka consumer property, passed through (SASL/SSL go here)",
    "kafka.producer": "any librdkafka producer property, passed through",
    "kafka.poll_max_records": "records taken per loop turn (never past `batching.max_in_flight`)",
    "kafka.poll_timeout_ms": "longest wait for a record when nothing is in flight (2 ms steps otherwise)",
    "kafka.commit_interval_ms": "how often the done prefix of every partition is committed",
    "kafka.rejoin_timeout_ms": "a consumer out of its group this long is replaced "
                               "(`null`: `max.poll.interval.ms` + `session.timeout.ms`; 0: never)",
    "model.name": "`tiny`, `identity`, `synthetic`, `minilm`, `package.module:factory` or a model file",
    "model.options": "handler options: a built-in's settings or the factory's keyword arguments",
    "model.version": "goes into results and the cache key (`null`: the handler's own)",
    "model.device": "`auto` (cuda, then mps, then cpu), `cpu`, `cuda`, `cuda:N` or `mps`",
    "model.devices": "several devices: one pipeline each, batches go to whichever is free",
    "model.dtype": "autocast precision",
    "model.compile": "`torch.compile` the forward (eager if it fails at warm-up)",
    "model.warmup": "run the model's example inputs at batch 1 and 8 before taking traffic",
    "model.batch_timeout_s": "a batch on a device longer than this ends the worker (exit 1); 0: never",
    "model.host_threads": "host threads per process for handlers with `decode_batch`; default (null): the "
                          "CPUs this process may use (affinity, cgroup v2 cpu.max)",
    "model.processes": "worker processes sharing the device(s), each a group member, under a supervisor "
                       "(`worker run --processes` overrides it)",
    "model.generation.max_new_tokens": "generative models: the most new tokens a request may ask for",
    "model.generation.default_max_new_tokens": "generative models: new tokens for a request that names none",
    "model.generation.max_stop": "generative models: stop strings per request",
    "model.generation.max_stop_chars": "generative models: characters per stop string",
    "model.generation.max_prompt_chars": "generative models: characters per prompt",
    "model.generation.max_sequences": "generative models: sequences decoded together in one step",
    "model.generation.max_batch_tokens": ("generative models: tokens the running sequences reserve in all "
                                          "(prompt + max_new_tokens each), the cache bound"),
    "model.generation.admission": ("generative models: grow (tokens as cached, preempting on overflow) or "
                                   "reserve (prompt + max_new_tokens held from admission, never recomputes)"),
    "model.generation.priority_headroom_tokens": ("generative models: of max_batch_tokens, tokens only the "
                                                  "highest-priority lane may reserve"),
    "batching.policy": "`fixed` windows, or `adaptive` (online `a + b*n` latency model)",
    "batching.lanes": "the priority lanes, each with its own batching settings (table below)",
    "batching.lanes[].name": "the lane's name, as requests and the `x-priority` header give it",
    "batching.lanes[].topics": "input topics whose records go to this lane",
    "batching.lanes[].weight": "guaranteed share of served records under overload, relative to other lanes",
    "batching.lanes[].priority": "higher is served first; ties go to the lane listed first",
    "batching.lanes[].max_batch_size": "a window closes at this many records",
    "batching.lanes[].max_wait_ms": "... or when its first record has waited this long",
    "batching.lanes[].deadline_ms": "default budget after receipt; a request's `deadline_ms` overrides it",
    "batching.lanes[].queue_bound": "at this many queued records the lane's topics are paused",
    "batching.lanes[].fill_with_lower": "a partial batch of this lane takes lower-priority records into "
                                        "its free slots",
    "batching.lanes[].fill_efficiency": "a filled batch stops at the smallest size reaching this fraction of "
                                        "a full batch's records/s (1: fills to `max_batch_size`)",
    "batching.lanes[].max_batch_tokens": "... or when the next record would take it over this cost (the "
                                         "model's `size_of` per record); unset: no token budget",
    "batching.default_lane": "where records naming an unknown lane go",
    "batching.bucket_width": "> 0: batch inputs of similar size together (`size // bucket_width`)",
    "batching.max_in_flight": "backpressure: pause fetching at this many records in flight",
    "batching.resume_ratio": "... and resume below `max_in_flight * resume_ratio`",
    "batching.max_uncommitted": "per partition: pause it at this many records read since its oldest "
                                "unfinished one",
    "delivery.mode": "`at_least_once` or `exactly_once` (transactions)",
    "delivery.transactional_id": "exactly-once: stable per instance (`null`: `<group_id>-<hostname>`)",
    "delivery.revoke_timeout_ms": "time in-flight records of revoked partitions get to finish",
    "delivery.shutdown_timeout_s": "time in-flight work gets on SIGTERM",
    "delivery.max_input_bytes": "larger records go to the DLQ before decoding",
    "delivery.max_attempts": "with `redis.url`: a record on the device this many times when the process "
                             "died is quarantined (>= 2)",
    "delivery.format": "wire format of requests and results",
    "delivery.outputs_encoding": "`lists`, or `float32`: numeric outputs as little-endian float32 bytes "
                                 "with dtype and shape ([wire format](wire-format.md))",
    "delivery.producer_stall_s": "at-least-once: a producer holding results undelivered this long is "
                                 "replaced (0: never)",
    "redis.url": "`redis://`, `rediss://` or `unix://` URL; `null`: in-memory store, per process",
    "redis.password": "AUTH password (or in the URL); use `${env:...}` or `${file:...}`",
    "redis.tls": "TLS on a `redis://` URL",
    "redis.tls_ca_file": "CA bundle to verify the server (TLS only)",
    "redis.key_prefix": "namespace for every key",
    "redis.cache": "result cache on",
    "redis.cache_ttl_s": "lifetime of a cached result",
    "redis.ledger": "delivered-id ledger on (at-least-once mode)",
    "redis.ledger_ttl_s": "lifetime of a ledger entry",
    "redis.attempts_ttl_s": "lifetime of an attempt counter",
    "redis.timeout_ms": "connect and read timeout of each call (no client retries)",
    "redis.breaker_failures": "consecutive failures that open the circuit breaker",
    "redis.breaker_reset_s": "how long the circuit stays open before one probe call",
    "metrics.enabled": "serve `/metrics`, `/healthz` and `/readyz`",
    "metrics.host": "address the HTTP port binds to",
    "metrics.port": "the HTTP port (0: any free port, logged)",
    "metrics.lag_interval_s": "how often consumer lag is reported",
    "logging.level": "log level",
    "logging.format": "`json` lines or plain `text`",
}

# Shown in the example instead of the default: the worker needs input topics to start.
EXAMPLE_VALUES: dict[str, Any] = {"kafka.input_topics": ["requests"]}


def _type(t: Any) -> str:
    """A type from ``msgspec.inspect`` as a reader writes it: ``int (1-1000000)``, ``fixed | adaptive``."""
    name = type(t).__name__
    if name == "UnionType":
        parts = [p for p in t.types if type(p).__name__ != "NoneType"]
        text = " | ".join(_type(p) for p in parts)
        return text + " | null" if len(parts) < len(t.types) else text
    if name == "LiteralType":
        return " | ".join(str(v) for v in t.values)
    if name in ("IntType", "FloatType"):
        base = "int" if name == "IntType" else "float"
        bounds = [f">= {t.ge}" if t.ge is not None else "", f"> {t.gt}" if t.gt is not None else "",
                  f"<= {t.le}" if t.le is not None else "", f"< {t.lt}" if t.lt is not None else ""]
        bounds = [b for b in bounds if b]
        return f"{base} ({', '.join(bounds)})" if bounds else base
    if name == "StrType":
        return "non-empty string" if t.min_length else "string"
    if name == "ListType":
        item = t.item_type
        if type(item).__name__ == "StrType":
            return "list of non-empty strings" if item.min_length else "list of strings"
        if type(item).__name__ == "StructType":
            return "list of lanes"
        return f"list of {_type(item)}"
    if name == "DictType":
        return "mapping"
    return {"BoolType": "bool", "AnyType": "any", "NoneType": "null"}.get(name, name)


def _default(f: Any) -> Any:
    if f.default is not msgspec.NODEFAULT:
        return msgspec.to_builtins(f.default)
    if f.default_factory is not msgspec.NODEFAULT:
        return msgspec.to_builtins(f.default_factory())
    return None


def _show(value: Any) -> str:
    if value is None:
        return "`null`"
    return f"`{_flow(value)}`"


def fields() -> list[tuple[str, str, Any, bool]]:
    """(dotted key, type, default, required) for every config key, sections and lanes included."""
    out: list[tuple[str, str, Any, bool]] = []

    def walk(info: Any, prefix: str) -> None:
        for f in info.fields:
            key = f"{prefix}{f.name}"
            t = f.type
            if type(t).__name__ == "StructType":
                walk(t, key + ".")
                continue
            out.append((key, _type(t), _default(f), f.required))
            if type(t).__name__ == "ListType" and type(t.item_type).__name__ == "StructType":
                walk(t.item_type, key + "[].")

    walk(msgspec.inspect.type_info(Config), "")
    return out


def check_meanings() -> None:
    keys = {k for k, *_ in fields()}
    missing, stale = sorted(keys - MEANINGS.keys()), sorted(MEANINGS.keys() - keys)
    if missing or stale:
        raise SystemExit(f"tests/support/config_reference.py MEANINGS: missing {missing}, unknown {stale}")


def _example() -> str:
    defaults = msgspec.to_builtins(Config())
    for key, value in EXAMPLE_VALUES.items():
        section, name = key.split(".")
        defaults[section][name] = value
    lines = []
    for section, body in defaults.items():
        if section == "redis":  # its keys matter only with a URL: see the table below and the Redis page
            lines.append("redis: {url: null, ...}")
            continue
        lines.append(f"{section}:")
        for key, value in body.items():
            if key == "lanes":  # one lane per line, as a config lists them
                lines += ["  lanes:", *(f"    - {_flow(lane)}" for lane in value)]
            else:
                lines.append(f"  {key}: {_flow(value)}")
    return "\n".join(lines)


def _flow(value: Any) -> str:
    text = str(yaml.safe_dump(value, default_flow_style=True, width=1000, sort_keys=False))
    return text.strip().removesuffix("...").strip()


def render() -> str:
    check_meanings()
    rows = fields()
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m tests.support.config_reference` from worker/config/settings.py;",
        "     a unit test fails when this page differs from what it generates. Do not edit by hand. -->",
        "",
        "Every key the worker accepts, with its type and default. How the file is read, "
        "environment overrides",
        "and secrets: [Configuration](configuration.md). The whole file with every default (only",
        "`kafka.input_topics` is an example value; the worker needs at least one input topic):",
        "",
        "```yaml",
        _example(),
        "```",
        "",
    ]
    sections: dict[str, list[str]] = {}
    for key, typ, default, required in rows:
        # Lanes get a table of their own, after their section's.
        name = key.split("[]")[0] if "[]" in key else key.split(".")[0]
        shown = "required" if required else _show(default)
        row = f"| `{key}` | {_cell(typ)} | {_cell(shown)} | {_cell(MEANINGS[key])} |"
        sections.setdefault(name, []).append(row)
    for name, lines in sections.items():
        out += [f"## `{name}`", "", "| key | type | default | meaning |", "|---|---|---|---|", *lines, ""]
    return "\n".join(out).rstrip("\n") + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "&#124;")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.support.config_reference", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 when the committed page is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is stale: run python -m tests.support.config_reference", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
