"""The app's figures across router replicas: one ledger that every router
feeds, so that /v1/spec/stats and /metrics say the same whichever router
answers, add up every router's requests, and survive a router's restart.

Owns: the batch a router sends (`RouterBatch`: finished requests' records,
its HTTP outcome counts since its last batch, its requests in flight, the
target replicas' reports it received), the router's outbox of unsent batches
(`Outbox`), and the ledger that applies them (`Ledger`): the acceptance
record (`SpecStats`), the HTTP outcomes (`HttpOutcomes`), the target
replicas' reports (`ReplicaTable`) and the routers' target choices
(`affinity.Tally`) of the whole app. Pure: no Ray, no clock of
its own; `deployments.ledger.LedgerServer` runs it as a Serve deployment and
checkpoints it, and `deployments.router` feeds it.

What holds:
- Each batch is applied once: a router numbers its batches and resends an
  unacknowledged one with the same number (a call that timed out after it was
  applied counts once).
- Counters never go back: a router's restart loses only its batches not yet
  sent (at most the router's flush interval); the ledger's own restart loses
  what came after its last checkpoint (`dumps` / `loads`).
- A router's routing tallies are cumulative: its newest count, and a pruned
  router's stay in the sums.
- Requests in flight are a gauge per router: a router not heard from within
  LIVE_S (dead, or scaled down) is not summed.
- A target replica's report is cumulative; an older one (routers send them in
  any order) never replaces a newer one.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections import Counter

from specserve.acceptance.outcomes import HttpOutcomes
from specserve.acceptance.record import Figures
from specserve.acceptance.replicas import GRACE_S, LIVE_S, ReplicaTable
from specserve.acceptance.stats import RequestRecord, SpecStats
from specserve.control.affinity import Tally

# The most records a router keeps while the ledger does not answer; past it the
# records of the oldest unsent batches are dropped (and counted).
MAX_UNSENT_RECORDS = 20_000
CHECKPOINT_VERSION = 1


@dataclasses.dataclass
class RouterBatch:
    """What one router learned since its previous batch."""

    router: str  # the router replica's id
    seq: int  # 1, 2, ... per router (a resend keeps its number)
    records: list[RequestRecord] = dataclasses.field(default_factory=list)
    responses: Counter = dataclasses.field(default_factory=Counter)  # (route, status) -> n
    aborts: Counter = dataclasses.field(default_factory=Counter)  # route -> n
    stream_failures: Counter = dataclasses.field(default_factory=Counter)  # route -> n
    inflight: dict[str, int] = dataclasses.field(default_factory=dict)  # route -> now
    reports: list[dict] = dataclasses.field(default_factory=list)  # target replicas'
    # the router's target choices so far, by deployment (cumulative: the newest wins)
    tallies: dict[str, Tally] = dataclasses.field(default_factory=dict)

    def empty(self) -> bool:
        return not (self.records or self.responses or self.aborts or self.stream_failures
                    or self.reports)


class Outbox:
    """A router's side: what it records goes into the next batch; batches stay
    until the ledger acknowledges them (resent in order, same numbers)."""

    def __init__(self, router: str, max_unsent_records: int = MAX_UNSENT_RECORDS):
        self.router = router
        self.max_unsent_records = max_unsent_records
        self._seq = 0
        self._open = RouterBatch(router, 0)
        self._sent_outcomes = HttpOutcomes()  # the cumulative counts already batched
        self._unsent: list[RouterBatch] = []
        self.dropped_records = 0  # records of batches dropped past the bound

    def record(self, r: RequestRecord) -> None:
        self._open.records.append(r)

    def report(self, report: dict) -> None:
        """A target replica's figures; only its newest is kept per replica."""
        reports = self._open.reports
        reports[:] = [x for x in reports if x["replica"] != report["replica"]] + [report]

    def pending(self, outcomes: HttpOutcomes,
                tallies: dict[str, Tally] | None = None) -> RouterBatch | None:
        """The oldest unacknowledged batch, after closing the open one (with the
        outcome counts `outcomes`, the router's cumulative ones, gained since the
        previous batch, its requests in flight now, and its routing `tallies`
        so far); None: nothing to send."""
        b = self._open
        b.tallies = dict(tallies or {})
        sent = self._sent_outcomes
        b.responses = outcomes.responses - sent.responses
        b.aborts = outcomes.aborts - sent.aborts
        b.stream_failures = outcomes.stream_failures - sent.stream_failures
        b.inflight = {r: n for r, n in outcomes.inflight.items() if n}
        if not b.empty() or not self._unsent:
            # always one batch a flush: it carries the in-flight gauge and says
            # the router is alive
            self._seq += 1
            b.seq = self._seq
            self._unsent.append(b)
            sent.responses = Counter(outcomes.responses)
            sent.aborts = Counter(outcomes.aborts)
            sent.stream_failures = Counter(outcomes.stream_failures)
            self._open = RouterBatch(self.router, 0)
        self._bound()
        return self._unsent[0] if self._unsent else None

    def acked(self, seq: int) -> None:
        self._unsent = [b for b in self._unsent if b.seq > seq]

    def has_unsent(self) -> bool:
        return bool(self._unsent)

    def unsent_records(self) -> int:
        return sum(len(b.records) for b in self._unsent)

    def _bound(self) -> None:
        """Past the bound the oldest batches lose their records (their outcome
        counts stay: they are small, and a batch keeps its number, so one the
        ledger applied already is still not counted twice)."""
        excess = self.unsent_records() - self.max_unsent_records
        for b in self._unsent:
            if excess <= 0:
                return
            excess -= len(b.records)
            self.dropped_records += len(b.records)
            b.records = []


