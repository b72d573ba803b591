"""The quotas section of the config (`quotas`): what one request may ask for,
how many requests may wait for a target replica, and how long one may take.

The checks themselves are `specserve.target.quotas` (request fields, prompt
length) and `deployments/router.py` (the queue's 429, the timeout).
"""

from __future__ import annotations

from pydantic import Field

from specserve.config.base import _Strict

# vLLM's own ceiling on n (VLLM_MAX_N_SEQUENCES).
VLLM_MAX_N = 16384


class QuotaConfig(_Strict):
    """Per-request limits and the queue in front of the target pool. A request
    over a limit gets an OpenAI-style 4xx naming the field; nothing else is
    disturbed."""

    max_n: int = Field(
        16, ge=1, le=VLLM_MAX_N,
        description="Most sequences one request may generate: `n` (or `best_of`) times the "
                    "prompts of a completions request; more gets HTTP 400. Each sequence is "
                    "one engine request with its own draft stream. vLLM's own limit is "
                    f"{VLLM_MAX_N} (VLLM_MAX_N_SEQUENCES); OpenAI's is 128.")
    max_prompt_tokens: int | None = Field(
        None, ge=1,
        description="Longest prompt, in tokens after the chat template; longer gets HTTP "
                    "400. Null: the target's max_model_len (vLLM's own check).")
    max_completion_tokens: int | None = Field(
        None, ge=1,
        description="Most tokens one sequence may generate: a request asking for more "
                    "(max_tokens, max_completion_tokens) gets HTTP 400, one that names no "
                    "limit gets at most this many. Null: the rest of the target's context "
                    "(vLLM's default).")
    max_queued_requests: int | None = Field(
        256, ge=1,
        description="Requests one router replica may hold waiting for a target replica "
                    "(each takes target.max_ongoing_requests at a time): Ray Serve's "
                    "max_queued_requests on the target deployment. More get HTTP 429 with "
                    "Retry-After. Null: no limit (requests wait however long the queue).")
    request_timeout_s: float | None = Field(
        600.0, gt=0,
        description="Longest time the router gives one request, from its arrival to its "
                    "last byte, seconds. Past it the client gets HTTP 504 (or, once a stream "
                    "has started, an error event and the end of the stream) and the engine "
                    "request is aborted. Null: no limit.")
