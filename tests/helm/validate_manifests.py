"""Offline validation of rendered chart manifests (used by tests/helm/check_chart.sh).

Built-in kinds are validated against the Kubernetes JSON schemas that the ``kubernetes-validate`` package
bundles (strict: unknown fields are errors), for each ``--kube-version``; nothing is downloaded.
Custom resources (KEDA ScaledObject / TriggerAuthentication, Prometheus Operator ServiceMonitor) have
no bundled schema: they get a structural check of their own below, covering every field the chart
renders. On top, a few invariants of this chart that no schema expresses (selectors match, probes use a
declared port, the grace period covers the worker's shutdown budget, the pod is locked down).

    python tests/helm/validate_manifests.py --kube-version 1.30.0 --kube-version 1.37.0 \
        [--extract-config out.yaml] rendered.yaml

Exit 0 when every document passes, 1 with one line per problem otherwise, 2 on bad usage or a missing
validator (a missing tool is a failure, never a skip).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import yaml

try:
    import jsonschema
    import kubernetes_validate
except ImportError as e:  # pragma: no cover - reported, not skipped
    print(f"FATAL: {e.name} is not installed; it is needed to validate manifests offline "
          "(pip install kubernetes-validate)", file=sys.stderr)
    sys.exit(2)

# ---------------------------------------------------------------------------------------------- CRDs
_STR = {"type": "string", "minLength": 1}
_STRMAP = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253},
                   "namespace": _STR, "labels": _STRMAP, "annotations": _STRMAP},
    "additionalProperties": False,
}
_DURATION = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"}


def _crd(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"apiVersion": {"const": api_version}, "kind": {"const": kind},
                       "metadata": _META, "spec": spec},
        "additionalProperties": False,
    }


_KAFKA_TRIGGER_KEYS = {
    # keda.sh kafka scaler metadata; all values are strings.
    "bootstrapServers", "consumerGroup", "topic", "lagThreshold", "activationLagThreshold",
    "offsetResetPolicy", "allowIdleConsumers", "scaleToZeroOnInvalidOffset", "excludePersistentLag",
    "limitToPartitionsWithLag", "version", "partitionLimitation", "sasl", "tls", "unsafeSsl",
    "ensureEvenDistributionOfPartitions",
}
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("keda.sh/v1alpha1", "ScaledObject"): _crd("keda.sh/v1alpha1", "ScaledObject", {
        "type": "object",
        "required": ["scaleTargetRef", "triggers"],
        "additionalProperties": False,
        "properties": {
            "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                               "properties": {"name": _STR, "kind": _STR, "apiVersion": _STR,
                                              "envSourceContainerName": _STR}},
            "pollingInterval": {"type": "integer", "minimum": 1},
            "cooldownPeriod": {"type": "integer", "minimum": 0},
            "initialCooldownPeriod": {"type": "integer", "minimum": 0},
            "idleReplicaCount": {"type": "integer", "minimum": 0},
            "minReplicaCount": {"type": "integer", "minimum": 0},
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "fallback": {"type": "object"},
            "advanced": {"type": "object", "additionalProperties": False, "properties": {
                "restoreToOriginalReplicaCount": {"type": "boolean"},
                "horizontalPodAutoscalerConfig": {"type": "object", "additionalProperties": False, "properties": {
                    "name": _STR, "behavior": {"type": "object"}}},
                "scalingModifiers": {"type": "object"}}},
            "triggers": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                "properties": {
                    "type": {"const": "kafka"},
                    "name": _STR,
                    "useCachedMetrics": {"type": "boolean"},
                    "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                    "metadata": {"type": "object", "required": ["bootstrapServers", "consumerGroup"],
                                 "propertyNames": {"enum": sorted(_KAFKA_TRIGGER_KEYS)},
                                 "additionalProperties": {"type": "string"}},
                    "authenticationRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                          "properties": {"name": _STR,
                                                         "kind": {"enum": ["TriggerAuthentication",
                                                                           "ClusterTriggerAuthentication"]}}},
                }}},
        },
    }),
    ("keda.sh/v1alpha1", "TriggerAuthentication"): _crd("keda.sh/v1alpha1", "TriggerAuthentication", {
        "type": "object",
        "additionalProperties": False,
        "minProperties": 1,
        "properties": {
            "secretTargetRef": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["parameter", "name", "key"], "additionalProperties": False,
                "properties": {"parameter": {"enum": ["sasl", "username", "password", "tls", "ca", "cert", "key",
                                                      "keyPassword", "oauthTokenEndpointUri", "scopes"]},
                               "name": _STR, "key": _STR}}},
        },
    }),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _crd("monitoring.coreos.com/v1", "ServiceMonitor", {
        "type": "object",
        "required": ["selector", "endpoints"],
        "additionalProperties": False,
        "properties": {
            "jobLabel": _STR,
            "selector": {"type": "object", "additionalProperties": False, "minProperties": 1,
                         "properties": {"matchLabels": _STRMAP, "matchExpressions": {"type": "array"}}},
            "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": _STR}}},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False,
                "properties": {"port": _STR, "targetPort": {"type": ["string", "integer"]}, "path": _STR,
                               "scheme": {"enum": ["http", "https"]}, "interval": _DURATION,
                               "scrapeTimeout": _DURATION, "honorLabels": {"type": "boolean"},
                               "relabelings": {"type": "array", "items": {"type": "object"}},
                               "metricRelabelings": {"type": "array", "items": {"type": "object"}}}}},
        },
    }),
}


def check_crd(doc: dict[str, Any]) -> list[str]:
    schema = CRD_SCHEMAS[(doc["apiVersion"], doc["kind"])]
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'.'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message}"
            for err in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]


# ---------------------------------------------------------------------------------- chart invariants
# What a stop takes past delivery.shutdown_timeout_s at most (README, "Delivery guarantees"; the chart's
# kiw.stopOverheadSeconds): the grace period must cover it too.
STOP_OVERHEAD_S = 13


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def check_invariants(docs: list[dict[str, Any]]) -> list[str]:
    errs: list[str] = []
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    deployments = by_kind.get("Deployment", [])
    if len(deployments) != 1:
        return [f"expected exactly one Deployment, got {len(deployments)}"]
    dep = deployments[0]
    name = dep["metadata"]["name"]
    pod = _pod_spec(dep)
    match = dep["spec"]["selector"]["matchLabels"]
    labels = dep["spec"]["template"]["metadata"].get("labels", {})
    if any(labels.get(k) != v for k, v in match.items()):
        errs.append(f"Deployment/{name}: selector {match} does not match the pod labels {labels}")

    # What the API server refuses in a Deployment's strategy (the JSON schemas cannot express it).
    strategy = dep["spec"].get("strategy") or {}
    kind = strategy.get("type", "RollingUpdate")
    rolling = strategy.get("rollingUpdate")
    if kind != "RollingUpdate" and rolling is not None:
        errs.append(f"Deployment/{name}: spec.strategy.rollingUpdate: Forbidden: may not be specified when "
                    f"strategy type is {kind!r}")
    if kind == "RollingUpdate" and rolling is not None:
        def zero(v: Any) -> bool:
            return str(v) in ("0", "0%")
        if zero(rolling.get("maxSurge")) and zero(rolling.get("maxUnavailable")):
            errs.append(f"Deployment/{name}: spec.strategy.rollingUpdate.maxUnavailable: may not be 0 when "
                        "maxSurge is 0")

    (worker,) = [c for c in pod["containers"] if c["name"] == "worker"]
    ports = {p["name"]: p["containerPort"] for p in worker.get("ports", [])}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        if probe in worker and worker[probe]["httpGet"]["port"] not in ports:
            errs.append(f"Deployment/{name}: {probe} uses port {worker[probe]['httpGet']['port']!r}, not declared")
    if worker.get("readinessProbe", {}).get("httpGet", {}).get("path", "/readyz") != "/readyz":
        errs.append(f"Deployment/{name}: readinessProbe must use /readyz")
    if worker.get("livenessProbe", {}).get("httpGet", {}).get("path", "/healthz") != "/healthz":
        errs.append(f"Deployment/{name}: livenessProbe must use /healthz")

    # Locked-down pod: the chart promises these whatever the values.
    psc, csc = pod.get("securityContext", {}), worker.get("securityContext", {})
    if not psc.get("runAsNonRoot"):
        errs.append(f"Deployment/{name}: pod securityContext.runAsNonRoot must be true")
    if psc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
        errs.append(f"Deployment/{name}: seccompProfile must be RuntimeDefault")
    if not csc.get("readOnlyRootFilesystem"):
        errs.append(f"Deployment/{name}: readOnlyRootFilesystem must be true")
    if "ALL" not in csc.get("capabilities", {}).get("drop", []):
        errs.append(f"Deployment/{name}: capabilities must drop ALL")
    if csc.get("allowPrivilegeEscalation") is not False:
        errs.append(f"Deployment/{name}: allowPrivilegeEscalation must be false")
    mounts = {m["mountPath"]: m["name"] for m in worker.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    # The schemas accept `emptyDir: null`; the API server does not ("must specify a volume type").
    for vol_name, vol in volumes.items():
        sources = [k for k, v in vol.items() if k != "name" and v is not None]
        if len(sources) != 1:
            errs.append(f"Deployment/{name}: volume {vol_name!r}: must specify exactly one volume type, "
                        f"got {sources or 'none'}")
    if not isinstance(volumes.get(mounts.get("/tmp", ""), {}).get("emptyDir"), dict):
        errs.append(f"Deployment/{name}: /tmp must be an emptyDir (the root filesystem is read-only)")
    for mount_name in mounts.values():
        if mount_name not in volumes:
            errs.append(f"Deployment/{name}: volumeMount {mount_name!r} has no volume")

    # The config the pod mounts is the ConfigMap rendered with it, and the grace period covers shutdown.
    cm_name = volumes.get(mounts.get("/etc/worker", ""), {}).get("configMap", {}).get("name")
    cms = {c["metadata"]["name"]: c for c in by_kind.get("ConfigMap", [])}
    if cm_name not in cms:
        errs.append(f"Deployment/{name}: /etc/worker must mount the chart's ConfigMap, got {cm_name!r}")
    else:
        cfg = yaml.safe_load(cms[cm_name]["data"]["config.yaml"]) or {}
        shutdown = float(cfg.get("delivery", {}).get("shutdown_timeout_s", 30))
        pre_stop = 0
        cmd = worker.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        if cmd[:1] == ["sleep"]:
            pre_stop = int(cmd[1])
        grace = pod.get("terminationGracePeriodSeconds", 30)
        if grace < math.ceil(shutdown) + pre_stop + STOP_OVERHEAD_S:
            errs.append(f"Deployment/{name}: terminationGracePeriodSeconds={grace} does not cover "
                        f"preStop {pre_stop}s + shutdown_timeout_s {shutdown}s + the worker's stop overhead "
                        f"{STOP_OVERHEAD_S}s")
        port = int(cfg.get("metrics", {}).get("port", 9400))
        if ports.get("metrics") != port:
            errs.append(f"Deployment/{name}: containerPort metrics={ports.get('metrics')} but config metrics.port={port}")
        if "checksum/config" not in dep["spec"]["template"]["metadata"].get("annotations", {}):
            errs.append(f"Deployment/{name}: pod template lacks the checksum/config annotation")

    env = {e["name"]: e for e in worker.get("env", [])}
    for cm in cms.values():
        text = cm["data"].get("config.yaml", "")
        for var in ("KIW_SASL_USERNAME", "KIW_SASL_PASSWORD", "KIW_REDIS_PASSWORD"):
            if "${env:" + var + "}" in text and "secretKeyRef" not in env.get(var, {}).get("valueFrom", {}):
                errs.append(f"ConfigMap/{cm['metadata']['name']}: references ${{env:{var}}} but the pod does "
                            "not set it from a Secret")

    for svc in by_kind.get("Service", []):
        sel = svc["spec"].get("selector", {})
        if any(labels.get(k) != v for k, v in sel.items()):
            errs.append(f"Service/{svc['metadata']['name']}: selector {sel} selects no worker pod")
        for p in svc["spec"]["ports"]:
            if isinstance(p.get("targetPort"), str) and p["targetPort"] not in ports:
                errs.append(f"Service/{svc['metadata']['name']}: targetPort {p['targetPort']!r} is not a container port")

    scalers = by_kind.get("ScaledObject", []) + by_kind.get("HorizontalPodAutoscaler", [])
    if len(scalers) > 1:
        errs.append("both a KEDA ScaledObject and an HPA target the Deployment: they would fight")
    for s in scalers:
        if s["spec"]["scaleTargetRef"]["name"] != name:
            errs.append(f"{s['kind']}/{s['metadata']['name']}: scaleTargetRef is not the Deployment {name!r}")
        if scalers and "replicas" in dep["spec"]:
            errs.append(f"Deployment/{name}: sets replicas while an autoscaler owns the count")
    auths = {a["metadata"]["name"] for a in by_kind.get("TriggerAuthentication", [])}
    for so in by_kind.get("ScaledObject", []):
        for t in so["spec"]["triggers"]:
            ref = t.get("authenticationRef", {}).get("name")
            if ref and ref not in auths:
                errs.append(f"ScaledObject/{so['metadata']['name']}: authenticationRef {ref!r} is not rendered")
    for pdb in by_kind.get("PodDisruptionBudget", []):
        sel = pdb["spec"]["selector"].get("matchLabels", {})
        if any(labels.get(k) != v for k, v in sel.items()):
            errs.append(f"PodDisruptionBudget/{pdb['metadata']['name']}: selects no worker pod")
    return errs


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("manifests", type=Path)
    ap.add_argument("--kube-version", action="append", default=[],
                    help="Kubernetes version(s) to validate against (repeatable)")
    ap.add_argument("--extract-config", type=Path, help="write the worker config of the ConfigMap here")
    args = ap.parse_args(argv)
    versions = args.kube_version or [kubernetes_validate.latest_version()]

    docs = [d for d in yaml.safe_load_all(args.manifests.read_text()) if d]
    if not docs:
        print(f"{args.manifests}: no manifests rendered", file=sys.stderr)
        return 1
    errors: list[str] = []
    counts: dict[str, int] = {}
    for doc in docs:
        ref = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        counts[doc["kind"]] = counts.get(doc["kind"], 0) + 1
        if (doc.get("apiVersion"), doc.get("kind")) in CRD_SCHEMAS:
            errors += [f"{ref}: {e}" for e in check_crd(doc)]
            continue
        for v in versions:
            try:
                kubernetes_validate.validate(doc, v, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path) or "<root>"
                errors.append(f"{ref} (k8s {v}): {path}: {e.message}")
            except kubernetes_validate.SchemaNotFoundError as e:
                errors.append(f"{ref} (k8s {v}): {e.message}")
    if not errors:  # the invariants assume schema-valid documents
        errors += check_invariants(docs)

    if args.extract_config:
        cms = [d for d in docs if d["kind"] == "ConfigMap" and "config.yaml" in d.get("data", {})]
        if len(cms) != 1:
            errors.append(f"expected one ConfigMap with config.yaml, got {len(cms)}")
        else:
            args.extract_config.write_text(cms[0]["data"]["config.yaml"])

    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    if errors:
        for e in errors:
            print(f"INVALID {args.manifests.name}: {e}")
        return 1
    print(f"valid {args.manifests.name}: {summary} (k8s {', '.join(versions)}; CRDs structural)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
