"""The speculation section of the config: K and W, branches (the speculation
cache), the bounded wait, and the K controller's thresholds; and the one
statement of the W > K rule."""

from __future__ import annotations

from pydantic import Field, model_validator

from specserve.config.base import _Strict
from specserve.config.kcontrol import KControlConfig

MAX_SPECULATIVE_TOKENS = 16


def lookahead_tokens(k: int, lookahead: int | None) -> int:
    """The effective W: `lookahead`, or 2K + 1 when it is unset.

    2K + 1 is the least that leaves a whole window of K drafts waiting after a
    fully accepted step: that step verifies K drafts and the bonus token, and
    the next window is the K positions after those."""
    if lookahead is not None:
        return lookahead
    return 2 * k + 1 if k > 0 else 0


def lookahead_problem(k: int, lookahead: int | None, k_name: str = "num_speculative_tokens",
                      lookahead_name: str = "lookahead") -> str | None:
    """Why W = `lookahead` cannot go with K = `k` (W must exceed K), or None.

    The one statement of the rule: the config model, the CLI and LocalSpec ask
    it, each naming the settings as its user spells them."""
    if k > 0 and lookahead is not None and lookahead <= k:
        return (f"{lookahead_name} ({lookahead}) must be greater than {k_name} ({k}); raise "
                f"{lookahead_name} or remove it to use 2K + 1 ({lookahead_tokens(k, None)})")
    return None


class SpeculationConfig(_Strict):
    """How far drafts run ahead and how much the target verifies per step."""

    num_speculative_tokens: int = Field(
        4, ge=0, le=MAX_SPECULATIVE_TOKENS,
        description="K: drafted tokens the target verifies per step. 0 runs target-only "
                    "(only allowed without drafts). Changes on a running app without "
                    "restarting engines while it stays within max_speculative_tokens.")
    max_speculative_tokens: int | None = Field(
        None, ge=0, le=MAX_SPECULATIVE_TOKENS,
        description="The target engine's K ceiling (vLLM's num_speculative_tokens), fixed "
                    "when the engine starts: K may change on the running app up to it; past "
                    "it, or a change of the ceiling, restarts the targets. Null: K (so any "
                    "change of K restarts them). At least K; W must exceed it.")
    lookahead: int | None = Field(
        None, ge=1,
        description="W: how many tokens past the last verified position a draft may run; "
                    "must be greater than K. Null: 2K + 1 (a whole window after a fully "
                    "accepted step).")
    branch_fan_out: int = Field(
        3, ge=0, le=16,
        description="F: at most this many alternatives a draft pre-drafts at one position "
                    "of its window (its next-best tokens there, each continued a few tokens), "
                    "so that the step after a rejection finds drafts waiting. 0: no branches.")
    branch_budget: int | None = Field(
        None, ge=0, le=256,
        description="Alternatives per request in all, split over the window's positions "
                    "geometrically by the draft's acceptance (specserve.control.policy.fan_out: "
                    "more near the verified position, where rejections are likelier). "
                    "Null: F × (K + 1), F at every position the next verify step can reject.")
    branch_len: int | None = Field(
        None, ge=1, le=64,
        description="Tokens a branch continues past its alternative token. Null: K.")
    release_after_steps: int = Field(
        0, ge=0, le=1024,
        description="The target gives a request's drafts up once this many of its steps in a "
                    "row found none (after the bounded wait): the draft stops drafting it and "
                    "the target decodes it on alone (the draft autoscaler counts it as late). "
                    "0 (the default): never; on the CPU bench it did not pay beyond noise "
                    "(docs/benchmarks.md).")
    per_request_k: bool = Field(
        False,
        description="The target proposes, per request and step, only the drafted tokens "
                    "whose chance of acceptance (that request's own so far) beats what one "
                    "more verified token costs the batch: its measured cost per token times "
                    "the batch's output rate (specserve.control.policy.row_k). A request "
                    "whose drafts are seldom accepted then costs its batch little at once, "
                    "before the router has figures. False (the default: on this CPU it "
                    "measured no gain, docs/benchmarks.md): every request gets the K the "
                    "router gave it.")
    max_wait_ms: float = Field(
        50.0, ge=0.0, le=250.0,
        description="Upper bound on the bounded wait: after a rejection with no matching "
                    "branch, the target may hold a step this long at most for fresh drafts; "
                    "the rate model (specserve.control.policy.wait_bound) picks less, or 0 "
                    "when the batch is large or drafts are poor. 0: never wait.")
    max_stream_messages_per_s: int = Field(
        2000, ge=10, le=1_000_000,
        description="The most messages one draft stream may send a target's sink per second "
                    "(a burst of one second's worth allowed); a stream past it is cut off "
                    "(RESOURCE_EXHAUSTED) so that it cannot starve the others. A draft "
                    "replica sends one batch per draft step (about 250 a second); opens and "
                    "closes the sink takes are not counted (each request opens and closes "
                    "once, so a burst of arriving requests never cuts a draft off), refused "
                    "ones are.")
    k_control: KControlConfig = Field(
        default_factory=KControlConfig,
        description="The K controller's thresholds: when figures are trusted, probing, margin.")

    @model_validator(mode="after")
    def _check(self):
        if self.max_speculative_tokens is not None \
                and self.max_speculative_tokens < self.num_speculative_tokens:
            raise ValueError(f"max_speculative_tokens ({self.max_speculative_tokens}) must be at "
                             f"least num_speculative_tokens ({self.num_speculative_tokens}); "
                             "raise it (the targets restart) or lower K")
        # Every K up to the engine's ceiling must leave W > K.
        k_name = ("num_speculative_tokens" if self.max_speculative_tokens is None
                  else "max_speculative_tokens")
        problem = lookahead_problem(self.engine_k(), self.lookahead, k_name=k_name)
        if problem:
            raise ValueError(problem)
        return self

    def engine_k(self) -> int:
        """The target engine's K ceiling (max_speculative_tokens, or K)."""
        if self.max_speculative_tokens is None:
            return self.num_speculative_tokens
        return self.max_speculative_tokens

    def lookahead_tokens(self) -> int:
        """The effective W."""
        return lookahead_tokens(self.num_speculative_tokens, self.lookahead)

    def branch_alternatives(self) -> int:
        """The effective branch budget (alternatives per request)."""
        if self.branch_budget is not None:
            return self.branch_budget
        return self.branch_fan_out * (self.num_speculative_tokens + 1)

    def branch_tokens(self) -> int:
        """The effective branch length."""
        return self.branch_len if self.branch_len is not None else max(self.num_speculative_tokens, 1)
