"""The OpenAI-compatible protocol of the router: requests in, responses out.

Owns: parsing and validating /v1/completions and /v1/chat/completions request
bodies (turning every problem into one readable ApiError with an HTTP status),
the context-length check, the JSON shapes of responses, streaming chunks and
/v1/models and Server-Sent-Events framing. (Stop strings are applied by the
target engine, which sees the detokenized text.)

Never does: I/O, HTTP, tokenisation, chat templates, or anything with an engine.
Callers hand in bytes and token counts and get back models, dicts and strings,
so everything here is testable without Ray, vLLM or a web framework.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import (
    AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator,
)

# Bodies are tiny JSON; anything larger is a mistake or an attack. The HTTP layer
# should also refuse to read past this, so a huge body is never buffered.
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_STOP_STRINGS = 4  # OpenAI's limit
SSE_DONE = "data: [DONE]\n\n"


class ApiError(Exception):
    """An error to send to the client as an OpenAI-style error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


# ---------------------------------------------------------------- requests

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Request(BaseModel):
    """Fields shared by both endpoints. Strict: no "5" -> 5 or true -> 1 coercion,
    so a client bug shows up as a 400 rather than as a surprising generation."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)  # engines keep seeds in int64
    stop: list[str] = Field(default_factory=list)  # normalised: a single string becomes [s]
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        # Many clients send explicit nulls for parameters they leave unset; treat
        # null as "absent" so the default applies (null model is then "required").
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ValueError("must be a string or a list of strings")
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(v)}")
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("n")
    @classmethod
    def _single_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("n > 1 is not supported")
        return v

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    prompt: str  # normalised: a list of exactly one string becomes that string

    @field_validator("prompt", mode="before")
    @classmethod
    def _single_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
            v = v[0]
        if not isinstance(v, str):
            raise ValueError("must be a string or a list of exactly one string "
                             "(batched and token-id prompts are not supported)")
        if not v:
            raise ValueError("must not be empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: str  # normalised: text parts are joined

    @field_validator("content", mode="before")
    @classmethod
    def _text_content(cls, v: Any) -> Any:
        if isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of text parts")
        texts = []
        for i, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(
                    f"only text content parts are supported; part {i} has type {kind!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {i} has no 'text' string")
            texts.append(part["text"])
        # Joined with newlines, as vLLM's own server does, so prompts match it.
        return "\n".join(texts)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    # Unset means "up to the end of the context" (see effective_max_tokens).
    # OpenAI's newer name wins when a client sends both.
    max_tokens: int | None = Field(
        None, ge=1, validation_alias=AliasChoices("max_completion_tokens", "max_tokens"))

    def message_dicts(self) -> list[dict[str, str]]:
        """The messages as plain dicts, ready for a tokenizer's chat template."""
        return [{"role": m.role, "content": m.content} for m in self.messages]


_KINDS = {"completion": CompletionRequest, "chat": ChatCompletionRequest}


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not allowed")  # NaN / Infinity are not JSON


def _loc_name(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _problem(err: dict) -> str:
    """One pydantic error in words a client can act on."""
    kind, ctx = err["type"], err.get("ctx", {})
    if kind == "value_error":
        return str(ctx["error"])
    for bound, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if bound in ctx:
            limit = ctx[bound]
            if isinstance(limit, float) and limit.is_integer():
                limit = int(limit)  # float fields report 0.0; say 0
            return f"must be {op} {limit}"
    simple = {
        "missing": "is required",
        "int_type": "must be an integer",
        "float_type": "must be a number",
        "finite_number": "must be a finite number",
        "bool_type": "must be true or false",
        "string_type": "must be a string",
        "list_type": "must be a list",
        "model_type": "must be an object",
    }
    if kind in simple:
        return simple[kind]
    if kind == "literal_error":
        return f"must be {ctx['expected']}"
    if kind == "too_short":
        return "must not be empty"
    return err["msg"]


def parse_request(kind: str, raw: bytes,
                  known_models: list[str]) -> CompletionRequest | ChatCompletionRequest:
    """Validate a request body; kind is "completion" or "chat". Raises ApiError."""
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}")
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, not {type(data).__name__}")
    try:
        req = _KINDS[kind].model_validate(data)
    except ValidationError as e:
        # Report the first problem only: one clear message beats a list of
        # pydantic internals.
        err = e.errors(include_url=False)[0]
        param = _loc_name(err["loc"]) or None
        problem = _problem(err)
        raise ApiError(400, f"{param}: {problem}" if param else problem, param=param) from None
    if req.model not in known_models:
        available = ", ".join(known_models)
        raise ApiError(400, f"model {req.model!r} does not exist; available: {available}",
                       code="model_not_found", param="model")
    return req


