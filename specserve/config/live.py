"""Which settings reach a running app without restarting an engine, and the
split of a config into those and the rest.

Ray Serve hashes an application's `args` into the code version of every
deployment in it: any change there restarts every replica (a target restart
reloads its model). So the Serve config carries a config in two parts:

- the *code part* (`code_part`): the app's `args`, everything that needs new
  replicas: models, tensor parallelism, engine and resource settings, the
  draft port, TLS, W and the branch settings, and the engine's K ceiling
  (`speculation.max_speculative_tokens`, vLLM's num_speculative_tokens);
- the *live part* (`live_part`): each deployment's `user_config`, which Serve
  hands to the running replicas' `reconfigure` (`with_live` merges it back):
  K up to the ceiling, the K controller's thresholds, the quotas and the
  replica bounds of every pool and of the router. The replica bounds and the target's queue
  limit also go to Serve as deployment options (`deployments.app.serve_config`),
  which Serve applies without restarting replicas.

In the code part the live settings hold fixed stand-ins (K = the ceiling, the
rest their defaults), so that changing them leaves `args` as it was. Never
does: I/O, or know Ray.
"""

from __future__ import annotations

import copy

from specserve.config.schema import AppConfig

# Sections of the live part; each is `with_live`'s to put back.
LIVE_SECTIONS = ("speculation", "quotas", "replicas")


def live_part(cfg: AppConfig) -> dict:
    """The settings a running app takes without restarting engines (JSON types)."""
    spec = cfg.speculation
    return {
        "speculation": {"num_speculative_tokens": spec.num_speculative_tokens,
                        "k_control": spec.k_control.model_dump(mode="json")},
        "quotas": cfg.quotas.model_dump(mode="json"),
        "replicas": {"target": cfg.target.replicas.model_dump(mode="json"),
                     "router": cfg.router.replicas.model_dump(mode="json"),
                     "drafts": {d.name: d.replicas.model_dump(mode="json")
                                for d in cfg.drafts}},
    }


def code_part(cfg: AppConfig) -> dict:
    """`cfg` without its live settings (they stand at fixed values): what a
    change of which needs new replicas (JSON types)."""
    data = cfg.model_dump(mode="json")
    spec = data["speculation"]
    k = cfg.speculation.engine_k()
    spec["num_speculative_tokens"] = spec["max_speculative_tokens"] = k
    del spec["k_control"]
    del data["quotas"]
    del data["target"]["replicas"]
    del data["router"]["replicas"]
    for d in data["drafts"]:
        del d["replicas"]
    return data


def with_live(cfg: AppConfig, live: dict) -> AppConfig:
    """`cfg` with the live settings of `live` (a `live_part`) put in,
    validated as a whole (K within the ceiling, W > K, ...): ConfigError
    otherwise. A draft pool `live` does not name keeps its bounds."""
    data = cfg.model_dump(mode="json")
    unknown = set(live) - set(LIVE_SECTIONS)
    if unknown:
        from specserve.config.loading import ConfigError

        raise ConfigError(f"user_config: unknown sections {sorted(unknown)}; the live "
                          f"settings are {', '.join(LIVE_SECTIONS)}")
    spec = live.get("speculation", {})
    data["speculation"].update(copy.deepcopy(spec))
    if "quotas" in live:
        data["quotas"] = copy.deepcopy(live["quotas"])
    replicas = live.get("replicas", {})
    for pool in ("target", "router"):
        if pool in replicas:
            data[pool]["replicas"] = copy.deepcopy(replicas[pool])
    for d in data["drafts"]:
        if d["name"] in replicas.get("drafts", {}):
            d["replicas"] = copy.deepcopy(replicas["drafts"][d["name"]])
    return AppConfig.from_dict(data, source="user_config (the live settings)")