@dataclasses.dataclass
class _Router:
    seq: int  # the last batch applied
    heard_at: float
    inflight: dict[str, int]


class Ledger:
    """The app's figures: every router's batches applied once."""

    def __init__(self, k: int, grace_s: float = GRACE_S, live_s: float = LIVE_S):
        self.stats = SpecStats(k, grace_s=grace_s)
        self.outcomes = HttpOutcomes()
        self.replicas = ReplicaTable(grace_s, live_s)
        self.grace_s, self.live_s = grace_s, live_s
        self.routers: dict[str, _Router] = {}
        self._report_at: dict[str, float] = {}  # target replica -> its newest report's time
        self.tallies: dict[str, dict[str, Tally]] = {}  # router -> its newest tallies
        self.retired_tallies: dict[str, Tally] = {}  # of routers pruned (kept in the sums)
        self.changed = False  # since the last checkpoint

    def add(self, batch: RouterBatch, now: float) -> dict[str, Figures]:
        """Apply a router's batch (once: a batch numbered at or below the last
        one applied from that router is acknowledged and ignored). Returns the
        app's acceptance per draft model (the routers' K controllers use it)."""
        known = self.routers.get(batch.router)
        if known is not None and batch.seq <= known.seq:
            known.heard_at = now
            return self.stats.by_model
        for r in batch.records:
            self.stats.record(r)
        o = self.outcomes
        o.responses.update(batch.responses)
        o.aborts.update(batch.aborts)
        o.stream_failures.update(batch.stream_failures)
        for report in batch.reports:
            self.report(report, now)
        if batch.tallies and batch.tallies != self.tallies.get(batch.router):
            self.tallies[batch.router] = batch.tallies
            self.changed = True
        if not batch.empty() or known is None or known.inflight != batch.inflight:
            self.changed = True  # (a router's heartbeat alone changes nothing)
        self.routers[batch.router] = _Router(batch.seq, now, dict(batch.inflight))
        return self.stats.by_model

    def report(self, report: dict, now: float) -> None:
        """A target replica's figures (cumulative; `at`: when it took them).
        An older report than the one held is ignored."""
        at = report.get("at", now)
        if at >= self._report_at.get(report["replica"], float("-inf")):
            self._report_at[report["replica"]] = at
            self.replicas.update(report, now)
            self.changed = True

    def prune(self, now: float) -> None:
        """Routers silent for grace_s leave (their numbering with them: a router
        id is never reused by Serve); the acceptance record and the replica
        table prune their own rows."""
        for name, r in list(self.routers.items()):
            if now - r.heard_at > self.grace_s:
                del self.routers[name]
                for deployment, t in self.tallies.pop(name, {}).items():
                    self.retired_tallies.setdefault(deployment, Tally()).add(t)
        for replica in list(self._report_at):
            if replica not in self.replicas.replicas():
                self._report_at.pop(replica, None)
        self.stats.prune(now)
        self.replicas.prune(now)

    def live_routers(self, now: float) -> list[str]:
        return sorted(n for n, r in self.routers.items() if now - r.heard_at <= self.live_s)

    def inflight(self, now: float) -> Counter:
        """Requests in flight per route, summed over the routers heard from within live_s."""
        total: Counter = Counter()
        for name in self.live_routers(now):
            total.update(self.routers[name].inflight)
        return total

    def view(self, now: float) -> dict:
        """The figures as of now, what the ops views render: {"stats":
        SpecStats, "outcomes": HttpOutcomes, "replicas": ReplicaTable,
        "routers": the routers heard from within live_s, "routing": the
        routers' target choices (affinity.Tally.snapshot) by deployment}
        (Serve pickles it to the router that asks: a copy)."""
        self.prune(now)
        outcomes = HttpOutcomes()
        outcomes.responses = Counter(self.outcomes.responses)
        outcomes.aborts = Counter(self.outcomes.aborts)
        outcomes.stream_failures = Counter(self.outcomes.stream_failures)
        outcomes.inflight = self.inflight(now)
        routing: dict[str, Tally] = {}
        for tallies in (self.retired_tallies, *self.tallies.values()):
            for deployment, t in tallies.items():
                routing.setdefault(deployment, Tally()).add(t)
        return {"stats": self.stats, "outcomes": outcomes, "replicas": self.replicas,
                "routers": self.live_routers(now),
                "routing": {d: t.snapshot() for d, t in sorted(routing.items())}}

    def dumps(self) -> bytes:
        """A checkpoint (the whole ledger); `loads` restores it."""
        self.changed = False
        return pickle.dumps((CHECKPOINT_VERSION, self))

    @staticmethod
    def loads(data: bytes) -> "Ledger":
        """The ledger of a checkpoint; ValueError when it is not one this code wrote."""
        try:
            version, ledger = pickle.loads(data)
        except Exception as e:
            raise ValueError(f"not a ledger checkpoint: {type(e).__name__}: {e}") from None
        if version != CHECKPOINT_VERSION or not isinstance(ledger, Ledger):
            raise ValueError(f"a ledger checkpoint of another version ({version!r})")
        return ledger
