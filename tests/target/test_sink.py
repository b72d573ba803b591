"""The draft sink over real gRPC on loopback: drafts in, verified tokens out,
per-request errors, stream-level cut-offs, malformed bytes."""

import queue
import threading
import time

import grpc
import numpy as np
import pytest

from specserve.target.sink import DraftSink
from specserve.v1 import spec_pb2, spec_pb2_grpc


@pytest.fixture
def sink():
    s = DraftSink(vocab_size=100, max_requests=8, max_pending=16)
    s.start("127.0.0.1:0")
    yield s
    s.stop()


class Client:
    """A draft stream driven from the test: push messages, read replies."""

    def __init__(self, sink, name=None):
        self.sink = sink
        self.channel = grpc.insecure_channel(f"127.0.0.1:{sink.port}")
        self.out: queue.Queue = queue.Queue()
        self.replies: queue.Queue = queue.Queue()
        self.status = None
        metadata = [("x-specserve-draft", name)] if name else None
        call = spec_pb2_grpc.DraftSinkStub(self.channel).Connect(iter(self.out.get, None),
                                                                metadata=metadata)
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

    def open(self, rid, prompt, ticket=None):
        """The target registers the request (as its engine client does), then
        this draft opens it with the ticket (another one: `ticket`)."""
        self.sink.register(rid, prompt, ticket=f"ticket-{rid}")
        self.attach(rid, f"ticket-{rid}" if ticket is None else ticket)

    def attach(self, rid, ticket, verified_position=0):
        self.out.put(spec_pb2.DraftMessage(open=spec_pb2.OpenRequest(
            request_id=rid, ticket=ticket, verified_position=verified_position)))

    def draft(self, rid, position, tokens, branches=()):
        self.out.put(spec_pb2.DraftMessage(draft=spec_pb2.DraftTokens(
            request_id=rid, position=position, token_ids=tokens,
            branches=[spec_pb2.Branch(fork_position=f, token_ids=t) for f, t in branches])))

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


def rows(*histories):
    """vLLM's view of a batch: token_ids_cpu and num_tokens_no_spec."""
    tok = np.zeros((len(histories), max(len(x) for x in histories)), np.int32)
    for i, x in enumerate(histories):
        tok[i, : len(x)] = x
    return tok, np.array([len(x) for x in histories])


def verified(msg):
    """The (request id, position, tokens, held) of a sink message's verified batch."""
    from specserve.wire import unpack_verified

    assert msg.WhichOneof("kind") == "verified", msg
    return unpack_verified(msg.verified)


def test_drafts_flow_in_and_verified_tokens_flow_back(sink):
    c = Client(sink)
    c.open("r", [1, 2, 3])
    c.draft("r", 3, [4, 5, 6, 7])
    assert wait_for(lambda: sink.stats()["draft_tokens_buffered"] == 4)
    assert sink.propose(*rows(h(1, 2, 3, 4)), [True], k=2, keys=["r"]) == [[5, 6]]
    # the sink still holds drafts for positions 4..6: they end at 7
    assert verified(c.reply()) == [("r", 3, [4], 7)]
    c.close()
    assert wait_for(lambda: sink.stats()["streams"] == 0)
    assert sink.stats()["open_requests"] == 1  # the target's until it unregisters
    sink.unregister("r")
    assert sink.stats()["open_requests"] == 0


def test_a_client_without_the_ticket_learns_nothing_and_changes_nothing(sink):
    """A client of the draft port that guesses an id (or has a wrong ticket)
    gets NOT_FOUND, the same for both, and never hears the row's tokens."""
    good = Client(sink)
    good.open("r", [1, 2, 3])
    good.draft("r", 3, [4, 5, 6])
    rogue = Client(sink)
    rogue.attach("r", "guess")
    err = rogue.reply().error
    assert err.code == grpc.StatusCode.NOT_FOUND.value[0] and "ticket" not in err.message
    rogue.attach("unknown", "")
    assert rogue.reply().error.code == grpc.StatusCode.NOT_FOUND.value[0]
    rogue.draft("r", 3, [9, 9, 9])
    assert rogue.reply().error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert wait_for(lambda: sink.stats()["draft_tokens_buffered"] == 3)
    assert sink.propose(*rows(h(1, 2, 3, 4)), [True], k=2, keys=["r"]) == [[5, 6]]
    assert verified(good.reply()) == [("r", 3, [4], 6)]
    with pytest.raises(queue.Empty):
        rogue.reply(timeout=0.5)
    good.close()
    rogue.close()


