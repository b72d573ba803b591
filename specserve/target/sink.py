"""The draft sink: the target's gRPC endpoint that drafts stream into.

Owns the DraftSink gRPC server (one per target replica, in TP rank 0), the
streams of connected drafts, and the lock around the draft book. Converts
protobuf messages to book calls and back at this edge only.

The target owns every request: its engine client registers each one (id,
prompt, K, end and a ticket it gives only to the draft it chose) through
`register` before the request's first step, and `unregister`s it when it ends.
A draft stream can only attach to a registered id whose ticket it presents, and
extend the requests it attached to; rows are found by request id
(`specserve.target.book`). A client of the draft port with no ticket learns
nothing and changes nothing.

Never blocks the engine beyond a bound: `propose()` takes the lock for the
book's in-memory matching and hands verified updates to per-stream bounded
queues without waiting. Then, only if rows that had drafts at their last step
find none now (a rejection with no branch for it, or a draft that fell
behind) and the rate model says it pays (specserve.control.policy.wait_bound),
it waits at most that long for their fresh drafts (the bounded wait) and
proposes what arrived. A draft that does not read its verified updates, or breaks a
stream-level bound, is cut off with a gRPC status; its requests are dropped and
the target simply decodes them without drafts. A request whose steps found no
drafts `release_after` times in a row (after the wait) is released: the book
closes it and its draft is told (spec.proto Release) to stop drafting it.
"""

from __future__ import annotations

import dataclasses
import itertools
import hmac
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures

import grpc
import numpy as np

from specserve.control import policy
from specserve.target.book import NOT_FOUND, RESOURCE_EXHAUSTED, BookError, BookStats, DraftBook
from specserve.target.sink_clock import DraftSpeed, StepClock
from specserve.tls import draft_role_problem, server_credentials
from specserve.v1 import spec_pb2, spec_pb2_grpc
from specserve.wire import CHANNEL_OPTIONS, DRAFT_NAME_KEY, pack_verified

log = logging.getLogger(__name__)


@dataclasses.dataclass
class WaitFigures:
    """The bounded wait, per draft."""

    waits: int = 0  # steps held for this draft's rows
    wait_seconds: float = 0.0
    steps: int = 0  # proposer steps with at least one of its rows


