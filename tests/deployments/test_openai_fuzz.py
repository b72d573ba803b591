"""Hypothesis on the pure OpenAI request parser: whatever the bytes, it returns a
request with sane fields or raises ApiError with a 4xx status and an OpenAI
error body; nothing else escapes (which would be a 500 at the router)."""

import math

from hypothesis import HealthCheck, given, settings

from fuzz_bodies import MODEL, chat_bytes, completion_bytes
from specserve import openai_api as api

FUZZ = settings(max_examples=1000, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def check(kind, raw):
    try:
        req = api.parse_request(kind, raw, [MODEL])
    except api.ApiError as e:
        assert 400 <= e.status < 500, e.status
        body = e.body()["error"]
        assert isinstance(body["message"], str) and body["message"]
        assert body["type"] and "code" in body
        return
    assert req.model == MODEL
    assert req.max_tokens is None or (isinstance(req.max_tokens, int) and req.max_tokens >= 1)
    assert math.isfinite(req.temperature) and req.temperature >= 0
    assert math.isfinite(req.top_p) and 0 < req.top_p <= 1
    assert isinstance(req.stream, bool)
    if kind == "chat":
        assert req.message_dicts() and all(isinstance(m["content"], str)
                                           for m in req.message_dicts())
    else:
        assert isinstance(req.prompt, str)


@FUZZ
@given(completion_bytes)
def test_completion_bodies(raw):
    check("completion", raw)


@FUZZ
@given(chat_bytes)
def test_chat_bodies(raw):
    check("chat", raw)
