"""SinkLink: a draft replica's stream to one target's draft sink.

Owns one long-lived bidirectional gRPC stream (many requests on it), its
reconnects, and the protobuf conversion on the draft side. Its caller hands it
whole windows; what goes on the wire are deltas (`specserve.draft.sent`): the
tokens the sink does not hold yet and each branch once. They are coalesced:
once per turn of the event loop (a draft step of the engine) what every
request drafted goes out in one DraftBatch message. Outgoing messages go
through a bounded queue and are dropped when it is full: drafts are hints, and
the sink's next verified update says what it lacks (`held`), which is sent
again. After a reconnect every live request is opened again from its verified
history (the sink forgot the old stream's requests).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from specserve.draft.sent import SentWindows
from specserve.v1 import spec_pb2, spec_pb2_grpc
from specserve import wire
from specserve.wire import DRAFT_NAME_KEY, pack_drafts, unpack_verified

log = logging.getLogger(__name__)


class SinkLink:
    def __init__(
        self,
        address: str,
        on_verified: Callable[[str, int, list[int]], None],
        snapshot: Callable[["SinkLink"], list[tuple[str, str, int, list[int]]]],
        max_queued: int = 4096,
        channel_factory: Callable[[str], grpc.aio.Channel] | None = None,
        tls=None,
        name: str = "",
        on_release: Callable[[str], None] | None = None,
    ):
        """tls: a specserve.tls.TlsFiles: connect with mutual TLS (None: plaintext).
        name: this draft's "model/replica", sent as call metadata (the sink's
        figures are kept per name). on_release: called with a request id the
        sink gave up (its drafts came too late, spec.proto Release)."""
        self.name = name
        self._on_release = on_release
        self.address = address
        self._on_verified = on_verified
        self._snapshot = snapshot
        self._max_queued = max_queued
        self._channel_factory = channel_factory or wire.channel_factory(tls)
        self._queue: asyncio.Queue | None = None  # the live connection's outbox
        self._closed = False
        self.connects = 0
        self.dropped = 0
        self.errors: list[str] = []  # per-request errors the sink sent (latest few)
        # When the stream last broke with nothing received since (monotonic s);
        # None while messages arrive. A sink down for long means its target is gone.
        self.down_since: float | None = None
        self.batches = 0  # DraftBatch messages sent
        self.tokens_sent = 0  # drafted tokens put on the wire (branch tokens too)
        self._sent = SentWindows()
        # request id -> (from where its window goes out, its new branches), not sent yet
        self._pending: dict[str, tuple[int, list]] = {}
        # request id -> the verified position it knows: its window from there is
        # all it has for now
        self._done: dict[str, int] = {}
        self._flush_at_turn = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"link-{address}")

    # ---- sending (never blocks) ---------------------------------------------------

    def open(self, rid: str, ticket: str, verified_position: int = 0) -> None:
        """Take up a request the target registered (with this ticket) at the sink."""
        self._put(spec_pb2.DraftMessage(open=spec_pb2.OpenRequest(
            request_id=rid, ticket=ticket, verified_position=verified_position)))

    def send_draft(self, rid: str, position: int, tokens: list[int],
                   branches: list[tuple[int, list[int]]] = ()) -> None:
        """A request's whole window from its verified position on (and its
        branches); what of it the sink lacks goes out at the end of this
        loop turn, with whatever else the request drafted in it."""
        delta = self._sent.delta(rid, position, tokens, branches)
        if delta is not None:
            self._queue_delta(rid, *delta)

    def send_done(self, rid: str, position: int, tokens: list[int]) -> None:
        """The request's whole window from the verified position the draft
        knows (`tokens`, maybe none) is all it has until it hears the target:
        the sink stops waiting for it if it verified that far and no further.
        Goes out whole (not as a delta) with this loop turn's batch."""
        self._sent.delta(rid, position, tokens)  # the record: the sink will hold it
        self._done[rid] = position
        self._flush_soon()

    def _queue_delta(self, rid: str, start: int, branches: list) -> None:
        pending = self._pending.get(rid)
        if pending is not None:
            start, branches = min(start, pending[0]), pending[1] + branches
        self._pending[rid] = (start, branches)
        self._flush_soon()

    def _flush_soon(self) -> None:
        if not self._flush_at_turn:
            self._flush_at_turn = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_at_turn = False
        if not self._pending and not self._done:
            return
        windows = {}
        for rid, (start, branches) in self._pending.items():
            position, tokens = self._sent.tokens_from(rid, start)
            windows[rid] = (position, tokens, branches)
            self.tokens_sent += len(tokens) + sum(len(b) for _, b in branches)
        done = set()
        for rid, position in self._done.items():
            start, tokens = self._sent.tokens_from(rid, position)
            if start != position:
                continue  # it sent a window from further on since: not done there
            pending = windows.get(rid, (0, [], []))
            self.tokens_sent += len(tokens) - len(pending[1])
            windows[rid] = (position, tokens, pending[2])
            done.add(rid)
        self._pending.clear()
        self._done.clear()
        self.batches += 1
        self._put(spec_pb2.DraftMessage(batch=pack_drafts(windows, done)))

    def close_request(self, rid: str) -> None:
        self._pending.pop(rid, None)  # a window for a request we close is moot
        self._done.pop(rid, None)
        self._sent.forget(rid)
        self._put(spec_pb2.DraftMessage(close=spec_pb2.CloseRequest(request_id=rid)))

    def _put(self, msg) -> None:
        q = self._queue
        if q is None:
            return  # not connected: the snapshot re-opens live requests on connect
        try:
            q.put_nowait(msg)
        except asyncio.QueueFull:
            self.dropped += 1

    # ---- the stream -------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.05
        while not self._closed:
            channel = self._channel_factory(self.address)
            queue: asyncio.Queue = asyncio.Queue(maxsize=self._max_queued)
            self._sent.clear()  # a new stream: the sink holds nothing of ours
            self._pending.clear()
            self._done.clear()
            try:
                for rid, ticket, verified, drafts in self._snapshot(self):
                    queue.put_nowait(spec_pb2.DraftMessage(open=spec_pb2.OpenRequest(
                        request_id=rid, ticket=ticket, verified_position=verified)))
                    if drafts:
                        queue.put_nowait(spec_pb2.DraftMessage(draft=spec_pb2.DraftTokens(
                            request_id=rid, position=verified, token_ids=drafts)))
                self._queue = queue
                call = spec_pb2_grpc.DraftSinkStub(channel).Connect(
                    self._outgoing(queue),
                    metadata=((DRAFT_NAME_KEY, self.name),) if self.name else None)
                self.connects += 1
                async for msg in call:
                    backoff = 0.05
                    self.down_since = None
                    kind = msg.WhichOneof("kind")
                    if kind == "verified":
                        for rid, position, tokens, held in unpack_verified(msg.verified):
                            again = self._sent.heard(rid, position, tokens, held)
                            if again is not None:  # the sink lacks some of what we sent
                                self._queue_delta(rid, *again)
                            self._on_verified(rid, position, tokens)
                    elif kind == "release":
                        if self._on_release is not None:
                            self._on_release(msg.release.request_id)
                    elif kind == "error":
                        e = msg.error
                        self.errors = (self.errors + [f"{e.request_id}: {e.message}"])[-16:]
                        log.debug("sink refused a message for %s: %s", e.request_id, e.message)
            except asyncio.CancelledError:
                break
            except grpc.aio.AioRpcError as e:
                if self.down_since is None:
                    self.down_since = time.monotonic()
                if not self._closed:
                    log.warning("draft stream to %s broke (%s: %s); reconnecting",
                                self.address, e.code().name, e.details())
            except Exception:
                if self.down_since is None:
                    self.down_since = time.monotonic()
                log.exception("draft stream to %s failed; reconnecting", self.address)
            finally:
                self._queue = None
                await channel.close(grace=None)
            if self._closed:
                break
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    @staticmethod
    async def _outgoing(queue: asyncio.Queue):
        while True:
            msg = await queue.get()
            if msg is None:
                return
            yield msg

    async def close(self) -> None:
        self._closed = True
        q = self._queue
        if q is not None:
            try:
                q.put_nowait(None)
            except asyncio.QueueFull:
                pass
        self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):
            pass
