"""Offline validation of rendered chart manifests (used by tests/helm/check_chart.sh).

Built-in kinds are validated against the Kubernetes JSON schemas that the ``kubernetes-validate`` package
bundles (strict: unknown fields are errors), for each ``--kube-version``; nothing is downloaded.
Custom resources (KEDA ScaledObject / TriggerAuthentication, Prometheus Operator ServiceMonitor /
PrometheusRule) have no bundled schema: they get a structural check of their own (crd_schemas.py), covering
every field the chart renders. On top, invariants of this chart that no schema expresses (selectors match,
probes use a declared port, the grace period covers the worker's shutdown budget, the pod is locked down, the
test pod, NetworkPolicy and alerts point at what was rendered) and the secrets' wiring (secret_wiring.py: no
secret inlined, KEDA reads the same Secret keys as the pod).

    python tests/helm/validate_manifests.py --kube-version 1.30.0 --kube-version 1.37.0 \
        [--extract-config out.yaml] rendered.yaml

Exit 0 when every document passes, 1 with one line per problem otherwise, 2 on bad usage or a missing
validator (a missing tool is a failure, never a skip).
"""

from __future__ import annotations

import argparse
import json
import math
import re
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

import secret_wiring  # noqa: E402 - beside this script, on its sys.path
from crd_schemas import CRD_SCHEMAS  # noqa: E402


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
    for probe, want in (("startupProbe", None), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        if probe not in worker:
            continue
        if "httpGet" in worker[probe]:
            target, path = worker[probe]["httpGet"]["port"], worker[probe]["httpGet"]["path"]
            if target not in ports:
                errs.append(f"Deployment/{name}: {probe} uses port {target!r}, not declared")
        else:  # exec: python3 calls the loopback address on the metrics port (each process's, with several)
            command = " ".join(worker[probe]["exec"]["command"])
            m = re.search(r"http://[^/]+:(\d+)(/\w+)", command)
            many = re.search(r"http://[^/]+:%d(/\w+)' % p, timeout=\d+\) for p in range\((\d+), (\d+)\)",
                             command)
            target, path = (int(m.group(1)), m.group(2)) if m else (None, None)
            if many:
                path, called = many.group(1), list(range(int(many.group(2)), int(many.group(3))))
                declared = sorted(v for k, v in ports.items() if k == "metrics" or k.startswith("metrics-"))
                if called != declared:
                    errs.append(f"Deployment/{name}: {probe} calls ports {called}, not the "
                                f"metrics ports {declared}")
            elif target != ports.get("metrics"):
                errs.append(f"Deployment/{name}: {probe} calls port {target}, not the metrics port")
        if path not in ((want,) if want else ("/readyz", "/healthz")):
            errs.append(f"Deployment/{name}: {probe} must use {want or '/readyz or /healthz'}, got {path}")

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
            errs.append(f"Deployment/{name}: containerPort metrics={ports.get('metrics')} but config "
                        f"metrics.port={port}")
        if "checksum/config" not in dep["spec"]["template"]["metadata"].get("annotations", {}):
            errs.append(f"Deployment/{name}: pod template lacks the checksum/config annotation")

    for c in pod.get("initContainers", []) + pod["containers"]:
        for m in c.get("volumeMounts", []):
            if m["name"] not in volumes and c is not worker:
                errs.append(f"Deployment/{name}: container {c['name']!r} mounts {m['name']!r}, "
                            "which has no volume")
    errs += secret_wiring.check(docs)
    errs += check_extras(docs, labels, pod)

    for svc in by_kind.get("Service", []):
        sel = svc["spec"].get("selector", {})
        if any(labels.get(k) != v for k, v in sel.items()):
            errs.append(f"Service/{svc['metadata']['name']}: selector {sel} selects no worker pod")
        pod_ports = {p.get("name") for c in pod["containers"] for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            if isinstance(p.get("targetPort"), str) and p["targetPort"] not in pod_ports:
                errs.append(f"Service/{svc['metadata']['name']}: targetPort {p['targetPort']!r} is not a "
                            "container port")

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
                errs.append(f"ScaledObject/{so['metadata']['name']}: authenticationRef {ref!r} "
                            "is not rendered")
    for pdb in by_kind.get("PodDisruptionBudget", []):
        sel = pdb["spec"]["selector"].get("matchLabels", {})
        if any(labels.get(k) != v for k, v in sel.items()):
            errs.append(f"PodDisruptionBudget/{pdb['metadata']['name']}: selects no worker pod")
    return errs


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def check_extras(docs: list[dict[str, Any]], labels: dict[str, str], pod: dict[str, Any]) -> list[str]:
    """The optional resources around the Deployment: the helm test pod, the NetworkPolicy, the PrometheusRule
    and the dashboard ConfigMap point at what the chart rendered."""
    errs: list[str] = []
    services = {s["metadata"]["name"]: s for s in docs if s["kind"] == "Service"}
    port_names = {p.get("name"): p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])}
    tests = [d for d in docs if d["kind"] == "Pod"]
    for t in tests:
        where = f"Pod/{t['metadata']['name']}"
        if t["metadata"].get("annotations", {}).get("helm.sh/hook") != "test":
            errs.append(f"{where}: a Pod beside the Deployment must be a helm test hook")
        if t["spec"].get("restartPolicy") != "Never":
            errs.append(f"{where}: a test pod must not restart (restartPolicy: Never)")
        script = " ".join(t["spec"]["containers"][0].get("args", []))
        m = re.search(r"http://([a-z0-9-]+)\.[a-z0-9-]+\.svc:(\d+)", script)
        svc = services.get(m.group(1)) if m else None
        if svc is None or int(m.group(2)) not in [p["port"] for p in svc["spec"]["ports"]]:
            errs.append(f"{where}: does not call a port of a rendered Service "
                        f"({m.group(0) if m else 'no URL'})")
    for np in (d for d in docs if d["kind"] == "NetworkPolicy"):
        where = f"NetworkPolicy/{np['metadata']['name']}"
        if not _selects(np["spec"]["podSelector"].get("matchLabels", {}), labels):
            errs.append(f"{where}: podSelector selects no worker pod")
        for rule in np["spec"].get("ingress", []):
            for p in rule.get("ports", []):
                if isinstance(p["port"], str) and p["port"] not in port_names:
                    errs.append(f"{where}: port {p['port']!r} is no container port of the worker pod")
            peers = [peer.get("podSelector", {}).get("matchLabels", {}) for peer in rule.get("from", [])]
            for t in tests:
                if not any(_selects(sel, t["metadata"]["labels"]) for sel in peers):
                    errs.append(f"{where}: does not let the helm test pod {t['metadata']['name']!r} in")
    jobs = set(services)
    for pr in (d for d in docs if d["kind"] == "PrometheusRule"):
        for group in pr["spec"]["groups"]:
            for rule in group["rules"]:
                for job in re.findall(r'job="([^"]+)"', rule["expr"]):
                    if job not in jobs:
                        errs.append(f"PrometheusRule/{pr['metadata']['name']}: {rule.get('alert')} selects "
                                    f"job={job!r}, which is no rendered Service (the ServiceMonitor's job)")
    for cm in (
        d for d in docs if d["kind"] == "ConfigMap" and "kafka-inference-worker.json" in d.get("data", {})
    ):
        try:
            json.loads(cm["data"]["kafka-inference-worker.json"])
        except ValueError as e:
            errs.append(f"ConfigMap/{cm['metadata']['name']}: the dashboard is not JSON: {e}")
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
