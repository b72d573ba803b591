"""The chart's edge (docs/kubernetes.md, "Before production"), rendered by
Helm's Go SDK and validated like tests/tools/test_helm.py does: the /metrics
scrape key apart from the API key, and what the router's PodMonitor sends;
the Ingress / Gateway API options with TLS; the router on its own pods (the
only ones with the keys), autoscaled by Serve.
"""

from __future__ import annotations

import pytest

from test_helm import (chart_config, check_rayservice, container, gpu_values, groups, render,
                       serve_app, validate_core)


def _env(group: dict) -> dict:
    return {e["name"]: e for e in container(group)["env"]}


@pytest.mark.parametrize("metrics_key", [{"existingSecret": "scrape", "secretKey": "token"},
                                         {"value": "scr4pe"}])
def test_metrics_has_its_own_key_and_the_monitor_sends_it(metrics_key, monkeypatch):
    values = {**gpu_values(), "apiKey": {"existingSecret": "api"}, "metricsKey": metrics_key}
    objs = render(values)
    rs = objs["RayService"]
    check_rayservice(rs)
    name = metrics_key.get("existingSecret", "spec-specserve-metrics-key")
    key = metrics_key.get("secretKey", "metrics-key")
    if "value" in metrics_key:
        validate_core(objs["Secret/metrics-key"])
        assert objs["Secret/metrics-key"]["stringData"] == {key: "scr4pe"}
        assert "scr4pe" not in str(rs)
    else:
        assert "Secret/metrics-key" not in objs
    cfg = chart_config(serve_app(rs)[1])
    assert cfg.http.metrics_key_env == "SPECSERVE_METRICS_KEY"
    assert cfg.http.api_key_env == "SPECSERVE_API_KEY"
    # On the router's pods only (where the router runs).
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert {n for n, g in {"head": head, **groups(rs)}.items()
            if "SPECSERVE_METRICS_KEY" in _env(g)} == {"router"}
    assert _env(groups(rs)["router"])["SPECSERVE_METRICS_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": name, "key": key}}
    # The router reads it: /metrics then takes that key only (tests/deployments/test_router.py).
    monkeypatch.setenv("SPECSERVE_METRICS_KEY", "from-the-secret")
    assert cfg.http.metrics_keys() == ("from-the-secret",)
    endpoint = objs["PodMonitor/router"]["spec"]["podMetricsEndpoints"][0]
    assert endpoint["authorization"]["credentials"] == {"name": name, "key": key}


def test_without_a_metrics_key_the_monitor_sends_the_api_key():
    objs = render({**gpu_values(), "apiKey": {"existingSecret": "api"}})
    cfg = chart_config(serve_app(objs["RayService"])[1])
    assert cfg.http.metrics_key_env is None
    endpoint = objs["PodMonitor/router"]["spec"]["podMetricsEndpoints"][0]
    assert endpoint["authorization"]["credentials"] == {"name": "api", "key": "api-key"}
    for group in groups(objs["RayService"]).values():
        assert "SPECSERVE_METRICS_KEY" not in _env(group)


# ---- Ingress / Gateway API with TLS ------------------------------------------------------

def test_no_external_endpoint_by_default():
    objs = render(gpu_values())
    assert "Ingress" not in objs and "HTTPRoute" not in objs


def test_ingress_terminates_tls_and_routes_to_the_serve_service():
    values = {**gpu_values(), "ingress": {
        "enabled": True, "className": "nginx", "host": "llm.example.com",
        "annotations": {"cert-manager.io/cluster-issuer": "letsencrypt"},
        "tls": {"secretName": "llm-tls"}}}
    objs = render(values)
    ing = objs["Ingress"]
    validate_core(ing)
    svc = objs["RayService"]["spec"]["serveService"]
    assert ing["spec"]["tls"] == [{"hosts": ["llm.example.com"], "secretName": "llm-tls"}]
    (rule,) = ing["spec"]["rules"]
    assert rule["host"] == "llm.example.com"
    (path,) = rule["http"]["paths"]
    assert path["backend"]["service"] == {"name": svc["metadata"]["name"],
                                          "port": {"number": svc["spec"]["ports"][0]["port"]}}
    assert ing["spec"]["ingressClassName"] == "nginx"
    assert ing["metadata"]["annotations"] == {"cert-manager.io/cluster-issuer": "letsencrypt"}