def test_bad_requests_get_per_request_errors_and_the_stream_stays_open(sink):
    c = Client(sink)
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


def test_registrations_past_the_bound_are_refused_to_the_target(sink):
    from specserve.target.book import RESOURCE_EXHAUSTED, BookError

    for i in range(8):
        sink.register(f"r{i}", [1], ticket="t")
    with pytest.raises(BookError) as e:
        sink.register("r8", [1], ticket="t")  # that request runs without drafts
    assert e.value.code == RESOURCE_EXHAUSTED
    sink.unregister("r0")
    d = Client(sink)
    d.open("ok", [3])
    d.draft("ok", 1, [4])
    assert wait_for(lambda: sink.stats()["draft_tokens_buffered"] == 1)
    d.close()


def test_malformed_bytes_end_that_call_with_a_status_and_nothing_else(sink):
    good = Client(sink)
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
    assert sink.propose(*rows(h(1, 2, 3)), [True], k=2, keys=["r"]) == [[]]
    assert verified(good.reply()) == [("r", 2, [3], 3)]
    good.close()


def test_a_flood_stays_within_the_buffer_bounds(sink):
    c = Client(sink)
    c.open("r", [1])
    rng = np.random.default_rng(0)
    for _ in range(3000):
        c.draft("r", 1, rng.integers(0, 100, 64).tolist())
    assert wait_for(lambda: sink.stats()["draft_messages"] == 3000, timeout=30)
    # Each message is a newer window for the same verified history, so each
    # replaces the last; what is held stays within max_pending.
    (key,) = [k for k in sink._book._entries]
    seq, verified = sink._book.sequence(key)
    assert len(seq) - verified <= 16  # max_pending
    proposals = sink.propose(*rows(h(1)), [True], k=4, keys=["r"])
    assert len(proposals[0]) <= 4
    c.close()


def test_a_stream_cannot_touch_another_streams_requests(sink):
    """A stream reaches only the requests it attached to: a second stream that
    names the first one's request id reaches nothing of it."""
    a, b = Client(sink), Client(sink)
    a.open("r", [1, 2, 3])
    a.draft("r", 3, [4, 5, 6])
    assert wait_for(lambda: sink.stats()["draft_tokens_buffered"] == 3)
    b.out.put(spec_pb2.DraftMessage(close=spec_pb2.CloseRequest(request_id="r")))
    b.draft("r", 3, [9, 9, 9])
    err = b.reply().error  # (closing an unknown request is a no-op)
    assert err.request_id == "r" and err.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert sink.stats()["open_requests"] == 1
    assert sink.propose(*rows(h(1, 2, 3)), [True], k=2, keys=["r"]) == [[4, 5]]
    b.close()  # b going away drops b's requests only
    assert wait_for(lambda: sink.stats()["streams"] == 1)
    assert sink.stats()["open_requests"] == 1
    a.close()


