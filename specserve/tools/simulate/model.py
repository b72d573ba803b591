"""A discrete-event model of disaggregated speculative decoding, for capacity planning.

Owns the event model of `specserve simulate` (`simulate`) and sweeps over it
(`sweep`, `best`): N draft replicas and M target replicas (each target replica
may span TP GPUs; its step costs say how fast it is), a network round trip
between the pools, acceptance alpha, K, lookahead W and an arrival process
(Poisson or closed-loop). The step costs are a `Profile`
(`specserve.tools.simulate.profile`); what is simulated and what comes out are
`Scenario` and `Result` (`specserve.tools.simulate.scenario`). It never starts
an engine, opens a file or a socket: `simulate()` is a pure function of a
profile, a scenario and a seed (files are read and written by the CLI).

The model follows the real system's mechanics (specserve/draft/runner.py,
specserve/target/proposer.py):

- A target replica runs continuous batching: each step takes its running
  requests (admitting waiting ones up to `max_num_seqs` and `max_prefill_tokens`
  prompt tokens; their prefill is part of that step and emits their first token). For each running request it verifies
  up to K drafted tokens that are *waiting at the target* when the step starts
  (coverage), else it decodes one token. The step costs `target.step(tokens,
  seqs)` where tokens counts every query token of the batch (1 + drafts per row).
- Every drafted token is right with probability alpha, independently (as with the
  synthetic draft): a verify step with n drafts accepts the leading right ones
  and emits one more token of the target's own (recovered or bonus), so with n = K
  always waiting it emits (1 - alpha^(K+1)) / (1 - alpha) tokens on average.
- A draft replica runs batched steps over its requests that are fewer than W
  tokens past the verified position it knows; each step adds one token per such
  request. Tokens reach the target rtt/2 after they exist; verified positions
  reach the draft rtt/2 after the target step that made them. When the target
  decides a position differently from the draft (a rejected token, or a bonus
  token the draft guessed wrong, or a token the draft produced while behind), the
  draft rolls back: it restarts from the verified history (a segment restart,
  `draft.restart_ms`). A draft that reaches W ahead stops its segment; it restarts
  (same cost) when the target verifies more.
- Branches (pre-drafted outcomes, specserve/target/book.py): when a verify step
  rejects a drafted token, with probability `branch_hit` (the measured branch
  hit rate: the draft's alternatives held the target's token and the budget
  covered that position) the draft had already drafted that outcome: the next
  step finds the branch's continuation waiting (as far as the main line had
  got past the position, at most `branch_len` tokens, each right with
  probability alpha), and the draft goes on from the branch's end.
- The bounded wait: a step that would run a row draftless although its last
  step had drafts (a rejection without a branch, or a draft that fell behind)
  may be held for fresh drafts, at most `max_wait_ms` and
  only as long as the rate model says it pays (specserve.control.policy.wait_bound).
- Co-located baseline (vLLM `draft_model`): no draft pool; the draft runs on the
  target's GPUs at the target's TP, K draft steps before every verify step, so
  drafts are always waiting (coverage 1) and every step pays K draft steps.

Time is in milliseconds throughout.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections import deque

from specserve.acceptance.record import percentile
from specserve.config import lookahead_tokens
from specserve.tools.simulate.profile import Profile
from specserve.tools.simulate.scenario import Prices, Result, Scenario, cost_per_hour


def _quantiles(values: list[float]) -> dict[str, float]:
    """p50/p90/p99 (the one percentile, acceptance.record); NaN where there are no values."""
    return {f"p{q}": (percentile(values, q) if values else math.nan) for q in (50, 90, 99)}


# ---- the event model --------------------------------------------------------------------


class _Run:
    """One draft segment history since a rollback: its tokens' right/wrong flags
    for output positions start, start+1, ...; only ever appended to."""

    __slots__ = ("start", "flags", "first_wrong")

    def __init__(self, start: int):
        self.start = start
        self.flags: list[bool] = []
        self.first_wrong = math.inf  # index into flags of the first wrong token

    @property
    def end(self) -> int:
        return self.start + len(self.flags)

    def append(self, right: bool) -> None:
        if not right and self.first_wrong == math.inf:
            self.first_wrong = len(self.flags)
        self.flags.append(right)

    def agrees_before(self, pos: int) -> bool:
        """Every token this run holds before output position `pos` is right."""
        return self.first_wrong >= min(pos, self.end) - self.start


class _Request:
    __slots__ = ("id", "arrival", "target", "draft", "emitted", "first_token", "finish",
                 "run", "known", "started", "prefilled", "needs_restart", "view", "inbox",
                 "rejected", "drafted")

    def __init__(self, rid: int, arrival: float):
        self.id = rid
        self.arrival = arrival
        self.target = -1
        self.draft = -1
        self.emitted = 0            # verified output tokens (the target's history past the prompt)
        self.first_token: float | None = None
        self.finish: float | None = None
        # draft side
        self.run = _Run(0)
        self.known = 0              # verified position the draft has heard of
        self.started = False        # the draft has its Start
        self.prefilled = False      # the draft has prefilled the prompt
        self.needs_restart = True   # next draft step pays a (re)start
        # target side: drafts received, as (arrival time, run, end), latest last
        self.view: tuple[_Run, int] | None = None
        self.inbox: deque = deque()
        self.rejected = False  # its last step rejected a drafted token
        self.drafted = False  # its last step verified drafts


_ARRIVE, _DRAFT_START, _DRAFT_END, _VERIFIED, _TARGET_START, _TARGET_END = range(6)


class _Sim:
    def __init__(self, profile: Profile, sc: Scenario):
        self.p = profile
        self.sc = sc
        self.rng = random.Random(sc.seed)
        self.now = 0.0
        self.heap: list = []
        self.seq = 0
        self.requests: list[_Request] = []
        self.done = 0
        self.arrivals = 0  # arrivals scheduled so far
        self.use_pool = sc.k > 0 and not sc.colocated and sc.drafts > 0
        m = sc.targets
        self.t_running: list[list[_Request]] = [[] for _ in range(m)]
        self.t_waiting: list[deque] = [deque() for _ in range(m)]
        self.t_busy = [False] * m
        self.t_start_pending = [False] * m
        n = sc.drafts if self.use_pool else 0
        self.d_requests: list[list[_Request]] = [[] for _ in range(n)]
        self.d_busy = [False] * n
        # counters
        self.request_steps = self.steps_with_drafts = self.drafted = self.accepted = 0
        self.target_steps = self.rollbacks = 0
        self.branch_hits = self.rejections = self.waits = 0
        self.wait_ms = 0.0
        self.t_busy_ms = self.d_busy_ms = 0.0
        self.t_waited = [False] * m  # this target's next start already waited
        self.last_step_ms = [0.0] * m

    # events: (time, priority, seq, kind, payload); a target step starts after
    # everything else that happens at the same instant (drafts arriving just in time).
    def push(self, t: float, kind: int, payload, priority: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, priority, self.seq, kind, payload))

    def run(self) -> Result:
        sc = self.sc
        if sc.concurrency is not None:
            for _ in range(min(sc.concurrency, sc.requests)):
                self.push(0.0, _ARRIVE, None)
                self.arrivals += 1
        else:
            t = 0.0
            for _ in range(sc.requests):
                self.push(t, _ARRIVE, None)
                t += self.rng.expovariate(sc.rate_per_s / 1000.0)
        handlers = {_ARRIVE: self.on_arrive, _DRAFT_START: self.on_draft_start,
                    _DRAFT_END: self.on_draft_end, _VERIFIED: self.on_verified,
                    _TARGET_START: self.on_target_start, _TARGET_END: self.on_target_end}
        while self.heap:
            self.now, _, _, kind, payload = heapq.heappop(self.heap)
            handlers[kind](payload)
        return self.result()

    # ---- arrivals ----

    def on_arrive(self, _payload) -> None:
        r = _Request(len(self.requests), self.now)
        self.requests.append(r)
        # The router picks the least loaded target replica and draft replica.
        r.target = min(range(self.sc.targets),
                       key=lambda i: (len(self.t_running[i]) + len(self.t_waiting[i]), i))
        self.t_waiting[r.target].append(r)
        self.kick_target(r.target)
        if self.use_pool:
            for i, reqs in enumerate(self.d_requests):
                self.d_requests[i] = [q for q in reqs if q.finish is None]
            r.draft = min(range(len(self.d_requests)), key=lambda i: (len(self.d_requests[i]), i))
            self.d_requests[r.draft].append(r)
            self.push(self.now + self.leg_ms(r.target), _DRAFT_START, r)

    # ---- draft pool ----

    def on_draft_start(self, r: _Request) -> None:
        if r.finish is None:
            r.started = True
            self.kick_draft(r.draft)

    def draft_active(self, r: _Request) -> bool:
        return (r.started and r.finish is None and r.run.end - r.known < self.sc.lookahead
                and r.run.end < self.sc.output_len)

    def kick_draft(self, d: int) -> None:
        if self.d_busy[d]:
            return
        batch = [r for r in self.d_requests[d] if self.draft_active(r)]
        if not batch:
            return
        cost = self.p.draft
        ms = cost.step(len(batch))
        for r in batch:
            if r.needs_restart:
                # a new request prefills its prompt; a segment restart costs restart_ms
                ms += (cost.restart_ms if r.prefilled
                       else cost.prefill_ms_per_token * self.sc.prompt_len)
                r.needs_restart = False
                r.prefilled = True
        self.d_busy[d] = True
        self.d_busy_ms += ms
        self.push(self.now + ms, _DRAFT_END, (d, [(r, r.run) for r in batch]))

    def on_draft_end(self, payload) -> None:
        d, batch = payload
        for r, run in batch:
            if r.finish is not None or r.run is not run:
                continue  # finished, or rolled back meanwhile: this token drafts a history left
            run.append(self.rng.random() < self.sc.alpha)
            if not run.agrees_before(r.known):
                self.roll_back(r)  # a token the target had already decided otherwise
                continue
            if run.end > r.known:
                r.inbox.append((self.now + self.leg_ms(r.target), run, run.end))
            if run.end - r.known >= self.sc.lookahead:
                r.needs_restart = True  # the segment stops at W ahead
        self.d_requests[d] = [r for r in self.d_requests[d] if r.finish is None]
        self.d_busy[d] = False
        self.kick_draft(d)

    def leg_ms(self, t: int) -> float:
        """One way to or from target t: half the network's and the data plane's round trips."""
        ms = self.sc.rtt_ms / 2
        if self.p.dataplane is not None:
            ms += self.p.dataplane.round_trip_ms(len(self.t_running[t])) / 2
        return ms

    def roll_back(self, r: _Request) -> None:
        r.run = _Run(r.known)
        r.needs_restart = True
        self.rollbacks += 1

    def on_verified(self, updates) -> None:
        touched = set()
        for r, v in updates:
            if r.finish is not None or v <= r.known:
                continue
            r.known = v
            if not r.run.agrees_before(v):
                self.roll_back(r)
            touched.add(r.draft)
        for d in sorted(touched):
            self.kick_draft(d)

    # ---- target pool ----

    def kick_target(self, t: int) -> None:
        if not self.t_busy[t] and not self.t_start_pending[t]:
            self.t_start_pending[t] = True
            self.push(self.now, _TARGET_START, t, priority=1)

    def proposals(self, r: _Request) -> list[bool]:
        """Drafted tokens waiting at the target for r's next step (their flags)."""
        sc = self.sc
        # Never more drafts than the request has tokens left: the draft drafts up
        # to the output's end (prompt + max_tokens), its last token included.
        room = min(sc.k, sc.output_len - r.emitted)
        if sc.colocated:
            return [self.rng.random() < sc.alpha for _ in range(room)]
        while r.inbox and r.inbox[0][0] <= self.now:
            _, run, end = r.inbox.popleft()
            r.view = (run, end)
        if r.view is None:
            return []
        run, end = r.view
        v = r.emitted
        if run.start > v or end <= v or run.first_wrong < v - run.start:
            return []  # nothing past v, or built on a history the target has left
        i = v - run.start
        return run.flags[i:i + min(room, end - v)]

    def on_target_start(self, t: int) -> None:
        self.t_start_pending[t] = False
        if self.t_busy[t]:
            return
        sc, cost = self.sc, self.p.target
        running, waiting = self.t_running[t], self.t_waiting[t]
        if not running and not waiting:
            return
        decode = []
        tokens = 0
        for r in running:
            flags = self.proposals(r) if sc.k > 0 else []
            decode.append((r, flags))
            tokens += 1 + len(flags)
        if self.use_pool and sc.max_wait_ms > 0 and not self.t_waited[t]:
            misses = sum(1 for r, f in decode if r.drafted and not f)
            wait = self.wait_bound(t, len(decode), misses)
            if wait > 0:
                # Hold the step for fresh drafts (the sink's bounded wait).
                self.t_waited[t] = True
                self.waits += 1
                self.wait_ms += wait
                self.t_start_pending[t] = True
                self.push(self.now + wait, _TARGET_START, t, priority=1)
                return
        self.t_waited[t] = False
        new = []
        while (waiting and len(running) + len(new) < cost.max_num_seqs
               and (not new or (len(new) + 1) * sc.prompt_len <= cost.max_prefill_tokens)):
            new.append(waiting.popleft())
        ms = cost.step(tokens + len(new), len(decode) + len(new))
        ms += cost.prefill_ms_per_token * sc.prompt_len * len(new)
        if sc.k > 0 and decode:
            if sc.colocated:
                ms += sc.k * self.p.colocated_draft(len(decode))
            else:
                ms += cost.spec_overhead_ms
                if self.p.dataplane is not None:
                    ms += self.p.dataplane.propose_ms(len(decode))
        running.extend(new)
        self.t_busy[t] = True
        self.t_busy_ms += ms
        self.last_step_ms[t] = ms
        self.target_steps += 1
        self.push(self.now + ms, _TARGET_END, (t, decode, new))

    def on_target_end(self, payload) -> None:
        t, decode, new = payload
        sc = self.sc
        updates = []
        for r in new:
            r.emitted = 1
            r.first_token = self.now
            self.request_steps += 1
            # The draft has drafted from the prompt since the request arrived:
            # its first token is judged like a verify step's (the book does
            # so): wrong, it is a rejection a branch may cover (else the wait
            # may hold the next step); not drafted yet, the draft is behind.
            r.drafted = self.use_pool and r.run.end > 0
            r.rejected = r.drafted and not r.run.agrees_before(1)
            if r.rejected:
                self.rejections += 1
                if self.rng.random() < sc.branch_hit:
                    self.take_branch(r)
            updates.append((r, r.emitted))
        for r, flags in decode:
            accepted = 0
            while accepted < len(flags) and flags[accepted]:
                accepted += 1
            self.request_steps += 1
            if flags:
                self.steps_with_drafts += 1
                self.drafted += len(flags)
            self.accepted += accepted
            r.emitted += accepted + 1
            # A drafted token the target decided otherwise: a rejection, or a
            # bonus token the draft's window had wrong (a branch covers both).
            r.drafted = bool(flags)
            r.rejected = accepted < len(flags) or (
                flags and not r.run.agrees_before(r.emitted))
            if r.rejected:
                self.rejections += 1
                if self.rng.random() < sc.branch_hit:
                    self.take_branch(r)
            updates.append((r, r.emitted))
        finished = [r for r, _ in updates if r.emitted >= sc.output_len]
        for r in finished:
            r.finish = self.now
            self.done += 1
        if finished:
            self.t_running[t] = [r for r in self.t_running[t] if r.finish is None]
        if self.use_pool:
            self.push(self.now + self.leg_ms(t), _VERIFIED, updates)
        if sc.concurrency is not None:  # closed loop: each finished request is replaced
            for _ in finished:
                if self.arrivals < sc.requests:
                    self.push(self.now, _ARRIVE, None)
                    self.arrivals += 1
        self.t_busy[t] = False
        self.kick_target(t)

    def take_branch(self, r: _Request) -> None:
        """A rejection the draft had pre-drafted: its branch (as long as the main
        line had got past the position, at most branch_len tokens) is at the
        target now, and the draft goes on from its end."""
        sc = self.sc
        rejected_at = r.emitted - 1  # the target's own token stands here
        length = min(sc.branch_len or sc.k, max(r.run.end - rejected_at - 1, 0),
                     sc.output_len - r.emitted)
        run = _Run(r.emitted)
        for _ in range(length):
            run.append(self.rng.random() < sc.alpha)
        r.run = run
        r.needs_restart = True
        r.inbox.clear()
        r.view = (run, run.end)
        r.rejected = False
        self.branch_hits += 1

    def wait_bound(self, t: int, rows: int, misses: int) -> float:
        """The sink's bound (ms), from the same rate model, with this draft's speed
        and, as the sink fits it, the verify step's cost per token at this batch."""
        if not misses or self.p.draft is None:
            return 0.0
        from specserve.control.policy import StepCost, wait_bound

        step = self.p.target.step
        step_ms = self.last_step_ms[t] or step(rows, rows)
        k = max(self.sc.k, 1)
        per_token_ms = max(step(rows * (1 + k), rows) - step(rows, rows), 0.0) / (rows * k)
        cost = StepCost(max(step(rows, rows) - rows * per_token_ms, 0.0) / 1e3, per_token_ms / 1e3)
        draft_ms = self.p.draft.step(max(len(self.d_requests[0]) if self.d_requests else 1, 1))
        # the first fresh token: the round trip and one draft step; then one per step
        return 1e3 * wait_bound(self.sc.alpha, self.sc.k, rows, misses, step_ms / 1e3,
                                draft_ms / 1e3, cost=cost, max_wait_s=self.sc.max_wait_ms / 1e3,
                                first_token_s=(draft_ms + self.sc.rtt_ms) / 1e3)

    # ---- result ----

    def result(self) -> Result:
        sc = self.sc
        reqs = self.requests
        start = min(r.arrival for r in reqs)
        makespan = max(r.finish for r in reqs) - start
        ttft = [r.first_token - r.arrival for r in reqs]
        tpot = [(r.finish - r.first_token) / (sc.output_len - 1) for r in reqs if sc.output_len > 1]
        good = sum(sc.output_len for r in reqs
                   if r.first_token - r.arrival <= sc.ttft_slo_ms
                   and (sc.output_len == 1
                        or (r.finish - r.first_token) / (sc.output_len - 1) <= sc.tpot_slo_ms))
        out = sc.output_len * len(reqs)
        sec = makespan / 1000.0 if makespan > 0 else math.inf
        n_drafts = len(self.d_busy)
        return Result(
            scenario=sc, output_tokens=out, makespan_ms=makespan,
            throughput_tok_s=out / sec, goodput_tok_s=good / sec,
            ttft_ms=_quantiles(ttft), tpot_ms=_quantiles(tpot),
            request_steps=self.request_steps, steps_with_drafts=self.steps_with_drafts,
            drafted_tokens=self.drafted, accepted_tokens=self.accepted,
            target_steps=self.target_steps,
            target_busy=self.t_busy_ms / (makespan * sc.targets) if makespan else 0.0,
            draft_busy=self.d_busy_ms / (makespan * n_drafts) if makespan and n_drafts else 0.0,
            rollbacks=self.rollbacks, rejections=self.rejections,
            branch_hits=self.branch_hits, waits=self.waits, wait_ms=self.wait_ms,
        )


