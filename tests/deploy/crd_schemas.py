"""JSON schemas for the two custom resources deploy/ uses, written from their API docs.

The CRDs' own OpenAPI schemas are not available offline, so these cover each resource's
own fields (names, types, required fields; unknown fields rejected as a structural CRD
with strict field validation would), while the embedded Pod templates are checked
separately against the real Kubernetes PodTemplateSpec schema (kubernetes-validate).

RayCluster: KubeRay API reference, ray.io/v1 (RayClusterSpec, HeadGroupSpec,
WorkerGroupSpec). ServiceMonitor and ScrapeConfig: Prometheus Operator API,
monitoring.coreos.com/v1 and v1alpha1.
"""
from __future__ import annotations

_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
_METADATA = {"type": "object", "required": ["name"],
             "properties": {"name": {"type": "string",
                                     "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                                     "maxLength": 63},
                            "labels": _STR_MAP, "annotations": _STR_MAP}}
_TEMPLATE = {"type": "object", "required": ["spec"],
             "properties": {"metadata": {"type": "object"}, "spec": {"type": "object"}}}

RAYCLUSTER = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayCluster"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["headGroupSpec"],
            "additionalProperties": False,
            "properties": {
                "rayVersion": {"type": "string"},
                "enableInTreeAutoscaling": {"type": "boolean"},
                "autoscalerOptions": {"type": "object"},
                "headServiceAnnotations": _STR_MAP,
                "suspend": {"type": "boolean"},
                "managedBy": {"type": "string"},
                "gcsFaultToleranceOptions": {"type": "object"},
                "headGroupSpec": {
                    "type": "object",
                    "required": ["template"],
                    "additionalProperties": False,
                    "properties": {
                        "serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                        "headService": {"type": "object"},
                        "enableIngress": {"type": "boolean"},
                        # values are command-line strings: `num-gpus: 1` is rejected
                        "rayStartParams": _STR_MAP,
                        "template": _TEMPLATE,
                    },
                },
                "workerGroupSpecs": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["groupName", "template"],
                        "additionalProperties": False,
                        "properties": {
                            "groupName": {"type": "string", "minLength": 1},
                            "replicas": _INT32,
                            "minReplicas": _INT32,
                            "maxReplicas": _INT32,
                            "numOfHosts": {"type": "integer", "minimum": 1},
                            "idleTimeoutSeconds": _INT32,
                            "suspend": {"type": "boolean"},
                            "rayStartParams": _STR_MAP,
                            "scaleStrategy": {"type": "object"},
                            "template": _TEMPLATE,
                        },
                    },
                },
            },
        },
    },
}

SERVICEMONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["selector"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "selector": {"type": "object", "properties": {
                    "matchLabels": _STR_MAP, "matchExpressions": {"type": "array"}}},
                "namespaceSelector": {"type": "object", "properties": {
                    "any": {"type": "boolean"},
                    "matchNames": {"type": "array", "items": {"type": "string"}}}},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string",
                                         "pattern": r"^(0|(([0-9]+)(ms|s|m|h))+)$"},
                            "scrapeTimeout": {"type": "string"},
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {"type": "array"},
                            "metricRelabelings": {"type": "array"},
                            "bearerTokenSecret": {"type": "object"},
                        },
                    },
                },
            },
        },
    },
}

_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)(ms|s|m|h))+)$"}

SCRAPECONFIG = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1alpha1"},
        "kind": {"const": "ScrapeConfig"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "jobName": {"type": "string"},
                "httpSDConfigs": {
                    "type": "array",
                    "items": {"type": "object", "required": ["url"],
                              "additionalProperties": False,
                              "properties": {"url": {"type": "string",
                                                     "pattern": "^https?://"},
                                             "refreshInterval": _DURATION}}},
                "staticConfigs": {"type": "array"},
                "metricsPath": {"type": "string", "pattern": "^/"},
                "scrapeInterval": _DURATION,
                "scrapeTimeout": _DURATION,
                "honorLabels": {"type": "boolean"},
                "relabelings": {"type": "array"},
                "metricRelabelings": {"type": "array"},
            },
        },
    },
}

CRD_SCHEMAS = {("ray.io/v1", "RayCluster"): RAYCLUSTER,
               ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICEMONITOR,
               ("monitoring.coreos.com/v1alpha1", "ScrapeConfig"): SCRAPECONFIG}
