"""The schema of a specserve deployment: one pydantic model, one source of truth.

Owns `AppConfig`, the whole deployment, assembled from its sections: the target
pool and the draft pools (specserve/config/pools.py, their replicas' bounds,
resources and engine settings in specserve/config/replicas.py), speculation
settings K and W, the HTTP ingress, the quotas, replica routing and gRPC TLS,
each a module of its own, and the two sections kept here: the router deployment
(`RouterConfig`) and how to reach Ray (`RayConfig`). Every field carries a
`description=`: that text is the reference documentation of every key in
`cluster/*.yaml` and of the Helm values, which are generated from this model.
Each section checks its own fields; this module owns the checks across sections
that must fail at load time, before anything starts (unique draft names, drafts
need K >= 1), and deriving a config from another (`with_overrides`: the CLI's
flags). Reading files and formatting errors is `specserve.config.loading`; draft
pool names are `specserve.config.naming`.

It does not check that model folders exist or that a draft's tokenizer matches
the target's: a config is often written on one machine for models that live on
others (e.g. `/models/...` inside the cluster). The CLI and the replicas check
those where the models are.

Every model forbids unknown keys (`extra="forbid"`), so a typo such as
`max_replica: 4` is an error instead of a silently ignored setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from specserve.config.base import _Strict
from specserve.config.grpc_tls import GrpcTlsConfig
from specserve.config.http import HttpConfig
from specserve.config.loading import (DEFAULT_CONFIG_PATH, MODEL_DRAFT_CONFIG_PATH, ConfigError,
                                      read_yaml, validation_error)
from specserve.config.naming import pool_names
from specserve.config.pools import DraftConfig, TargetConfig
from specserve.config.quotas import QuotaConfig
from specserve.config.replicas import Autoscaling
from specserve.config.routing import RoutingConfig
from specserve.config.speculation import SpeculationConfig
from specserve.models import DEFAULT_DRAFT_KEYWORD

# Engine settings that describe one model rather than the machine (its context
# length): a value the embedded default sets for the default model must not be
# applied to another model that replaces it (`with_overrides`).
MODEL_BOUND_ENGINE_KEYS = ("max_model_len",)


class RayConfig(_Strict):
    """Which Ray cluster to run on."""

    address: str | None = Field(
        None,
        description="Ray cluster address, e.g. 'auto' or 'ray://head:10001'. Null: start a "
                    "local cluster, unless RAY_ADDRESS is set.")
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs of a local cluster started by specserve. Null: all.")

    @model_validator(mode="after")
    def _check(self):
        # Ray treats address "local" as "start a local cluster" too.
        if self.num_cpus is not None and self.address not in (None, "local"):
            raise ValueError(f"num_cpus only sizes a local cluster, but address is "
                             f"{self.address!r}; remove num_cpus or address")
        return self


class RouterConfig(_Strict):
    """The router deployment (the HTTP ingress): its replicas and where they run."""

    replicas: Autoscaling = Field(
        default_factory=Autoscaling,
        description="Router replica bounds; min < max autoscales on requests in flight "
                    "(Serve's own policy, target_ongoing_requests per replica).")
    target_ongoing_requests: int = Field(
        256, ge=1, description="Requests in flight per router replica that Serve's "
                               "autoscaling aims for (when min_replicas < max_replicas).")
    ray_resource: str | None = Field(
        None, min_length=1,
        description="A Ray custom resource each router replica asks one unit of, so that it "
                    "runs only on nodes that advertise it (the Helm chart's router pods, or "
                    "the head), the only ones that need the API key. Null: any node.")


class AppConfig(_Strict):
    """A whole specserve deployment."""

    target: TargetConfig = Field(
        default_factory=TargetConfig, description="The target pool.")
    drafts: list[DraftConfig] = Field(
        default_factory=list, description="Draft pools, one per draft model. Empty: target-only.")
    speculation: SpeculationConfig = Field(
        default_factory=SpeculationConfig, description="K and W.")
    http: HttpConfig = Field(
        default_factory=HttpConfig, description="HTTP ingress.")
    quotas: QuotaConfig = Field(
        default_factory=QuotaConfig,
        description="Per-request limits (n, prompt and completion tokens), the queue in "
                    "front of the target pool, the request timeout.")
    router: RouterConfig = Field(
        default_factory=RouterConfig, description="The router deployment (HTTP ingress).")
    ray: RayConfig = Field(
        default_factory=RayConfig, description="Ray cluster.")
    routing: RoutingConfig = Field(
        default_factory=RoutingConfig,
        description="Replica choice: by prefix within a load bound, or Ray Serve's default.")
    grpc_tls: GrpcTlsConfig | None = Field(
        None, description="Mutual TLS on the draft -> target gRPC stream. Null: plaintext "
                          "(fine on a private network or loopback).")

    @model_validator(mode="after")
    def _check(self):
        # These errors have no single field location pydantic can attach, so
        # each message starts with the path it is about.
        seen: dict[str, int] = {}
        for i, d in enumerate(self.drafts):
            if d.name in seen:
                raise ValueError(f"drafts[{i}].name: {d.name!r} is already the name of "
                                 f"drafts[{seen[d.name]}]; draft names must be unique")
            seen[d.name] = i
        if self.drafts and self.speculation.num_speculative_tokens == 0:
            raise ValueError("speculation.num_speculative_tokens: 0 with drafts configured; "
                             "set it to 1 or more, or remove the drafts to run target-only")
        return self

    # ---- loading -------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any, source: str = "config") -> AppConfig:
        """Validate parsed data; `source` names it in errors (a path, "command line")."""
        if data is None:  # an empty YAML file: all defaults
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of keys "
                              f"(target, drafts, ...), got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise validation_error(e, cls, source) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> AppConfig:
        return cls.from_dict(read_yaml(path), source=str(path))

    @classmethod
    def embedded_default(cls, model_draft: bool = False) -> AppConfig:
        """The CPU default (`cluster/default.yaml` of the repo: a suffix draft);
        model_draft: its pair with a draft model (`cluster/model-draft.yaml`)."""
        path = MODEL_DRAFT_CONFIG_PATH if model_draft else DEFAULT_CONFIG_PATH
        if not path.is_file():
            raise ConfigError(f"the default config {path} is missing: specserve "
                              "must be installed from its repository (pip install -e .), "
                              "or pass a config file")
        return cls.from_yaml(path)

    # ---- deriving ------------------------------------------------------------

    def with_overrides(self, target: str | None = None, drafts: list[str] | None = None,
                       port: int | None = None, api_key: str | None = None,
                       api_key_file: str | None = None,
                       share_draft_cpus: bool = False, host: str | None = None) -> AppConfig:
        """A new config with the CLI's flags applied; None leaves a setting as it is.

        target: the target model folder. The served name is reset to follow
          the new folder, since a name set for another model would mislead.
        drafts: draft model folders (`--draft PATH`, repeatable); they replace
          the configured pools. Each pool is named from its folder (sanitized,
          -2, -3, ... for repeats) and copies replicas, resources, engine and
          max_ongoing_requests from the first configured draft model pool (or
          defaults; a suffix pool's settings do not fit a model).
          An empty list means no drafts (target-only).
        share_draft_cpus: the new pools split the first pool's
          resources.cpus_per_worker between them instead of each copying it
          (what a local cluster sized for one draft pool needs).

        A model that replaces the default model (target `model: null`, draft
        `model: default`) does not inherit the engine settings that describe
        the default model (`MODEL_BOUND_ENGINE_KEYS`, e.g. max_model_len): they
        become null, the new model's own.
        """
        data = self.model_dump()
        if target is not None:
            if self.target.model is None:
                _reset_model_bound(data["target"]["engine"])
            data["target"]["model"] = target
            data["target"]["name"] = None
        if drafts is not None:
            first = next((d for d in self.drafts if d.kind == "model"), None)
            template = first.model_dump() if first else {}
            pools = []
            for path, name in zip(drafts, pool_names(drafts)):
                pool = {k: v for k, v in template.items() if k not in ("name", "model")}
                if share_draft_cpus and "resources" in pool:
                    pool["resources"] = {**pool["resources"], "cpus_per_worker":
                                         pool["resources"]["cpus_per_worker"] / len(drafts)}
                if first is not None and first.model == DEFAULT_DRAFT_KEYWORD \
                        and path != DEFAULT_DRAFT_KEYWORD:
                    pool["engine"] = dict(pool["engine"])
                    _reset_model_bound(pool["engine"])
                pools.append({**pool, "name": name, "model": path})
            data["drafts"] = pools
        if port is not None:
            data["http"]["port"] = port
        if host is not None:
            data["http"]["host"] = host
        if api_key is not None or api_key_file is not None:
            # The flag's key replaces the config's source of keys.
            data["http"].update(api_key=api_key, api_key_env=None,
                                api_key_file=None if api_key_file is None
                                else str(Path(api_key_file).resolve()))
        # Validate again: an override can break a cross-field rule (e.g. drafts
        # added to a K=0 config).
        return AppConfig.from_dict(data, source="command line")

    def draft_kinds(self) -> dict[str, str]:
        """Each draft pool's kind ("model", "suffix" or "hybrid") by pool name: the one map
        the router, its views and the K choice read a pool's kind from."""
        return {d.name: d.kind for d in self.drafts}

    def collect_gaps(self) -> dict[str, int]:
        """Adapting pools' collect gaps (AdaptConfig.collect_gap), for the K controller."""
        return {d.name: gap for d in self.drafts
                if (gap := d.adapt.collect_gap()) is not None}

    def lookahead_tokens(self) -> int:
        """The effective W (lookahead, or 2K + 1 when unset)."""
        return self.speculation.lookahead_tokens()

    def to_yaml(self) -> str:
        """YAML that `from_yaml` reads back into an equal config (all keys, nulls included)."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _reset_model_bound(engine: dict) -> None:
    for key in MODEL_BOUND_ENGINE_KEYS:
        engine[key] = None
