"""The router's in-flight count and the target stream of a streaming response are
released exactly once, however the response ends: streamed to the end, the
client gone before the body starts (Starlette then never starts the events
generator), or the response dropped without ever being sent."""

import asyncio
import gc

from deployments.router import Router


class FakeStream:
    """Stands in for the target's streaming DeploymentResponseGenerator."""

    def __init__(self, chunks):
        self.chunks = list(chunks)
        self.cancelled = 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.chunks:
            raise StopAsyncIteration
        await asyncio.sleep(0)
        return self.chunks.pop(0)

    def cancel(self):
        self.cancelled += 1


class FakeRequest:
    include_usage = False


def chunk(text, finish=None):
    return {"text": text, "token_ids": [1], "finish_reason": finish}


def router():
    r = Router.__new__(Router)  # no tokenizer, Ray or engine needed for _sse
    r.model_name = "tiny"
    r.inflight = {"pool": 1}
    r._observe = lambda *a: None
    return r


def sse_response(r, stream):
    first = stream.chunks.pop(0)
    return r._sse("completion", FakeRequest(), "cmpl-1", 3, first, stream, 0.0, 0.0, "pool")


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
        r, stream = router(), FakeStream([chunk("a"), chunk("b"), chunk("c", "length")])
        response = sse_response(r, stream)
        call, sent = run_asgi(response, [])
        await call
        body = b"".join(m.get("body", b"") for m in sent)
        assert b"data: [DONE]" in body and b'"text": "b"' in body.replace(b'":"', b'": "')
        return r, stream

    r, stream = asyncio.run(main())
    assert r.inflight == {"pool": 0} and stream.cancelled == 1


def test_a_client_gone_before_the_body_starts_releases():
    async def main():
        r, stream = router(), FakeStream([chunk("a"), chunk("b", "length")])
        response = sse_response(r, stream)
        call, sent = run_asgi(response, [{"type": "http.disconnect"}])
        await call
        # The disconnect won the race: no body was sent, the generator never ran ...
        assert not any(m.get("body") for m in sent), sent
        return r, stream

    r, stream = asyncio.run(main())
    # ... and still the slot is free and the target stream cancelled.
    assert r.inflight == {"pool": 0} and stream.cancelled == 1


def test_a_response_never_sent_releases_when_collected():
    async def main():
        r, stream = router(), FakeStream([chunk("a"), chunk("b", "length")])
        response = sse_response(r, stream)
        assert r.inflight == {"pool": 1}
        del response
        gc.collect()
        await asyncio.sleep(0.05)  # the release is handed to the loop
        return r, stream

    r, stream = asyncio.run(main())
    assert r.inflight == {"pool": 0} and stream.cancelled == 1