def effective_max_tokens(req: CompletionRequest | ChatCompletionRequest,
                         prompt_len: int, max_model_len: int) -> int:
    """The token budget: as asked, or the rest of the context when left unset.
    Pass the result to check_context."""
    return req.max_tokens if req.max_tokens is not None else max_model_len - prompt_len


def check_context(prompt_len: int, max_tokens: int, max_model_len: int) -> None:
    """Refuse requests that cannot fit the model's context, before they reach an engine."""
    if prompt_len >= max_model_len:
        raise ApiError(400, f"prompt has {prompt_len} tokens; the model's context is "
                            f"{max_model_len} tokens", code="context_length_exceeded")
    if prompt_len + max_tokens > max_model_len:
        raise ApiError(400, f"max_tokens is too large: {prompt_len} prompt tokens + {max_tokens} > "
                            f"context {max_model_len}; lower max_tokens",
                       code="context_length_exceeded", param="max_tokens")


# ---------------------------------------------------------------- responses

def _now(created: int | None) -> int:
    return int(time.time()) if created is None else created


def finish_reason(vllm_reason: str | None) -> str | None:
    """vLLM's finish reason as the API reports it. "stop" and "length" mean the
    same in both; others ("abort", ...) pass through, so clients see the truth.
    The one place to change should a mapping ever be needed."""
    return vllm_reason


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(id: str, model: str, text: str, finish_reason: str | None,
                        prompt_tokens: int, completion_tokens: int,
                        created: int | None = None) -> dict:
    return {
        "id": id, "object": "text_completion", "created": _now(created), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": _usage(prompt_tokens, completion_tokens),
    }


def chat_response(id: str, model: str, text: str, finish_reason: str | None,
                  prompt_tokens: int, completion_tokens: int, created: int | None = None) -> dict:
    return {
        "id": id, "object": "chat.completion", "created": _now(created), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "logprobs": None, "finish_reason": finish_reason}],
        "usage": _usage(prompt_tokens, completion_tokens),
    }


def completion_chunk(id: str, model: str, text: str, finish_reason: str | None = None,
                     created: int | None = None) -> dict:
    return {
        "id": id, "object": "text_completion", "created": _now(created), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def chat_chunk(id: str, model: str, delta_text: str, finish_reason: str | None = None,
               created: int | None = None, first: bool = False) -> dict:
    # As OpenAI streams: the first delta names the role, later ones carry only
    # content, and a closing chunk with no new text has an empty delta.
    if first:
        delta = {"role": "assistant", "content": delta_text}
    else:
        delta = {"content": delta_text} if delta_text else {}
    return {
        "id": id, "object": "chat.completion.chunk", "created": _now(created), "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(id: str, model: str, prompt_tokens: int, completion_tokens: int,
                created: int | None = None, *, kind: str) -> dict:
    """The last chunk of a stream asked for with stream_options.include_usage."""
    obj = {"completion": "text_completion", "chat": "chat.completion.chunk"}[kind]
    return {"id": id, "object": obj, "created": _now(created), "model": model,
            "choices": [], "usage": _usage(prompt_tokens, completion_tokens)}


def models_response(models: list[str], created: int | None = None) -> dict:
    created = _now(created)
    return {"object": "list",
            "data": [{"id": m, "object": "model", "created": created, "owned_by": "specserve"}
                     for m in models]}


def sse(obj: dict) -> str:
    """One Server-Sent Event. json.dumps escapes newlines, so the frame cannot break."""
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"
