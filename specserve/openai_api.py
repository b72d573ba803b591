"""The OpenAI error shape of the router's own answers (401, 404, 413, 429, 503,
504, 500),
and `TargetUnavailable`, which a target replica raises to the router when its
engine is dead (the router answers 503 or retries, as for a dead replica).

The OpenAI API itself (request parsing and validation, chat templates,
responses, streaming chunks, logprobs, errors about request fields) is vLLM's
own serving layer, run by each target replica (`specserve.target.openai_app`);
the router answers only what it decides itself, in the same shape vLLM uses.

Never does: I/O, or parse request bodies.
"""

from __future__ import annotations


class ApiError(Exception):
    """An error to send to the client as an OpenAI-style error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None):
        """headers: response headers that go with it (e.g. Retry-After)."""
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


class TargetUnavailable(Exception):
    """Raised by a target replica whose engine is dead: the request was not
    served there, and the router treats it as a failed replica (a retry when
    nothing was sent yet, else a 503 `target_unavailable`)."""
