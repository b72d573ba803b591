"""`specserve serve`: the Ray Serve app on a config, until Ctrl-C.

Owns what is checked before Ray starts (the config and its overrides, model
folders, tokenizers, the tool-call parser, each engine's max_model_len against its model, and on a
local cluster whether the deployments fit its CPUs) and waiting for the app to
run, saying which deployment waits for which resources and what each node has
free. The app is deployed from its Serve config (`deployments.app.serve_app`,
as `serve deploy` and KubeRay deploy it); on SIGHUP the config file is read
again and applied: a change of live settings only (K within its ceiling, the K
controller's thresholds, quotas, replica bounds: `specserve.config.live`)
reaches the running replicas, any other change replaces them. The checks are
`specserve.config.fit`.
"""

from __future__ import annotations

import os
import sys
import time

from specserve.cli.common import UsageError, draft_dir, model_dir

# A deployment Serve reports as waiting to be scheduled is described again
# after this many seconds if it still waits.
WAIT_REPEAT_S = 60.0


def ray_address(cfg) -> str | None:
    """The cluster to join, or None to start a local one."""
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    return address if address and address != "local" else None


def local_cluster_cpus(cfg) -> float | None:
    """CPUs of the local Ray cluster `serve` starts; None when it joins one."""
    if ray_address(cfg) is not None:
        return None
    return float(cfg.ray.num_cpus or os.cpu_count() or 1)


def serve_config(args):
    from specserve.config import AppConfig, ConfigError
    from specserve.models import DEFAULT_DRAFT_KEYWORD, tokenizers_compatible

    try:
        drafts = args.draft
        if drafts is not None and [d.lower() for d in drafts] == ["none"]:
            drafts = []
        if "suffix" in (drafts or []):
            raise UsageError("--draft takes draft model folders; a suffix draft pool is a "
                             "config's `kind: suffix` pool (the embedded default has one)")
        if any(d.lower().startswith("hybrid:") for d in drafts or []):
            raise UsageError("--draft takes draft model folders; a hybrid draft pool is a "
                             "config's `kind: hybrid` pool (with its model folder)")
        # With no config, draft models start from the default's model-draft pair.
        cfg = (AppConfig.from_yaml(args.config) if args.config
               else AppConfig.embedded_default(model_draft=bool(drafts)))
        target = model_dir(args.target, "target") if args.target else None
        from specserve.draft.synthetic import is_synthetic

        if any(is_synthetic(d) for d in drafts or []):
            raise UsageError("synthetic drafts work in 'specserve generate' and 'specserve "
                             "bench' only: a Serve draft replica cannot know a request's "
                             "continuation in advance; pass a draft model folder")
        # 'default' stays a keyword in the config; each replica resolves it.
        drafts = None if drafts is None else [
            d if d == DEFAULT_DRAFT_KEYWORD else model_dir(d, "draft") for d in drafts]
        base = cfg
        cfg = base.with_overrides(target=target, drafts=drafts, port=args.port,
                                  api_key=args.api_key, api_key_file=args.api_key_file,
                                  host=args.host)
        cfg = _share_local_cores(base, cfg, target, drafts, args)
        if args.api_key_file:
            cfg.http.api_keys()  # a missing or empty key file: one line now, not a 500 later
    except ConfigError as e:
        raise UsageError(str(e).replace("\n", "; ")) from None
    cpus = local_cluster_cpus(cfg)
    if cpus is not None:
        from specserve.config.fit import local_fit_problem

        problem = local_fit_problem(cfg, cpus)
        if problem:
            raise UsageError(problem)
    if cfg.target.model is not None:
        model_dir(cfg.target.model, "target")
    if cfg.target.tool_call_parser is not None:  # (imports vLLM: only when set)
        import logging

        from specserve.target.openai_app import check_tool_call_parser

        vllm_log = logging.getLogger("vllm")
        level = vllm_log.level
        vllm_log.setLevel(logging.ERROR)  # not its import-time notes: one line on error
        try:
            check_tool_call_parser(cfg.target.tool_call_parser)
        except ValueError as e:
            raise UsageError(str(e)) from None
        finally:
            vllm_log.setLevel(level)
    for d in cfg.drafts:
        if d.has_model:  # a suffix pool has no model folder
            draft_dir(d.model)
    return cfg, tokenizers_compatible


def _share_local_cores(base, cfg, target, drafts, args):
    """`--draft A --draft B` on a config sized for one draft pool: on a local
    cluster the pools share the first pool's CPUs when copying them would not fit."""
    from specserve.config.fit import local_fit_problem

    cpus = local_cluster_cpus(cfg)
    if cpus is None or not drafts or len(drafts) < 2 or not local_fit_problem(cfg, cpus):
        return cfg
    shared = base.with_overrides(target=target, drafts=drafts, port=args.port,
                                 api_key=args.api_key, api_key_file=args.api_key_file,
                                 share_draft_cpus=True, host=args.host)
    if local_fit_problem(shared, cpus):
        return cfg  # sharing does not help: the caller refuses with the figures
    each = shared.drafts[0].resources.cpus_per_worker
    print(f"specserve: the {len(drafts)} draft pools share the local cluster's cores: "
          f"{each:g} CPU each", file=sys.stderr, flush=True)
    return shared


def check_contexts(cfg, target_dir: str) -> None:
    """Each engine's max_model_len against the model it runs (one line, exit 2)."""
    from specserve.config.fit import context_problem
    from specserve.models import context_length

    engines = [("target", cfg.target.engine.max_model_len, target_dir)]
    engines += [(f"drafts[{i}] ({d.name})", d.engine.max_model_len, draft_dir(d.model))
                for i, d in enumerate(cfg.drafts) if d.has_model]
    for where, max_len, folder in engines:
        problem = context_problem(where, max_len, folder, context_length(folder))
        if problem:
            raise UsageError(problem)


