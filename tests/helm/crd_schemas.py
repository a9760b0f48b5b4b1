"""Structural JSON schemas of the custom resources the chart renders (validate_manifests.py).

KEDA ScaledObject / TriggerAuthentication and the Prometheus Operator's ServiceMonitor / PrometheusRule have
no schema in kubernetes-validate's bundle: these cover every field the chart renders, with the operators'
field names and types, and refuse unknown ones.
"""

from __future__ import annotations

from typing import Any

_STR = {"type": "string", "minLength": 1}
_STRMAP = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                            "maxLength": 253},
                   "namespace": _STR, "labels": _STRMAP, "annotations": _STRMAP},
    "additionalProperties": False,
}
# Prometheus durations: 30s, 1h30m, 2d.
_DURATION = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(ms|s|m|h|d|w|y))+$"}


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
                "horizontalPodAutoscalerConfig": {"type": "object", "additionalProperties": False,
                                                  "properties": {
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
                    "authenticationRef": {"type": "object", "required": ["name"],
                                          "additionalProperties": False,
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
                "properties": {"parameter": {"enum": ["sasl", "username", "password", "tls", "ca", "cert",
                                                      "key",
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
                               "tlsConfig": {"type": "object", "additionalProperties": False, "properties": {
                                   "insecureSkipVerify": {"type": "boolean"}, "serverName": _STR,
                                   "ca": {"type": "object"}, "cert": {"type": "object"},
                                   "keySecret": {"type": "object"}, "caFile": _STR, "certFile": _STR,
                                   "keyFile": _STR}},
                               "relabelings": {"type": "array", "items": {"type": "object"}},
                               "metricRelabelings": {"type": "array", "items": {"type": "object"}}}}},
        },
    }),
}

_RULE = {
    "type": "object", "additionalProperties": False,
    "properties": {"alert": _STR, "record": _STR, "expr": _STR, "for": _DURATION,
                   "keep_firing_for": _DURATION,
                   "labels": _STRMAP, "annotations": _STRMAP},
    "required": ["expr"],
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
}
CRD_SCHEMAS[("monitoring.coreos.com/v1", "PrometheusRule")] = _crd("monitoring.coreos.com/v1",
                                                                   "PrometheusRule", {
    "type": "object",
    "required": ["groups"],
    "additionalProperties": False,
    "properties": {"groups": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["name", "rules"], "additionalProperties": False,
        "properties": {"name": _STR, "interval": _DURATION, "rules": {"type": "array", "items": _RULE}}}}},
})
