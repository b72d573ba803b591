"""DraftingEngine (specserve/target/drafting.py) with a stand-in engine: drafts
per engine request and per sequence (n > 1) with the router's K, records
from vLLM's per-request figures, draft streams closed however the request
ends, the CPU seed refusal as a 400 before anything starts; and of
specserve/target/openai_app.py the in-process ASGI call, the tool-call parser
check and the config hints in vLLM's error messages."""

import asyncio
import contextlib
import contextvars
from types import SimpleNamespace

import pytest

from specserve.target import openai_app
from specserve.target.drafting import ROUTE, DraftingEngine, Route, refusal


def params(n=1, kind="DELTA", seed=None, temperature=0.0, max_tokens=8):
    from vllm.sampling_params import RequestOutputKind

    return SimpleNamespace(n=n, output_kind=getattr(RequestOutputKind, kind), seed=seed,
                           temperature=temperature, max_tokens=max_tokens)


def output(index, tokens, finish=None, histogram=None):
    m = (SimpleNamespace(num_draft_tokens=sum(histogram) * (len(histogram) - 1),
                         histogram=histogram) if histogram else None)
    return SimpleNamespace(index=index, token_ids=tokens, finish_reason=finish,
                           spec_decode_metrics=m)


class FakeEngine:
    model_config = "the engine's"

    def __init__(self, steps, fail=False, hang=False, sink=True):
        self.steps, self.fail, self.hang, self.calls = steps, fail, hang, []
        self.sink = sink  # whether TP rank 0 has a sink that takes registrations
        self.rpcs = []  # the worker hook's calls: (method, args)

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.rpcs.append((method, args))
        return [self.sink, False]  # rank 0, rank 1 (no sink there)

    async def generate(self, prompt, params, request_id, **kw):
        self.calls.append((prompt, request_id, kw))
        for outs in self.steps:
            await asyncio.sleep(0)
            yield SimpleNamespace(outputs=outs)
        if self.fail:
            raise RuntimeError("engine failed")
        if self.hang:  # a request still generating
            await asyncio.sleep(3600)


class Drafts:
    def __init__(self):
        self.opened, self.closed = [], 0

    def __call__(self, pool, rid, ids, max_tokens, k, ticket):
        self.opened.append((pool, rid, ids, max_tokens, k))
        self.tickets = getattr(self, "tickets", []) + [ticket]
        owner = self

        class Stream:
            who = {"model": pool, "replica": f"r{len(owner.opened)}", "lag": 0.5}

            def close(self):
                owner.closed += 1
        return Stream()


async def run(engine, route, prompt, p):
    context = contextvars.copy_context()
    context.run(ROUTE.set, route)

    async def consume():
        return [out async for out in client.generate(prompt, p, "cmpl-1-0", priority=0)]

    drafts = Drafts()
    client = DraftingEngine(engine, drafts, k_max=4, target_replica="t0", live=lambda: (3, 1))
    outs = await asyncio.get_running_loop().create_task(consume(), context=context)
    return outs, drafts, client


def test_one_draft_stream_with_the_routers_k_and_a_record_from_vllms_figures():
    async def go():
        engine = FakeEngine([[output(0, [5, 6])], [output(0, [7], "length", [1, 0, 2])]])
        route = Route("same", 2)
        outs, drafts, client = await run(engine, route, {"prompt_token_ids": [1, 2, 3]},
                                         params())
        assert len(outs) == 2  # vLLM's outputs, unchanged
        assert drafts.opened == [("same", "cmpl-1-0", [1, 2, 3], 8, 2)] and drafts.closed == 1
        # registered with the sink first (id, prompt, the ticket the draft got,
        # K, end = prompt + max_tokens), unregistered at the end
        await asyncio.sleep(0)
        (reg, args), (unreg, uargs) = engine.rpcs
        assert reg == "specserve_register" and unreg == "specserve_unregister"
        assert args == ("cmpl-1-0", [1, 2, 3], drafts.tickets[0], 2, 3 + 8)
        assert uargs == ("cmpl-1-0",) and len(drafts.tickets[0]) >= 16
        [record] = route.records
        r, a = record.report, record.acceptance
        assert (r.draft_model, r.draft_replica, a.k, a.output_tokens) == ("same", "r1", 2, 3)
        assert a.accepted_histogram == (1, 0, 2) and a.draft_tokens == 6
        assert (r.target_replica, r.target_running, r.target_waiting, r.draft_lag) == (
            "t0", 3, 1, 0.5)
        assert 0 <= record.ttft_s <= record.duration_s
        assert engine.calls[0][2] == {"priority": 0}  # the rest goes on to the engine
        assert client.model_config == "the engine's"  # and so does the rest of the client

    asyncio.run(go())