def test_memory_stays_bounded_under_a_flood_of_big_messages():
    """Many streams attaching to requests with big prompts (registered by the
    target), guessing others, and sending big drafts as fast as they can:
    buffered drafts and the process's memory stay bounded (drafts past
    max_pending are dropped; a request has one draft at a time)."""
    import psutil

    sink = DraftSink(vocab_size=100, max_requests=16, max_pending=16, max_prompt_len=200_000)
    sink.start("127.0.0.1:0")
    me = psutil.Process()
    stop = threading.Event()
    big_prompt = [1] * 150_000  # ~0.6 MB per message on the wire
    rng = np.random.default_rng(0)
    sent = [0]
    for j in range(16):
        sink.register(f"r{j}", big_prompt, ticket=f"t{j}")

    def flood(i):
        channel = grpc.insecure_channel(f"127.0.0.1:{sink.port}", options=[
            ("grpc.max_send_message_length", 8 << 20)])

        def msgs():
            n = 0
            while not stop.is_set():
                rid = f"r{n % 40}"  # 16 registered, 24 guessed
                yield spec_pb2.DraftMessage(open=spec_pb2.OpenRequest(
                    request_id=rid, ticket=f"t{n % 40}"))
                yield spec_pb2.DraftMessage(draft=spec_pb2.DraftTokens(
                    request_id=rid, position=len(big_prompt),
                    token_ids=rng.integers(0, 100, 50_000).tolist()))
                sent[0] += 2
                n += 1

        while not stop.is_set():  # reconnect after each cut-off, like a real draft
            try:
                for _ in spec_pb2_grpc.DraftSinkStub(channel).Connect(msgs()):
                    pass
            except grpc.RpcError:
                pass
        channel.close()

    try:
        baseline = me.memory_info().rss
        threads = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(8)]
        for t in threads:
            t.start()
        peak_requests = peak_buffered = 0
        peak_rss = baseline
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            s = sink.stats()
            peak_requests = max(peak_requests, s["open_requests"])
            with sink._lock:  # drafted tokens held past each verified position
                held = [e.length - e.verified for e in sink._book._entries.values()]
            peak_buffered = max([peak_buffered, *held])
            peak_rss = max(peak_rss, me.memory_info().rss)
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(10)
        assert sent[0] > 200, "the flood did not get going"
        assert peak_requests <= 16 and peak_buffered <= 16, (peak_requests, peak_buffered)
        # 16 open requests of 150k tokens are ~10 MB in the book; gRPC buffers
        # a few messages per stream. Unbounded buffering would be gigabytes.
        grown = (peak_rss - baseline) / (1 << 20)
        print(f"flood: {sent[0]} messages, peak RSS growth {grown:.0f} MiB")
        assert grown < 300, f"memory grew by {grown:.0f} MiB under the flood"
    finally:
        stop.set()
        sink.stop()


def test_a_link_knows_how_long_its_sink_has_been_unreachable(sink):
    """A draft replica stops drafting for a target whose sink stays unreachable
    (deployments/draft.py); the link measures it and a working stream resets it."""
    import asyncio
    import socket

    from specserve.draft.link import SinkLink

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]

    got = []

    async def main():
        down = SinkLink(f"127.0.0.1:{dead}", lambda *a: None, lambda link: [])
        up = SinkLink(f"127.0.0.1:{sink.port}", lambda *a: got.append(a), lambda link: [])
        await asyncio.sleep(1.0)
        sink.register("r", [1, 2], ticket="t")
        up.open("r", "t")  # (before the stream is up, the snapshot would re-open it)
        for _ in range(100):
            if sink._book.stream_of("r") is not None:
                break
            await asyncio.sleep(0.02)
        assert sink.propose(*rows(h(1, 2, 3)), [True], k=2, keys=["r"]) == [[]]  # a verified update for "r"
        await asyncio.sleep(0.5)
        result = down.down_since, up.down_since
        await down.close()
        await up.close()
        return result

    down_since, up_since = asyncio.run(main())
    assert down_since is not None
    assert got == [("r", 2, [3])] and up_since is None  # the working stream delivered


