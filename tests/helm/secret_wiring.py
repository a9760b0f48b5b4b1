"""How a rendered chart wires secrets into the worker (validate_manifests.py): checks no schema expresses.

- No secret is inlined: in the worker config (the ConfigMap), every secret-looking key holds nothing but a
  ``${env:VAR}`` or ``${file:/path}`` reference, and so does the password of a Redis URL.
- Every ``${env:VAR}`` the config names is set in the worker container; one behind a secret key from a
  Secret (``secretKeyRef``), never a literal value.
- Every file the config names (``${file:...}``, ``ssl.*.location``, ``redis.tls_ca_file``, a Redis URL's
  ``ssl_certfile``...) lies under a volume mounted in the worker container, and for a Secret volume with
  ``items`` it is one of them.
- KEDA reaches the brokers as the worker does: the TriggerAuthentication names the same Secret keys the pod
  reads (SASL credentials through env, CA / client certificate / key through the mounted files), and the
  trigger's ``sasl`` / ``tls`` follow the consumer's ``security.protocol`` and ``sasl.mechanism``.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

_REF = re.compile(r"\$\{(env|file):([^}]+)\}")
_ONLY_REF = re.compile(r"^\$\{(env|file):[^}]+\}$")
# The worker's own list (worker.config.settings.SECRET_WORDS), spelled with "." and "_" alike.
_SECRET_KEY = re.compile(
    r"(password|passwd|secret|token|sasl[._]jaas|sasl[._]oauthbearer[._]config|key[._]pem|"
    r"private|credential|api[._]?key|authorization)",
    re.IGNORECASE,
)
_FILE_PROPS = ("ssl.ca.location", "ssl.certificate.location", "ssl.key.location", "ssl.crl.location",
               "ssl.keystore.location")
_URL_FILES = ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs")
# Trust stores every image has (and "probe": librdkafka's own search): no volume needed.
_SYSTEM = ("/etc/ssl/", "/etc/pki/")
# KEDA TriggerAuthentication parameter -> the consumer property whose file (or env reference) it mirrors.
_KEDA_FILE = {"ca": "ssl.ca.location", "cert": "ssl.certificate.location", "key": "ssl.key.location"}
_KEDA_ENV = {"username": "sasl.username", "password": "sasl.password", "keyPassword": "ssl.key.password"}
_KEDA_SASL = {"PLAIN": "plaintext", "SCRAM-SHA-256": "scram_sha256", "SCRAM-SHA-512": "scram_sha512",
              "GSSAPI": "gssapi", "OAUTHBEARER": "oauthbearer"}


def _walk(value: Any, path: str) -> list[tuple[str, str, Any]]:
    """(path, key, value) of every leaf."""
    out: list[tuple[str, str, Any]] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, (dict, list)):
                out += _walk(v, f"{path}.{k}")
            else:
                out.append((f"{path}.{k}", str(k), v))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _walk(v, f"{path}[{i}]")
    return out


class PodView:
    """The worker container's env and mounted files, as the checks need them."""

    def __init__(self, dep: dict[str, Any]) -> None:
        pod = dep["spec"]["template"]["spec"]
        (worker,) = [c for c in pod["containers"] if c["name"] == "worker"]
        self.env: dict[str, dict[str, Any]] = {e["name"]: e for e in worker.get("env", [])}
        self.env_from = bool(worker.get("envFrom"))
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        self.mounts = [(m["mountPath"].rstrip("/"),
                        volumes.get(m["name"], {})) for m in worker.get("volumeMounts", [])]

    def secret_ref(self, var: str) -> tuple[str, str] | None:
        ref = self.env.get(var, {}).get("valueFrom", {}).get("secretKeyRef")
        return (ref["name"], ref["key"]) if ref else None

    def file_source(self, path: str) -> tuple[str, str | None] | None:
        """("secret:<name>", key) / ("<kind>", None) of the volume holding ``path``; None when none does, or
        ("missing", None) when a Secret volume's items leave that file out."""
        best = max((m for m in self.mounts if path.startswith(m[0] + "/")), key=lambda m: len(m[0]),
                   default=None)
        if best is None:
            return None
        mount, vol = best
        rel = path[len(mount) + 1:]
        if "secret" in vol:
            items = vol["secret"].get("items")
            if items is None:
                return f"secret:{vol['secret']['secretName']}", rel
            key = next((i["key"] for i in items if i["path"] == rel), None)
            return (f"secret:{vol['secret']['secretName']}", key) if key else ("missing", None)
        return next((k for k in vol if k != "name"), "volume"), None


def _config_files(cfg: dict[str, Any]) -> list[tuple[str, str]]:
    """(config path, file path) of every file the worker config names."""
    files: list[tuple[str, str]] = []
    for path, key, value in _walk(cfg, "config"):
        if not isinstance(value, str):
            continue
        files += [(path, ref) for kind, ref in _REF.findall(value) if kind == "file"]
        if key in _FILE_PROPS or key == "tls_ca_file":
            files.append((path, value))
    url = (cfg.get("redis") or {}).get("url") or ""
    for name, vals in parse_qs(urlsplit(url).query).items():
        if name in _URL_FILES:
            files += [(f"config.redis.url?{name}", v) for v in vals]
    return files