def test_n_sequences_get_a_draft_stream_each_and_a_record_each():
    async def go():
        engine = FakeEngine([[output(0, [5, 6, 7], "stop", [2, 1, 0, 0, 0]),
                              output(1, [5, 6, 8, 9], "length", [3, 0, 0, 0, 0])]])
        route = Route("same", 9)  # more than the engine's K: capped at 4
        outs, drafts, _ = await run(engine, route, {"prompt_token_ids": [1]},
                                    params(n=2, kind="FINAL_ONLY"))
        # vLLM's own names for the sequences of an n > 1 request
        assert [o[1] for o in drafts.opened] == ["0_cmpl-1-0", "1_cmpl-1-0"]
        assert len(set(drafts.tickets)) == 2
        assert {o[4] for o in drafts.opened} == {4} and drafts.closed == 2
        assert [(r.output_tokens, r.report.draft_replica) for r in route.records] == [
            (3, "r1"), (4, "r2")]

    asyncio.run(go())


def test_no_draft_pool_means_no_drafts_but_still_a_record():
    async def go():
        route = Route(None, 4)
        _, drafts, _ = await run(FakeEngine([[output(0, [5], "length")]]), route,
                                 {"prompt_token_ids": [1]}, params())
        assert drafts.opened == []
        [r] = route.records
        assert r.report.draft_model is None and r.acceptance.k == 0 and r.output_tokens == 1

    asyncio.run(go())


def test_a_sequence_the_sink_did_not_take_runs_without_a_draft():
    async def go():
        route = Route("same", 4)
        engine = FakeEngine([[output(0, [5])], [output(0, [6], "length")]], sink=False)
        _, drafts, _ = await run(engine, route, {"prompt_token_ids": [1]}, params())
        assert drafts.opened == [] and engine.rpcs[0][0] == "specserve_register"
        [r] = route.records
        assert r.report.draft_model is None and r.acceptance.k == 0  # ran alone

    asyncio.run(go())


def test_draft_streams_close_when_the_engine_fails_or_the_request_is_cancelled():
    async def go():
        with pytest.raises(RuntimeError):
            await run(FakeEngine([[output(0, [5])]], fail=True), Route("same", 4),
                      {"prompt_token_ids": [1]}, params())
        drafts = Drafts()
        client = DraftingEngine(FakeEngine([[output(0, [5])]], hang=True), drafts, 4, "t0")
        context = contextvars.copy_context()
        context.run(ROUTE.set, Route("same", 4))
        gen = client.generate({"prompt_token_ids": [1]}, params(), "r")

        async def consume():
            async for _ in gen:
                await asyncio.sleep(0)
        task = asyncio.get_running_loop().create_task(consume(), context=context)
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # vLLM's serving layer closes the generators it merged (merge_async_iterators)
        await gen.aclose()
        assert len(drafts.opened) == 1 and drafts.closed == 1

    asyncio.run(go())


def test_a_seeded_sampled_request_is_refused_on_cpu_before_it_starts():
    from vllm.exceptions import VLLMValidationError

    client = DraftingEngine(FakeEngine([]), Drafts(), 4, "t0", on_cpu=True)
    with pytest.raises(VLLMValidationError) as e:
        client.generate({"prompt_token_ids": [1]}, params(seed=3, temperature=0.7), "r")
    assert e.value.parameter == "seed" and "temperature" in str(e.value)
    assert refusal(params(seed=3, temperature=0.0), on_cpu=True) is None
    assert refusal(params(seed=3, temperature=0.7), on_cpu=False) is None