def test_a_release_reaches_the_draft_runner_over_the_wire():
    """A real SinkLink and DraftRunner with a draft too slow to ever send a
    token: after release_after = 2 steps without drafts the sink releases the
    request, and the runner, told over the stream, stops drafting it."""
    import asyncio

    from specserve.draft.runner import DraftRunner

    class Stuck:
        max_model_len = 1000

        async def continue_tokens(self, segment_id, request_id, tokens, max_tokens):
            await asyncio.Event().wait()
            yield []

    s = DraftSink(vocab_size=100, max_requests=8, max_pending=16, release_after=2)
    s.start("127.0.0.1:0")

    async def main():
        runner = DraftRunner(Stuck())
        s.register("r", [1, 2], ticket="t")
        runner.start("r", [1, 2], f"127.0.0.1:{s.port}", lookahead=4, max_tokens=50,
                     ticket="t")
        for _ in range(200):
            if s.stats()["streams"] and s._book.stream_of("r") is not None:
                break
            await asyncio.sleep(0.02)
        for hist in ([1, 2, 3], [1, 2, 3, 4]):
            assert await asyncio.to_thread(s.propose, *rows(h(*hist)), [True], 2, ["r"]) == [[]]
        for _ in range(200):
            if runner.stats.released:
                break
            await asyncio.sleep(0.02)
        result = runner.stats.released, runner.active(), runner.assigned()
        await runner.close()
        return result

    try:
        assert asyncio.run(main()) == (1, 0, 1)
        assert s.stats()["released"] == 1 and s.stats()["request_errors"] == 0
    finally:
        s.stop()


def test_a_wait_ends_when_the_draft_says_it_has_nothing_for_the_targets_token():
    """A real SinkLink and DraftRunner with a memory-like draft that knows no
    continuation after the target's token: after the rejection the runner
    rolls back, finds nothing and says so (DraftBatch.done), and the sink's wait
    ends then, not at its bound; the answer is the draft's round trip."""
    import asyncio

    from specserve.draft.runner import DraftRunner

    class Memory:
        max_model_len = 1000
        known = {2: [5, 6, 7, 8]}  # after 2: 5 6 7 8; after anything else: nothing

        async def continue_tokens(self, segment_id, request_id, tokens, max_tokens):
            if tokens[-1] in self.known:
                yield self.known[tokens[-1]][:max_tokens]

    s = DraftSink(vocab_size=100, max_requests=8, max_pending=16, max_wait_s=0.25)
    s.start("127.0.0.1:0")
    bound = 2.0  # far above any round trip: a wait that lasts it did not end early
    s.wait_bound = lambda *a: bound

    async def main():
        runner = DraftRunner(Memory())
        s.register("r", [1, 2], ticket="t")
        runner.start("r", [1, 2], f"127.0.0.1:{s.port}", lookahead=8, max_tokens=50,
                     ticket="t")
        for _ in range(200):
            if s._book.pending("r") == 4 and s._book.answered("r", 8):
                break  # drafted 5 6 7 8, then said it had nothing more
            await asyncio.sleep(0.02)
        assert s._book.pending("r") == 4 and s._book.answered("r", 8)
        props = await asyncio.to_thread(s.propose, *rows(h(1, 2, 5)), [True], 3, ["r"])
        assert props == [[6, 7, 8]]
        t0 = time.monotonic()  # the target took 6, then sampled 40 instead of 7
        props = await asyncio.to_thread(s.propose, *rows(h(1, 2, 5, 6, 40)), [True], 3, ["r"])
        waited = time.monotonic() - t0
        await runner.close()
        return props, waited

    try:
        props, waited = asyncio.run(main())
        assert props == [[]]
        assert waited < bound / 4, waited
        assert len(s.draft_speed.round_trips) == 1 and s.draft_speed.round_trips[0] < bound / 4
        assert s.stats()["request_errors"] == 0
    finally:
        s.stop()


# ---- branches and the bounded wait ------------------------------------------------


def test_branches_travel_the_wire_and_the_figures_are_kept_per_draft(sink):
    c = Client(sink, name="tiny/replica-0")
    c.open("r", [1, 2])
    c.draft("r", 2, [5, 6, 7, 8], branches=[(4, [40, 41, 42])])
    assert wait_for(lambda: sink.stats()["branches_buffered"] == 1)
    assert sink.propose(*rows(h(1, 2, 5)), [True], k=3, keys=["r"]) == [[6, 7, 8]]
    # 6 accepted, 40 instead of 7: the branch is proposed in the same step.
    assert sink.propose(*rows(h(1, 2, 5, 6, 40)), [True], k=3, keys=["r"]) == [[41, 42]]
    stats = spec_pb2_grpc.DraftSinkStub(c.channel).Stats(spec_pb2.StatsRequest())
    (d,) = stats.drafts
    assert d.draft == "tiny/replica-0"
    assert d.counters["branch_hits"] == 1 and d.counters["steps_after_rejected"] == 1
    assert d.steps == 2 and d.waits == 0
    c.close()
    # A closed stream's figures stay, under its draft's name.
    assert wait_for(lambda: sink.stats()["streams"] == 0)
    assert sink.figures()["tiny/replica-0"][0].branch_hits == 1


