"""README's configuration reference against the config schema: every key the worker accepts is documented
with its real default, and the README shows no key the worker would reject. Without this the reference
drifts silently each time a key is added or a default changes."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import yaml

from tests.support.readme import section
from worker.config.settings import Config, RedisConfig

# Values the README shows as an example rather than the default.
EXAMPLES = {"kafka.input_topics"}


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and v and path not in ("model.options",):
            out.update(_flatten(v, path + "."))
        else:
            out[path] = v
    return out


def _readme_config() -> dict[str, Any]:
    block = re.search(r"```yaml\n(kafka:.*?)```", section("configuration"), re.S)
    assert block, "the configuration section has no full YAML example"
    # `redis: {url: null, ...}` points to the Redis section, which is checked on its own below.
    return yaml.safe_load(block.group(1).replace("{url: null, ...}", "{url: null}"))


def test_the_reference_example_lists_every_key_with_its_default() -> None:
    shown = _readme_config()
    defaults = msgspec.to_builtins(Config())
    lanes_shown, lanes_default = shown["batching"].pop("lanes"), defaults["batching"].pop("lanes")
    shown_flat, default_flat = _flatten(shown), _flatten(defaults)
    default_flat = {k: v for k, v in default_flat.items() if not k.startswith("redis.") or k == "redis.url"}
    assert sorted(set(shown_flat) - set(default_flat)) == [], "README shows keys the worker rejects"
    assert sorted(set(default_flat) - set(shown_flat)) == [], "keys missing from README's reference"
    wrong = {
        k: (shown_flat[k], v) for k, v in default_flat.items() if k not in EXAMPLES and shown_flat[k] != v
    }
    assert wrong == {}, "README default (left) differs from the code's (right)"
    assert lanes_shown == lanes_default


def test_the_redis_table_lists_every_redis_key_with_its_default() -> None:
    rows = re.findall(r"^\| (`[^|]+`) \| ([^|]+) \|", section("redis"), re.M)
    documented: dict[str, str] = {}
    for keys, defaults in rows:
        names = re.findall(r"`([a-z_]+)`", keys)
        values = [v.strip().strip("`") for v in defaults.split(",")]
        documented.update(zip(names, values, strict=True))
    code = msgspec.to_builtins(RedisConfig())
    assert sorted(documented) == sorted(code)
    for key, value in code.items():
        want = "unset" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        assert documented[key] == want, f"redis.{key}: README says {documented[key]!r}, code {want!r}"