def test_call_runs_an_asgi_app_in_process_and_stops_it_when_closed():
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route as HttpRoute

    stopped = []

    async def endless(request):
        body = await request.body()

        async def events():
            try:
                yield b"got " + body
                while True:
                    await asyncio.sleep(0.001)
                    yield b"."
            finally:
                stopped.append(True)
        return StreamingResponse(events(), status_code=201, media_type="text/event-stream")

    app = Starlette(routes=[HttpRoute("/x", endless, methods=["POST"])])

    async def go():
        calls = openai_app.call(app, "POST", "/x", "", [("content-type", "a/b")], b"hi")
        start = await anext(calls)
        assert start["status"] == 201 and ("content-type", "text/event-stream; charset=utf-8") \
            in start["headers"]
        assert await anext(calls) == b"got hi"
        assert await anext(calls) == b"."
        await calls.aclose()  # the client went away
        await asyncio.sleep(0.01)
        assert stopped == [True]

    asyncio.run(go())


def test_a_closed_call_stops_a_handler_that_runs_in_its_own_task():
    """vLLM's non-streaming handlers run under with_cancellation, in a task of
    their own that only a disconnect cancels (cancelling the app's task
    leaves it, and its engine request, running)."""
    from fastapi import FastAPI, Request
    from vllm.entrypoints.serve.utils.api_utils import with_cancellation

    started, stopped = asyncio.Event(), []

    class Serving:
        @with_cancellation
        async def handle(self, raw_request: Request):
            started.set()
            try:
                await asyncio.sleep(3600)  # generating
            finally:
                stopped.append(True)

    serving = Serving()
    app = FastAPI()

    @app.post("/x")
    async def x(raw_request: Request):
        return await serving.handle(raw_request)

    async def go():
        calls = openai_app.call(app, "POST", "/x", "", [], b"{}")
        pending = asyncio.ensure_future(anext(calls))
        await started.wait()
        pending.cancel()  # the client went away (Serve cancels the call)
        with contextlib.suppress(asyncio.CancelledError):
            await pending
        await calls.aclose()
        assert stopped == [True]

    asyncio.run(go())


def test_error_bodies_name_specserves_config_where_vllm_names_its_flags():
    import json

    body = json.dumps({"error": {"message": '"auto" tool choice requires '
                                 "--enable-auto-tool-choice and --tool-call-parser to be set",
                                 "type": "BadRequestError", "param": None, "code": 400}})
    hinted = json.loads(openai_app.config_hint(body.encode()))
    assert hinted["error"]["message"].startswith(
        '"auto" tool choice requires target.tool_call_parser to be set in specserve\'s config')
    assert hinted["error"]["type"] == "BadRequestError"
    named = b'{"error": {"message": "tool_choice=\\"required\\" requires --tool-call-parser to be set"}}'
    assert b"target.tool_call_parser" in openai_app.config_hint(named)
    other = b'{"error": {"message": "max_tokens must be at least 1"}}'
    assert openai_app.config_hint(other) == other


def test_an_unknown_tool_call_parser_is_refused_with_the_known_ones():
    openai_app.check_tool_call_parser(None)
    openai_app.check_tool_call_parser("hermes")
    with pytest.raises(ValueError, match="'hermez' is not one of vLLM's tool-call parsers: .*hermes"):
        openai_app.check_tool_call_parser("hermez")


def test_body_chunks_queued_while_the_caller_was_busy_go_on_as_one():
    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for piece in (b"data: a\n\n", b"data: b\n\n", b""):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: c\n\n", "more_body": False})

    async def go():
        return [item async for item in openai_app.call(app, "POST", "/x", "", [], b"")]

    assert asyncio.run(go()) == [{"status": 200, "headers": []},
                                 b"data: a\n\ndata: b\n\ndata: c\n\n"]


