"""The draft sink: the target's gRPC endpoint that drafts stream into.

Owns the DraftSink gRPC server (one per target replica, in TP rank 0), the
streams of connected drafts, and the lock around the draft book. Converts
protobuf messages to book calls and back at this edge only.

Never blocks the engine: `propose()` takes the lock only for the book's
in-memory matching and hands verified updates to per-stream bounded queues
without waiting. A draft that does not read its verified updates, or breaks a
stream-level bound, is cut off with a gRPC status; its requests are dropped and
the target simply decodes them without drafts.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures

import grpc
import numpy as np

from specserve.target.book import RESOURCE_EXHAUSTED, BookError, DraftBook
from specserve.v1 import spec_pb2, spec_pb2_grpc

log = logging.getLogger(__name__)

# gRPC refuses bigger messages; a prompt of 1M tokens fits in ~5 MiB.
MAX_MESSAGE_BYTES = 8 << 20


class _Stream:
    """Outbound side of one connected draft stream."""

    def __init__(self, stream_id: int, peer: str, max_queued: int):
        self.id = stream_id
        self.peer = peer
        self.out: queue.Queue = queue.Queue(maxsize=max_queued)
        self.abort: tuple[grpc.StatusCode, str] | None = None
        self.done = threading.Event()

    def send(self, msg: spec_pb2.SinkMessage) -> None:
        """Queue a message; a draft that stopped reading is cut off."""
        try:
            self.out.put_nowait(msg)
        except queue.Full:
            self.cut(grpc.StatusCode.RESOURCE_EXHAUSTED, "draft is not reading verified updates")

    def cut(self, code: grpc.StatusCode, message: str) -> None:
        if self.abort is None:
            self.abort = (code, message)
        self.done.set()


class DraftSink(spec_pb2_grpc.DraftSinkServicer):
    """Buffers drafts from any number of streams; serves them to the proposer."""

    def __init__(
        self,
        vocab_size: int,
        max_requests: int = 4096,
        max_pending: int = 64,
        max_queued_updates: int = 65536,
        max_prompt_len: int = 1 << 20,
    ):
        self._book = DraftBook(
            vocab_size,
            max_requests=max_requests,
            max_pending=max_pending,
            max_prompt_len=max_prompt_len,
        )
        self._lock = threading.Lock()
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count(1)
        self._max_queued = max_queued_updates
        self._server: grpc.Server | None = None
        self.port: int | None = None
        self.request_errors = 0

    # ---- the engine side ------------------------------------------------------

    def propose(
        self,
        histories: Sequence[np.ndarray],
        active: Sequence[bool],
        k: int,
    ) -> list[list[int]]:
        with self._lock:
            proposals, updates = self._book.propose(histories, k, max_advance=k + 1, active=active)
            streams = dict(self._streams)
        for u in updates:
            stream = streams.get(u.key[0])
            if stream is not None:
                stream.send(
                    spec_pb2.SinkMessage(
                        verified=spec_pb2.Verified(
                            request_id=u.key[1], position=u.position, token_ids=u.token_ids
                        )
                    )
                )
        return proposals

    def stats(self) -> dict:
        with self._lock:
            s = self._book.stats
            return {**s.__dict__, "open_requests": len(self._book), "streams": len(self._streams),
                    "request_errors": self.request_errors}

    # ---- the gRPC side ----------------------------------------------------------

    def Connect(self, request_iterator, context) -> Iterator[spec_pb2.SinkMessage]:
        stream = _Stream(next(self._ids), context.peer(), self._max_queued)
        with self._lock:
            self._streams[stream.id] = stream
        log.info("draft stream %d connected from %s", stream.id, stream.peer)
        reader = threading.Thread(
            target=self._read, args=(stream, request_iterator), daemon=True,
            name=f"sink-read-{stream.id}",
        )
        reader.start()
        try:
            while context.is_active():
                try:
                    msg = stream.out.get(timeout=0.2)
                except queue.Empty:
                    if stream.done.is_set():
                        break
                    continue
                yield msg
        finally:
            with self._lock:
                self._streams.pop(stream.id, None)
                dropped = self._book.close_all(stream.id)
            log.info("draft stream %d closed (%d requests dropped); book: %s",
                     stream.id, dropped, self._book.stats)
        if stream.abort is not None:
            context.abort(*stream.abort)

    def _read(self, stream: _Stream, request_iterator) -> None:
        try:
            for msg in request_iterator:
                if stream.done.is_set():
                    return
                self._apply(stream, msg)
        except grpc.RpcError:
            pass  # the client went away; Connect's loop notices
        except Exception as e:  # never let a reader thread die silently
            log.exception("draft stream %d failed", stream.id)
            stream.cut(grpc.StatusCode.INTERNAL, f"sink error: {e}")
            return
        stream.done.set()

    def _apply(self, stream: _Stream, msg: spec_pb2.DraftMessage) -> None:
        kind = msg.WhichOneof("kind")
        rid = ""
        try:
            with self._lock:
                if kind == "open":
                    rid = msg.open.request_id
                    self._book.open((stream.id, rid), msg.open.prompt_token_ids,
                                    k=msg.open.max_draft_tokens)
                elif kind == "draft":
                    rid = msg.draft.request_id
                    self._book.extend(
                        (stream.id, rid), msg.draft.position, msg.draft.token_ids
                    )
                elif kind == "close":
                    rid = msg.close.request_id
                    self._book.close((stream.id, rid))
                else:
                    raise BookError(3, "empty DraftMessage: set open, draft or close")
        except BookError as e:
            with self._lock:
                self.request_errors += 1
            if e.code == RESOURCE_EXHAUSTED:
                stream.cut(grpc.StatusCode.RESOURCE_EXHAUSTED, e.message)
                return
            stream.send(
                spec_pb2.SinkMessage(
                    error=spec_pb2.RequestError(request_id=rid, code=e.code, message=e.message)
                )
            )

    # ---- lifecycle --------------------------------------------------------------

    def start(self, address: str, max_streams: int = 64, tls=None) -> int:
        """Serve on host:port (port 0 picks one); returns the bound port.
        tls: a specserve.tls.TlsFiles: mutual TLS, client certificates required."""
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_streams, thread_name_prefix="sink"),
            maximum_concurrent_rpcs=max_streams,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        spec_pb2_grpc.add_DraftSinkServicer_to_server(self, server)
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            from specserve.tls import server_credentials

            port = server.add_secure_port(address, server_credentials(tls))
        if port == 0:
            raise RuntimeError(f"draft sink cannot listen on {address}; pick a free port")
        server.start()
        self._server, self.port = server, port
        log.info("draft sink listening on %s (port %d%s)", address, port,
                 ", mutual TLS" if tls is not None else "")
        return port

    def stop(self, grace: float = 0.5) -> None:
        if self._server is not None:
            self._server.stop(grace)
            self._server = None
