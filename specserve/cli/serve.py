"""`specserve serve`: the Ray Serve app on a config, until Ctrl-C.

Owns what is checked before Ray starts (the config and its overrides, model
folders, tokenizers) and waiting for the app to run. The app itself is
`deployments.app.build_app`.
"""

from __future__ import annotations

import os
import sys

from specserve.cli.common import UsageError, draft_dir, model_dir


def serve_config(args):
    from specserve.config import AppConfig, ConfigError
    from specserve.models import DEFAULT_DRAFT_KEYWORD, tokenizers_compatible

    try:
        cfg = (AppConfig.from_yaml(args.config) if args.config
               else AppConfig.embedded_default())
        drafts = args.draft
        if drafts is not None and [d.lower() for d in drafts] == ["none"]:
            drafts = []
        target = model_dir(args.target, "target") if args.target else None
        from specserve.draft.synthetic import is_synthetic

        if any(is_synthetic(d) for d in drafts or []):
            raise UsageError("synthetic drafts work in 'specserve generate' and 'specserve "
                             "bench' only: a Serve draft replica cannot know a request's "
                             "continuation in advance; pass a draft model folder")
        # 'default' stays a keyword in the config; each replica resolves it.
        drafts = None if drafts is None else [
            d if d == DEFAULT_DRAFT_KEYWORD else model_dir(d, "draft") for d in drafts]
        cfg = cfg.with_overrides(target=target, drafts=drafts, port=args.port,
                                 api_key=args.api_key)
    except ConfigError as e:
        raise UsageError(str(e).replace("\n", "; ")) from None
    if cfg.target.model is not None:
        model_dir(cfg.target.model, "target")
    for d in cfg.drafts:
        draft_dir(d.model)
    return cfg, tokenizers_compatible


def wait_running(serve, stop, app: str = "specserve") -> None:
    """Until every deployment (draft pools included) has its replicas up."""
    import time

    last = None
    while not stop.is_set():
        status = serve.status().applications.get(app)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"the app failed to deploy: {status.message}")
        waiting = sorted(name for name, d in (status.deployments if status else {}).items()
                         if d.status != "HEALTHY")
        if waiting != last:
            print(f"specserve: starting {', '.join(waiting) or 'the app'} ...",
                  file=sys.stderr, flush=True)
            last = waiting
        time.sleep(1)


def run_serve(args) -> int:
    import signal
    import threading

    from specserve.models import ensure_default_model

    cfg, tokenizers_compatible = serve_config(args)
    target_dir = cfg.target.model or str(ensure_default_model())
    for d in cfg.drafts:
        problem = tokenizers_compatible(target_dir, draft_dir(d.model))
        if problem:
            raise UsageError(f"draft {d.name}: {problem}")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    import ray
    from ray import serve

    from deployments.app import build_app

    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        ray.init(address=address)
    else:
        ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
        serve.run(build_app(cfg), name="specserve", route_prefix="/", blocking=False)
        wait_running(serve, stop)
        url = f"http://{cfg.http.host}:{cfg.http.port}"
        drafts = ", ".join(d.name for d in cfg.drafts) or "none (target-only)"
        print(f"specserve: serving {cfg.target.served_name()} at {url}/v1 "
              f"(drafts: {drafts}); Ctrl-C to stop", flush=True)
        stop.wait()
        print("specserve: shutting down", file=sys.stderr, flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0