REJECTED = h(1, 2, 5, 6, 7, 8, 9, 10, 40)


def _rejected(sink, c, step_s=0.1):
    """Open r with drafts [5 .. 11]; one step accepts all, the next rejects 11
    (conditional acceptance 0.8); REJECTED is the history then, no branch."""
    c.open("r", [1, 2])
    c.draft("r", 2, [5, 6, 7, 8, 9, 10, 11])
    assert wait_for(lambda: sink.stats()["draft_tokens_buffered"] == 7)
    assert sink.propose(*rows(h(1, 2, 5)), [True], k=3, keys=["r"]) == [[6, 7, 8]]
    assert sink.propose(*rows(h(1, 2, 5, 6, 7, 8, 9)), [True], k=3, keys=["r"]) == [[10, 11]]
    sink.clock.step_s = step_s  # a target of this step time (measured in a real engine)
    c.reply(), c.reply()


def test_the_bounded_wait_proposes_drafts_that_arrive_in_time():
    sink = DraftSink(vocab_size=100, max_pending=16, max_wait_s=0.2)
    sink.start("127.0.0.1:0")
    try:
        c = Client(sink)
        _rejected(sink, c)
        sink.draft_speed.token_s = 0.03  # the draft's measured speed

        def answer():
            msg = c.reply()  # the verified update goes out before the wait
            assert verified(msg)[0][2] == [10, 40]
            time.sleep(0.02)
            c.draft("r", 9, [41, 42, 43])

        t = threading.Thread(target=answer)
        t.start()
        t0 = time.monotonic()
        props = sink.propose(*rows(REJECTED), [True], k=3, keys=["r"])
        waited = time.monotonic() - t0
        t.join()
        assert props == [[41, 42, 43]]
        assert waited < 0.2
        s = sink.stats()
        assert s["wait_hits"] == 1 and s["covered_after_rejected"] == 1
        (st, w) = sink.figures()["?"]
        assert w.waits == 1 and 0 < w.wait_seconds < 0.2
        c.close()
    finally:
        sink.stop()


