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
