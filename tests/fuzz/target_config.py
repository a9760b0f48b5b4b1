"""Fuzz target ``config``: YAML bytes through the real config loader (worker.config.settings.load: the
duplicate-key loader, the shape checks, env-free secret references, msgspec conversion, the checks across
keys).

What must hold: load() either returns a Config or raises ConfigError (whose message starts with the key
path or the file), never anything else (a RecursionError, a TypeError from a value of an unexpected type),
and within a bounded time.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import yaml
from hypothesis import strategies as st

from worker.config.settings import Config, ConfigError, load

BOUND_S = 5.0

_KEYS = ["kafka", "batching", "delivery", "redis", "metrics", "logging", "model", "lanes", "name", "topics",
         "input_topics", "consumer", "producer", "bootstrap_servers", "group_id", "url", "password",
         "max_wait_ms",
         "max_batch_size", "weight", "deadline_ms", "default_lane", "mode", "format", "port", "tls", "<<"]
_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
            | st.sampled_from(["${env:NOPE}", "${file:/nonexistent}", "${env:", ".inf", "-.nan", "~", "",
                               "exactly_once", "msgpack", "redis://:pw@h:1/0", "rediss://h:x/0"])
            | st.text(max_size=12))
_docs = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=6), inner, max_size=5),
                     max_leaves=40)
_fragments = st.sampled_from([b"&a [*a]", b"a: &x {b: *x}", b"<<: *nope", b"!!python/object:os.system x",
                              b"a: 1\na: 2", b"\t", b"- - - -", b"{{{{", b"key: !!binary AAAA", b"? [a]\n: b",
                              b"%YAML 1.1\n---", b"...", b"\xef\xbb\xbf", b"\xff\xfe",
                              b"kafka: {consumer: {a: [1]}}",
                              b'"\\U0010FFFF"', b'"\\x"', b"!!timestamp 2024-02-30", b"!!float", b"!!int",
                              b"!!binary", b"!!set", b"!!omap", b"2024-13-45"])


@st.composite
def yaml_bytes(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=200))
    doc = yaml.safe_dump({"kafka": {"input_topics": ["in"]}, **draw(st.dictionaries(st.sampled_from(_KEYS),
                                                                                     _docs, max_size=4))})
    raw = doc.encode()
    if kind >= 2:
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, len(raw)))
            raw = raw[:i] + draw(_fragments | st.binary(max_size=8)) + raw[i:]
    return raw


_DIR: list[Path] = []


def check(data: bytes) -> None:
    if not _DIR:
        _DIR.append(Path(tempfile.mkdtemp(prefix="kiw-fuzz-config-")))
    path = _DIR[0] / "worker.yaml"
    path.write_bytes(data)
    t0 = time.perf_counter()
    try:
        cfg = load(path, environ={})
    except ConfigError as e:
        msg = str(e)
        assert msg.startswith(("$", str(path), "cannot read config file")), msg
    else:
        assert isinstance(cfg, Config)
    took = time.perf_counter() - t0
    assert took < BOUND_S, f"{took:.2f} s"
