"""The Helm chart's values schema (helm/specserve/values.schema.json), generated.

Owns one pure function, `values_schema()`: the JSON schema of the chart's
values. Its `specserve` key is AppConfig's own schema (pydantic), so Helm
rejects at install time what `specserve serve` would reject at load time
(unknown keys, wrong types, out-of-range numbers; cross-field rules such as
min <= max replicas are checked by AppConfig when the app starts). The other
keys describe the Kubernetes side of the chart (image, head and worker groups,
Serve service, API key Secret, GCS fault tolerance, Ray's ports, NetworkPolicies,
Ray token authentication, the draft stream's TLS, monitoring, Grafana dashboard); `global` is accepted so the chart works as a subchart.

`make helm-schema` (python -m specserve.tools.chart) writes the file, and
helm/specserve/serve-defaults.json beside it (`deployments.app.chart_defaults`:
what the chart needs to render the Serve config as `deployments.app.serve_app`
does); a test checks the checked-in files equal what this generates.
"""

from __future__ import annotations

import json
from pathlib import Path

from specserve.config import AppConfig

CHART_DIR = Path(__file__).resolve().parents[2] / "helm" / "specserve"
SCHEMA_PATH = CHART_DIR / "values.schema.json"
DEFAULTS_PATH = CHART_DIR / "serve-defaults.json"


def _obj(properties: dict, description: str, required: list[str] | None = None) -> dict:
    out = {"type": "object", "description": description, "properties": properties,
           "additionalProperties": False}
    if required:
        out["required"] = required
    return out


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}], "description": schema.pop("description", "")}


_MAP_OF_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_PEERS = {"type": "array", "items": {"type": "object"}}
_RAY_PORTS = ("objectManager", "nodeManager", "runtimeEnvAgent", "dashboardAgentGrpc",
              "dashboardAgentListen", "metricsExport", "minWorker", "maxWorker")
_RESOURCES = {
    "type": "object",
    "description": "Kubernetes container resources (requests, limits). For worker groups, "
                   "nvidia.com/gpu is added to limits from `gpus`.",
    "properties": {
        "requests": {"type": "object", "additionalProperties": {"type": ["string", "number"]}},
        "limits": {"type": "object", "additionalProperties": {"type": ["string", "number"]}},
    },
    "additionalProperties": False,
}


def _pod_settings(what: str) -> dict:
    return {
        "rayStartParams": {"type": "object", "description": f"Extra `ray start` flags of the {what} "
                           "(values are passed as strings).",
                           "additionalProperties": {"type": ["string", "number", "boolean"]}},
        "resources": _RESOURCES,
        "nodeSelector": {**_MAP_OF_STRINGS, "description": f"Node labels the {what} pods need, "
                         "e.g. the GPU type (cloud.google.com/gke-accelerator: nvidia-h100-80gb)."},
        "tolerations": {"type": "array", "items": {"type": "object"},
                        "description": f"Tolerations of the {what} pods (e.g. for GPU taints)."},
        "affinity": {"type": "object", "description": f"Affinity of the {what} pods."},
        "env": {"type": "array", "items": {"type": "object"},
                "description": f"Extra container environment variables of the {what} "
                               "(Kubernetes EnvVar objects)."},
        "volumes": {"type": "array", "items": {"type": "object"},
                    "description": f"Extra volumes of the {what} pods (e.g. the models)."},
        "volumeMounts": {"type": "array", "items": {"type": "object"},
                         "description": "Where the container mounts them."},
        "labels": {**_MAP_OF_STRINGS, "description": f"Extra labels of the {what} pods."},
        "annotations": {**_MAP_OF_STRINGS,
                        "description": f"Annotations of the {what} pods."},
        "serviceAccountName": {"type": "string",
                               "description": f"Service account of the {what} pods; "
                                              "empty: the namespace's default."},
        "securityContext": {"type": "object",
                            "description": f"Pod securityContext of the {what} pods."},
        "containerSecurityContext": {"type": "object",
                                     "description": f"securityContext of the {what} "
                                                    "container."},
        "runtimeClassName": {"type": "string",
                             "description": f"RuntimeClass of the {what} pods (e.g. nvidia); "
                                            "empty: the cluster's default."},
        "priorityClassName": {"type": "string",
                              "description": f"PriorityClass of the {what} pods."},
        "envFrom": {"type": "array", "items": {"type": "object"},
                    "description": f"Environment of the {what} container from Secrets or "
                                   "ConfigMaps (Kubernetes EnvFromSource objects)."},
        "topologySpreadConstraints": {"type": "array", "items": {"type": "object"},
                                      "description": f"How the {what} pods spread over "
                                                     "zones or nodes."},
        "terminationGracePeriodSeconds": _nullable({
            "type": "integer", "minimum": 0,
            "description": f"Seconds a stopping {what} pod has to finish its streams before "
                           "it is killed. Null: Kubernetes' 30."}),
        "shmSizeLimit": _nullable({
            "type": ["string", "integer"],
            "description": f"Size of the {what} pods' /dev/shm (an emptyDir in memory, counted "
                           "against the pod's memory), e.g. 16Gi. Null: no limit."}),
        "startupProbe": _nullable({
            "type": "object", "description": f"The {what} container's startupProbe (a "
                                             "Kubernetes Probe). Null: none."}),
        "readinessProbe": _nullable({
            "type": "object", "description": f"The {what} container's readinessProbe. "
                                             "Null: KubeRay's own."}),
        "image": _nullable({"type": "string", "description": f"Image of the {what} pods. "
                            "Null: image.repository:tag."}),
    }