def simulate(profile: Profile, scenario: Scenario) -> Result:
    """Run one scenario; deterministic for a given seed."""
    scenario.check(profile)
    return _Sim(profile, scenario).run()



def sweep(profile: Profile, base: Scenario, drafts: list[int], ks: list[int],
          prices: Prices, colocated: bool = False) -> list[Result]:
    """Every (drafts, K) pair (K = 0 once, with no drafts), plus the co-located
    baseline at each K > 0 when asked; each result carries its cost per hour.
    W is at least the product default (2K + 1) at each K.
    Sorted best first by goodput per dollar (then throughput)."""
    scenarios = []
    for k in sorted(set(ks)):
        if k == 0:
            scenarios.append(dataclasses.replace(base, k=0, drafts=0, colocated=False))
            continue
        for n in sorted(set(drafts)):
            if n > 0:
                scenarios.append(dataclasses.replace(
                    base, k=k, drafts=n, colocated=False, lookahead=max(base.lookahead, lookahead_tokens(k, None))))
        if colocated:
            scenarios.append(dataclasses.replace(base, k=k, drafts=0, colocated=True))
    results = []
    for sc in scenarios:
        res = simulate(profile, sc)
        res.cost_per_hour = cost_per_hour(profile, sc, prices)
        results.append(res)
    results.sort(key=lambda r: (-(r.goodput_tokens_per_dollar or 0.0), -r.throughput_tok_s))
    return results


def best(results: list[Result]) -> Result:
    """The best by goodput per dollar (sweep() sorts so)."""
    return results[0]
