"""The emulated draft replicas of `specserve bench dataplane`: one process, one stream each.

Owns one draft replica's side of the data plane with no model: a real
`SinkLink` (one gRPC stream to the sink, as a draft replica has), the draft
state of every request it was given, and a batched draft step every
`DraftPlan.draft_step_ms` that drafts each request's next tokens at
`DraftPlan.rate` tokens per second and hands its link the window as
`DraftRunner` does (the whole window from the verified position, with
branches, each step; the link sends what the sink lacks). Never decides anything the target decides.

Drafted tokens follow the synthetic draft's rule (specserve/draft/synthetic.py
`drafted_token`, `alternatives`): position q carries T_r[q] with probability
A, else another token; the alternatives at q are the draft's next-best tokens
there, sent as branches (`specserve.control.policy.fan_out` splits the budget
over the window, as `DraftRunner._branches` does). The draft follows the
verified updates that come back exactly as `DraftRunner._on_verified` does:
tokens the target agreed with are dropped from the window, a rejection
restarts the window from the verified position (on the branch the target took,
if one was sent). The draft answers with its window built on the new verified
position: after agreement at once (the branches for the window's new
positions, with fan-out), after a rejection with its next drafted token (at
once when its budget holds one, as it does while its window waited full).
That answer reaching the book is what the bench's round trip times.

The rate is a budget per request that refills at `rate` and holds at most one
draft step's worth (a draft engine does not bank tokens while its window is
full); `rate` 0 drafts every request's window full at every step (the
ingest-capacity cell). Commands come from the bench over a multiprocessing
queue (`run_replica`, the process's body; `DraftProcesses`, the bench's handle
on them); a process exits when told, or when its parent is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import sys
import time

from specserve.control.policy import fan_out
from specserve.draft.synthetic import alternatives, drafted_token
from specserve.tools.bench.dataplane_workload import DraftPlan, true_token, true_tokens

log = logging.getLogger(__name__)

# Arrival times of verified updates kept between two asks (~60 MB at most): a
# monotonic clock is one clock for every process of the machine.
MAX_HEARD = 500_000


class _Request:
    """One request's draft state: S = T_r[:v] + win (the verified history and the window)."""

    __slots__ = ("rid", "seed", "digest", "v", "win", "end", "k", "budget", "alts", "sent")

    def __init__(self, rid: str, seed: int, v: int, end: int, k: int):
        self.rid, self.seed, self.v, self.end, self.k = rid, seed, v, end, k
        self.digest = seed.to_bytes(16, "little")  # the corruption rule's per-request key
        self.win: list[int] = []  # drafted tokens for positions v, v + 1, ...
        self.budget = 0.0  # tokens the draft may draft now
        self.alts: dict[int, list[int]] = {}  # position -> the draft's next-best tokens
        self.sent: dict[int, tuple[int, ...]] = {}  # position -> alternatives sent as branches


