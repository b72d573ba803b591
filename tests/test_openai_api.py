"""The OpenAI protocol module: request validation, response shapes, SSE, stop strings.
Pure and fast: no engines, no HTTP."""

from __future__ import annotations

import json

import pytest

from specserve.openai_api import (
    MAX_BODY_BYTES, SSE_DONE, ApiError, ChatCompletionRequest, CompletionRequest,
    chat_chunk, chat_response, check_context, completion_chunk, completion_response,
    effective_max_tokens, finish_reason, models_response, parse_request,
    sse, usage_chunk,
)

MODELS = ["tiny", "smol"]


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def completion(**over) -> bytes:
    return body(**{"model": "tiny", "prompt": "Hello", **over})


def chat(**over) -> bytes:
    return body(**{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **over})


def error(kind: str, raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(kind, raw, MODELS)
    return info.value


# ---------------------------------------------------------------- valid requests

def test_completion_defaults():
    req = parse_request("completion", completion(), MODELS)
    assert isinstance(req, CompletionRequest)
    assert (req.model, req.prompt, req.max_tokens) == ("tiny", "Hello", 16)
    assert (req.temperature, req.top_p, req.seed, req.stop, req.n) == (1.0, 1.0, None, [], 1)
    assert (req.stream, req.ignore_eos, req.include_usage) == (False, False, False)


def test_completion_all_fields_and_normalisation():
    req = parse_request("completion", completion(
        prompt=["only one"], max_tokens=5, temperature=0, top_p=0.5, seed=7, stop="END", n=1,
        stream=True, stream_options={"include_usage": True}, ignore_eos=True,
        logit_bias={"1": 2}, user="someone"), MODELS)  # unsupported extras are ignored
    assert req.prompt == "only one"
    assert req.stop == ["END"]
    assert (req.max_tokens, req.temperature, req.top_p, req.seed) == (5, 0.0, 0.5, 7)
    assert req.ignore_eos
    assert req.include_usage


def test_nulls_mean_defaults():
    raw = completion(max_tokens=None, temperature=None, stop=None, seed=None)
    req = parse_request("completion", raw, MODELS)
    assert (req.max_tokens, req.temperature, req.stop, req.seed) == (16, 1.0, [], None)


def test_include_usage_needs_stream():
    req = parse_request("completion", completion(stream_options={"include_usage": True}), MODELS)
    assert not req.include_usage


def test_chat_parses_and_joins_text_parts():
    raw = body(model="smol", messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "name": "x",
         "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ], stop=["x", "y"])
    req = parse_request("chat", raw, MODELS)
    assert isinstance(req, ChatCompletionRequest)
    assert req.max_tokens is None
    assert req.stop == ["x", "y"]
    assert req.message_dicts() == [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "a\nb"}]


def test_chat_max_completion_tokens_alias():
    assert parse_request("chat", chat(max_tokens=9), MODELS).max_tokens == 9
    assert parse_request("chat", chat(max_completion_tokens=7), MODELS).max_tokens == 7
    both = chat(max_tokens=9, max_completion_tokens=7)
    assert parse_request("chat", both, MODELS).max_tokens == 7  # the newer name wins
    e = error("chat", chat(max_completion_tokens=0))
    assert (e.status, e.param) == (400, "max_completion_tokens")
    assert e.message == "max_completion_tokens: must be >= 1"


# ---------------------------------------------------------------- bad requests

@pytest.mark.parametrize("raw, param, message", [
    (completion(max_tokens=0), "max_tokens", "max_tokens: must be >= 1"),
    (completion(max_tokens="x"), "max_tokens", "max_tokens: must be an integer"),
    (completion(max_tokens=True), "max_tokens", "max_tokens: must be an integer"),
    (completion(temperature=-1), "temperature", "temperature: must be >= 0"),
    (completion(temperature=3), "temperature", "temperature: must be <= 2"),
    (completion(temperature="hot"), "temperature", "temperature: must be a number"),
    (completion(top_p=0), "top_p", "top_p: must be > 0"),
    (completion(top_p=1.5), "top_p", "top_p: must be <= 1"),
    (completion(seed=-1), "seed", "seed: must be >= 0"),
    (completion(n=2), "n", "n: n > 1 is not supported"),
    (completion(n=0), "n", "n: must be >= 1"),
    (completion(stream="yes"), "stream", "stream: must be true or false"),
    (completion(stream_options={"include_usage": 1}), "stream_options.include_usage",
     "stream_options.include_usage: must be true or false"),
    (completion(stop=["a", "b", "c", "d", "e"]), "stop",
     "stop: at most 4 stop strings are allowed, got 5"),
    (completion(stop=[""]), "stop", "stop: stop strings must not be empty"),
    (completion(stop=[1]), "stop", "stop: must be a string or a list of strings"),
    (body(prompt="Hi"), "model", "model: is required"),
    (completion(model=3), "model", "model: must be a string"),
])
def test_completion_rejects(raw, param, message):
    e = error("completion", raw)
    assert (e.status, e.type, e.param, e.message) == (400, "invalid_request_error", param, message)


@pytest.mark.parametrize("prompt", [["a", "b"], [], [1, 2, 3], 5, ""])
def test_unsupported_prompts(prompt):
    e = error("completion", completion(prompt=prompt))
    assert e.status == 400 and e.param == "prompt"
    assert "must" in e.message


def test_non_finite_numbers_rejected():
    e = error("completion", b'{"model": "tiny", "prompt": "x", "temperature": NaN}')
    assert e.status == 400 and "NaN is not allowed" in e.message
    e = error("completion", b'{"model": "tiny", "prompt": "x", "temperature": 1e999}')
    assert e.message == "temperature: must be a finite number"


@pytest.mark.parametrize("raw, fragment", [
    (b'{"model": "tiny",', "request body is not valid JSON: "),
    (b"\xff\xfe\x00garbage", "request body is not valid JSON: "),
    (b"", "request body is not valid JSON: "),
    (b'[{"model": "tiny"}]', "request body must be a JSON object, not list"),
    (b'"text"', "request body must be a JSON object, not str"),
])
def test_bad_bodies(raw, fragment):
    e = error("completion", raw)
    assert e.status == 400 and e.message.startswith(fragment)
    assert e.body()["error"]["type"] == "invalid_request_error"


def test_unknown_model():
    e = error("chat", chat(model="x"))
    assert (e.status, e.code, e.param) == (400, "model_not_found", "model")
    assert e.message == "model 'x' does not exist; available: tiny, smol"


@pytest.mark.parametrize("messages, param, fragment", [
    ([], "messages", "must not be empty"),
    ("hi", "messages", "must be a list"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
     "messages[0].content", "only text content parts are supported; part 0 has type 'image_url'"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content", "no 'text' string"),
    ([{"role": "user", "content": "ok"}, {"role": "robot", "content": "x"}],
     "messages[1].role", "must be 'system'"),
    ([{"role": "user"}], "messages[0].content", "is required"),
    ([{"role": "user", "content": 5}],
     "messages[0].content", "must be a string or a list of text parts"),
    (["hi"], "messages[0]", "must be an object"),
])
def test_chat_rejects(messages, param, fragment):
    e = error("chat", chat(messages=messages))
    assert e.status == 400 and e.param == param
    assert e.message.startswith(param + ": ") and fragment in e.message


def test_oversized_body_is_413():
    raw = completion(prompt="x" * MAX_BODY_BYTES)
    e = error("completion", raw)
    assert e.status == 413 and str(MAX_BODY_BYTES) in e.message
    # Exactly at the limit is still read (and here fails only as bad JSON).
    assert error("completion", b" " * MAX_BODY_BYTES).status == 400


def test_error_body_shape():
    e = ApiError(401, "bad key", type="authentication_error", code="invalid_api_key")
    assert e.body() == {"error": {"message": "bad key", "type": "authentication_error",
                                  "param": None, "code": "invalid_api_key"}}
    assert str(e) == "bad key"


# ---------------------------------------------------------------- context

def test_check_context():
    check_context(10, 20, 30)  # exactly fills the context: fine
    with pytest.raises(ApiError) as info:
        check_context(30, 1, 30)
    assert info.value.status == 400
    assert info.value.message == "prompt has 30 tokens; the model's context is 30 tokens"
    with pytest.raises(ApiError) as info:
        check_context(10, 21, 30)
    assert info.value.param == "max_tokens"
    assert info.value.message == \
        "max_tokens is too large: 10 prompt tokens + 21 > context 30; lower max_tokens"


def test_effective_max_tokens():
    assert effective_max_tokens(parse_request("chat", chat(), MODELS), 10, 100) == 90
    assert effective_max_tokens(parse_request("chat", chat(max_tokens=5), MODELS), 10, 100) == 5
    assert effective_max_tokens(parse_request("completion", completion(), MODELS), 10, 100) == 16


# ---------------------------------------------------------------- responses

def test_completion_response_shape():
    r = completion_response("cmpl-1", "tiny", "out", "length", 3, 4, created=123)
    assert r == {"id": "cmpl-1", "object": "text_completion", "created": 123, "model": "tiny",
                 "choices": [{"index": 0, "text": "out", "logprobs": None,
                              "finish_reason": "length"}],
                 "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}


def test_chat_response_shape():
    r = chat_response("chatcmpl-1", "tiny", "hi", "stop", 5, 1, created=9)
    assert r == {"id": "chatcmpl-1", "object": "chat.completion", "created": 9, "model": "tiny",
                 "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                              "logprobs": None, "finish_reason": "stop"}],
                 "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}


def test_chunk_shapes():
    assert completion_chunk("c", "m", "ab", None, 1) == {
        "id": "c", "object": "text_completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": None}]}
    first = chat_chunk("c", "m", "", None, 1, first=True)
    assert first == {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}]}
    assert chat_chunk("c", "m", "x", None, 1)["choices"][0]["delta"] == {"content": "x"}
    last = chat_chunk("c", "m", "", "stop", 1)["choices"][0]
    assert (last["delta"], last["finish_reason"]) == ({}, "stop")
    for kind, obj in (("completion", "text_completion"), ("chat", "chat.completion.chunk")):
        assert usage_chunk("c", "m", 2, 3, 1, kind=kind) == {
            "id": "c", "object": obj, "created": 1, "model": "m", "choices": [],
            "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}


def test_created_times():
    assert isinstance(completion_chunk("c", "m", "")["created"], int)


def test_models_response():
    assert models_response(["a", "b"], created=5) == {"object": "list", "data": [
        {"id": "a", "object": "model", "created": 5, "owned_by": "specserve"},
        {"id": "b", "object": "model", "created": 5, "owned_by": "specserve"}]}


def test_finish_reason():
    reasons = ["stop", "length", "abort", None]
    assert [finish_reason(r) for r in reasons] == reasons


def test_sse_framing():
    event = sse({"text": "line1\nline2", "u": "é"})
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert event.count("\n") == 2  # newlines inside strings are escaped
    assert json.loads(event[len("data: "):]) == {"text": "line1\nline2", "u": "é"}
    assert SSE_DONE == "data: [DONE]\n\n"
