"""The router's HTTP ingress in the config (`http:`): where it listens, the
API keys it asks for (inline, from an environment variable or from a file;
several for rotation), the scrape keys of /metrics, and the largest body it
takes. Part of `AppConfig`
(specserve/config/schema.py); the router compares keys
(deployments/router.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from specserve.config.base import _require_non_empty, _Strict
from specserve.config.loading import ConfigError


class HttpConfig(_Strict):
    """The router's HTTP ingress (OpenAI API)."""

    host: str = Field("127.0.0.1", description="Address the HTTP server binds to; "
                                               "0.0.0.0 to accept connections from other hosts.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of the OpenAI API.")
    api_key: str | None = Field(
        None, description="Bearer token clients must send (Authorization: Bearer ...). "
                          "Null: no authentication.")
    api_key_env: str | None = Field(
        None, description="Name of an environment variable holding the bearer token, read by "
                          "the router when it starts: keeps the key out of the config, which "
                          "anyone who can read a RayService or the Ray dashboard can read (the "
                          "Helm chart fills it from a Secret). Several keys (rotation: old and "
                          "new) are separated by commas or whitespace. Use instead of api_key. "
                          "Null: api_key decides.")
    api_key_file: str | None = Field(
        None, description="Path of a file holding the bearer token, read by the router when it "
                          "starts (on its node): keeps the key out of the config and out of "
                          "argv (`specserve serve --api-key-file`). Several keys (rotation) "
                          "one per line; '#' starts a comment. Null: api_key or api_key_env "
                          "decides.")
    metrics_key_env: str | None = Field(
        None, description="Name of an environment variable holding the key(s) a scraper sends "
                          "to /metrics (Authorization: Bearer ...), read by the router when it "
                          "starts; several separated by commas or whitespace. When set, "
                          "/metrics takes only these keys (an API key does not open it, and "
                          "these keys open nothing else). Null: /metrics takes the API keys "
                          "(and is open without them).")
    max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1, description="Largest request body accepted, bytes; "
                                           "larger requests get HTTP 413.")

    @field_validator("host")
    @classmethod
    def _host_not_empty(cls, v: str):
        if not v.strip():
            raise ValueError("host must not be empty; use 127.0.0.1 or 0.0.0.0")
        return v

    @field_validator("api_key")
    @classmethod
    def _api_key_not_empty(cls, v):
        # An empty key would either lock everyone out or be mistaken for "no
        # auth"; make the author say which.
        if v is not None and not v.strip():
            raise ValueError("api_key is empty; set a key or use null for no authentication")
        return v

    @field_validator("api_key_env", "metrics_key_env")
    @classmethod
    def _env_name(cls, v, info):
        if v is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError(f"{info.field_name} {v!r} is not an environment variable name; "
                             "use letters, digits and '_' (e.g. SPECSERVE_API_KEY)")
        return v

    @field_validator("api_key_file")
    @classmethod
    def _api_key_file_not_empty(cls, v):
        return _require_non_empty(v, "api_key_file")

    @model_validator(mode="after")
    def _one_key_source(self):
        given = [k for k in ("api_key", "api_key_env", "api_key_file")
                 if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"set one of api_key, api_key_env, api_key_file, not "
                             f"{' and '.join(given)}")
        return self

    def api_keys(self) -> tuple[str, ...]:
        """The bearer tokens any of which a client may send (empty: no
        authentication). api_key_env and api_key_file are read now; either may
        hold several keys, so a key is rotated by adding the new one, moving
        the clients, then removing the old one."""
        if self.api_key is not None:
            return (self.api_key,)
        if self.api_key_env is not None:
            return _env_keys(self.api_key_env, "api_key_env")
        if self.api_key_file is not None:
            try:
                text = Path(self.api_key_file).read_text()
            except OSError as e:
                raise ConfigError(f"http.api_key_file: cannot read {self.api_key_file} "
                                  f"({e.strerror}); it must exist on the router's node") from None
            keys = tuple(line.strip() for line in text.splitlines()
                         if line.strip() and not line.strip().startswith("#"))
            if not keys:
                raise ConfigError(f"http.api_key_file: {self.api_key_file} holds no key; "
                                  "write one key per line")
            return keys
        return ()

    def metrics_keys(self) -> tuple[str, ...]:
        """The keys /metrics takes instead of the API keys (empty: none of its
        own; /metrics then goes with the API keys). Read now."""
        if self.metrics_key_env is None:
            return ()
        return _env_keys(self.metrics_key_env, "metrics_key_env")


def _env_keys(name: str, field: str) -> tuple[str, ...]:
    """The keys of environment variable `name` (split at commas and
    whitespace); ConfigError when it holds none."""
    keys = tuple(os.environ.get(name, "").replace(",", " ").split())
    if not keys:
        raise ConfigError(f"http.{field}: the environment variable {name} is not set or "
                          f"empty; set it (the Helm chart fills it from its Secret) or remove "
                          f"{field}")
    return keys