@pytest.mark.parametrize("ingress, message", [
    ({"enabled": True, "tls": {"secretName": "x"}}, "needs ingress.host"),
    ({"enabled": True, "host": "llm.example.com"}, "no plaintext public endpoint"),
])
def test_an_ingress_without_host_or_tls_fails_at_render(ingress, message):
    import helm_python as helm

    with pytest.raises(helm.HelmError, match=message):
        render({**gpu_values(), "ingress": ingress})


def test_gateway_route_attaches_to_the_https_listener():
    import helm_python as helm

    parent = {"name": "public", "namespace": "gateways", "sectionName": "https"}
    objs = render({**gpu_values(), "gateway": {"enabled": True, "parentRefs": [parent],
                                               "hostnames": ["llm.example.com"],
                                               "requestTimeout": "700s"}})
    route = objs["HTTPRoute"]
    svc = objs["RayService"]["spec"]["serveService"]
    # The fields of Gateway API v1's HTTPRoute (no CRD of it is vendored here).
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert set(route["spec"]) == {"parentRefs", "hostnames", "rules"}
    assert route["spec"]["parentRefs"] == [parent]
    (rule,) = route["spec"]["rules"]
    assert rule == {"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                    "backendRefs": [{"name": svc["metadata"]["name"],
                                     "port": svc["spec"]["ports"][0]["port"]}],
                    "timeouts": {"request": "700s"}}
    with pytest.raises(helm.HelmError, match="needs gateway.parentRefs"):
        render({**gpu_values(), "gateway": {"enabled": True}})


# ---- the router off the head, autoscaled ---------------------------------------------------

def _resources(group: dict) -> dict:
    import json

    raw = group["rayStartParams"].get("resources")
    return json.loads(json.loads(raw)) if raw else {}


def test_the_router_runs_on_its_own_pods_and_autoscales():
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app

    values = gpu_values()
    values["specserve"]["router"] = {"replicas": {"min_replicas": 2, "max_replicas": 8}}
    rs = render(values)["RayService"]
    check_rayservice(rs)
    _, app = serve_app(rs)
    cfg = chart_config(app)
    resource = cfg.router.ray_resource
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]
    g = groups(rs)
    # Only the router group advertises the router's resource (2 replicas a pod),
    # and it is the CPU image's, with no GPU and no other replica (num-cpus 0).
    assert {n for n, grp in {"head": head, **g}.items() if resource in _resources(grp)} == \
        {"router"}
    assert _resources(g["router"]) == {resource: 2}
    assert g["router"]["rayStartParams"]["num-cpus"] == "0"
    assert "nvidia.com/gpu" not in container(g["router"])["resources"]["limits"]
    assert (g["router"]["minReplicas"], g["router"]["maxReplicas"]) == (1, 4)
    # Serve autoscales the router on requests in flight (its own policy).
    router = next(d for d in app["deployments"] if d["name"] == "router")
    assert router["num_replicas"] is None
    assert router["autoscaling_config"] == {
        "min_replicas": 2, "max_replicas": 8, "initial_replicas": None,
        "upscale_delay_s": 30, "downscale_delay_s": 300, "target_ongoing_requests": 256}
    # What Serve builds: the router's replicas ask for one unit of it, no CPU.
    built = build_app(call_user_app_builder_with_args_if_necessary(
        import_attr(app["import_path"]), app["args"]), name=app["name"], default_runtime_env={})
    (d,) = [d for d in built.deployments if d.name == "router"]
    assert d._replica_config.ray_actor_options["resources"] == {resource: 1}
    assert d._replica_config.ray_actor_options["num_cpus"] == 0


def test_router_ray_resource_is_the_charts():
    import helm_python as helm

    values = gpu_values()
    values["specserve"]["router"] = {"ray_resource": "mine"}
    with pytest.raises(helm.HelmError, match="router.ray_resource is the chart's"):
        render(values)
