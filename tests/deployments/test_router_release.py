"""The router's in-flight count and the target stream of a streaming response are
released exactly once, however the response ends: streamed to the end, the
client gone before the body starts (Starlette then never starts the events
generator), or the response dropped without ever being sent."""

import asyncio
import gc

from fake_target import FakeStream, FakeTarget, sse_answer
from test_router import request, router

EVENTS = [b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\n', b"data: [DONE]\n\n"]


async def sse_response():
    stream = FakeStream(sse_answer(EVENTS))
    r = router(FakeTarget([stream]))
    response = await r(request("POST", "/v1/completions", b'{"stream": true}'))
    assert r.choice.inflight == {"same": 1}
    return r, stream, response


def run_asgi(response, messages):
    sent = []
    incoming = list(messages)

    async def receive():
        if incoming:
            return incoming.pop(0)
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)
        await asyncio.sleep(0)

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    return response(scope, receive, send), sent


def test_a_stream_read_to_the_end_releases_once():
    async def main():
        r, stream, response = await sse_response()
        call, sent = run_asgi(response, [])
        await call
        body = b"".join(m.get("body", b"") for m in sent)
        assert body == b"".join(EVENTS)
        return r, stream

    r, stream = asyncio.run(main())
    assert r.choice.inflight == {"same": 0} and stream.cancelled == 1


def test_a_client_gone_before_the_body_starts_releases():
    async def main():
        r, stream, response = await sse_response()
        call, sent = run_asgi(response, [{"type": "http.disconnect"}])
        await call
        # The disconnect won the race: no body was sent, the generator never ran ...
        assert not any(m.get("body") for m in sent), sent
        return r, stream

    r, stream = asyncio.run(main())
    # ... and still the slot is free and the target stream cancelled.
    assert r.choice.inflight == {"same": 0} and stream.cancelled == 1


def test_a_response_never_sent_releases_when_collected():
    async def main():
        r, stream, response = await sse_response()
        del response
        gc.collect()
        await asyncio.sleep(0.05)  # the release is handed to the loop
        return r, stream

    r, stream = asyncio.run(main())
    assert r.choice.inflight == {"same": 0} and stream.cancelled == 1