def test_the_sink_fits_the_verify_step_cost_over_steady_steps(monkeypatch):
    """step seconds = a + b · tokens from the time between proposes; a step in
    which rows came or went (a prefill) or a row did not sample is left out."""
    import types

    import specserve.target.sink as sink_module

    now = [100.0]
    monkeypatch.setattr(sink_module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    sink = DraftSink(vocab_size=100, max_wait_s=0.05)
    a, b = 0.05, 0.01
    prev = None
    for count in [1] * 12 + [8] * 12 + [3] * 2:
        if prev is not None:
            now[0] += a + b * prev + (0.5 if count != prev else 0.0)
        active = [True] * count
        if count == 3:
            active[0] = False  # a row still in its prefill: not a decode step
        assert sink.propose(*rows(*[h(1, 2, 3)] * count), active, k=3) == [[]] * count
        prev = count
    fit = sink.clock.fit.fit()
    assert fit is not None and len(sink.clock.fit) == 22
    assert abs(fit[0] - a) < 1e-9 and abs(fit[1] - b) < 1e-9
    # What the wait prices with: the fit, redone every 16 steady steps.
    assert abs(sink.clock.cost.fixed - a) < 1e-9 and abs(sink.clock.cost.per_token - b) < 1e-9
    # What the K controller decides with: the fit, in the sink's Stats answer
    # (none before enough steady steps).
    cost = sink.Stats(spec_pb2.StatsRequest(), None).step_cost
    assert cost.steps == 22
    assert cost.fixed_s == pytest.approx(a) and cost.per_token_s == pytest.approx(b)
    assert not DraftSink(vocab_size=100).Stats(spec_pb2.StatsRequest(), None).HasField("step_cost")


def test_the_price_of_a_drafted_token_is_its_measured_cost_times_the_output_rate(monkeypatch):
    """per_request_k: the sink prices a drafted token (policy.row_k) at the
    fitted cost per token times the tokens its rows emit per second; 0 (every
    row its K) until the cost is fitted, and always with per_request_k off."""
    import types

    import specserve.target.sink as sink_module
    from specserve.control.stepcost import MIN_STEPS

    now = [100.0]
    monkeypatch.setattr(sink_module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    a, b = 0.02, 0.002
    for on in (True, False):
        sink = DraftSink(vocab_size=100, per_request_k=on)
        prices = []
        for count in [4] * 10 + [8] * 20:  # two batch sizes, so b can be fitted
            now[0] += a + b * count
            sink.propose(*rows(*[h(1, 2, 3)] * count), [True] * count, k=3)
            prices.append(sink.price())
        assert prices[:MIN_STEPS] == [0.0] * MIN_STEPS
        if on:
            # 8 rows of one token each per a + 8 b seconds (unknown rows: no drafts)
            assert prices[-1] == pytest.approx(b * 8 / (a + 8 * b), rel=1e-2)  # (EWMAs)
        else:
            assert prices[-1] == 0.0


def test_the_wait_is_bounded_and_zero_when_it_cannot_pay():
    sink = DraftSink(vocab_size=100, max_pending=16, max_wait_s=0.08)
    sink.start("127.0.0.1:0")
    try:
        c = Client(sink)
        _rejected(sink, c)
        sink.draft_speed.token_s = 0.01
        t0 = time.monotonic()
        assert sink.propose(*rows(REJECTED), [True], k=3, keys=["r"]) == [[]]  # nothing ever comes
        bound = sink.wait_bound(rows=1, waiting_rows=1, k=3)
        assert 0 < bound <= 0.08
        assert time.monotonic() - t0 < bound + 0.05
        # A draft too slow to pay for the wait, or a big batch: no wait at all.
        sink.draft_speed.token_s = 1.0
        assert sink.wait_bound(rows=1, waiting_rows=1, k=3) == 0.0
        sink.draft_speed.token_s = 0.01
        assert sink.wait_bound(rows=64, waiting_rows=1, k=3) == 0.0
        # A draft that sends its drafts at once: the deadline is the 90th
        # percentile of its round trips, not their mean (0.0032 s here).
        sink.draft_speed.token_s = 0.0
        sink.draft_speed.round_trips.extend([0.002] * 8 + [0.006, 0.010])
        assert sink.wait_bound(rows=1, waiting_rows=1, k=3) == pytest.approx(0.0064)
        # Two rows waiting: the percentile at which both are in 9 times in 10
        # (100 * 0.9 ** 0.5 = 94.87th: 0.006 + 0.004 * 0.538).
        assert sink.wait_bound(rows=2, waiting_rows=2, k=3) == pytest.approx(0.00815, rel=1e-3)
        c.close()
    finally:
        sink.stop()
    assert DraftSink(vocab_size=100).wait_bound(1, 1, 3) == 0.0  # max_wait_s 0: never


def test_a_request_without_drafts_for_n_steps_in_a_row_is_released():
    """release_after = 3: a draft opened "late" but never sends its drafts in
    time. The third step in a row without any releases it: the sink closes it,
    tells the draft (Release), and drops the draft's late messages for it
    without an error. "keeps-up", whose window is always ahead, stays."""
    s = DraftSink(vocab_size=100, max_requests=8, max_pending=16, release_after=3)
    s.start("127.0.0.1:0")
    try:
        c = Client(s)
        c.open("late", [1, 2, 3])
        c.open("keeps-up", [7, 8])
        c.draft("keeps-up", 2, list(range(50, 60)))
        assert wait_for(lambda: s.stats()["draft_tokens_buffered"] == 10)
        late, ok = [1, 2, 3], [7, 8]
        for step in range(3):
            out = s.propose(*rows(h(*late), h(*ok)), [True, True], k=2, keys=["late", "keeps-up"])
            assert out == [[], list(range(50 + 3 * step, 52 + 3 * step))], out
            late.append(10 + step)
            ok += list(range(50 + 3 * step, 53 + 3 * step))  # 2 accepted + the bonus
        replies = []
        while True:
            try:
                replies.append(c.reply(timeout=1))
            except queue.Empty:
                break
        released = [m.release for m in replies if m.WhichOneof("kind") == "release"]
        assert [(r.request_id, r.uncovered_steps) for r in released] == [("late", 3)]
        stats = s.stats()
        assert stats["open_requests"] == 2 and stats["released"] == 1  # still registered
        c.draft("late", 4, [5, 6])  # sent before the draft heard: dropped quietly
        c.out.put(spec_pb2.DraftMessage(close=spec_pb2.CloseRequest(request_id="late")))
        c.draft("keeps-up", 12, [1])  # (in order: the late ones came first)
        assert wait_for(lambda: s.stats()["draft_messages"] == 2)
        assert s.stats()["request_errors"] == 0
        assert s.propose(*rows(h(*ok)), [True], k=2, keys=["keeps-up"]) == [[59, 1]]
        c.close()
    finally:
        s.stop()


def test_a_links_drafts_go_out_as_one_batch_per_loop_turn():
    """SinkLink coalesces: the windows a draft step sends for many requests
    (and several for one request) leave as one DraftBatch, what each request
    drafted in the turn as one entry."""
    import asyncio

    from specserve.draft.link import SinkLink

    sink = DraftSink(vocab_size=100, max_requests=64, max_pending=16)
    sink.start("127.0.0.1:0")
    for i in range(50):
        sink.register(f"r{i}", [1, 2], ticket=f"t{i}")

    async def main():
        link = SinkLink(f"127.0.0.1:{sink.port}", lambda *a: None, lambda link: [])
        for _ in range(100):
            if link._queue is not None:
                break
            await asyncio.sleep(0.02)
        for i in range(50):
            link.open(f"r{i}", f"t{i}")
        for i in range(50):  # one draft step: a token for every request ...
            link.send_draft(f"r{i}", 2, [3])
            link.send_draft(f"r{i}", 2, [3, 4])  # ... and a newer window for each
        await asyncio.sleep(0)
        for _ in range(100):
            if sink.stats()["draft_tokens_buffered"] == 100:
                break
            await asyncio.sleep(0.02)
        batches = link.batches
        await link.close()
        return batches

    try:
        assert asyncio.run(main()) == 1
    finally:
        sink.stop()
    s = sink.stats()
    assert s["draft_tokens_buffered"] == 100 and s["draft_messages"] == 50
    assert s["request_errors"] == 0
    keys = [f"r{i}" for i in range(50)]
    tok, lengths = rows(*[h(1, 2, 3)] * 50)
    assert sink.propose(tok, lengths, [True] * 50, k=2, keys=keys) == [[4]] * 50


def test_a_stream_over_its_message_rate_is_cut_off_and_others_go_on():
    sink = DraftSink(vocab_size=100, max_requests=8, max_pending=16,
                     max_stream_messages_per_s=50)
    sink.start("127.0.0.1:0")
    try:
        good = Client(sink)
        good.open("r", [1, 2])
        flood = Client(sink, name="flood/0")
        for i in range(200):  # far past 50 a second (one second's burst)
            flood.draft("unknown", 2, [3])
        assert wait_for(lambda: flood.status is not None)
        assert flood.status == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The cut is counted for that draft (specserve_draft_stream_cuts_total).
        assert wait_for(lambda: sink.figures().get("flood/0", (None,))[0] is not None
                        and sink.figures()["flood/0"][0].stream_cuts == 1)
        good.draft("r", 2, [3, 4])
        assert wait_for(lambda: sink.stats()["draft_tokens_buffered"] == 2)
        assert good.status is None
        good.close()
    finally:
        sink.stop()


def test_a_burst_of_opens_and_closes_is_not_cut_but_refused_ones_count():
    """Thousands of requests arriving at once: their draft opens and closes
    each one (the book takes them), far past the message rate, and goes on;
    opens the book refuses (ids it was not given) count against the rate."""
    sink = DraftSink(vocab_size=100, max_requests=512, max_pending=16,
                     max_stream_messages_per_s=50)
    sink.start("127.0.0.1:0")
    try:
        burst = Client(sink, name="burst/0")
        for i in range(400):  # 8x the rate's one-second burst
            burst.open(f"r{i}", [1, 2])
        burst.draft("r399", 2, [3, 4])
        assert wait_for(lambda: sink.stats()["draft_tokens_buffered"] == 2)
        for i in range(400):
            burst.out.put(spec_pb2.DraftMessage(close=spec_pb2.CloseRequest(request_id=f"r{i}")))
        burst.draft("r0", 2, [3])  # closed: refused per request, the stream stays
        assert isinstance(burst.reply(), spec_pb2.SinkMessage)
        assert burst.status is None
        burst.close()

        thief = Client(sink, name="thief/0")
        for i in range(200):  # guessed ids: every one refused, each counted
            thief.attach(f"r{i}", "guess")
        assert wait_for(lambda: thief.status is not None)
        assert thief.status == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        sink.stop()


def test_a_links_done_goes_out_whole_and_not_after_a_window_from_further_on():
    """send_done: the request's whole window from the verified position it
    names, marked done, in the turn's one batch; a window sent from a later
    verified position in the same turn means the draft heard more, and the
    done is dropped (its position no longer matches what goes out)."""
    import asyncio

    from specserve.draft.link import SinkLink
    from specserve.wire import pack_drafts

    sent = []

    async def main():
        link = SinkLink("127.0.0.1:9", lambda *a: None, lambda link: [])
        link._task.cancel()  # no stream (a connect would clear what is pending)
        link._put = sent.append
        link.send_draft("a", 5, [6, 7])
        await asyncio.sleep(0)
        link.send_done("a", 5, [6, 7])  # the sink holds 6 7: sent again, whole, done
        link.send_done("b", 9, [])  # nothing past 9
        await asyncio.sleep(0)
        link.send_done("c", 3, [4])
        link.send_draft("c", 4, [8])  # heard 4 since: not done at 3
        await asyncio.sleep(0)
        await link.close()

    asyncio.run(main())
    batches = [m.batch for m in sent if m.WhichOneof("kind") == "batch"]
    assert batches[0] == pack_drafts({"a": (5, [6, 7], [])})
    assert batches[1] == pack_drafts({"a": (5, [6, 7], []), "b": (9, [], [])}, {"a", "b"})
    assert batches[2] == pack_drafts({"c": (4, [8], [])}, set())


def test_the_k_controller_decides_with_the_sinks_step_cost_once_it_has_one(sink):
    """TargetEngine.step_cost: vLLM's step records until the sink answers with
    its fit (timed inside the step), then the sink's; its counters come along."""
    import asyncio

    from specserve.control.stepcost import StepCostFit
    from specserve.target.engine import SpecTotals, TargetEngine

    engine_fit = StepCostFit()
    for tokens in range(1, 21):  # vLLM's records: 0.06 s + 0.001 s per token
        engine_fit.add(tokens, 0.06 + 0.001 * tokens)
    target = TargetEngine(None, SpecTotals(), engine_fit, f"127.0.0.1:{sink.port}", [], 4)
    assert target.step_cost()["source"] == "engine"
    assert target.step_cost()["per_token_s"] == pytest.approx(0.001)
    assert asyncio.run(target.sink_stats()) == {}  # no draft yet, no fit yet
    assert target.step_cost()["source"] == "engine"
    for tokens in range(1, 21):  # the sink's: 0.01 s + 0.004 s per token
        sink.clock.fit.add(tokens, 0.01 + 0.004 * tokens)
    asyncio.run(target.sink_stats())
    cost = target.step_cost()
    assert cost["source"] == "sink" and cost["steps"] == 20
    assert cost["fixed_s"] == pytest.approx(0.01) and cost["per_token_s"] == pytest.approx(0.004)
