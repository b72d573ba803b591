"""The Helm chart (helm/specserve), rendered and linted by Helm's own Go SDK
(helm-python-sdk, no helm binary), for the default values and the GPU example:

- the RayService validates against KubeRay's CRD schema (tests/data/crds, made
  strict: unknown fields are errors, as the API server's strict field
  validation makes them), its rayClusterConfig against the RayCluster CRD's
  spec; Service and ConfigMap against Kubernetes' schemas (kubernetes-validate);
- serveConfigV2 loads into AppConfig (for the GPU example: equal to
  cluster/gpu-example.yaml) and names the builder that takes it;
- worker groups get the GPUs, nodeSelectors and replica bounds of their pools;
- values.schema.json is what `make helm-schema` generates and rejects typos;
- every PromQL expression of the Grafana dashboard names metrics specserve
  exports.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

from specserve.config import AppConfig

from grafana import (PROMQL_FUNCTIONS, dashboard, grafana_expressions,
                     promql_metrics)

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "specserve"
GPU_VALUES = CHART / "examples" / "gpu-values.yaml"
CRDS = Path(__file__).resolve().parents[1] / "data" / "crds"
KUBE_VERSION = "1.30"
FULLNAME = "spec-specserve"  # release "spec"
TLS_DIR = "/etc/specserve/draft-tls"
SINK_PORT = 50051  # values.yaml's specserve.target.sink_port
# Ray's ports as values.yaml fixes them (rayPorts), on every pod.
RAY_PORT_PARAMS = {"object-manager-port": "8076", "node-manager-port": "8077",
                   "runtime-env-agent-port": "8078", "dashboard-agent-grpc-port": "8079",
                   "dashboard-agent-listen-port": "52365", "metrics-export-port": "8080",
                   "min-worker-port": "10002", "max-worker-port": "19999"}
ROUTER_RESOURCE = "specserve_router"  # the Ray resource only router-hosting pods advertise
SEVERAL = ("PodMonitor", "NetworkPolicy", "Secret", "PodDisruptionBudget")


@lru_cache(maxsize=None)
def chart():
    import helm_python as helm

    return helm.Chart.load(str(CHART))


def gpu_values() -> dict:
    import helm_python as helm

    return helm.values_from_yaml(GPU_VALUES.read_text())  # as `helm -f` reads it


def render(values: dict | None = None) -> dict[str, dict]:
    """kind -> object, NOTES.txt under "NOTES"; a kind the chart may render
    several of (PodMonitor, NetworkPolicy, Secret, PodDisruptionBudget) is keyed
    "kind/<name suffix after the fullname->" (e.g. "NetworkPolicy/draft-sink")."""
    out: dict[str, dict] = {}
    for path, text in chart().render(values, name="spec", namespace="llm").items():
        if path.endswith("NOTES.txt"):
            out["NOTES"] = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                key = doc["kind"]
                if key in SEVERAL:
                    key = f"{key}/{doc['metadata']['name'].removeprefix(FULLNAME + '-')}"
                assert key not in out, f"two {key} objects"
                out[key] = doc
    return out


# ---- schemas ----------------------------------------------------------------------

def _strict(s: dict) -> dict:
    """A CRD's structural OpenAPI schema as JSON schema that rejects unknown fields."""
    out = {}
    for k, v in s.items():
        if k.startswith("x-kubernetes-"):
            continue
        if k == "properties":
            out[k] = {name: _strict(p) for name, p in v.items()}
        elif k in ("items", "additionalProperties", "not") and isinstance(v, dict):
            out[k] = _strict(v)
        elif k in ("allOf", "anyOf", "oneOf"):
            out[k] = [_strict(x) for x in v]
        else:
            out[k] = v
    if ("properties" in s and "additionalProperties" not in s
            and not s.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    if s.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


@lru_cache(maxsize=None)
def crd_schema(kind: str) -> dict:
    crd = yaml.safe_load((CRDS / f"ray.io_{kind.lower()}s.yaml").read_text())
    assert crd["spec"]["names"]["kind"] == kind
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return _strict(version["schema"]["openAPIV3Schema"])


def validate_crd(obj: dict, kind: str) -> None:
    import jsonschema

    errors = sorted(jsonschema.Draft7Validator(crd_schema(kind)).iter_errors(obj),
                    key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                                 for e in errors[:20])


def validate_core(obj: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def check_rayservice(rs: dict) -> None:
    assert rs["apiVersion"] == "ray.io/v1"
    validate_crd(rs, "RayService")
    # The RayCluster the RayService creates, checked against its own CRD.
    validate_crd({"apiVersion": "ray.io/v1", "kind": "RayCluster",
                  "metadata": {"name": "spec-raycluster"}, "spec": rs["spec"]["rayClusterConfig"]},
                 "RayCluster")


def serve_app(rs: dict) -> dict:
    serve_config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    return serve_config, app


def chart_config(app: dict) -> AppConfig:
    """The whole config a rendered Serve app carries: its args (the code part)
    with the live part of the router's user_config put back, as the
    replicas' reconfigure does (tests/tools/test_helm_live.py)."""
    from specserve.config.live import with_live

    router = next(d for d in app["deployments"] if d["name"] == "router")
    return with_live(AppConfig.from_dict(app["args"], source="args"), router["user_config"])


def pinned(data: dict) -> AppConfig:
    """The config `data` with the engine's K ceiling written out, as the code
    part carries it (max_speculative_tokens null: K)."""
    cfg = AppConfig.from_dict(data)
    spec = cfg.speculation.model_copy(update={"max_speculative_tokens": cfg.speculation.engine_k()})
    return cfg.model_copy(update={"speculation": spec})


def groups(rs: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def container(group: dict) -> dict:
    (c,) = group["template"]["spec"]["containers"]
    return c


# ---- tests ------------------------------------------------------------------------

def test_checked_in_values_schema_is_the_generated_one():
    from specserve.tools.chart import SCHEMA_PATH, render as render_schema

    assert SCHEMA_PATH == CHART / "values.schema.json"
    assert SCHEMA_PATH.read_text() == render_schema(), \
        "values.schema.json is stale: run `make helm-schema`"
    assert chart().schema["properties"]["specserve"]["properties"].keys() == \
        AppConfig.model_fields.keys()


@pytest.mark.parametrize("values", ["default", "gpu"])
def test_helm_lint_is_clean(values):
    import helm_python as helm

    report = helm.lint(str(CHART), None if values == "default" else gpu_values(), strict=True,
                       kube_version=f"v{KUBE_VERSION}.0")
    assert report["total_charts_linted"] == 1
    assert not report["errors"], report
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems, problems


def test_default_values_render_a_valid_cpu_deployment():
    objs = render()
    assert set(objs) == {"RayService", "ConfigMap", "NetworkPolicy/ray",
                         "NetworkPolicy/operator", "PodDisruptionBudget/target", "NOTES"}
    rs = objs["RayService"]
    check_rayservice(rs)
    for kind in ("ConfigMap", "NetworkPolicy/ray", "NetworkPolicy/operator",
                 "PodDisruptionBudget/target"):
        validate_core(objs[kind])

    serve_config, app = serve_app(rs)
    assert serve_config["http_options"] == {"host": "0.0.0.0", "port": 8000}
    assert app["route_prefix"] == "/"
    cfg = chart_config(app)
    assert cfg == pinned({"http": {"host": "0.0.0.0"}, "ray": {"address": "auto"},
                          "target": {"sink_port": SINK_PORT},
                          "router": {"ray_resource": ROUTER_RESOURCE}})
    # The import path names a Serve application builder that takes the args.
    module, attr = app["import_path"].split(":")
    builder = getattr(importlib.import_module(module), attr)
    assert list(inspect.signature(builder).parameters) == ["args"]

    # CPU only, no drafts: one target group without GPUs, autoscaler on.
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert set(groups(rs)) == {"target"}
    target = groups(rs)["target"]
    assert (target["minReplicas"], target["maxReplicas"]) == (1, 1)
    assert "nvidia.com/gpu" not in container(target)["resources"]["limits"]
    # Without the router group the router runs on the head (the Ray resource
    # its replicas ask for), and only there.
    assert cluster["headGroupSpec"]["rayStartParams"] == {
        "dashboard-host": "0.0.0.0", "num-cpus": "0", **RAY_PORT_PARAMS,
        "resources": json.dumps(json.dumps({ROUTER_RESOURCE: 1000}, separators=(",", ":")))}
    assert target["rayStartParams"] == RAY_PORT_PARAMS


def test_gpu_example_renders_gpu_groups_and_the_example_config():
    objs = render(gpu_values())
    assert set(objs) == {"RayService", "ConfigMap", "PodMonitor/router", "PodMonitor/ray",
                         "NetworkPolicy/ray", "NetworkPolicy/operator",
                         "NetworkPolicy/draft-sink", "Secret/draft-tls",
                         "PodDisruptionBudget/target", "PodDisruptionBudget/draft-llama-1b",
                         "PodDisruptionBudget/draft-llama-8b", "PodDisruptionBudget/router",
                         "NOTES"}
    rs = objs["RayService"]
    check_rayservice(rs)
    for kind in set(objs) - {"RayService", "NOTES", "PodMonitor/router", "PodMonitor/ray"}:
        validate_core(objs[kind])

    # The example's config, plus what the chart adds for the cluster: the
    # sink's fixed port (values.yaml) and the draft stream's TLS files.
    _, app = serve_app(rs)
    example = AppConfig.from_yaml(REPO / "cluster" / "gpu-example.yaml").model_dump()
    example["target"]["sink_port"] = SINK_PORT
    example["router"] = {"ray_resource": ROUTER_RESOURCE}
    example["grpc_tls"] = {"ca_file": f"{TLS_DIR}/ca.crt", "cert_file": f"{TLS_DIR}/tls.crt",
                           "key_file": f"{TLS_DIR}/tls.key", "server_name": "draft-sink"}
    assert chart_config(app) == pinned(example)

    g = groups(rs)
    assert set(g) == {"target", "draft-llama-1b", "draft-llama-8b", "router"}
    target, draft = g["target"], g["draft-llama-1b"]
    # A target replica is one pod with tensor_parallel_size GPUs, on H100 nodes.
    assert container(target)["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert (target["minReplicas"], target["maxReplicas"]) == (1, 4)
    assert target["template"]["spec"]["nodeSelector"] == {
        "cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    # Each group advertises its accelerator type as a Ray resource (what the
    # bundles and draft actors ask for), so KubeRay's autoscaler can grow it.
    for group, kind in ((target, "H100"), (draft, "L4")):
        assert json.loads(json.loads(group["rayStartParams"]["resources"])) == {
            f"accelerator_type:{kind}": 1}
    # One group per draft pool: one L4 per replica, the pool's own bounds.
    for name, bounds in (("draft-llama-1b", (2, 8)), ("draft-llama-8b", (1, 4))):
        assert container(g[name])["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert (g[name]["minReplicas"], g[name]["maxReplicas"]) == bounds
        assert g[name]["template"]["spec"]["nodeSelector"] == {
            "cloud.google.com/gke-accelerator": "nvidia-l4"}
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]
    for group in (head, target, draft):  # the router on the head reads the tokenizer
        spec = group["template"]["spec"]
        assert {"name": "models", "mountPath": "/models", "readOnly": True} \
            in container(group)["volumeMounts"]
        assert {"name": "models", "persistentVolumeClaim": {"claimName": "models",
                                                            "readOnly": True}} in spec["volumes"]
    for group in (target, draft):
        spec = group["template"]["spec"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} \
            in spec["tolerations"]

    # KubeRay's own Serve service (it sets the selector to the active cluster's
    # proxies); no Service of the chart's own duplicates it.
    svc = rs["spec"]["serveService"]
    assert svc["spec"]["type"] == "ClusterIP" and "selector" not in svc["spec"]
    validate_core({"apiVersion": "v1", "kind": "Service", **svc})
    (port,) = svc["spec"]["ports"]
    assert any(p["name"] == port["targetPort"] and p["containerPort"] == 8000
               for p in container(target)["ports"])
    # The router's /metrics once per cluster (the head's proxy); Ray's agents on
    # every pod.
    rm, pm = objs["PodMonitor/router"], objs["PodMonitor/ray"]
    head_labels = head["template"]["metadata"]["labels"]
    assert rm["spec"]["selector"]["matchLabels"].items() <= head_labels.items()
    for name in ("target", "draft-llama-1b", "draft-llama-8b"):
        assert not (rm["spec"]["selector"]["matchLabels"].items()
                    <= g[name]["template"]["metadata"]["labels"].items())
    (endpoint,) = rm["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    assert any(p["name"] == endpoint["port"] for p in container(head)["ports"])
    pod_labels = target["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert any(p["name"] == pm["spec"]["podMetricsEndpoints"][0]["port"]
               for p in container(draft)["ports"])
    assert rm["metadata"]["labels"]["release"] == "prometheus"

    notes = objs["NOTES"]
    assert "/dashboard" in notes and "llama-3.1-70b-instruct" in notes
    assert "kubectl -n llm port-forward svc/spec-specserve 8000:8000" in notes


def test_serve_builds_the_gpu_app_that_fits_its_pods():
    """What the Serve controller does with serveConfigV2 (Ray's own schema,
    import and build), and the replicas' needs against the pods' GPUs/CPUs."""
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app
    from ray.serve.schema import ServeDeploySchema

    rs = render(gpu_values())["RayService"]
    serve_config, app = serve_app(rs)
    ServeDeploySchema.model_validate(serve_config)
    built = build_app(call_user_app_builder_with_args_if_necessary(
        import_attr(app["import_path"]), app["args"]), name=app["name"], default_runtime_env={})
    deployments = {d.name: d for d in built.deployments}
    assert set(deployments) == {"router", "ledger", "target", "draft-llama-1b", "draft-llama-8b"}
    assert built.ingress_deployment_name == "router"
    # The ledger (the app's figures across routers) needs no router pod slot.
    assert deployments["ledger"]._replica_config.ray_actor_options["num_cpus"] == 0
    assert "resources" not in deployments["ledger"]._replica_config.ray_actor_options

    g = groups(rs)
    limits = {name: container(group)["resources"]["limits"] for name, group in g.items()}
    bundles = deployments["target"]._replica_config.placement_group_bundles
    # One target replica (all its tensor-parallel bundles) fits one target pod.
    assert sum(b["GPU"] for b in bundles) == limits["target"]["nvidia.com/gpu"] == 4
    assert sum(b["CPU"] for b in bundles) <= float(limits["target"]["cpu"])
    for name in ("draft-llama-1b", "draft-llama-8b"):
        d = deployments[name]
        actor = d._replica_config.ray_actor_options
        assert actor["num_gpus"] <= limits[name]["nvidia.com/gpu"]
        assert actor["num_cpus"] <= float(limits[name]["cpu"])
    # The pools' bounds are deployment options of the Serve config (live settings).
    options = {d["name"]: d for d in app["deployments"]}
    assert [options[n]["autoscaling_config"]["max_replicas"]
            for n in ("target", "draft-llama-1b", "draft-llama-8b")] == [4, 8, 4]


def test_values_schema_rejects_typos_and_bad_values():
    import helm_python as helm

    chart().validate_schema(gpu_values())
    for bad in ({"specserve": {"target": {"max_replica": 4}}},  # AppConfig: unknown key
                {"specserve": {"speculation": {"num_speculative_tokens": 99}}},
                {"specserve": {"drafts": [{"name": "x", "kind": "llm"}]}},  # no such kind
                {"workerGroups": {"target": {"gpus": -1}}},
                {"workerGroups": {"target": {"nodeselector": {}}}},
                {"servicemonitor": {"enabled": True}}):
        with pytest.raises(helm.HelmValuesError):
            chart().validate_schema(bad)
        with pytest.raises(helm.HelmError):  # installs and renders refuse them too
            chart().render(bad, name="spec")


def test_overrides_reach_the_serve_config():
    values = {"specserve": {"http": {"port": 9000},
                            "speculation": {"num_speculative_tokens": 6, "lookahead": 12},
                            "target": {"engine": {"max_model_len": 4096}}},
              "workerGroups": {"target": {"gpus": 2, "minReplicas": 0, "maxReplicas": 3}}}
    objs = render(values)
    rs = objs["RayService"]
    check_rayservice(rs)
    serve_config, app = serve_app(rs)
    cfg = chart_config(app)
    assert cfg.http.port == 9000 and cfg.http.host == "0.0.0.0"
    assert cfg.speculation.num_speculative_tokens == 6 and cfg.target.engine.max_model_len == 4096
    assert serve_config["http_options"]["port"] == 9000
    target = groups(rs)["target"]
    assert (target["minReplicas"], target["maxReplicas"]) == (0, 3)
    assert container(target)["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert {"name": "serve", "containerPort": 9000} in container(target)["ports"]
    assert "Authorization: Bearer" not in objs["NOTES"]


def _pods(rs: dict) -> list[dict]:
    spec = rs["spec"]["rayClusterConfig"]
    return [spec["headGroupSpec"], *spec["workerGroupSpecs"]]


def test_every_pod_starts_ray_with_the_node_environment():
    """The engines run at the pod's priority, not Ray's worker nice 15
    (specserve.placement.RAY_NODE_ENV, which `specserve serve` sets too)."""
    from specserve.placement import RAY_NODE_ENV

    for values in (None, gpu_values()):
        rs = render(values)["RayService"]
        for pod in _pods(rs):
            env = {e["name"]: e.get("value") for e in container(pod)["env"]}
            assert {k: env.get(k) for k in RAY_NODE_ENV} == RAY_NODE_ENV


@pytest.mark.parametrize("api_key", [{"existingSecret": "my-key", "secretKey": "token"},
                                     {"value": "k3y-s3cret"}])
def test_api_key_comes_from_a_secret_never_the_serve_config(api_key, monkeypatch):
    values = {**gpu_values(), "apiKey": api_key}
    objs = render(values)
    rs = objs["RayService"]
    check_rayservice(rs)
    name = api_key.get("existingSecret", "spec-specserve-api-key")
    key = api_key.get("secretKey", "api-key")
    if "value" in api_key:
        secret = objs["Secret/api-key"]
        validate_core(secret)
        assert secret["metadata"]["name"] == name
        assert secret["stringData"] == {key: "k3y-s3cret"}
        assert "k3y-s3cret" not in yaml.safe_dump(rs)
    else:
        assert "Secret/api-key" not in objs
    _, app = serve_app(rs)
    cfg = chart_config(app)
    assert cfg.http.api_key is None and cfg.http.api_key_env == "SPECSERVE_API_KEY"
    # Only the router's pods get the key from the Secret (the router runs
    # nowhere else: it asks for the Ray resource only they advertise).
    assert cfg.router.ray_resource == ROUTER_RESOURCE
    for pod in _pods(rs):
        hosts_router = ROUTER_RESOURCE in pod["rayStartParams"].get("resources", "")
        assert hosts_router == (pod.get("groupName") == "router")
        assert ({"name": "SPECSERVE_API_KEY",
                 "valueFrom": {"secretKeyRef": {"name": name, "key": key}}}
                in container(pod)["env"]) == hosts_router
    monkeypatch.setenv("SPECSERVE_API_KEY", "from-the-secret")
    assert cfg.http.api_keys() == ("from-the-secret",)
    # Prometheus authenticates with the same Secret.
    endpoint = objs["PodMonitor/router"]["spec"]["podMetricsEndpoints"][0]
    assert endpoint["authorization"]["credentials"] == {"name": name, "key": key}
    assert "Authorization: Bearer $API_KEY" in objs["NOTES"]
    assert f"get secret {name}" in objs["NOTES"]


def test_a_plain_text_api_key_is_refused():
    import helm_python as helm

    with pytest.raises(helm.HelmError, match="plain text.*apiKey.existingSecret"):
        render({"specserve": {"http": {"api_key": "k3y"}}})


def test_pod_settings_reach_every_group_and_the_chart_takes_global():
    settings = {
        "serviceAccountName": "specserve", "runtimeClassName": "nvidia",
        "priorityClassName": "inference", "securityContext": {"fsGroup": 100},
        "containerSecurityContext": {"allowPrivilegeEscalation": False},
        "envFrom": [{"secretRef": {"name": "hf-token"}}],
        "labels": {"team": "llm"}, "annotations": {"example.com/owner": "llm"},
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": {"team": "llm"}}}],
    }
    values = gpu_values()
    values["global"] = {"imageRegistry": "ignored.example.com"}
    values["head"] = {**values["head"], **settings}
    for name in ("target", "draft", "router"):
        values["workerGroups"][name] = {**values["workerGroups"][name], **settings}
    values["gcsFaultTolerance"] = {"enabled": True, "redisAddress": "redis:6379",
                                   "redisPasswordSecret": {"name": "redis", "key": "password"}}
    chart().validate_schema(values)
    rs = render(values)["RayService"]
    check_rayservice(rs)
    for pod in _pods(rs):
        t = pod["template"]
        spec = t["spec"]
        for k in ("serviceAccountName", "runtimeClassName", "priorityClassName",
                  "topologySpreadConstraints"):
            assert spec[k] == settings[k], k
        # Helm merges a group's securityContext into the chart's restricted defaults.
        assert spec["securityContext"]["fsGroup"] == 100
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert container(pod)["securityContext"] == {"allowPrivilegeEscalation": False,
                                                     "capabilities": {"drop": ["ALL"]}}
        assert container(pod)["envFrom"] == settings["envFrom"]
        assert t["metadata"]["labels"]["team"] == "llm"
        assert t["metadata"]["annotations"] == settings["annotations"]
    assert rs["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis", "key": "password"}}}}


@pytest.mark.parametrize("group, resources, message", [
    ("target", {"limits": {"cpu": "15", "memory": "300Gi"}},
     "cpu 15 is less than the 16 CPUs one target replica asks Ray for "
     r"\(tensor_parallel_size 4 x resources per worker\)"),
    ("target", {"limits": {"cpu": "16000m", "memory": "255Gi"}},
     "memory 255Gi is less than the 256Gi"),
    ("draft", {"limits": {"cpu": "3"}}, "cpu 3 is less than the 4 CPUs one draft replica "
                                          r"asks Ray for \(draft llama-8b\)"),
])
def test_pods_too_small_for_their_replicas_fail_at_render(group, resources, message):
    import helm_python as helm

    values = gpu_values()
    values["workerGroups"][group] = {**values["workerGroups"][group], "resources": resources}
    with pytest.raises(helm.HelmError, match=message):
        render(values)
    # Exactly enough renders.
    values["workerGroups"][group]["resources"] = {
        "limits": {"cpu": "16", "memory": "256Gi"} if group == "target" else {"cpu": "4"}}
    render(values)


def test_each_draft_pool_gets_its_own_group():
    """Unset bounds count as AppConfig's defaults (1); GPUs round up a share;
    an L4 pool and an L40S pool advertise only their own accelerator type, and
    draftPools.<name> places one pool on other nodes."""
    values = {"specserve": {"drafts": [
        {"name": "a", "model": "/m", "resources": {"gpus_per_worker": 1,
                                                   "accelerator_type": "L4"}},
        {"name": "b", "model": "/n", "replicas": {"min_replicas": 0, "max_replicas": 3},
         "resources": {"gpus_per_worker": 0.5, "accelerator_type": "L40S"}}]},
        "workerGroups": {
            "draft": {"nodeSelector": {"gpu": "l4"}},
            "draftPools": {"b": {"nodeSelector": {"gpu": "l40s"}, "tolerations": [
                {"key": "l40s", "operator": "Exists", "effect": "NoSchedule"}]}}}}
    rs = render(values)["RayService"]
    check_rayservice(rs)
    g = groups(rs)
    assert set(g) == {"target", "draft-a", "draft-b"}
    a, b = g["draft-a"], g["draft-b"]
    assert (a["minReplicas"], a["maxReplicas"]) == (1, 1)
    assert (b["minReplicas"], b["maxReplicas"]) == (0, 3)
    for group, kind, selector in ((a, "L4", "l4"), (b, "L40S", "l40s")):
        assert container(group)["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert json.loads(json.loads(group["rayStartParams"]["resources"])) == {
            f"accelerator_type:{kind}": 1}
        assert group["template"]["spec"]["nodeSelector"] == {"gpu": selector}
        assert group["template"]["metadata"]["labels"]["specserve.io/draft-pool"] == \
            group["groupName"].removeprefix("draft-")
    assert "tolerations" not in a["template"]["spec"]
    assert b["template"]["spec"]["tolerations"][0]["key"] == "l40s"


@pytest.mark.parametrize("override, message", [
    ({"target": {"gpus": 3}}, r"workerGroups.target.gpus 3 is less than the 4 GPUs one "
                              r"replica needs on a pod \(tensor_parallel_size 4 x gpus_per_worker 1\)"),
    ({"draftPools": {"llama-8b": {"gpus": 0}}}, "workerGroups.draftPools.llama-8b.gpus 0 is "
                                                "less than the 1 GPUs"),
    ({"draftPools": {"llama-3b": {"gpus": 1}}}, "no draft pool is named llama-3b"),
])
def test_group_overrides_that_cannot_hold_a_replica_fail_at_render(override, message):
    import helm_python as helm

    values = gpu_values()
    for group, settings in override.items():
        if group == "draftPools":
            values["workerGroups"]["draftPools"] = settings
        else:
            values["workerGroups"][group] = {**values["workerGroups"][group], **settings}
    with pytest.raises(helm.HelmError, match=message):
        render(values)


# ---- the Grafana dashboard ----------------------------------------------------------

def exported_metric_names() -> set[str]:
    """What specserve exports: the catalogue's series (the router's /metrics and,
    with Ray's prefix, its Ray metrics; tests/acceptance/test_catalogue.py holds
    /metrics to the catalogue) and any constant name the code gives
    ray.serve.metrics' Counter/Gauge/Histogram, as Ray's exporter names them."""
    from specserve.acceptance import catalogue

    names = catalogue.series_names()
    suffixes = {"Counter": ("", "_total"), "Gauge": ("",),
                "Histogram": ("_bucket", "_sum", "_count")}
    for path in [*(REPO / "specserve").rglob("*.py"), *(REPO / "deployments").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in suffixes and node.args
                    and isinstance(node.args[0], ast.Constant)):
                names |= {f"ray_{node.args[0].value}{s}" for s in suffixes[node.func.id]}
    return names


def test_grafana_dashboard_queries_only_exported_metrics():
    panels = dashboard()["panels"]
    titles = " | ".join(p["title"] for p in panels)
    for topic in ("Acceptance rate per draft model", "Acceptance per position", "Coverage",
                  "K ", "TTFT", "TPOT", "Replicas per pool", "Tokens/s", "Autoscaling"):
        assert topic in titles, topic
    exported = exported_metric_names()
    assert {"specserve_accepted_tokens_total", "ray_specserve_ttft_seconds_bucket",
            "ray_specserve_autoscale_desired_replicas", "specserve_pool_replicas"} <= exported
    for expr in grafana_expressions():
        metrics, functions = promql_metrics(expr)
        assert metrics, expr
        assert metrics <= exported, (expr, sorted(metrics - exported))
        assert functions <= PROMQL_FUNCTIONS, (expr, functions - PROMQL_FUNCTIONS)


def test_promql_parsing_finds_names_and_misses_none():
    m, f = promql_metrics('sum by (a, b) (rate(x_total{a!="none", b=~"q(.*)"}[5m])) / on (a) '
                          'group_left sum by (a) (rate(y_total[1h])) + 1 - z')
    assert m == {"x_total", "y_total", "z"} and f == {"sum", "rate"}
    assert not exported_metric_names() >= {"specserve_no_such_metric"}
