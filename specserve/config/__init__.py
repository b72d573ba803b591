"""The specserve application config: one pydantic model, one source of truth.

- `schema`: `AppConfig` and its parts, every field described, the cross-field
  checks, `with_overrides` (the CLI's flags), the W > K rule;
- `loading`: YAML files in, `ConfigError` lines ("field.path: problem") out;
- `naming`: the draft pool name rule and names made from model folders.

Import from here: `from specserve.config import AppConfig, ConfigError, ...`.
"""

from specserve.config.loading import DEFAULT_CONFIG_PATH, ConfigError
from specserve.config.naming import DRAFT_NAME_MAX_LEN, DRAFT_NAME_RE
from specserve.config.schema import (
    MAX_SPECULATIVE_TOKENS,
    MODEL_BOUND_ENGINE_KEYS,
    AppConfig,
    Autoscaling,
    DraftConfig,
    EngineConfig,
    GrpcTlsConfig,
    HttpConfig,
    RayConfig,
    Resources,
    SpeculationConfig,
    TargetConfig,
    lookahead_problem,
    lookahead_tokens,
)

__all__ = [
    "DEFAULT_CONFIG_PATH", "DRAFT_NAME_MAX_LEN", "DRAFT_NAME_RE", "MAX_SPECULATIVE_TOKENS",
    "MODEL_BOUND_ENGINE_KEYS", "AppConfig", "Autoscaling", "ConfigError", "DraftConfig",
    "EngineConfig", "GrpcTlsConfig", "HttpConfig", "RayConfig", "Resources",
    "SpeculationConfig", "TargetConfig", "lookahead_problem", "lookahead_tokens",
]
