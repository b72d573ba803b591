"""The draft runner: speculate ahead of the target, roll back when it disagrees.

Owns, per request, the draft's speculative sequence S (prompt + verified tokens +
drafted tokens) and its verified length, and keeps S up to `lookahead` (W) tokens
past the verified position by running the draft model in segments. Every token
is handed to the target's sink link as soon as it exists, as the whole window
from the verified position on; the link sends what the sink lacks
(specserve/draft/sent.py). When the target verifies tokens that differ from S
(a rejection) or runs past S, the current segment is aborted and drafting
restarts from the verified history.

Branches (pre-drafted outcomes). With a BranchPlan and a model that can branch,
every window also carries branches: at window offset j, fan_out(α, ...) of the
model's next-best tokens there (specserve.control.policy.fan_out: SSD's
geometric split of the budget, α the draft's own acceptance as measured from
the target's verified tokens), each continued a few tokens. The target takes
one when it rejects our token there with that alternative; then so does the
runner: its S becomes the branch, and drafting goes on from the branch's end.

Collection (with an AdaptBuffer, `drafts[].adapt`): every request's prompt
and the target's verified tokens are appended to the buffer as they arrive,
the examples the draft learns from (specserve/adapt/buffer.py); the buffer
only reads them, so drafting and drafts are the same with or without it.

Never decides output: the target's rejection sampler does. Knows nothing of HTTP
or tokenization; talks to sinks through `SinkLink` and to the model through a
`DraftModel`: vLLM (specserve/draft/model.py), a suffix memory, both (hybrid), or
a replay of recorded tokens (the synthetic draft).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

from specserve.control.policy import fan_out
from specserve.draft.link import SinkLink

log = logging.getLogger(__name__)


class DraftModel(Protocol):
    """Something that continues a token sequence greedily, a few tokens at a time."""

    max_model_len: int

    def continue_tokens(
        self, segment_id: str, request_id: str, tokens: list[int], max_tokens: int
    ) -> AsyncIterator[list[int]]:
        """Yield new tokens (lists, usually of one) as they are generated."""
        ...


@dataclasses.dataclass(frozen=True)
class BranchPlan:
    """How much to pre-draft (SpeculationConfig.branch_fan_out / branch_budget / branch_len)."""

    fan_out: int = 3  # F: alternatives at one position at most
    budget: int = 15  # per request, over the window (F × (K + 1) at the defaults)
    length: int = 4  # continuation tokens per branch
    # Window positions the budget covers: those the next verify step can
    # reject (K + 1: K drafts and the bonus position); the request's own K + 1
    # when it has one. None: the whole window.
    positions: int | None = None

    def __post_init__(self):
        if self.fan_out < 0 or self.budget < 0 or self.length < 1:
            raise ValueError("branch fan_out and budget must be >= 0 and length >= 1")

    @property
    def active(self) -> bool:
        return self.fan_out > 0 and self.budget > 0


@dataclasses.dataclass
class DraftStats:
    requests: int = 0
    drafted_tokens: int = 0
    segments: int = 0
    rollbacks: int = 0  # the target left our sequence
    verified_tokens: int = 0
    branches_sent: int = 0  # branch entries in the windows sent
    branches_taken: int = 0  # rollbacks that continued on one of our branches
    released: int = 0  # requests the sink gave up (our drafts came too late)
    # Our tokens the target agreed with before a rejection, and the rejections:
    # this draft's own estimate of its acceptance, for the branch budget.
    agreed_tokens: int = 4
    rejections: int = 1

    @property
    def alpha(self) -> float:
        return self.agreed_tokens / (self.agreed_tokens + self.rejections)


class _Request:
    """Draft state of one request.

    verified: the target's history as far as we have heard (prompt + output).
    tokens:   our sequence S; it agrees with `verified` wherever both have a token.
    When the target is ahead of us, S is shorter than `verified` and the running
    segment keeps going: its tokens are checked against the target's as they come.
    """

    def __init__(self, rid: str, prompt: list[int], link: SinkLink, lookahead: int, limit: int,
                 k: int = 0, ticket: str = ""):
        self.id = rid
        self.ticket = ticket  # the target's secret for this request, presented at open
        self.k = k  # the target proposes at most k of our tokens per step (0: its own K)
        self.verified = list(prompt)
        self.tokens = list(prompt)
        self.link = link
        self.lookahead = lookahead
        self.limit = limit  # never draft past this many tokens in total
        self.epoch = 0  # bumped on every rollback; a running segment checks it
        self.segments = 0
        self.changed = asyncio.Event()
        self.cancelled = False
        self.task: asyncio.Task | None = None
        # (fork position, alternative token) -> [alternative, continuation...]
        self.branches: dict[tuple[int, int], list[int]] = {}

    def agrees(self, start: int) -> bool:
        """S and the verified history agree on every position from `start` on."""
        end = min(len(self.tokens), len(self.verified))
        return start >= end or self.tokens[start:end] == self.verified[start:end]

    def roll_back(self, since: int = 0) -> bool:
        """Restart from the verified history, on our branch for it if we have
        one; S and the history agree before `since` (a scan from there, not
        from the prompt's start). Returns whether a branch was taken."""
        v = self.verified
        p = next((i for i in range(since, min(len(self.tokens), len(v)))
                  if self.tokens[i] != v[i]), None)
        branch = self.branches.get((p, v[p])) if p is not None else None
        self.branches = {}
        self.epoch += 1
        if branch is not None and branch[: len(v) - p] == v[p : p + len(branch)] \
                and p + len(branch) >= len(v):
            self.tokens = v[:p] + branch
            return True
        self.tokens = list(v)
        return False


class DraftRunner:
    def __init__(self, model: DraftModel, link_factory=None, tls=None,
                 branches: BranchPlan | None = None, name: str = "", adapt=None):
        """tls: a specserve.tls.TlsFiles for mutual TLS to the sinks (None: plaintext).
        branches: pre-draft alternatives (needs a model with `branches`; None: none).
        name: "model/replica", how the sinks' figures name this draft.
        adapt: an AdaptBuffer collecting the verified tokens (None: none)."""
        self.model = model
        self.adapt = adapt
        self.plan = branches if branches is not None and branches.active \
            and hasattr(model, "branches") else None
        self.stats = DraftStats()
        # A model that learns from the target's verified tokens (the suffix draft).
        self._observe = getattr(model, "observe", None)
        self._requests: dict[str, _Request] = {}
        self._released: set[str] = set()  # given up, until the caller cancels them
        self._links: dict[str, SinkLink] = {}
        # (drafts were waiting past the new verified position, tokens behind it)
        # at each verified update: how timely this draft is, for autoscaling.
        self._timeliness: collections.deque = collections.deque(maxlen=512)
        self._link_factory = link_factory or (
            lambda address: SinkLink(address, self._on_verified, self._snapshot, tls=tls,
                                     on_release=self.release,
                                     name=name)
        )

    # ---- control ----------------------------------------------------------------

    def start(self, rid: str, prompt: list[int], sink_address: str, lookahead: int,
              max_tokens: int, k: int = 0, ticket: str = "") -> None:
        """Draft for a request the target registered at `sink_address` with
        `ticket` (the sink refuses an open without it)."""
        if not prompt:
            raise ValueError("prompt must not be empty")
        if lookahead < 1 or max_tokens < 1:
            raise ValueError("lookahead and max_tokens must be >= 1")
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already being drafted")
        self._released.discard(rid)
        link = self._links.get(sink_address)
        if link is None:
            link = self._links[sink_address] = self._link_factory(sink_address)
        limit = min(len(prompt) + max_tokens, self.model.max_model_len)
        req = _Request(rid, prompt, link, lookahead, limit, k, ticket)
        self._requests[rid] = req
        self.stats.requests += 1
        if self.adapt is not None:
            self.adapt.open(rid, prompt)
        link.open(rid, ticket)
        req.task = asyncio.get_running_loop().create_task(self._run(req), name=f"draft-{rid}")

    def cancel(self, rid: str) -> bool:
        if rid in self._released:
            self._released.discard(rid)
            return True
        req = self._requests.pop(rid, None)
        if req is None:
            return False
        self._stop(req)
        return True

    def _stop(self, req: _Request) -> None:
        rid = req.id
        req.cancelled = True
        req.changed.set()
        if self.adapt is not None:
            self.adapt.close(rid)
        forget = getattr(self.model, "forget", None)
        if forget is not None:
            forget(rid)
        if req.task is not None:
            req.task.cancel()
        req.link.close_request(rid)

    def release(self, rid: str) -> None:
        """The sink gave the request up: its steps kept finding none of our
        drafts in time, so drafting it only takes the draft engine's time from
        the requests it keeps up with. Stop drafting it; it stays assigned
        (the caller's cancel() still ends it)."""
        req = self._requests.pop(rid, None)
        if req is None:
            return
        self._released.add(rid)
        self.stats.released += 1
        log.debug("the sink released %s: stopped drafting it", rid)
        self._stop(req)

    def active(self) -> int:
        """Requests being drafted."""
        return len(self._requests)

    def assigned(self) -> int:
        """Requests started and not cancelled: being drafted, or released."""
        return len(self._requests) + len(self._released)

    def released(self) -> int:
        """Requests the sink gave up and the caller has not cancelled yet."""
        return len(self._released)

    def links(self) -> list[SinkLink]:
        """This runner's streams, one per sink."""
        return list(self._links.values())

    def sink_down_for(self, sink_address: str) -> float:
        """Seconds the stream to this sink has been broken (0 while it works)."""
        link = self._links.get(sink_address)
        if link is None or link.down_since is None:
            return 0.0
        return time.monotonic() - link.down_since

    def timeliness(self) -> tuple[float, float]:
        """(share of recent verified updates that found drafts ahead, mean tokens
        behind the verified position); (1, 0) with no recent updates."""
        recent = list(self._timeliness)
        if not recent:
            return 1.0, 0.0
        return (sum(a for a, _ in recent) / len(recent),
                sum(lag for _, lag in recent) / len(recent))

    async def close(self) -> None:
        for rid in list(self._requests):
            self.cancel(rid)
        self._released.clear()
        for link in self._links.values():
            await link.close()
        self._links.clear()

    # ---- from the sink ----------------------------------------------------------

    def _on_verified(self, rid: str, position: int, tokens: list[int]) -> None:
        req = self._requests.get(rid)
        if req is None or position > len(req.verified):
            return  # finished, or a gap we cannot fill: the next update fixes it
        end = position + len(tokens)
        if end <= len(req.verified):
            return  # nothing new
        self.stats.verified_tokens += end - len(req.verified)
        self._timeliness.append((len(req.tokens) > end, max(end - len(req.tokens), 0)))
        old = len(req.verified)
        req.verified[position:] = tokens
        if self._observe is not None:
            self._observe(rid, req.verified)
        if self.adapt is not None:
            self.adapt.observe(rid, req.verified)
        ours = req.tokens[old:min(end, len(req.tokens))]
        agreed = next((i for i, t in enumerate(ours) if t != req.verified[old + i]), None)
        self.stats.agreed_tokens += len(ours) if agreed is None else agreed
        if not req.agrees(position):
            # The target rejected one of our tokens: restart from its history
            # (on our branch for its token, if we drafted one).
            self.stats.rejections += 1
            if req.roll_back(since=position):
                self.stats.branches_taken += 1
            self.stats.rollbacks += 1
        else:
            if req.branches:
                req.branches = {b: t for b, t in req.branches.items() if b[0] >= end}
            if self.plan is not None and len(req.tokens) > end:
                # The window's positions moved: send branches for the new ones
                # now (a draft that is W ahead drafts nothing until the window
                # drains, so without this the next rejection would find none).
                req.link.send_draft(req.id, end, req.tokens[end:], self._branches(req, end))
        req.changed.set()

    def _snapshot(self, link: SinkLink) -> list[tuple[str, str, int, list[int]]]:
        """(request, ticket, verified length, drafts) of a link's requests, to re-open them."""
        return [
            (r.id, r.ticket, len(r.verified), r.tokens[len(r.verified):])
            for r in self._requests.values()
            if r.link is link
        ]

    # ---- drafting ---------------------------------------------------------------

    async def _run(self, req: _Request) -> None:
        try:
            while not req.cancelled:
                if self._ahead(req) or len(req.tokens) >= req.limit:
                    req.changed.clear()
                    await req.changed.wait()
                    continue
                req.changed.clear()
                if not await self._segment(req) and not req.changed.is_set():
                    # The model had nothing to add (a suffix memory with no
                    # continuation, a synthetic draft past its record): say so,
                    # so the target does not wait for us, and wait for it
                    # instead of asking again at once.
                    v = len(req.verified)
                    if len(req.tokens) >= v:
                        req.link.send_done(req.id, v, req.tokens[v:])
                    await req.changed.wait()
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("drafting for %s failed; the target continues without drafts", req.id)

    @staticmethod
    def _ahead(req: _Request) -> bool:
        """S already reaches W tokens past the verified position."""
        return len(req.tokens) >= len(req.verified) + req.lookahead

    async def _segment(self, req: _Request) -> bool:
        """Run the draft model on S until it is W ahead, rolled back or done.
        Returns whether the model produced any token.

        A segment asks for all the tokens up to the limit and is stopped early
        (aborted) when S gets W ahead: restarting costs a prefill, so one long
        segment is cheaper than one per W tokens while the target keeps up.
        """
        epoch = req.epoch
        req.segments += 1
        self.stats.segments += 1
        segment_id = f"{req.id}#{req.segments}"
        want = req.limit - len(req.tokens)
        produced = False
        # closed on every return (the model's request stops now, not when
        # asyncio's finalizer gets to the generator)
        async with contextlib.aclosing(self.model.continue_tokens(
                segment_id, req.id, list(req.tokens), want)) as segment:
            async for new in segment:
                produced = True
                if req.cancelled or req.epoch != epoch:
                    return True  # rolled back: this segment drafts a history the target left
                start = len(req.tokens)
                req.tokens.extend(new)
                self.stats.drafted_tokens += len(new)
                if not req.agrees(start):
                    req.roll_back(since=start)  # we guessed a token the target decided otherwise
                    self.stats.rollbacks += 1
                    return True
                v = len(req.verified)
                if len(req.tokens) > v:
                    req.link.send_draft(req.id, v, req.tokens[v:], self._branches(req, v))
                if self._ahead(req):
                    return True
        return produced

    def _branches(self, req: _Request, v: int) -> list[tuple[int, list[int]]]:
        """The window's branches: the budget split over its positions."""
        if self.plan is None:
            return []
        plan = self.plan
        span = len(req.tokens) - v
        if req.k:
            span = min(span, req.k + 1)
        elif plan.positions:
            span = min(span, plan.positions)
        counts = fan_out(self.stats.alpha, span, plan.budget, plan.fan_out)
        forget = getattr(self.model, "forget", None)
        if forget is not None:
            forget(req.id, before=v)  # their positions are verified
        out: list[tuple[int, list[int]]] = []
        req.branches = {}
        for j, count in enumerate(counts):
            if count:
                for b in self.model.branches(req.id, req.tokens, v + j, count, plan.length):
                    out.append((v + j, b))
                    req.branches[(v + j, b[0])] = b
        self.stats.branches_sent += len(out)
        return out
