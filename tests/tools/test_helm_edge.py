"""The chart's edge (docs/kubernetes.md, "Before production"), rendered by
Helm's Go SDK and validated like tests/tools/test_helm.py does: the /metrics
scrape key apart from the API key, and what the router's PodMonitor sends.
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
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert _env(head)["SPECSERVE_METRICS_KEY"]["valueFrom"] == {
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
