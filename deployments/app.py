"""The one builder: wires Router, LedgerServer, TargetServer and DraftServers into Ray Serve.

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

from specserve.config import AppConfig, Autoscaling, QuotaConfig, SpeculationConfig
from specserve.config.live import code_part, live_part
from specserve.placement import draft_actor_options, target_placement

from deployments.draft import DraftServer
from deployments.ledger import LedgerServer
from deployments.router import Router
from deployments.target import TargetServer


APP_NAME = "specserve"
IMPORT_PATH = "deployments.app:app_from_args"
# Replicas sample record_autoscaling_stats every look_back/5 seconds.
LOOK_BACK_PERIOD_S = 10
POLICIES = {"target": "specserve.control.autoscale:target_policy",
            "draft": "specserve.control.autoscale:draft_policy"}


def _scaling(r: Autoscaling, pool: str) -> dict:
    """Fixed replicas, or autoscaling with specserve's policy of `pool`
    (specserve.control.autoscale); the other option null, so that one
    replaces the other when the Serve config changes. The Helm chart renders
    the same (helm/specserve/serve-defaults.json, `chart_defaults`)."""
    return _replicas(r, {"look_back_period_s": LOOK_BACK_PERIOD_S,
                         "policy": {"policy_function": POLICIES[pool]}})


def _replicas(r: Autoscaling, how: dict) -> dict:
    """Fixed replicas (min = max), or Serve's autoscaling between the bounds,
    as `how` says (a policy, or Serve's own target)."""
    if r.min_replicas == r.max_replicas:
        return {"num_replicas": r.max_replicas, "autoscaling_config": None}
    return {"num_replicas": None, "autoscaling_config": {
        "min_replicas": r.min_replicas, "max_replicas": r.max_replicas,
        "initial_replicas": r.initial_replicas,
        "upscale_delay_s": r.upscale_delay_s, "downscale_delay_s": r.downscale_delay_s,
        **how}}


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
            **_scaling(d.replicas, "draft"),
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
        **_scaling(t.replicas, "target"),
    ).bind(config, drafts)

    # The app's figures across router replicas (one replica; the routers feed
    # it). It takes no CPU and needs no key: it runs anywhere, not in a
    # router pod's slot (router.ray_resource).
    ledger = serve.deployment(LedgerServer).options(
        name="ledger",
        ray_actor_options={"num_cpus": 0},
        num_replicas=1,
        # every router's batches and views (each answered at once, in memory):
        # not Serve's default of 5 at a time
        max_ongoing_requests=LEDGER_MAX_ONGOING,
        health_check_period_s=10,
    ).bind(code.speculation.num_speculative_tokens)

    return serve.deployment(Router).options(
        name="router",
        ray_actor_options=router_actor_options(cfg),
        max_ongoing_requests=ROUTER_MAX_ONGOING,
        user_config=live,
        **_router_scaling(cfg),
    ).bind(config, target, list(drafts), ledger=ledger)


ROUTER_MAX_ONGOING = 1024
LEDGER_MAX_ONGOING = 256


def router_actor_options(cfg: AppConfig) -> dict:
    """The router takes no CPU; with router.ray_resource it runs only where
    that resource is (the chart's router pods, or the head: the pods that hold
    the API key)."""
    opts: dict = {"num_cpus": 0}
    if cfg.router.ray_resource:
        opts["resources"] = {cfg.router.ray_resource: 1}
    return opts


def _router_scaling(cfg: AppConfig) -> dict:
    """Fixed router replicas, or Serve's own request-based autoscaling."""
    return _replicas(cfg.router.replicas,
                     {"target_ongoing_requests": cfg.router.target_ongoing_requests})


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
            {"name": "router", "user_config": live, **_router_scaling(cfg)},
            {"name": "target", "user_config": live, "max_queued_requests": _queue(cfg),
             **_scaling(t.replicas, "target")},
            *({"name": f"draft-{d.name}", **_scaling(d.replicas, "draft")}
              for d in cfg.drafts),
        ],
    }


def code_version(app: dict) -> str:
    """The code version Ray Serve gives every deployment of the Serve app
    `app` (a `serve_app`): what must stay the same for a change to restart no
    replica. Ray hashes the args, and also the deployments' autoscaling
    policies: a pool switched between fixed replicas and autoscaling changes it."""
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve.schema import ServeApplicationSchema

    return get_app_code_version(ServeApplicationSchema.model_validate(app))


def chart_defaults() -> dict:
    """What the Helm chart needs to render `serve_app` from its values, which
    hold only the keys that differ from AppConfig's defaults: the app's name
    and builder, the defaults of the live settings, and the autoscaling
    options `_scaling` adds. `make helm-schema` writes it to
    helm/specserve/serve-defaults.json (JSON types)."""
    return {"app": {"name": APP_NAME, "import_path": IMPORT_PATH},
            "num_speculative_tokens": SpeculationConfig().num_speculative_tokens,
            "replicas": Autoscaling().model_dump(mode="json"),
            "max_queued_requests": QuotaConfig().max_queued_requests,
            "router_target_ongoing_requests": AppConfig().router.target_ongoing_requests,
            "look_back_period_s": LOOK_BACK_PERIOD_S,
            "policies": POLICIES}


def serve_deploy_config(cfg: AppConfig) -> dict:
    """A whole Serve config file for `cfg` (`serve deploy FILE`)."""
    return {"http_options": {"host": cfg.http.host, "port": cfg.http.port},
            "applications": [serve_app(cfg)]}


def app_from_args(args: dict):
    """Serve config entry point (`import_path: deployments.app:app_from_args`):
    `args` is an AppConfig as a mapping, e.g. the Helm chart's `specserve`
    values rendered into the RayService's serveConfigV2."""
    return build_app(AppConfig.from_dict(args, source="serve config args"))