class _Stream:
    """Outbound side of one connected draft stream."""

    def __init__(self, stream_id: int, peer: str, max_queued: int, rate: float = 0.0):
        self.id = stream_id
        self.peer = peer
        # a token bucket of messages: `rate` a second, a burst of one second's
        self.rate = rate
        self._allowance = rate
        self._checked = time.monotonic()
        self.out: queue.Queue = queue.Queue(maxsize=max_queued)
        self.abort: tuple[grpc.StatusCode, str] | None = None
        self.done = threading.Event()
        self.name = ""  # the draft's "model/replica", from the call's metadata

    def send(self, msg: spec_pb2.SinkMessage) -> None:
        """Queue a message; a draft that stopped reading is cut off."""
        try:
            self.out.put_nowait(msg)
        except queue.Full:
            self.cut(grpc.StatusCode.RESOURCE_EXHAUSTED, "draft is not reading verified updates")

    def within_rate(self) -> bool:
        """Count one incoming message; False once the stream is past its rate."""
        if self.rate <= 0:
            return True
        now = time.monotonic()
        self._allowance = min(self.rate, self._allowance + (now - self._checked) * self.rate)
        self._checked = now
        self._allowance -= 1.0
        return self._allowance >= 0.0

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
        max_wait_s: float = 0.0,
        max_branches: int = 32,
        max_branch_len: int = 16,
        release_after: int = 0,
        max_stream_messages_per_s: float = 0.0,
        per_request_k: bool = False,
    ):
        """max_stream_messages_per_s: a stream sending more is cut off (0: no bound).
        per_request_k: propose per request only the drafted tokens that pay at
        the measured step cost (`price`)."""
        self.max_stream_messages_per_s = max_stream_messages_per_s
        self.per_request_k = per_request_k
        self._book = DraftBook(
            vocab_size,
            max_requests=max_requests,
            max_pending=max_pending,
            max_prompt_len=max_prompt_len,
            max_branches=max_branches,
            max_branch_len=max_branch_len,
            release_after=release_after,
        )
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # drafts came in
        self.max_wait_s = min(max(max_wait_s, 0.0), policy.MAX_WAIT_S)
        # The engine's step and the draft's speed, for the wait bound, the
        # per-request price and the K controller's cost (sink_clock).
        self.clock = StepClock()
        self.draft_speed = DraftSpeed()
        self.last_wait_s = 0.0  # the bounded wait of the last propose() (0: none)
        self._retired: dict[str, BookStats] = {}  # figures of closed streams, by draft
        self._waits: dict[str, WaitFigures] = {}
        self._streams: dict[int, _Stream] = {}
        self._tickets: dict[str, str] = {}  # request id -> the ticket its draft must present
        self._ids = itertools.count(1)
        self._max_queued = max_queued_updates
        self._server: grpc.Server | None = None
        self._draft_names: tuple[str, ...] | None = None  # mutual TLS: grpc_tls.draft_names
        self.port: int | None = None
        self.request_errors = 0

    # ---- the engine side ------------------------------------------------------

    def register(self, request_id: str, prompt: Sequence[int], ticket: str, k: int = 0,
                 end: int = 0) -> None:
        """The target's registration of one engine request (before its first
        step). Raises BookError (too many open, a bad prompt, already there)."""
        if not ticket:
            raise BookError(3, "a registration needs a ticket")
        with self._lock:
            self._book.register(request_id, prompt, k=k, end=end)
            self._tickets[request_id] = ticket

    def unregister(self, request_id: str) -> None:
        """The target is done with a request: its entry goes; a draft still
        drafting for it hears nothing more and its messages get NOT_FOUND."""
        with self._lock:
            self._book.unregister(request_id)
            self._tickets.pop(request_id, None)
            self.draft_speed.forget(request_id)

    def propose(
        self,
        tok: np.ndarray,
        lengths: np.ndarray,
        active: Sequence[bool],
        k: int,
        keys: Sequence[str | None] | None = None,
    ) -> list[list[int]]:
        """tok[i, :lengths[i]]: row i's history (vLLM's token_ids_cpu and
        num_tokens_no_spec); keys[i]: row i's request id (None: unknown; no drafts)."""
        nrows = len(active)
        start = time.monotonic()
        self.last_wait_s = 0.0
        with self._lock:
            stepping = self.clock.tick(start, nrows, all(active))
            proposals, verified = self._book.propose_rows(tok, lengths, k, max_advance=k + 1,
                                                          active=active, keys=keys,
                                                          price=self.price())
            if stepping:
                self.clock.gained(self._book.emitted)
            misses = list(self._book.misses)
            streams = dict(self._streams)
            for _, key in misses:
                self.draft_speed.missed(key, start)
            if len(self.draft_speed) > 4 * nrows + 64:
                self.draft_speed.forget()  # forgotten rows; the next misses remeasure
            names = {streams[sid].name for sid in
                     (self._book.stream_of(key) for _, key in misses) if sid in streams}
        for sid, part in verified.by_stream().items():  # one batch per stream
            stream = streams.get(sid)
            if stream is not None:
                stream.send(spec_pb2.SinkMessage(verified=pack_verified(part)))
        if misses:
            bound = self.wait_bound(sum(1 for a in active if a), len(misses), k)
            if bound > 0:
                wait_start = time.monotonic()
                got = self._wait(lengths, misses, k, start + bound)
                self.last_wait_s = time.monotonic() - wait_start
                for i, tokens in got.items():
                    proposals[i] = tokens
                waited = time.monotonic() - start
                with self._lock:
                    for name in names:
                        w = self._waits.setdefault(name, WaitFigures())
                        w.waits += 1
                        w.wait_seconds += waited
        with self._lock:
            released = self._book.release_uncovered()
        for key, steps, sid in released:
            # Its drafts came too late this many steps in a row: tell its draft.
            stream = streams.get(sid)
            if stream is not None:
                stream.send(spec_pb2.SinkMessage(release=spec_pb2.Release(
                    request_id=key, uncovered_steps=steps)))
        with self._lock:
            for name in {s_.name for s_ in streams.values()}:
                self._waits.setdefault(name, WaitFigures()).steps += 1
            # The engine's step is the time from here to the next propose (the
            # forward pass); a wait is not part of it. It verifies one token per
            # sampling row plus what is proposed now.
            self.clock.hand_over(time.monotonic(), nrows,
                                 sum(1 for a in active if a) + sum(len(p) for p in proposals))
        return proposals

    def price(self) -> float:
        """What one more verified token costs the batch, in tokens it emits:
        the measured cost per token (s) times the batch's output rate (tokens
        per step / seconds per step). 0 (every row gets its K) until measured
        or with per_request_k off. A drafted token is proposed only where its
        chance of acceptance beats this (`policy.row_k`)."""
        return self.clock.price() if self.per_request_k else 0.0

    def wait_bound(self, rows: int, waiting_rows: int, k: int) -> float:
        """Seconds to hold this step for fresh drafts (the rate model's bound)."""
        if self.max_wait_s <= 0.0 or self.clock.step_s is None:
            return 0.0
        alpha = self._book.stats.alpha
        s = self._book.stats
        coverage = s.rows_with_proposals / s.rows_seen if s.rows_seen else 1.0
        # Unknown draft speed: probe with a share of the cap, then measure.
        d = self.draft_speed.token_s
        if d is None:
            d = self.max_wait_s / max(k, 1)
        return policy.wait_bound(alpha if alpha is not None else 0.0, k, rows, waiting_rows,
                                 self.clock.step_s, d, cost=self.clock.cost, coverage=coverage,
                                 max_wait_s=self.max_wait_s,
                                 first_token_s=self.draft_speed.first_token_s(waiting_rows))

    def _wait(self, lengths, misses, k: int, deadline: float) -> dict[int, list[int]]:
        keys = [key for _, key in misses]
        with self._arrived:
            while True:
                if all(self._book.answered(key, k) for key in keys):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._arrived.wait(left)
            return self._book.refill(lengths, k)

    def stats(self) -> dict:
        with self._lock:
            s = self._book.stats
            return {**s.__dict__, "open_requests": len(self._book),
                    "attached_requests": self._book.attached(), "streams": len(self._streams),
                    "request_errors": self.request_errors}

    def figures(self) -> dict[str, tuple[BookStats, WaitFigures]]:
        """Per draft name: the book's counters (closed streams included) and the wait."""
        with self._lock:
            out: dict[str, tuple[BookStats, WaitFigures]] = {}
            for name, st in self._retired.items():
                acc = BookStats()
                acc.add(st)
                out[name] = (acc, dataclasses.replace(self._waits.get(name, WaitFigures())))
            for sid, stream in self._streams.items():
                st = self._book.stream_stats.get(sid)
                if st is None:
                    continue
                if stream.name not in out:
                    out[stream.name] = (BookStats(), dataclasses.replace(
                        self._waits.get(stream.name, WaitFigures())))
                out[stream.name][0].add(st)
            return out

    def step_cost(self) -> dict | None:
        """The verify step's cost fitted over steady steps, measured from one
        propose() to the next ({"fixed_s", "per_token_s", "steps"}; None until
        enough steps): the time the engine's step takes, and the tokens it
        verified. The K controller's cost (deployments.target.spec_totals)."""
        with self._lock:
            return self.clock.fit.as_dict()

    def Stats(self, request, context) -> spec_pb2.SinkStats:
        msg = spec_pb2.SinkStats()
        cost = self.step_cost()
        if cost is not None:
            msg.step_cost.CopyFrom(spec_pb2.StepCostFit(**cost))
        for name, (st, w) in sorted(self.figures().items()):
            d = msg.drafts.add(draft=name, waits=w.waits, wait_seconds=w.wait_seconds,
                               steps=w.steps)
            for f in dataclasses.fields(st):
                d.counters[f.name] = getattr(st, f.name)
        return msg

    # ---- the gRPC side ----------------------------------------------------------

    def Connect(self, request_iterator, context) -> Iterator[spec_pb2.SinkMessage]:
        if self._draft_names is not None:  # mutual TLS: the peer's certificate is verified
            problem = draft_role_problem(context.auth_context(), self._draft_names)
            if problem is not None:
                log.warning("refused a draft stream from %s: %s", context.peer(), problem)
                context.abort(grpc.StatusCode.PERMISSION_DENIED, problem)
        stream = _Stream(next(self._ids), context.peer(), self._max_queued,
                         self.max_stream_messages_per_s)
        stream.name = dict(context.invocation_metadata() or ()).get(DRAFT_NAME_KEY, "") or "?"
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
                dropped = self._book.close_all(stream.id)  # detached, still registered
                st = self._book.stream_stats.pop(stream.id, None)
                if st is not None:
                    self._retired.setdefault(stream.name, BookStats()).add(st)
                if stream.abort is not None:
                    self._retired.setdefault(stream.name, BookStats()).stream_cuts += 1
            log.info("draft stream %d closed (%d requests detached); book: %s",
                     stream.id, dropped, self._book.stats)
        if stream.abort is not None:
            context.abort(*stream.abort)

    def _read(self, stream: _Stream, request_iterator) -> None:
        try:
            for msg in request_iterator:
                if stream.done.is_set():
                    return
                # An open or close the book takes costs nothing of the rate: each
                # registered id is opened and closed once, so a burst of requests
                # (thousands arriving together) does not cut its draft off. Drafts,
                # batches and refused opens and closes are counted.
                free = msg.WhichOneof("kind") in ("open", "close")
                if not free and not stream.within_rate():
                    stream.cut(grpc.StatusCode.RESOURCE_EXHAUSTED, self._rate_message(stream))
                    return
                if not self._apply(stream, msg) and free and not stream.within_rate():
                    stream.cut(grpc.StatusCode.RESOURCE_EXHAUSTED, self._rate_message(stream))
                    return
        except grpc.RpcError:
            pass  # the client went away; Connect's loop notices
        except Exception as e:  # never let a reader thread die silently
            log.exception("draft stream %d failed", stream.id)
            stream.cut(grpc.StatusCode.INTERNAL, f"sink error: {e}")
            return
        stream.done.set()

    @staticmethod
    def _rate_message(stream: _Stream) -> str:
        return (f"draft stream sent more than {stream.rate:.0f} messages a second "
                "(speculation.max_stream_messages_per_s); drafts batch their windows")

    def _apply(self, stream: _Stream, msg: spec_pb2.DraftMessage) -> bool:
        """True if the book took the message whole."""
        kind = msg.WhichOneof("kind")
        if kind == "batch":
            self._apply_batch(stream, msg.batch)
            return True
        return self._apply_one(stream, kind, getattr(msg, kind) if kind else None)

    def _apply_batch(self, stream: _Stream, batch: spec_pb2.DraftBatch) -> None:
        """Every window of a DraftBatch into the book at once; a refused entry
        gets its per-request error, a malformed batch one error for all."""
        try:
            with self._lock:
                added, errors = self._book.extend_batch(
                    stream.id, list(batch.request_ids), batch.positions, batch.counts,
                    batch.token_ids, batch.branch_of, batch.fork_positions,
                    batch.branch_counts, batch.branch_token_ids, batch.done)
                done = set(batch.done)
                if added.any() or done:
                    for i in sorted(set(np.flatnonzero(added).tolist()) | done):
                        rid = batch.request_ids[i]
                        self.draft_speed.arrived(rid, int(added[i]), time.monotonic(),
                                                 done=i in done)
                    self._arrived.notify_all()
        except BookError as e:
            errors = [("", e)]
        if errors:
            with self._lock:
                self.request_errors += len(errors)
            for rid, e in errors:
                stream.send(spec_pb2.SinkMessage(error=spec_pb2.RequestError(
                    request_id=rid, code=e.code, message=e.message)))

    def _apply_one(self, stream: _Stream, kind: str | None, part) -> bool:
        """One open, draft or close; False if refused (its error sent, or the
        stream cut off)."""
        rid = ""
        try:
            with self._lock:
                if kind == "open":
                    rid = part.request_id
                    ticket = self._tickets.get(rid)
                    if ticket is None or not hmac.compare_digest(ticket.encode(),
                                                                 part.ticket.encode()):
                        # the same answer for an unknown id and a wrong ticket
                        raise BookError(NOT_FOUND, f"unknown request {rid!r}")
                    self._book.attach(rid, stream.id, known=part.verified_position)
                elif kind == "draft":
                    rid = part.request_id
                    added = self._book.extend(
                        rid, part.position, part.token_ids,
                        branches=[(b.fork_position, b.token_ids) for b in part.branches],
                        stream=stream.id,
                    )
                    if added:
                        self.draft_speed.arrived(rid, added, time.monotonic())
                        self._arrived.notify_all()
                elif kind == "close":
                    rid = part.request_id
                    self._book.detach(rid, stream.id)
                else:
                    raise BookError(3, "empty DraftMessage: set open, draft, batch or close")
        except BookError as e:
            with self._lock:
                self.request_errors += 1
            if e.code == RESOURCE_EXHAUSTED:
                stream.cut(grpc.StatusCode.RESOURCE_EXHAUSTED, e.message)
                return False
            stream.send(
                spec_pb2.SinkMessage(
                    error=spec_pb2.RequestError(request_id=rid, code=e.code, message=e.message)
                )
            )
            return False
        return True

    # ---- lifecycle --------------------------------------------------------------

    def start(self, address: str, max_streams: int = 64, tls=None) -> int:
        """Serve on host:port (port 0 picks one); returns the bound port.
        tls: a specserve.tls.TlsFiles: mutual TLS, client certificates required."""
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_streams, thread_name_prefix="sink"),
            maximum_concurrent_rpcs=max_streams,
            options=CHANNEL_OPTIONS,
        )
        spec_pb2_grpc.add_DraftSinkServicer_to_server(self, server)
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, server_credentials(tls))
            self._draft_names = tuple(tls.draft_names)
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

