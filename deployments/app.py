"""The one builder: wires Router, TargetServer and DraftServers into Ray Serve.

Only here are `serve.deployment(...).options(...).bind(...)` applied; the
deployment classes stay plain Python. Every Serve option comes from the one
config model (`specserve.config.AppConfig`), the request routers of the
target and draft deployments too (`deployments.routing`). The replicas are built from the
config's code part and get its live part (K, thresholds, quotas, replica
bounds) as Serve's user_config, through their `reconfigure`
(`specserve.config.live`), so that a change of the live part restarts no
engine. `serve_config` writes the Serve config file (`serve deploy`,
KubeRay's serveConfigV2) that keeps the two parts apart.
"""

from __future__ import annotations

from specserve.config import AppConfig, Autoscaling
from specserve.config.live import code_part, live_part
from specserve.placement import draft_actor_options, target_placement

from deployments.draft import DraftServer
from deployments.router import Router
from deployments.target import TargetServer


APP_NAME = "specserve"
IMPORT_PATH = "deployments.app:app_from_args"


def _scaling(r: Autoscaling, policy: str) -> dict:
    """Fixed replicas, or autoscaling with specserve's policy
    (specserve.control.autoscale); the other option null, so that one
    replaces the other when the Serve config changes."""
    if r.min_replicas == r.max_replicas:
        return {"num_replicas": r.max_replicas, "autoscaling_config": None}
    return {"num_replicas": None, "autoscaling_config": {
        "min_replicas": r.min_replicas, "max_replicas": r.max_replicas,
        "initial_replicas": r.initial_replicas,
        "upscale_delay_s": r.upscale_delay_s, "downscale_delay_s": r.downscale_delay_s,
        # Replicas sample record_autoscaling_stats every look_back/5 seconds.
        "look_back_period_s": 10,
        "policy": {"policy_function": f"specserve.control.autoscale:{policy}"},
    }}


def build_app(cfg: AppConfig, target_cls=TargetServer, draft_cls=DraftServer):
    """The Serve app of `cfg`. target_cls / draft_cls: classes with the
    constructors of TargetServer / DraftServer (the placement tests deploy
    stand-ins, specserve.testing.standin, with exactly these options)."""
    from ray import serve

    # What the replicas are built from; the rest reaches them as user_config.
    code = AppConfig.from_dict(code_part(cfg), source="the config's code part")
    live = live_part(cfg)
    config = code.model_dump(mode="json")
    routing = cfg.routing
    drafts = {}
    for i, d in enumerate(cfg.drafts):
        drafts[d.name] = serve.deployment(draft_cls).options(
            name=f"draft-{d.name}",
            ray_actor_options=draft_actor_options(d.resources),
            max_ongoing_requests=d.max_ongoing_requests,
            health_check_period_s=10,
            # Each target replica picks the draft replica of each engine request.
            **_router(routing.draft, routing.max_extra_requests, draft=True),
            **_scaling(d.replicas, "draft_policy"),
        ).bind(code.drafts[i].model_dump(mode="json"), cfg.target.tensor_parallel_size,
               cfg.grpc_tls.model_dump(mode="json") if cfg.grpc_tls else None,
               code.speculation.model_dump(mode="json"))

    t = cfg.target
    # One bundle per TP worker; the replica actor lives in bundle 0 and takes no
    # GPU: on GPUs vLLM's Ray executor puts one worker on each bundle
    # (specserve.placement).
    place = target_placement(t)
    target = serve.deployment(target_cls).options(
        name="target",
        ray_actor_options=place.actor,
        placement_group_bundles=place.bundles,
        placement_group_strategy=place.strategy,
        max_ongoing_requests=t.max_ongoing_requests,
        # Requests a router replica holds for the target pool beyond what its
        # replicas take; past it the router answers 429 (deployments/router.py).
        max_queued_requests=_queue(cfg),
        health_check_period_s=10,
        user_config=live,
        # Each router replica picks the target replica of each HTTP request.
        **_router(routing.target, routing.max_extra_requests),
        **_scaling(t.replicas, "target_policy"),
    ).bind(config, drafts)

    return serve.deployment(Router).options(
        name="router",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=1024,
        user_config=live,
    ).bind(config, target, list(drafts))


def _router(policy: str, max_extra_requests: int, draft: bool = False) -> dict:
    """The request_router_config option of `routing:` (none: Serve's default)."""
    if policy != "prefix":
        return {}
    from ray.serve.config import RequestRouterConfig

    # By path: deployments.routing imports Ray Serve's router classes, which
    # this module (imported without Ray by the config and chart tools) must not.
    cls = "DraftAffinityRouter" if draft else "TargetAffinityRouter"
    return {"request_router_config": RequestRouterConfig(
        request_router_class=f"deployments.routing.{cls}",
        request_router_kwargs={"max_extra_requests": max_extra_requests})}


def _queue(cfg: AppConfig) -> int:
    """The target deployment's max_queued_requests (-1: Serve's "no limit")."""
    return cfg.quotas.max_queued_requests or -1


def serve_app(cfg: AppConfig) -> dict:
    """The Serve application config of `cfg` (one entry of a Serve config's
    `applications`): the code part as `args`, the live part as each
    deployment's user_config and options. Applying it again with only live
    settings changed (`serve deploy`, KubeRay) restarts no replica."""
    live = live_part(cfg)
    t = cfg.target
    return {
        "name": APP_NAME, "route_prefix": "/", "import_path": IMPORT_PATH,
        "args": code_part(cfg),
        "deployments": [
            {"name": "router", "user_config": live},
            {"name": "target", "user_config": live, "max_queued_requests": _queue(cfg),
             **_scaling(t.replicas, "target_policy")},
            *({"name": f"draft-{d.name}", **_scaling(d.replicas, "draft_policy")}
              for d in cfg.drafts),
        ],
    }


def serve_deploy_config(cfg: AppConfig) -> dict:
    """A whole Serve config file for `cfg` (`serve deploy FILE`)."""
    return {"http_options": {"host": cfg.http.host, "port": cfg.http.port},
            "applications": [serve_app(cfg)]}


def app_from_args(args: dict):
    """Serve config entry point (`import_path: deployments.app:app_from_args`):
    `args` is an AppConfig as a mapping, e.g. the Helm chart's `specserve`
    values rendered into the RayService's serveConfigV2."""
    return build_app(AppConfig.from_dict(args, source="serve config args"))