def check_config_secrets(cfg: dict[str, Any], pod: PodView, where: str) -> list[str]:
    errs: list[str] = []
    for path, key, value in _walk(cfg, "config"):
        if isinstance(value, str) and _SECRET_KEY.search(key) and value and not _ONLY_REF.match(value):
            errs.append(f"{where}: {path} holds a value, not a ${{env:...}} / ${{file:...}} reference: a "
                        "secret would be inlined in the ConfigMap")
        for kind, ref in (_REF.findall(value) if isinstance(value, str) else []):
            if kind != "env":
                continue
            var = ref.strip()
            if var not in pod.env and not pod.env_from:
                errs.append(f"{where}: {path} references ${{env:{var}}}, which the worker "
                            "container does not set")
            elif (_SECRET_KEY.search(key) or var.startswith("KIW_")) and var in pod.env \
                    and pod.secret_ref(var) is None:
                errs.append(f"{where}: {path} references ${{env:{var}}}, which the pod does "
                            "not set from a Secret")
    url = (cfg.get("redis") or {}).get("url") or ""
    # user:password@ before the host; a reference may stand for either (and holds a ":" of its own).
    userinfo = _REF.sub("REF", url.partition("://")[2].partition("/")[0].rpartition("@")[0])
    password = userinfo.partition(":")[2]
    if password and password != "REF":
        errs.append(f"{where}: config.redis.url carries a password: a secret would be "
                    "inlined in the ConfigMap")
    for path, file in _config_files(cfg):
        if file == "probe" or file.startswith(_SYSTEM):
            continue
        src = pod.file_source(file)
        if src is None:
            errs.append(
                f"{where}: {path} names {file}, which no volume mounted in the worker container holds"
            )
        elif src[0] == "missing":
            errs.append(f"{where}: {path} names {file}, but the Secret volume there does "
                        "not project that file")
    return errs


def check_keda(cfg: dict[str, Any], pod: PodView, scaled: list[dict[str, Any]],
               auths: dict[str, dict[str, Any]]) -> list[str]:
    errs: list[str] = []
    consumer = {k: str(v) for k, v in ((cfg.get("kafka") or {}).get("consumer") or {}).items()}
    protocol = consumer.get("security.protocol", "PLAINTEXT").upper()
    for so in scaled:
        where = f"ScaledObject/{so['metadata']['name']}"
        for t in so["spec"]["triggers"]:
            md = t["metadata"]
            tls = md.get("tls") == "enable"
            if tls != (protocol in ("SSL", "SASL_SSL")):
                errs.append(f"{where}: trigger tls={md.get('tls')!r} but the worker's "
                            f"security.protocol is {protocol}")
            sasl = protocol.startswith("SASL")
            mech = consumer.get("sasl.mechanism", consumer.get("sasl.mechanisms", "PLAIN")).upper()
            if sasl and md.get("sasl") != _KEDA_SASL.get(mech) and "sasl.username" in consumer:
                errs.append(f"{where}: trigger sasl={md.get('sasl')!r} but the worker uses {mech}")
            name = t.get("authenticationRef", {}).get("name")
            refs = {r["parameter"]: (r["name"], r["key"])
                    for r in (auths.get(name, {}).get("spec", {}).get("secretTargetRef", []) if name else [])}
            errs += _check_refs(where, consumer, pod, refs, tls, sasl)
    return errs


def _check_refs(where: str, consumer: dict[str, str], pod: PodView, refs: dict[str, tuple[str, str]],
                tls: bool, sasl: bool) -> list[str]:
    errs: list[str] = []
    for param, prop in _KEDA_ENV.items():
        m = _ONLY_REF.match(consumer.get(prop, "")) and _REF.match(consumer[prop])
        worker = pod.secret_ref(m.group(2).strip()) if m and m.group(1) == "env" else None
        if param in refs and worker is not None and refs[param] != worker:
            errs.append(f"{where}: TriggerAuthentication {param} is {refs[param]}, the worker reads {prop} "
                        f"from {worker}")
        if worker is not None and param not in refs and (sasl or param == "keyPassword"):
            errs.append(f"{where}: the worker reads {prop} from Secret {worker}, the TriggerAuthentication "
                        f"has no {param}: KEDA could not connect")
    for param, prop in _KEDA_FILE.items():
        file = consumer.get(prop)
        if not tls or not file or file == "probe" or file.startswith(_SYSTEM):
            continue
        src = pod.file_source(file)
        worker = (src[0].removeprefix("secret:"), src[1]) if src and src[0].startswith("secret:") else None
        if param not in refs:
            errs.append(f"{where}: the worker's {prop} is {file}, the TriggerAuthentication has no {param}: "
                        "KEDA could not connect")
        elif worker is not None and refs[param] != worker:
            errs.append(f"{where}: TriggerAuthentication {param} is {refs[param]}, the worker's {prop} "
                        f"is {worker}")
    return errs


def check(docs: list[dict[str, Any]]) -> list[str]:
    deps = [d for d in docs if d["kind"] == "Deployment"]
    if len(deps) != 1:
        return []  # check_invariants reports it
    pod = PodView(deps[0])
    errs: list[str] = []
    cfg: dict[str, Any] = {}
    for cm in (d for d in docs if d["kind"] == "ConfigMap"):
        text = (cm.get("data") or {}).get("config.yaml")
        if text is not None:
            cfg = yaml.safe_load(text) or {}
            errs += check_config_secrets(cfg, pod, f"ConfigMap/{cm['metadata']['name']}")
    auths = {a["metadata"]["name"]: a for a in docs if a["kind"] == "TriggerAuthentication"}
    errs += check_keda(cfg, pod, [d for d in docs if d["kind"] == "ScaledObject"], auths)
    return errs
