"""The one builder: wires Router, TargetServer and DraftServers into Ray Serve.

Only here are `serve.deployment(...).options(...).bind(...)` applied; the
deployment classes stay plain Python. Every Serve option comes from the one
config model (`specserve.config.AppConfig`).
"""

from __future__ import annotations

from specserve.config import AppConfig, Autoscaling, Resources

from deployments.draft import DraftServer
from deployments.router import Router
from deployments.target import TargetServer


def _scaling(r: Autoscaling, policy: str) -> dict:
    """Fixed replicas, or autoscaling with specserve's policy (specserve.control.autoscale)."""
    if r.min_replicas == r.max_replicas:
        return {"num_replicas": r.max_replicas}
    return {"autoscaling_config": {
        "min_replicas": r.min_replicas, "max_replicas": r.max_replicas,
        "initial_replicas": r.initial_replicas,
        "upscale_delay_s": r.upscale_delay_s, "downscale_delay_s": r.downscale_delay_s,
        # Replicas sample record_autoscaling_stats every look_back/5 seconds.
        "look_back_period_s": 10,
        "policy": {"policy_function": f"specserve.control.autoscale:{policy}"},
    }}


def _actor_options(res: Resources, cpus: float | None = None) -> dict:
    opts: dict = {"num_cpus": res.cpus_per_worker if cpus is None else cpus,
                  "num_gpus": res.gpus_per_worker}
    if res.accelerator_type:
        opts["accelerator_type"] = res.accelerator_type
    if res.memory_gib:
        opts["memory"] = int(res.memory_gib * (1 << 30))
    if res.env:
        opts["runtime_env"] = {"env_vars": dict(res.env)}
    return opts


def build_app(cfg: AppConfig):
    from ray import serve

    config = cfg.model_dump(mode="json")
    drafts = {}
    for d in cfg.drafts:
        drafts[d.name] = serve.deployment(DraftServer).options(
            name=f"draft-{d.name}",
            ray_actor_options=_actor_options(d.resources),
            max_ongoing_requests=d.max_ongoing_requests,
            health_check_period_s=10,
            **_scaling(d.replicas, "draft_policy"),
        ).bind(d.model_dump(mode="json"), cfg.target.tensor_parallel_size,
               cfg.grpc_tls.model_dump(mode="json") if cfg.grpc_tls else None,
               cfg.speculation.model_dump(mode="json"))

    t = cfg.target
    tp = t.tensor_parallel_size
    bundle = {"CPU": t.resources.cpus_per_worker}
    if t.resources.gpus_per_worker:
        bundle["GPU"] = t.resources.gpus_per_worker
    if t.resources.accelerator_type:
        bundle[f"accelerator_type:{t.resources.accelerator_type}"] = 0.001
    # One bundle per TP worker; the replica actor itself lives in the first
    # bundle and asks for its share of it (vLLM's workers use the rest).
    actor = _actor_options(t.resources)
    actor.pop("accelerator_type", None)  # expressed by the bundles
    target = serve.deployment(TargetServer).options(
        name="target",
        ray_actor_options=actor,
        placement_group_bundles=[dict(bundle) for _ in range(tp)],
        placement_group_strategy="STRICT_PACK",
        max_ongoing_requests=t.max_ongoing_requests,
        health_check_period_s=10,
        **_scaling(t.replicas, "target_policy"),
    ).bind(config, drafts)

    return serve.deployment(Router).options(
        name="router",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=1024,
    ).bind(config, target, list(drafts))


def app_from_args(args: dict):
    """Serve config entry point (`import_path: deployments.app:app_from_args`):
    `args` is an AppConfig as a mapping, e.g. the Helm chart's `specserve`
    values rendered into the RayService's serveConfigV2."""
    return build_app(AppConfig.from_dict(args, source="serve config args"))
