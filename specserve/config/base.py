"""What every config model shares: unknown keys are errors, empty strings are refused."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    # extra="forbid": a misspelt key is an error, not a silently ignored setting.
    model_config = ConfigDict(extra="forbid")


def _require_non_empty(value: str | None, what: str) -> str | None:
    if value is not None and not value.strip():
        raise ValueError(f"{what} must not be empty; remove the key to use the default")
    return value
