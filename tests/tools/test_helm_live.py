"""The chart's serveConfigV2 keeps the live settings out of the app's args
(helm/specserve/templates/_helpers.tpl, "specserve.serveConfig"): rendered
by Helm's Go SDK, it is what `deployments.app.serve_app` writes for the same
config, and a change of K, the quotas or the replica bounds leaves the code
version Ray hashes (`get_app_code_version`) as it was, so no engine reloads.
"""

from __future__ import annotations

import copy

import pytest
import yaml

from deployments.app import code_version, serve_app as python_serve_app
from specserve.config import AppConfig
from specserve.config.live import live_part, with_live
from test_helm import chart_config, check_rayservice, gpu_values, render, serve_app


def with_k(values: dict, k: int) -> dict:
    out = copy.deepcopy(values)
    out["specserve"]["speculation"] = {"num_speculative_tokens": k, "max_speculative_tokens": 8,
                                       "lookahead": 9}
    return out


def _live_values() -> dict:
    """The GPU example with every live setting away from its default."""
    values = with_k(gpu_values(), 3)
    values["specserve"]["speculation"]["k_control"] = {"margin": 0.2, "probe_every": 7}
    values["specserve"]["quotas"] = {"max_n": 2, "max_queued_requests": None,
                                     "request_timeout_s": 30}
    values["specserve"]["drafts"][1]["replicas"] = {"min_replicas": 0, "max_replicas": 2,
                                                    "initial_replicas": 1}
    values["specserve"]["router"] = {"replicas": {"min_replicas": 2, "max_replicas": 6},
                                     "target_ongoing_requests": 100}
    return values


@pytest.mark.parametrize("values", ["default", "gpu", "live"])
def test_the_chart_renders_what_serve_app_writes(values):
    values = {"default": None, "gpu": gpu_values(), "live": _live_values()}[values]
    rs = render(values)["RayService"]
    check_rayservice(rs)
    _, app = serve_app(rs)
    cfg = chart_config(app)
    want = python_serve_app(cfg)
    assert {k: app[k] for k in ("name", "route_prefix", "import_path")} == \
        {k: want[k] for k in ("name", "route_prefix", "import_path")}
    # The args are the code part (the chart writes only the keys it was given,
    # so its code version is its own, not that of Python's full dump).
    assert AppConfig.from_dict(app["args"]) == AppConfig.from_dict(want["args"])
    got = {d["name"]: d for d in app["deployments"]}
    assert list(got) == [d["name"] for d in want["deployments"]]
    for d in want["deployments"]:
        g = dict(got[d["name"]])
        if "user_config" in d:  # the same live settings, written out in full by Python
            assert live_part(with_live(cfg, g.pop("user_config"))) == d.pop("user_config")
        assert g == d, d["name"]


def test_the_live_values_reach_the_config():
    _, app = serve_app(render(_live_values())["RayService"])
    cfg = chart_config(app)
    assert cfg.speculation.num_speculative_tokens == 3
    assert cfg.speculation.k_control.margin == 0.2 and cfg.quotas.max_n == 2
    assert cfg.quotas.max_queued_requests is None
    assert cfg.drafts[1].replicas.min_replicas == 0
    assert cfg.router.replicas.max_replicas == 6
    target = next(d for d in app["deployments"] if d["name"] == "target")
    assert target["max_queued_requests"] == -1  # Serve's "no limit"


def test_a_k_change_leaves_the_args_and_the_code_version_as_they_were():
    a = render(with_k(gpu_values(), 4))["RayService"]
    b = render(with_k(gpu_values(), 6))["RayService"]
    (_, app_a), (_, app_b) = serve_app(a), serve_app(b)
    assert yaml.safe_dump(app_a["args"]) == yaml.safe_dump(app_b["args"])
    assert code_version(app_a) == code_version(app_b)
    k = {name: [d["user_config"]["speculation"]["num_speculative_tokens"]
                for d in app["deployments"] if "user_config" in d]
         for name, app in (("a", app_a), ("b", app_b))}
    assert k == {"a": [4, 4], "b": [6, 6]}  # the router's and the target's user_config
    # Quotas and bounds are live too; the ceiling and the model are code.
    c = with_k(gpu_values(), 4)
    c["specserve"]["quotas"] = {"max_n": 2}
    c["specserve"]["target"]["replicas"]["max_replicas"] = 6
    assert code_version(serve_app(render(c)["RayService"])[1]) == code_version(app_a)
    for change in ({"speculation": {"num_speculative_tokens": 4, "max_speculative_tokens": 7,
                                    "lookahead": 9}},
                   {"target": {**c["specserve"]["target"], "model": "/models/other"}}):
        d = copy.deepcopy(c)
        d["specserve"].update(change)
        assert code_version(serve_app(render(d)["RayService"])[1]) != code_version(app_a)


def test_checked_in_serve_defaults_are_the_generated_ones():
    from specserve.tools.chart import DEFAULTS_PATH, render_defaults

    assert DEFAULTS_PATH.read_text() == render_defaults(), \
        "helm/specserve/serve-defaults.json is stale: run `make helm-schema`"
