"""A draft pool's online adaptation settings in the config (`drafts[].adapt`, off by default).

Owns `AdaptConfig`: whether a draft pool learns the traffic it serves, the
bounds of what each replica keeps of it (`specserve.adapt.buffer`), the
guard's margin and minimum held-out positions (`specserve.adapt.guard`), when
and how long training runs, and where the weights' versions live
(`specserve.adapt.versions`). Part of `DraftConfig` (specserve/config/pools.py),
so of the code part: a change restarts the pool's replicas.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from specserve.config.base import _require_non_empty, _Strict


class AdaptConfig(_Strict):
    """Online adaptation of a draft pool: collect what the target verified, train
    a copy of the draft on it, serve the copy only if it beats the serving weights
    on a held-out slice. The buffer holds user text (token ids); nothing leaves
    the replica unless asked."""

    enabled: bool = Field(
        False, description="Collect (context, target continuation) examples from the "
                           "verified tokens each replica of this pool receives. Needs a "
                           "draft model (kinds model and hybrid).")
    buffer_tokens: int = Field(
        262144, ge=1, description="Tokens (context + continuation) one replica keeps; the "
                                  "oldest requests are evicted first. Stored as int32: 4 "
                                  "bytes per token.")
    max_context_tokens: int = Field(
        512, ge=1, description="Tokens of a request's prompt kept as its example's context "
                               "(the last ones); less than per_request_tokens.")
    per_request_tokens: int = Field(
        2048, ge=2, description="Tokens (context + continuation) kept of one request, so "
                                "that one long request cannot fill the buffer; at most "
                                "buffer_tokens.")
    heldout_share: float = Field(
        0.2, gt=0, lt=1, description="Share of requests held out (by a stable hash of the "
                                     "request id): never trained on, the slice the guard "
                                     "measures alpha on.")
    margin: float = Field(
        0.02, ge=0, lt=1, description="New weights serve only if their held-out alpha "
                                      "exceeds the serving weights' by more than this "
                                      "(alpha points).")
    min_heldout_positions: int = Field(
        1024, ge=1, description="Fewest held-out positions (verified tokens of held-out "
                                "requests) the guard decides on; with fewer it refuses.")
    train_every_minutes: float = Field(
        30.0, gt=0, description="Minutes between training runs (the schedule).")
    train_minutes: float = Field(
        5.0, gt=0, description="Longest one training run may take, minutes; at most "
                               "train_every_minutes.")
    train_threads: int = Field(
        1, ge=1, description="CPU threads one training run uses, at a lower priority than "
                             "drafting.")
    learning_rate: float = Field(
        1e-3, gt=0, le=0.1, description="Peak learning rate of a training run (AdamW, "
                                        "warm-up then cosine decay over train_minutes, as "
                                        "`specserve distill`).")
    alpha_drop_trigger: float | None = Field(
        0.05, gt=0, lt=1, description="Train before the schedule when the serving weights' "
                                      "held-out alpha falls this far (alpha points) below "
                                      "its value when they started serving. Null: on the "
                                      "schedule only.")
    collect_share: float = Field(
        0.25, ge=0, le=1, description="Least share of requests routed through this pool "
                                      "while the K controller finds that its drafts do not "
                                      "pay (a probe at least every 1/share requests): a "
                                      "pool learns only from the requests it drafts for. "
                                      "The price: those requests run with drafts that do "
                                      "not pay (speed, never correctness). 0: only the "
                                      "controller's own probes.")
    versions_dir: str | None = Field(
        None, description="Folder of this pool's weight versions and their manifest (v0: "
                          "the shipped draft), on the replicas' node. Null: "
                          "adapt/POOL under the specserve cache ($SPECSERVE_CACHE, "
                          "~/.cache/specserve).")

    def collect_gap(self) -> int | None:
        """Most requests between two of this pool's (collect_share); None: no floor."""
        if not self.enabled or self.collect_share <= 0:
            return None
        return max(1, round(1 / self.collect_share))

    def versions_root(self, pool: str) -> Path:
        """The folder of `pool`'s versions: versions_dir, or adapt/POOL under the cache."""
        if self.versions_dir is not None:
            return Path(self.versions_dir).expanduser()
        from specserve.models import cache_root

        return cache_root() / "adapt" / pool

    @field_validator("versions_dir")
    @classmethod
    def _versions_dir_not_empty(cls, v):
        return _require_non_empty(v, "versions_dir")

    @model_validator(mode="after")
    def _check(self):
        if self.max_context_tokens >= self.per_request_tokens:
            raise ValueError(f"max_context_tokens ({self.max_context_tokens}) must be less than "
                             f"per_request_tokens ({self.per_request_tokens}), to leave room "
                             "for the continuation; lower it or raise per_request_tokens")
        if self.per_request_tokens > self.buffer_tokens:
            raise ValueError(f"per_request_tokens ({self.per_request_tokens}) is greater than "
                             f"buffer_tokens ({self.buffer_tokens}); lower it or raise "
                             "buffer_tokens")
        if self.train_minutes > self.train_every_minutes:
            raise ValueError(f"train_minutes ({self.train_minutes:g}) is greater than "
                             f"train_every_minutes ({self.train_every_minutes:g}): a run "
                             "would still be training when the next is due")
        return self
