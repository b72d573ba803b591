"""The specserve application config: one pydantic model, one source of truth.

- `schema`: `AppConfig`, the whole deployment (with the router and Ray
  sections), every field described, the checks across sections,
  `with_overrides` (the CLI's flags);
- `pools`: the target pool and the draft pools (`TargetConfig`, `DraftConfig`);
- `replicas`: what each replica of a pool is given (replica bounds, Ray
  resources, vLLM engine settings);
- `loading`: YAML files in, `ConfigError` lines ("field.path: problem") out;
- `speculation`: K, W, branches, the bounded wait, the K controller's thresholds
  (`kcontrol`), the W > K rule;
- `quotas`: per-request limits, the target queue, the request timeout;
- `suffix`: the suffix draft pool's memory bounds and drafting rule;
- `adapt`: a draft pool's online adaptation (collection bounds, guard, schedule);
- `http`: the HTTP ingress (listen address, API keys, body size);
- `grpc_tls`: mutual TLS on the draft -> target stream;
- `routing`: how target and draft replicas are chosen (prefix within a load bound);
- `naming`: the draft pool name rule and names made from model folders;
- `fit`: what the deployments ask of a local cluster, checked before Ray starts.

Import from here: `from specserve.config import AppConfig, ConfigError, ...`.
"""

from specserve.config.adapt import AdaptConfig
from specserve.config.grpc_tls import GrpcTlsConfig
from specserve.config.http import HttpConfig
from specserve.config.loading import DEFAULT_CONFIG_PATH, ConfigError
from specserve.config.naming import DRAFT_NAME_MAX_LEN, DRAFT_NAME_RE
from specserve.config.pools import DraftConfig, TargetConfig
from specserve.config.quotas import QuotaConfig
from specserve.config.replicas import Autoscaling, EngineConfig, Resources
from specserve.config.routing import RoutingConfig
from specserve.config.speculation import (
    MAX_SPECULATIVE_TOKENS,
    SpeculationConfig,
    lookahead_problem,
    lookahead_tokens,
)
from specserve.config.schema import MODEL_BOUND_ENGINE_KEYS, AppConfig, RayConfig
from specserve.config.suffix import SuffixConfig

__all__ = [
    "DEFAULT_CONFIG_PATH", "DRAFT_NAME_MAX_LEN", "DRAFT_NAME_RE", "MAX_SPECULATIVE_TOKENS",
    "MODEL_BOUND_ENGINE_KEYS", "AdaptConfig", "AppConfig", "Autoscaling", "ConfigError",
    "DraftConfig",
    "EngineConfig", "GrpcTlsConfig", "HttpConfig", "QuotaConfig", "RayConfig", "Resources",
    "RoutingConfig", "SpeculationConfig", "SuffixConfig", "TargetConfig", "lookahead_problem",
    "lookahead_tokens",
]