def test_fields_vllms_request_classes_lack_are_named():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.tokenize.protocol import (
        TokenizeChatRequest,
        TokenizeCompletionRequest,
    )

    completion = openai_app.field_names(CompletionRequest)
    known = {"model": "m", "prompt": "x", "max_tokens": 2, "echo": True, "ignore_eos": True,
             "structured_outputs": {"choice": ["a"]}}
    assert openai_app.unknown_fields(completion, known) == []
    assert openai_app.unknown_fields(completion, {**known, "foo": 1, "bar": 2}) == ["bar", "foo"]
    chat = openai_app.field_names(ChatCompletionRequest)
    body = {"model": "m", "messages": [], "max_completion_tokens": 2, "top_logprobs": 2}
    assert openai_app.unknown_fields(chat, body) == []
    assert openai_app.unknown_fields(chat, {**body, "guided_json": {}}) == ["guided_json"]
    # A union (/tokenize): a key any of its classes has is known.
    from fastapi import FastAPI
    from vllm.entrypoints.serve.tokenize.api_router import router

    app = FastAPI()
    app.include_router(router)
    fields = openai_app.request_fields(app)
    assert fields["/tokenize"] == (openai_app.field_names(TokenizeCompletionRequest)
                                   | openai_app.field_names(TokenizeChatRequest))
    assert openai_app.unknown_fields(fields["/tokenize"], {"prompt": "x", "messages": [],
                                                           "add_generation_prompt": True,
                                                           "nope": 1}) == ["nope"]
    assert "structured_outputs" in openai_app.unknown_fields_error(["guided_json"])


def test_unknown_fields_get_vllms_400_and_the_rest_reaches_vllms_routes():
    """vLLM's own completion router behind the wrapper: an unknown key is a 400
    naming it, in vLLM's error shape; known keys, other bodies and other
    routes reach the app as they came (here, its handler finds no engine)."""
    import json
    from http import HTTPStatus

    from fastapi import FastAPI
    from vllm.entrypoints.openai.completion.api_router import router
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

    seen = []

    class Serving:  # vLLM's completion handler, answering 418 with what it was given
        async def create_completion(self, request, raw_request):
            seen.append(request)
            return create_error_response("stub", status_code=HTTPStatus.IM_A_TEAPOT)

    inner = FastAPI()
    inner.include_router(router)
    init_exception_handler(inner)
    inner.state.args = SimpleNamespace(log_error_stack=False)
    inner.state.openai_serving_completion = Serving()

    @inner.post("/echo")
    async def echo(body: dict):
        seen.append(body)
        return body

    app = openai_app.RequestGate(inner, openai_app.request_fields(inner))
    assert "/v1/completions" in app.fields and "/echo" not in app.fields  # (no class)

    async def post(path, body: bytes):
        items = [item async for item in openai_app.call(
            app, "POST", path, "", [("content-type", "application/json")], body)]
        return items[0]["status"], b"".join(items[1:])

    status, body = asyncio.run(post("/v1/completions", json.dumps(
        {"model": "m", "prompt": "x", "max_tokens": 2, "foo": 1, "guided_regex": "a"}).encode()))
    error = json.loads(body)["error"]
    assert status == 400 and error["code"] == 400 and error["type"] == "BadRequestError"
    assert error["message"].startswith(
        "Unrecognized request argument supplied: foo, guided_regex") and error["param"] == "foo"
    assert seen == []
    # Known fields reach vLLM's handler, parsed.
    status, _ = asyncio.run(post("/v1/completions", json.dumps(
        {"model": "m", "prompt": "x", "max_tokens": 2, "ignore_eos": True}).encode()))
    assert status == 418 and seen[0].max_tokens == 2 and seen[0].ignore_eos
    # Not an object, not JSON, or too deep for Python's parser: vLLM answers.
    for raw in (b"[1, 2]", b'{"model": ', b"[" * 100_000 + b"]" * 100_000):
        status, body = asyncio.run(post("/v1/completions", raw))
        assert status == 400 and "Unrecognized" not in body.decode(), body
    # A route whose body is no request class: not looked at.
    assert asyncio.run(post("/echo", b'{"a": 1}')) == (200, b'{"a":1}') and seen[1] == {"a": 1}
