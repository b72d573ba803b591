"""The K controller's thresholds in the config (`speculation.k_control`)."""

from __future__ import annotations

from pydantic import Field, model_validator

from specserve.config.base import _Strict


class KControlConfig(_Strict):
    """When the K controller trusts its figures and how it probes
    (specserve/control/controller.py; the rate model is specserve/control/policy.py)."""

    min_drafted_tokens: int = Field(
        64, ge=1, description="Drafted tokens a draft pool must have had verified before its "
                              "acceptance is trusted; until then it runs at full K.")
    min_requests: int = Field(
        4, ge=1, description="Requests after which a pool is judged even if it drafted fewer "
                             "than min_drafted_tokens (drafts that never arrive in time).")
    min_steps: int = Field(
        32, ge=1, description="Target steps of a model or hybrid pool's finished requests "
                              "after which it is judged even if it drafted fewer than "
                              "min_drafted_tokens: its coverage over them is known (drafts that "
                              "seldom arrive in time). Suffix pools, which cost no core and no "
                              "wait, are judged on min_drafted_tokens or min_requests only.")
    probe_every: int = Field(
        16, ge=1, description="When no pool's K is above 0, a pool gets one request at full K "
                              "(a probe) this many requests after its last at K > 0, so that a "
                              "recovery is noticed; twice as long after each probe that did "
                              "not bring it back.")
    max_probe_every: int = Field(
        256, ge=1, description="The longest gap between probes (requests); at least "
                               "probe_every.")
    margin: float = Field(
        0.03, ge=0, description="Speculate only when the predicted rate beats K=0 by this "
                                "share (0.03: 3 %); for a suffix pool, by this share of its "
                                "coverage (the steps it drafts for are this much faster).")

    def thresholds(self):
        from specserve.control.policy import Thresholds

        return Thresholds(min_drafted_tokens=self.min_drafted_tokens,
                          min_requests=self.min_requests, min_steps=self.min_steps,
                          probe_every=self.probe_every, max_probe_every=self.max_probe_every,
                          margin=self.margin)

    @model_validator(mode="after")
    def _gaps(self):
        if self.max_probe_every < self.probe_every:
            raise ValueError(f"max_probe_every ({self.max_probe_every}) must be at least "
                             f"probe_every ({self.probe_every})")
        return self