class DraftReplica:
    def __init__(self, index: int, address: str, plan: DraftPlan, commands, results):
        from specserve.draft.link import SinkLink

        self.index = index
        self.plan = plan
        self.commands, self.results = commands, results
        self.requests: dict[str, _Request] = {}
        self.counts = {"drafted_tokens": 0, "messages": 0, "rollbacks": 0,
                       "branches_taken": 0, "requests": 0}
        self._split: dict[int, list[int]] = {}  # window span -> alternatives per position
        self.heard: dict[tuple[str, int], float] = {}  # (request, update's end) -> monotonic s
        # SinkLink's own outbox bound (a full outbox drops: counted, sent on)
        self.link = SinkLink(address, self._on_verified, self._snapshot,
                             name=f"dataplane/{index}")

    # ---- the draft's rule ---------------------------------------------------------

    def _drafted(self, r: _Request, q: int) -> int:
        p = self.plan
        return drafted_token(true_token(r.seed, q, p.vocab), p.alpha, p.seed, r.digest, q,
                             p.vocab)

    def _branches(self, r: _Request) -> list[tuple[int, list[int]]]:
        """The window's branches: the budget split over the K + 1 positions a step can reject."""
        p = self.plan
        if p.fan_out <= 0 or not r.win:
            return []
        span = min(len(r.win), r.k + 1)
        counts = self._split.get(span)
        if counts is None:  # the same split for every window of this span (A is fixed)
            counts = self._split[span] = fan_out(p.alpha, span, p.branch_budget, p.fan_out)
        out = []
        r.sent = {}
        for j, count in enumerate(counts):
            if not count:
                continue
            q = r.v + j
            alts = r.alts.get(q)
            if alts is None:
                alts = r.alts[q] = alternatives(true_token(r.seed, q, p.vocab), p.alpha,
                                                p.recovery_hit, p.seed, r.digest, q, p.vocab,
                                                p.fan_out)
            cont = r.win[j + 1: j + 1 + p.branch_len]
            r.sent[q] = tuple(alts[:count])
            out += [(q, [a, *cont]) for a in alts[:count]]
        return out

    def _draft(self, r: _Request, answer: bool) -> None:
        """Draft what the budget allows and send the window (always, when answering)."""
        p = self.plan
        start = r.v + len(r.win)
        room = min(p.lookahead - len(r.win), r.end - start)
        n = room if p.unlimited else min(room, int(r.budget))
        if n > 0:
            r.win.extend(self._drafted(r, q) for q in range(start, start + n))
            r.budget -= n
            self.counts["drafted_tokens"] += n
        if r.win and (n > 0 or answer):
            branches = self._branches(r)
            self.link.send_draft(r.rid, r.v, r.win, branches)
            self.counts["messages"] += 1

    # ---- from the sink (as DraftRunner._on_verified) -------------------------------

    def _on_verified(self, rid: str, position: int, tokens: list[int]) -> None:
        end = position + len(tokens)
        if len(self.heard) < MAX_HEARD:  # when each update got here (the round trip's legs)
            self.heard[(rid, end)] = time.monotonic()
        r = self.requests.get(rid)
        if r is None or position > r.v:
            return  # finished, or a gap: the next update fills it
        if end <= r.v:
            return
        new = tokens[r.v - position:]
        wrong = next((j for j, (ours, true) in enumerate(zip(r.win, new)) if ours != true), None)
        if wrong is None:
            r.win = r.win[len(new):]  # all agreed (or the target ran past our drafts)
        else:
            q = r.v + wrong
            # The target took our branch at q when its token there is an
            # alternative we sent; the branch's continuation is our main line's.
            branch = [new[wrong], *r.win[wrong + 1: wrong + 1 + self.plan.branch_len]]
            taken = new[wrong] in r.sent.get(q, ()) and branch[: len(new) - wrong] == new[wrong:]
            r.win = branch[len(new) - wrong:] if taken else []
            self.counts["rollbacks"] += 1
            self.counts["branches_taken"] += taken
        r.v = end
        for q in [q for q in r.alts if q < end]:
            del r.alts[q]
        # As DraftRunner: after agreement, branches for the window's new positions
        # go out at once; after a rejection, the next drafted token does.
        self._draft(r, answer=wrong is None and self.plan.fan_out > 0)

    def _snapshot(self, link) -> list[tuple[str, list[int], list[int], int, int]]:
        """Every request from its verified history, to re-open after a reconnect."""
        return [(r.rid, true_tokens(r.seed, 0, r.v, self.plan.vocab).tolist(), list(r.win),
                 r.k, r.end) for r in self.requests.values()]

    # ---- commands from the bench ----------------------------------------------------

    def _command(self, cmd: tuple) -> bool:
        kind = cmd[0]
        if kind == "start":
            _, rid, seed, n_prompt, end, k, ticket = cmd
            r = self.requests[rid] = _Request(rid, seed, n_prompt, end, k)
            self.counts["requests"] += 1
            open_request(self.link, rid, true_tokens(seed, 0, n_prompt, self.plan.vocab).tolist(),
                         k, end, ticket)
            r.budget = 1.0
            self._draft(r, answer=False)
        elif kind == "stop":
            if self.requests.pop(cmd[1], None) is not None:
                self.link.close_request(cmd[1])
        elif kind == "plan":
            self.plan = cmd[1]
            self._split = {}
        elif kind == "report":
            self.results.put(("report", self.index, cmd[1], {**self.counts,
                              "dropped": self.link.dropped, "open": len(self.requests),
                              "wire_tokens": self.link.tokens_sent,
                              "cpu_s": time.process_time()},
                              time.monotonic()))
        elif kind == "heard":  # when the updates got here since the last ask (then forgotten)
            self.results.put(("heard", self.index, cmd[1], self.heard, time.monotonic()))
            self.heard = {}
        elif kind == "quit":
            return False
        return True

    async def serve(self) -> None:
        parent = os.getppid()
        self.results.put(("ready", self.index, None, None, time.monotonic()))
        last = time.monotonic()
        try:
            while os.getppid() == parent:
                while True:
                    try:
                        cmd = self.commands.get_nowait()
                    except queue.Empty:
                        break
                    if not self._command(cmd):
                        return
                now = time.monotonic()
                p = self.plan
                # One batched draft step: every request's budget refills for the
                # time since the last one, holding at most one step's worth.
                cap = max(1.0, p.rate * p.draft_step_ms / 1000.0)
                for r in list(self.requests.values()):
                    r.budget = min(r.budget + p.rate * (now - last), cap)
                    self._draft(r, answer=False)
                last = now
                step = p.draft_step_ms / 1000.0 if self.requests else 0.005
                # (0 in the capacity cell: yield to the stream, then step again)
                await asyncio.sleep(max(0.0, last + step - time.monotonic()))
        finally:
            await self.link.close()


