"""The split of a config into what needs new replicas (the Serve app's args)
and what running replicas take (user_config), specserve/config/live.py, and
the Serve config written from it (deployments.app.serve_app)."""

import pytest

from deployments.app import serve_app
from specserve.config import AppConfig, ConfigError
from specserve.config.live import code_part, live_part, with_live

BASE = {"target": {"model": "/m/target", "replicas": {"min_replicas": 1, "max_replicas": 2}},
        "drafts": [{"name": "small", "model": "/m/draft"}],
        "speculation": {"num_speculative_tokens": 4, "max_speculative_tokens": 6},
        "quotas": {"max_n": 4}}


def cfg(**changes) -> AppConfig:
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}
    for path, value in changes.items():
        section, key = path.split("__")
        data[section] = {**data.get(section, {}), key: value}
    return AppConfig.from_dict(data)


def test_the_parts_join_back_into_the_config():
    c = cfg()
    joined = with_live(AppConfig.from_dict(code_part(c)), live_part(c))
    assert joined == c


@pytest.mark.parametrize("change", [
    {"speculation__num_speculative_tokens": 2},
    {"speculation__k_control": {"margin": 0.1}},
    {"quotas__max_n": 8},
    {"quotas__request_timeout_s": 5},
    {"quotas__max_queued_requests": None},
    {"target__replicas": {"min_replicas": 1, "max_replicas": 4}},
])
def test_live_changes_leave_the_args_as_they_were(change):
    assert code_part(cfg(**change)) == code_part(cfg())
    assert live_part(cfg(**change)) != live_part(cfg())
    assert serve_app(cfg(**change))["args"] == serve_app(cfg())["args"]


@pytest.mark.parametrize("change", [
    {"target__model": "/m/other"},
    {"target__tensor_parallel_size": 2},
    {"speculation__max_speculative_tokens": 8},
    {"speculation__branch_fan_out": 1},
])
def test_other_changes_change_the_args(change):
    assert code_part(cfg(**change)) != code_part(cfg())


def test_without_a_ceiling_k_is_the_engines_and_its_change_restarts():
    plain = {**BASE, "speculation": {"num_speculative_tokens": 4}}
    four, two = AppConfig.from_dict(plain), AppConfig.from_dict(
        {**plain, "speculation": {"num_speculative_tokens": 2}})
    assert code_part(four)["speculation"]["max_speculative_tokens"] == 4
    assert code_part(four) != code_part(two)


def test_a_live_k_past_the_ceiling_or_w_is_refused():
    c = cfg()
    with pytest.raises(ConfigError, match="max_speculative_tokens"):
        with_live(c, {"speculation": {"num_speculative_tokens": 7}})
    with pytest.raises(ConfigError, match="unknown sections"):
        with_live(c, {"model": "x"})
    with pytest.raises(ValueError, match="lookahead"):
        cfg(speculation__lookahead=5)  # W must exceed the ceiling, 6


def test_the_serve_app_gives_the_live_part_to_router_and_target_and_the_bounds_to_serve():
    app = serve_app(cfg())
    assert app["import_path"] == "deployments.app:app_from_args"
    by_name = {d["name"]: d for d in app["deployments"]}
    assert set(by_name) == {"router", "target", "draft-small"}
    assert by_name["router"]["user_config"] == by_name["target"]["user_config"] == live_part(cfg())
    assert by_name["target"]["max_queued_requests"] == 256
    assert by_name["target"]["num_replicas"] is None
    assert by_name["target"]["autoscaling_config"]["max_replicas"] == 2
    assert by_name["draft-small"]["num_replicas"] == 1
    assert "user_config" not in by_name["draft-small"]
    assert "quotas" not in app["args"] and "replicas" not in app["args"]["target"]


def test_the_serve_config_is_one_ray_serve_accepts():
    from ray.serve.schema import ServeDeploySchema

    from deployments.app import serve_deploy_config

    ServeDeploySchema.model_validate(serve_deploy_config(cfg()))


def test_the_code_version_ray_hashes_stays_for_live_changes_only():
    """deployments.app.code_version: what `specserve serve` compares on SIGHUP."""
    from deployments.app import code_version

    base = code_version(serve_app(cfg()))
    assert code_version(serve_app(cfg(speculation__num_speculative_tokens=2))) == base
    assert code_version(serve_app(cfg(target__replicas={"min_replicas": 1,
                                                        "max_replicas": 5}))) == base
    # Ray hashes the autoscaling policies too: fixed -> autoscaled is not live.
    assert code_version(serve_app(cfg(target__replicas={"min_replicas": 2,
                                                        "max_replicas": 2}))) != base
    assert code_version(serve_app(cfg(target__model="/m/other"))) != base