def _free_by_node() -> dict[str, dict[str, float]]:
    """What each live node has free, by address (Ray's per-node view; the
    cluster's total where that is not available)."""
    import ray

    try:
        from ray._private.state import available_resources_per_node

        address = {n["NodeID"]: n.get("NodeManagerAddress", n["NodeID"]) for n in ray.nodes()
                   if n.get("Alive")}
        return {address.get(node, node): res
                for node, res in available_resources_per_node().items()}
    except Exception:  # a Ray without the per-node view: the cluster as one
        return {"(cluster)": ray.available_resources()}


def wait_running(serve, stop, cfg, app: str = "specserve") -> None:
    """Until every deployment (draft pools included) has its replicas up; a
    deployment Serve cannot place is named with what it asks and what is free."""
    from specserve.config.fit import deploy_asks, describe_ask, describe_free

    asks = {a.deployment: a for a in deploy_asks(cfg)}
    last, told = None, {}
    while not stop.is_set():
        status = serve.status().applications.get(app)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"the app failed to deploy: {status.message}")
        deployments = status.deployments if status else {}
        waiting = sorted(name for name, d in deployments.items() if d.status != "HEALTHY")
        if waiting != last:
            print(f"specserve: starting {', '.join(waiting) or 'the app'} ...",
                  file=sys.stderr, flush=True)
            last = waiting
        now = time.monotonic()
        for name in waiting:
            # Serve says so once a replica has waited ~30 s for its resources.
            unplaced = "to be scheduled" in (deployments[name].message or "")
            if unplaced and name in asks and now - told.get(name, -WAIT_REPEAT_S) >= WAIT_REPEAT_S:
                told[name] = now
                n = asks[name].replicas
                print(f"specserve: {name} waits for resources: {describe_ask(asks[name])}, "
                      f"{n} replica{'' if n == 1 else 's'} to start; "
                      f"{describe_free(_free_by_node())}", file=sys.stderr, flush=True)
        time.sleep(1)


def checked_config(args):
    """The config of `args` with every check that needs no Ray (UsageError)."""
    from specserve.models import ensure_default_model

    cfg, tokenizers_compatible = serve_config(args)
    target_dir = cfg.target.model or str(ensure_default_model())
    for d in cfg.drafts:
        if not d.has_model:
            continue
        problem = tokenizers_compatible(target_dir, draft_dir(d.model))
        if problem:
            raise UsageError(f"draft {d.name}: {problem}")
    check_contexts(cfg, target_dir)
    return cfg


def deploy(cfg) -> None:
    """Apply the Serve config of `cfg` to the running Serve instance (what
    `serve deploy` does through the dashboard)."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from deployments.app import serve_app

    _get_global_client().deploy_apps(
        ServeDeploySchema.model_validate({"applications": [serve_app(cfg)]}))


def reload(args, cfg, stop):
    """The config file read again and applied (SIGHUP); the old one stays
    when the new one is refused. Returns the config now running."""
    from ray import serve

    from deployments.app import code_version, serve_app

    try:
        new = checked_config(args)
    except UsageError as e:
        print(f"specserve: the changed config is refused, the app runs on as it was: {e}",
              file=sys.stderr, flush=True)
        return cfg
    if (new.http.host, new.http.port) != (cfg.http.host, cfg.http.port):
        print("specserve: http.host and http.port take effect at the next start only",
              file=sys.stderr, flush=True)
    what = ("live settings only: the replicas keep running"
            if code_version(serve_app(new)) == code_version(serve_app(cfg))
            else "models, engines, resources or a pool's fixed/autoscaled choice changed: "
                 "the replicas are replaced")
    print(f"specserve: applying the changed config ({what})", file=sys.stderr, flush=True)
    try:
        deploy(new)
        time.sleep(2)  # until Serve has taken the new config (the status lags it)
        wait_running(serve, stop, new)
    except Exception as e:  # Serve has the new config, and keeps trying it
        print(f"specserve: the changed config did not deploy ({e}); fix it and send SIGHUP "
              "again", file=sys.stderr, flush=True)
        return new
    print("specserve: applied the changed config", file=sys.stderr, flush=True)
    return new


def run_serve(args) -> int:
    import signal
    import threading

    cfg = checked_config(args)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    import ray
    from ray import serve

    address = ray_address(cfg)
    if address is not None:
        ray.init(address=address)
    else:
        # address="local": a new cluster even where `ray start` left one running
        # (plain ray.init() would join it, with its own resources). Its raylet
        # reads RAY_NODE_ENV (the engines' priority) from this environment.
        from specserve.placement import RAY_NODE_ENV

        for key, value in RAY_NODE_ENV.items():
            os.environ.setdefault(key, value)
        ray.init(address="local", num_cpus=cfg.ray.num_cpus, include_dashboard=False)
    stop, changed = threading.Event(), threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: changed.set())
    try:
        serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
        deploy(cfg)
        wait_running(serve, stop, cfg)
        url = f"http://{cfg.http.host}:{cfg.http.port}"
        drafts = ", ".join(d.name for d in cfg.drafts) or "none (target-only)"
        print(f"specserve: serving {cfg.target.served_name()} at {url}/v1 "
              f"(drafts: {drafts}); Ctrl-C to stop, SIGHUP to apply a changed config",
              flush=True)
        while not stop.is_set():
            if changed.wait(1):
                changed.clear()
                cfg = reload(args, cfg, stop)
        print("specserve: shutting down", file=sys.stderr, flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0