def _worker_group(what: str, gpus: str, bounds: str,
                  pods: str = "one pod per replica") -> dict:
    return _obj({
        "gpus": _nullable({"type": "integer", "minimum": 0,
                           "description": f"nvidia.com/gpu per pod. Null: {gpus}."}),
        "minReplicas": _nullable({"type": "integer", "minimum": 0,
                                  "description": f"Fewest pods. Null: {bounds} min_replicas."}),
        "maxReplicas": _nullable({"type": "integer", "minimum": 0,
                                  "description": f"Most pods. Null: {bounds} max_replicas."}),
        "idleTimeoutSeconds": _nullable({
            "type": "integer", "minimum": 0,
            "description": "Seconds an idle pod of this group lives before the autoscaler "
                           "removes it (needs autoscaler.version v2). Null: "
                           "autoscaler.idleTimeoutSeconds."}),
        **_pod_settings(what),
    }, f"The {what} worker group: {pods}.")


INCREMENTAL = "NewClusterWithIncrementalUpgrade"


def _upgrade_strategy() -> dict:
    """KubeRay's RayService upgradeStrategy; the incremental one needs its options."""
    options = _obj({
        "gatewayClassName": {"type": "string", "minLength": 1,
                             "description": "The Gateway API class that shifts traffic."},
        "stepSizePercent": {"type": "integer", "minimum": 1, "maximum": 100,
                            "description": "Traffic moved to the new cluster per step, %."},
        "intervalSeconds": {"type": "integer", "minimum": 1,
                            "description": "Seconds between traffic steps."},
        "maxSurgePercent": {"type": "integer", "minimum": 1, "maximum": 100,
                            "description": "Capacity the new cluster may add per step, % of "
                                           "the old one (KubeRay's default: 100)."},
    }, f"Options of {INCREMENTAL}.", ["gatewayClassName", "stepSizePercent", "intervalSeconds"])
    out = _obj({
        "type": {"enum": ["NewCluster", INCREMENTAL, "None"],
                 "description": "NewCluster (KubeRay's default): a whole second cluster before "
                                f"switching. {INCREMENTAL}: the new cluster grows step by step "
                                "as traffic shifts. None: cluster changes are not rolled out."},
        "clusterUpgradeOptions": _nullable(options),
    }, "How KubeRay rolls out a change to the Ray cluster (docs/kubernetes.md lists the GPUs "
       "each type needs).", ["type"])
    out["allOf"] = [
        {"if": {"properties": {"type": {"const": INCREMENTAL}}},
         "then": {"properties": {"clusterUpgradeOptions": {"type": "object"}},
                  "required": ["clusterUpgradeOptions"]},
         "else": {"properties": {"clusterUpgradeOptions": {"type": "null"}}}},
    ]
    return out


