"""The draft sink over real gRPC on loopback: drafts in, verified tokens out,
per-request errors, stream-level cut-offs, malformed bytes."""

import queue
import threading
import time

import grpc
import numpy as np
import pytest

from specserve.sink import DraftSink
from specserve.v1 import spec_pb2, spec_pb2_grpc


@pytest.fixture
def sink():
    s = DraftSink(vocab_size=100, max_requests=8, max_pending=16)
    s.start("127.0.0.1:0")
    yield s
    s.stop()


class Client:
    """A draft stream driven from the test: push messages, read replies."""

    def __init__(self, port):
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.out: queue.Queue = queue.Queue()
        self.replies: queue.Queue = queue.Queue()
        self.status = None
        call = spec_pb2_grpc.DraftSinkStub(self.channel).Connect(iter(self.out.get, None))
        self.thread = threading.Thread(target=self._read, args=(call,), daemon=True)
        self.thread.start()

    def _read(self, call):
        try:
            for msg in call:
                self.replies.put(msg)
        except grpc.RpcError as e:
            self.status = e.code()
        else:
            self.status = grpc.StatusCode.OK

    def open(self, rid, prompt):
        self.out.put(spec_pb2.DraftMessage(open=spec_pb2.OpenRequest(
            request_id=rid, prompt_token_ids=prompt)))

    def draft(self, rid, position, tokens):
        self.out.put(spec_pb2.DraftMessage(draft=spec_pb2.DraftTokens(
            request_id=rid, position=position, token_ids=tokens)))

    def reply(self, timeout=5):
        return self.replies.get(timeout=timeout)

    def close(self):
        self.out.put(None)
        self.channel.close()


def wait_for(cond, timeout=5):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def h(*t):
    return np.array(t, dtype=np.int32)


def test_drafts_flow_in_and_verified_tokens_flow_back(sink):
    c = Client(sink.port)
    c.open("r", [1, 2, 3])
    c.draft("r", 3, [4, 5, 6, 7])
    assert wait_for(lambda: sink.stats()["draft_tokens_buffered"] == 4)
    assert sink.propose([h(1, 2, 3, 4)], [True], k=2) == [[5, 6]]
    msg = c.reply()
    assert msg.WhichOneof("kind") == "verified"
    assert (msg.verified.request_id, msg.verified.position, list(msg.verified.token_ids)) == (
        "r", 3, [4])
    c.close()
    assert wait_for(lambda: sink.stats()["open_requests"] == 0)


def test_bad_requests_get_per_request_errors_and_the_stream_stays_open(sink):
    c = Client(sink.port)
    c.draft("ghost", 5, [1])
    err = c.reply().error
    assert err.request_id == "ghost" and err.code == grpc.StatusCode.NOT_FOUND.value[0]
    c.open("r", [1, 2])
    c.draft("r", 2, [500])
    err = c.reply().error
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "vocabulary" in err.message
    c.out.put(spec_pb2.DraftMessage())  # nothing set
    assert c.reply().error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    c.draft("r", 2, [7, 8])
    assert wait_for(lambda: sink.stats()["draft_tokens_buffered"] == 2)
    assert c.status is None  # still connected
    c.close()


def test_a_stream_opening_too_many_requests_is_cut_off(sink):
    c = Client(sink.port)
    for i in range(20):
        c.open(f"r{i}", [1])
    assert wait_for(lambda: c.status is not None)
    assert c.status == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert wait_for(lambda: sink.stats()["open_requests"] == 0)
    # Another draft can still connect and work.
    d = Client(sink.port)
    d.open("ok", [3])
    assert wait_for(lambda: sink.stats()["open_requests"] == 1)
    d.close()


def test_malformed_bytes_end_that_call_with_a_status_and_nothing_else(sink):
    good = Client(sink.port)
    good.open("r", [1, 2])
    channel = grpc.insecure_channel(f"127.0.0.1:{sink.port}")
    raw = channel.stream_stream(
        "/specserve.v1.DraftSink/Connect",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    with pytest.raises(grpc.RpcError) as e:
        list(raw(iter([b"\xff\xff\xff\xff garbage"]), timeout=5))
    assert e.value.code() != grpc.StatusCode.OK
    channel.close()
    good.draft("r", 2, [3])
    assert wait_for(lambda: sink.stats()["draft_tokens_buffered"] == 1)
    assert sink.propose([h(1, 2, 3)], [True], k=2) == [[]]
    assert good.reply().verified.token_ids == [3]
    good.close()


def test_a_flood_stays_within_the_buffer_bounds(sink):
    c = Client(sink.port)
    c.open("r", [1])
    rng = np.random.default_rng(0)
    for _ in range(3000):
        c.draft("r", 1, rng.integers(0, 100, 64).tolist())
    assert wait_for(lambda: sink.stats()["draft_messages"] == 3000, timeout=30)
    stats = sink.stats()
    assert stats["draft_tokens_buffered"] <= 16  # max_pending
    proposals = sink.propose([h(1)], [True], k=4)
    assert len(proposals[0]) <= 4
    c.close()
