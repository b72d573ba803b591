"""The suffix draft's settings in the config (`drafts[].suffix`, with `kind: suffix`).

Owns `SuffixConfig`: the bounds of the suffix memory (tokens, requests, tokens
per request, trie depth), SuffixDecoding's drafting rule (length from the match,
minimum probability) and whether the memory is shared across requests (the
fleet memory). Part of `DraftConfig` (specserve/config/pools.py); the memory is
specserve/draft/suffix_tree.py, the draft specserve/draft/suffix.py.
"""

from __future__ import annotations

from pydantic import Field

from specserve.config.base import _Strict


class SuffixConfig(_Strict):
    """A suffix draft pool: drafts from what earlier tokens continued with, no model."""

    share: bool = Field(
        True, description="Keep one memory across requests (every request this replica "
                          "drafts for, on every target replica: the fleet memory). False: "
                          "each request drafts from its own prompt and output only.")
    max_tokens: int = Field(
        262144, ge=1, description="Tokens the shared memory keeps; the oldest requests are "
                                  "evicted first. It holds at most max_tokens x max_depth "
                                  "trie nodes.")
    max_requests: int = Field(
        4096, ge=1, description="Requests the shared memory keeps (oldest evicted first).")
    max_request_tokens: int = Field(
        16384, ge=1, description="Tokens of one request (prompt and output) indexed, in its "
                                 "own memory and the shared one; the rest is ignored.")
    max_depth: int = Field(
        24, ge=1, le=256, description="Depth of the suffix trie: the longest match used and "
                                      "the longest path walked before copying on.")
    max_draft_tokens: int = Field(
        16, ge=1, description="Most tokens one lookup drafts (the runner drafts again after "
                              "them, up to the lookahead).")
    factor: float = Field(
        1.0, gt=0, description="Draft length <= factor x match length + offset "
                               "(SuffixDecoding's adaptive length: a long match earns a long "
                               "draft).")
    offset: float = Field(0.0, ge=0, description="See factor.")
    min_prob: float = Field(
        0.1, ge=0, le=1, description="Stop a draft where its estimated probability (the "
                                     "continuation's frequency along the path) falls below "
                                     "this.")