def values_schema() -> dict:
    app = AppConfig.model_json_schema(mode="validation")
    defs = app.pop("$defs", {})
    app["description"] = ("The specserve application config (AppConfig, as in cluster/*.yaml), "
                          "rendered into the RayService's serveConfigV2.")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "specserve Helm chart values",
        "type": "object",
        "additionalProperties": False,
        "required": ["specserve"],
        "properties": {
            "specserve": app,
            "image": _obj({
                "repository": {"type": "string", "minLength": 1},
                "tag": {"type": "string", "description": "Empty: what Dockerfile.gpu / "
                        "Dockerfile.cpu build, <appVersion>-gpu when a pool asks for GPUs, "
                        "<appVersion>-cpu otherwise."},
                "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
            }, "The image of every Ray pod: Ray with specserve installed.", ["repository"]),
            "imagePullSecrets": {"type": "array", "items": {"type": "object"}},
            "rayVersion": {"type": "string", "description": "Ray version of the image."},
            "upgradeStrategy": _upgrade_strategy(),
            "autoscaler": _obj({
                "enabled": {"type": "boolean"},
                "idleTimeoutSeconds": {"type": "integer", "minimum": 0},
                "upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]},
                "version": {"enum": ["v1", "v2", None],
                            "description": "KubeRay's autoscaler version; per-group "
                                           "idleTimeoutSeconds needs v2. Null: KubeRay's."},
            }, "KubeRay's in-tree autoscaler (adds and removes worker pods)."),
            "head": _obj(_pod_settings("head"),
                         "The Ray head pod (GCS, dashboard, Serve controller, router)."),
            "workerGroups": _obj({
                "target": _worker_group("target", "tensor_parallel_size / hosts x "
                                        "gpus_per_worker", "specserve.target.replicas",
                                        "specserve.target.hosts pods (numOfHosts) per "
                                        "replica; the replica bounds count replicas"),
                "draft": _worker_group("draft", "the pool's resources.gpus_per_worker, "
                                       "rounded up", "the pool's replicas"),
                "router": _obj({
                    "enabled": {"type": "boolean", "description": "The router's own pods; "
                                "false: the router runs on the head."},
                    "routersPerPod": {"type": "integer", "minimum": 1,
                                      "description": "Router replicas one pod holds."},
                    "minReplicas": {"type": "integer", "minimum": 0},
                    "maxReplicas": {"type": "integer", "minimum": 1},
                    "idleTimeoutSeconds": _nullable({"type": "integer", "minimum": 0,
                                                     "description": "As the other groups'."}),
                    **_pod_settings("router"),
                }, "The router's pods (CPU): the only pods with the API key."),
                "draftPools": {"type": "object", "description": "Per draft pool name: the "
                               "keys of `draft` its own group (draft-<name>) sets differently.",
                               "additionalProperties": _worker_group(
                                   "draft pool's", "the pool's resources.gpus_per_worker, "
                                   "rounded up", "the pool's replicas")},
            }, "Worker groups of the Ray cluster: the target pool's, and one per draft pool.",
               ["target", "draft"]),
            "service": _obj({
                "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "annotations": _MAP_OF_STRINGS,
            }, "KubeRay's Serve service (spec.serveService) in front of the active cluster's "
               "Serve proxies."),
            "ingress": _obj({
                "enabled": {"type": "boolean"},
                "className": {"type": "string", "description": "IngressClass; empty: the "
                              "cluster's default."},
                "host": {"type": "string", "description": "The name clients use (needed "
                         "when enabled)."},
                "annotations": _MAP_OF_STRINGS,
                "tls": _obj({"secretName": {"type": "string", "description": "The Secret "
                             "with the certificate for host (needed when enabled)."}},
                            "TLS of the Ingress (always on)."),
            }, "An Ingress with TLS in front of the Serve service."),
            "gateway": _obj({
                "enabled": {"type": "boolean"},
                "parentRefs": {"type": "array", "items": {"type": "object"},
                               "description": "Gateway API ParentReferences: the Gateway and "
                                              "its HTTPS listener (sectionName)."},
                "hostnames": {"type": "array", "items": {"type": "string"}},
                "requestTimeout": _nullable({"type": "string", "description": "The route's "
                                             "request timeout (e.g. 600s). Null: the "
                                             "Gateway's."}),
            }, "A Gateway API HTTPRoute to the Serve service; TLS ends at the Gateway."),
            "apiKey": _obj({
                "existingSecret": {"type": "string",
                                   "description": "Name of a Secret holding the API key."},
                "secretKey": {"type": "string", "minLength": 1,
                              "description": "The Secret's key holding the API key."},
                "value": {"type": "string",
                          "description": "The API key; the chart creates the Secret. Empty "
                                         "(and no existingSecret): no authentication."},
            }, "The API key clients must send, from a Secret: the Ray pods get it as "
               "SPECSERVE_API_KEY (specserve.http.api_key_env); never in the RayService."),
            "metricsKey": _obj({
                "existingSecret": {"type": "string",
                                   "description": "Name of a Secret holding the scrape key."},
                "secretKey": {"type": "string", "minLength": 1,
                              "description": "The Secret's key holding the scrape key."},
                "value": {"type": "string",
                          "description": "The scrape key; the chart creates the Secret. Empty "
                                         "(and no existingSecret): /metrics takes the API key."},
            }, "The key Prometheus sends to /metrics, from a Secret (SPECSERVE_METRICS_KEY, "
               "specserve.http.metrics_key_env): /metrics then takes only it."),
            "gcsFaultTolerance": _obj({
                "enabled": {"type": "boolean"},
                "redisAddress": {"type": "string", "description": "Redis host:port."},
                "redisPasswordSecret": _nullable(_obj({
                    "name": {"type": "string", "minLength": 1},
                    "key": {"type": "string", "minLength": 1},
                }, "Secret key holding Redis' password.", ["name", "key"])),
            }, "GCS fault tolerance (KubeRay gcsFaultToleranceOptions) with an external Redis."),
            "rayPorts": _obj({
                name: {"type": "integer", "minimum": 1, "maximum": 65535} for name in _RAY_PORTS
            }, "Ray's ports on every pod, fixed so the NetworkPolicy can name them (the head "
               "also listens on GCS 6379, client 10001, dashboard 8265).",
                list(_RAY_PORTS)),
            "networkPolicy": _obj({
                "enabled": {"type": "boolean"},
                "serveFrom": {**_PEERS, "description": "Who may reach the Serve port "
                              "(NetworkPolicyPeers); empty: any source."},
                "metricsFrom": {**_PEERS, "description": "Who may scrape Ray's metrics port "
                                "(rayPorts.metricsExport); empty: nobody."},
                "operatorFrom": {**_PEERS, "description": "KubeRay's operator, allowed on the "
                                 "head's dashboard (8265) and Serve ports; empty: nobody."},
            }, "Ingress NetworkPolicies: Ray's ports only between this release's pods, the "
               "draft sink on target pods only from draft pods, the Serve port from serveFrom."),
            "rayAuth": _obj({
                "enabled": {"type": "boolean"},
                "existingSecret": {"type": "string", "description": "A Secret with the key "
                                   "auth_token. Empty: KubeRay generates one per cluster."},
            }, "Ray token authentication (KubeRay authOptions mode token; Ray >= 2.52)."),
            "draftTls": _obj({
                "enabled": {"type": "boolean"},
                "existingSecret": {"type": "string", "description": "A Secret with tls.crt, "
                                   "tls.key and ca.crt (e.g. a cert-manager Certificate's). "
                                   "Empty: the chart generates a CA and a certificate."},
                "serverName": {"type": "string", "minLength": 1, "description": "The name "
                               "in the certificate that drafts check (sinks are dialled by IP)."},
            }, "Mutual TLS on the draft stream (specserve.grpc_tls, filled by the chart)."),
            "podDisruptionBudget": _obj({
                "enabled": {"type": "boolean"},
                "maxUnavailable": {"type": ["integer", "string"],
                                   "description": "Pods of one group a drain may evict at "
                                                  "once (a number or a percentage)."},
            }, "PodDisruptionBudgets of the target group and each draft pool's group."),
            "global": {"type": "object",
                       "description": "Values a parent chart shares with its subcharts; "
                                      "this chart reads none."},
            "monitoring": _obj({
                "routerMonitor": _obj({
                    "enabled": {"type": "boolean"},
                    "interval": {"type": "string"},
                    "labels": _MAP_OF_STRINGS,
                    "bearerTokenSecret": _nullable(_obj({
                        "name": {"type": "string", "minLength": 1},
                        "key": {"type": "string", "minLength": 1},
                    }, "Secret key holding the bearer token. Null: the metricsKey Secret, "
                       "else the apiKey Secret.",
                        ["name", "key"])),
                }, "A PodMonitor for the router's /metrics, through the head pod's proxy "
                   "(once per Ray cluster)."),
                "podMonitor": _obj({
                    "enabled": {"type": "boolean"},
                    "interval": {"type": "string"},
                    "labels": _MAP_OF_STRINGS,
                }, "A PodMonitor for Ray's metrics agents."),
            }, "Prometheus Operator monitors."),
            "grafanaDashboard": _obj({
                "enabled": {"type": "boolean"},
                "labels": _MAP_OF_STRINGS,
                "annotations": _MAP_OF_STRINGS,
            }, "The Grafana dashboard ConfigMap."),
        },
        "$defs": defs,
    }


def render() -> str:
    return json.dumps(values_schema(), indent=2, sort_keys=False) + "\n"


def render_defaults() -> str:
    from deployments.app import chart_defaults

    return json.dumps(chart_defaults(), indent=2) + "\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_text(render())
    DEFAULTS_PATH.write_text(render_defaults())
    print(SCHEMA_PATH, DEFAULTS_PATH)
