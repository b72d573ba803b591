"""Replica choice in the config (`routing:`): how requests find a target
replica and how each engine request finds a draft replica. Part of `AppConfig`
(specserve/config/schema.py); the choice itself is `specserve.control.affinity`,
wired into Serve by `deployments.routing`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from specserve.config.base import _Strict

Policy = Literal["prefix", "serve"]


class RoutingConfig(_Strict):
    """Which replica serves a request: by prefix within a load bound, or Serve's default."""

    target: Policy = Field(
        "prefix",
        description="Target replica choice. 'prefix': the replica most likely to hold the "
                    "request's prefix (chat messages or prompt) in its KV cache, among those "
                    "within max_extra_requests of the least loaded one; 'serve': Ray Serve's "
                    "default (power of two choices, blind to prefixes).")
    draft: Policy = Field(
        "prefix",
        description="Draft replica choice, per engine request: 'prefix': the draft replica "
                    "that drafted the conversation before (holds its prompt's prefix), "
                    "within max_extra_requests of the least loaded one, else any healthy "
                    "replica; 'serve': Ray Serve's default.")
    max_extra_requests: int = Field(
        4, ge=0,
        description="The load bound of 'prefix': a replica with more requests in flight than "
                    "the least loaded one plus this is not chosen for its prefix (0: always "
                    "the least loaded; prefixes only break ties).")