def open_request(link, rid: str, prompt: list[int], k: int, end: int, ticket) -> None:
    """The draft side of starting a request: it opens the request the target
    registered with the ticket it was given (as DraftRunner.start does); the
    prompt, K and end are the target's, at the sink."""
    link.open(rid, ticket)


def run_replica(index: int, address: str, plan: DraftPlan, commands, results) -> None:
    """The draft process's body (multiprocessing spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the bench stops us
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s draft-{index} %(levelname)s %(name)s: %(message)s")

    async def main():
        await DraftReplica(index, address, plan, commands, results).serve()

    asyncio.run(main())


# ---- the bench's side -------------------------------------------------------------


class DraftProcesses:
    """The emulated draft replicas: spawned processes, one command queue each."""

    def __init__(self, n: int, address: str, plan):
        ctx = multiprocessing.get_context("spawn")
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(n)]
        self.procs = [ctx.Process(target=run_replica, daemon=True,
                                  args=(i, address, plan, self.commands[i], self.results),
                                  name=f"dataplane-draft-{i}") for i in range(n)]
        self._of: dict[str, int] = {}  # request -> replica
        self._next = 0
        for p in self.procs:
            p.start()
        self._collect("ready", None, timeout=60.0)

    def _collect(self, kind: str, tag, timeout: float) -> list:
        got, deadline = {}, time.monotonic() + timeout
        while len(got) < len(self.procs):
            if any(not p.is_alive() for p in self.procs):
                raise RuntimeError("a draft process died (see its log above)")
            try:
                msg = self.results.get(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"draft processes did not answer {kind!r} in {timeout} s")
                continue
            if msg[0] == kind and msg[2] == tag:
                got[msg[1]] = msg
        return [got[i] for i in range(len(self.procs))]

    def start(self, rid, seed, n_prompt, end, k, ticket) -> None:
        i = self._of[rid] = self._next % len(self.procs)
        self._next += 1
        self.commands[i].put(("start", rid, seed, n_prompt, end, k, ticket))

    def stop(self, rid: str) -> None:
        i = self._of.pop(rid, None)
        if i is not None:
            self.commands[i].put(("stop", rid))

    def set_plan(self, plan) -> None:
        for q in self.commands:
            q.put(("plan", plan))

    def heard(self, tag: str) -> dict:
        """When each verified update (request, end) reached its draft, since the last call."""
        for q in self.commands:
            q.put(("heard", tag))
        out: dict = {}
        for m in self._collect("heard", tag, timeout=30.0):
            out.update(m[3])
        return out

    def report(self, tag: str) -> tuple[dict, float]:
        """Counters summed over the replicas, and the mean time they were read."""
        for q in self.commands:
            q.put(("report", tag))
        msgs = self._collect("report", tag, timeout=30.0)
        total: dict = {}
        for m in msgs:
            for k, v in m[3].items():
                total[k] = total.get(k, 0) + v
        return total, sum(m[4] for m in msgs) / len(msgs)

    def close(self) -> None:
        for q in self.commands:
            with contextlib.suppress(Exception):
                q.put(("quit",))
        for p in self.procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
        for q in self.commands:  # commands a dead process never read must not hold our exit
            q.cancel_join_thread()
