"""The router's ops views: /v1/spec/stats (JSON), /metrics (Prometheus text), /dashboard.

Owns: turning the acceptance record (`specserve.acceptance.stats.SpecStats`),
the controller state (`deployments.choice.DraftChoice`) and what the target
and Serve report into those three views, and the same figures as Ray Serve
metrics (`ServeMetrics`). The views answer at once with what they know: a
figure that must come from a target replica or from Serve (engine counters,
drafting requests, replica counts) is waited on for at most REMOTE_WAIT_S and
is null (with the reason) when it did not come, e.g. while no target replica
is up. What each target replica last reported (its engine's and draft
sink's figures, after each call it served and at each scrape) is kept per
replica (`specserve.acceptance.replicas.ReplicaTable`); every family on
/metrics is catalogued (`specserve.acceptance.catalogue`).

With more than one router replica the figures are the app's, not this
router's: every router sends what it records to the ledger
(`deployments.ledger.LedgerServer`) after each response, every FLUSH_S and
before it renders a view, and the views render the ledger's figures, which
add up every router and survive a router's restart. When the ledger does not
answer, a view renders this router's own figures and says so
(`figures.source`). Never does: serve requests or choose drafts.
"""

from __future__ import annotations

import asyncio
import logging
import time

from specserve.acceptance import branches, catalogue
from specserve.acceptance.ledger import Outbox
from specserve.acceptance.outcomes import HttpOutcomes
from specserve.acceptance.prometheus import prometheus_lines
from specserve.acceptance.replicas import ReplicaTable
from specserve.acceptance.stats import RequestRecord, SpecStats
from specserve.control import pools

log = logging.getLogger("specserve.router")

REMOTE_WAIT_S = 2.0  # longest an ops view waits for a figure from a replica
POOLS_CACHE_S = 2.0
# A router sends its records to the ledger right after each response (one
# call in flight at a time), and at least every FLUSH_S (its requests in
# flight, its outcome counts, and that it is alive).
FLUSH_S = 0.5


class ServeMetrics:
    """The same figures as ray.serve.metrics (exported by Ray's metrics agent
    with a `ray_` prefix), for clusters that scrape Ray rather than /metrics.
    Names, help, tags and buckets are the catalogue's `source="ray"` entries;
    kinds: AppConfig.draft_kinds() (the `kind` tag)."""

    def __init__(self, kinds: dict[str, str]):
        from ray.serve.metrics import Counter, Histogram

        self.kinds = kinds

        def made(name):
            m = catalogue.RAY[name]
            if m.type == "counter":
                return Counter(catalogue.ray_name(m), tag_keys=m.labels, description=m.help)
            return Histogram(m.name, description=m.help, boundaries=list(m.buckets))

        self.draft_tokens = made("specserve_draft_tokens_total")
        self.accepted_tokens = made("specserve_accepted_tokens_total")
        self.output_tokens = made("specserve_output_tokens_total")
        self.ttft = made("specserve_ttft_seconds")
        self.tpot = made("specserve_tpot_seconds")

    def observe(self, r: RequestRecord) -> None:
        model = r.report.draft_model or catalogue.NO_DRAFT
        tags = {"draft_model": model, "draft_replica": r.report.draft_replica or "none",
                "kind": catalogue.kind_of(model, self.kinds)}
        a = r.acceptance
        for counter, value in ((self.draft_tokens, a.draft_tokens),
                               (self.accepted_tokens, a.accepted_tokens),
                               (self.output_tokens, a.output_tokens)):
            if value > 0:  # Ray's counters refuse increments of 0
                counter.inc(value, tags=tags)
        self.ttft.observe(r.ttft_s)
        if r.tpot_s is not None:
            self.tpot.observe(r.tpot_s)


async def _within(awaitable, what: str):
    """The awaited value, or "unavailable: ..." when it does not come in time."""
    try:
        return await asyncio.wait_for(awaitable, REMOTE_WAIT_S)
    except asyncio.TimeoutError:
        return f"unavailable: no answer from {what} within {REMOTE_WAIT_S:g} s"
    except Exception as e:  # a dead or restarting replica
        return f"unavailable: {type(e).__name__}"


class OpsViews:
    def __init__(self, stats: SpecStats, choice, target, bounds: dict[str, tuple[int, int]],
                 kinds: dict[str, str], serve_status=None, decisions=None, metrics=None,
                 running_targets=None, ledger=None, router: str = "router",
                 adapting: set[str] = frozenset()):
        """kinds: AppConfig.draft_kinds(), every view's `kind` of a pool
        (catalogue.kind_of); serve_status(): the Serve app's {deployment:
        {state: count}} (default: from `serve.status()`); decisions():
        awaitable, the autoscaling decisions (default:
        `specserve.control.pools.fetch`, from Ray); metrics: a
        ServeMetrics or None; running_targets(): the ids of the running target
        replicas, or None when unknown (default: from Serve's details);
        ledger: the ledger deployment's handle (None: this router's figures
        only); router: this router replica's id; adapting: the draft pools
        with adapt on (their rows carry the replicas' `adapt` figures)."""
        self.stats = stats
        self.choice = choice
        self.target = target
        self.bounds = bounds
        self.kinds = kinds
        self.adapting = set(adapting)
        self.metrics = metrics
        self._serve_status = serve_status or _serve_deployments
        self._running_targets = running_targets or _running_target_replicas
        self._decisions = decisions or pools.fetch
        self._pools: tuple[float, list[dict]] = (float("-inf"), [])
        self._pools_task: asyncio.Task | None = None
        self.replicas = ReplicaTable()  # what each target replica last reported
        self.outcomes = HttpOutcomes()
        self.ledger = ledger
        self.outbox = Outbox(router)
        self._flush_lock = asyncio.Lock()
        self._flush_queued = False
        self._ledger_down = False
        self._flusher: asyncio.Task | None = None

    def record(self, r: RequestRecord) -> None:
        """A finished sequence (from the target) into the picture and the metrics."""
        self.stats.record(r)
        if self.ledger is not None:
            self.outbox.record(r)
            self._flush_soon()
        if self.metrics is not None:
            self.metrics.observe(r)

    def replica_report(self, report: dict) -> None:
        """A target replica's figures (TargetServer.metrics_report)."""
        self.replicas.update(report, time.time())
        if self.ledger is not None:
            self.outbox.report(report)

    # ---- the ledger ------------------------------------------------------------------

    def start_flushing(self) -> None:
        """Send to the ledger every FLUSH_S from now on (idempotent; needs the
        router's event loop)."""
        if self.ledger is not None and (self._flusher is None or self._flusher.done()):
            self._flusher = asyncio.get_running_loop().create_task(self._flush_forever())

    def _flush_soon(self) -> None:
        """A flush as soon as the one under way (if any) is done: records reach
        the ledger right after their response, in one batch per round trip."""
        if not self._flush_queued:
            self._flush_queued = True
            asyncio.get_running_loop().create_task(self.flush())

    async def _flush_forever(self) -> None:
        while True:
            await self.flush()
            await asyncio.sleep(FLUSH_S)

    async def flush(self) -> str | None:
        """Send the ledger what this router recorded since its last batch (and
        any batch it has not acknowledged yet); None, or why it did not take
        them (they stay for the next flush)."""
        if self.ledger is None:
            return "no ledger"
        async with self._flush_lock:
            self._flush_queued = False
            while True:
                batch = self.outbox.pending(self.outcomes, _tally_copies())
                if batch is None:
                    return None
                by_model = await _within(self.ledger.add.remote(batch), "the ledger")
                if isinstance(by_model, str):
                    if not self._ledger_down:  # once per outage, not every flush
                        log.warning("figures not sent to the ledger (kept, sent later): %s",
                                    by_model)
                    self._ledger_down = True
                    return by_model
                if self._ledger_down:
                    log.info("the ledger answers again")
                self._ledger_down = False
                self.outbox.acked(batch.seq)
                self.choice.fleet_by_model = by_model
                if not self.outbox.has_unsent():
                    return None

    async def _figures(self) -> dict:
        """What the views render: the ledger's view of the whole app, after
        this router's own batch; this router's figures when the ledger does
        not answer (`source` says which, `why` why)."""
        why = await self.flush()
        if why is None:
            view = await _within(self.ledger.view.remote(), "the ledger")
            if isinstance(view, dict):
                # K is each router's choice (from the same app-wide figures);
                # Serve's running replicas are this router's latest word.
                view["stats"].k = self.stats.k
                view["stats"].current_k = dict(self.stats.current_k)
                view["replicas"].running_as(self.replicas)
                return {**view, "source": "ledger", "why": None}
            why = view
        return {"stats": self.stats, "outcomes": self.outcomes, "replicas": self.replicas,
                "routers": None, "routing": _routing_tallies(), "source": "this router",
                "why": why}

    def pool_waits(self) -> dict[str, float]:
        """Each draft pool's wait per step (seconds), from what the target
        replicas last reported (for the K choice)."""
        return branches.pool_waits(self.replicas.branch_totals(time.time()))

    async def _refresh_replica(self) -> str | None:
        """Ask one target replica (Serve's choice) for its figures; None, or
        why it did not answer."""
        method = getattr(self.target, "metrics_report", None)
        if method is None:
            return "unavailable: the target replica reports no figures"
        report = await _within(method.remote(), "a target replica")
        if isinstance(report, str):
            return report
        self.replica_report(report)
        return None

    async def pool_rows(self) -> list[dict]:
        """Replica counts per pool from Serve's status (cached for POOLS_CACHE_S).

        Serve's status can take longer than REMOTE_WAIT_S on a busy node: the
        refresh then goes on in the background (it fills the cache when it
        comes) and this view answers with the last counts it knows."""
        at, rows = self._pools
        if time.monotonic() - at < POOLS_CACHE_S:
            return rows
        if self._pools_task is None or self._pools_task.done():
            self._pools_task = asyncio.get_running_loop().create_task(self._refresh_pools())
        try:
            return await asyncio.wait_for(asyncio.shield(self._pools_task), REMOTE_WAIT_S)
        except Exception as e:  # the figures are for people; never fail a view
            log.warning("serve status unavailable: %s", e or type(e).__name__)
            if at > float("-inf"):
                return rows
            return pools.replica_counts({}, self.bounds, self.kinds)

    async def _refresh_pools(self) -> list[dict]:
        at = time.time()
        deployments = await asyncio.to_thread(self._serve_status)
        running = await asyncio.to_thread(self._running_targets)
        if running is not None:
            self.replicas.set_running(running, at)
        rows = pools.replica_counts(deployments, self.bounds, self.kinds)
        self._pools = (time.monotonic(), rows)
        return rows

    async def _adapt_figures(self) -> dict | str:
        """Each draft pool's adaptation figures (pools.with_adapt's `figures`),
        asked only when some pool adapts (a target replica asks the pools)."""
        if not self.adapting:
            return {}
        return await _within(self.target.draft_adapt.remote(), "a target replica")

    async def stats_json(self) -> dict:
        c = self.choice
        # Remote figures first (a target replica's report goes to the ledger
        # with this router's batch, before the figures are read).
        (target_engine, draft_active, pool_rows, autoscaling, missing,
         adapt) = await asyncio.gather(
            _within(self.target.spec_totals.remote(), "a target replica"),
            _within(self.target.draft_active.remote(), "a target replica"),
            self.pool_rows(),
            _within(self._decisions(), "the autoscaler"),
            self._refresh_replica(),
            self._adapt_figures())
        figures = await self._figures()
        replicas = figures["replicas"]
        snap = figures["stats"].snapshot(time.time(), self.kinds)
        # Whose figures these are: the ledger's (every router's, `routers`
        # heard from lately) or, when it did not answer, this router's alone.
        # Records this router could not send yet, and those it dropped (the
        # ledger did not answer for long: Outbox's bound).
        snap["figures"] = {"source": figures["source"], "routers": figures["routers"],
                           "why": figures["why"],
                           "unsent_records": self.outbox.unsent_records(),
                           "dropped_records": self.outbox.dropped_records}
        snap["load"] = c.load()
        snap["last_choice"] = c.last_choice.reason if c.last_choice else None
        # What the K choice last used: the target's measured step cost (or the
        # load model until it is measured), rows, per-pool K.
        snap["k_choice"] = c.k_inputs
        # Slots held right now: this router's requests in flight, and (from the
        # target replica that answers) its engine's unfinished requests and each
        # draft pool's active drafting requests; vLLM's engine-wide counters of
        # that replica cross-check the per-request attribution above.
        snap["router_inflight"] = sum(c.inflight.values())
        snap["target_engine"], snap["draft_active"] = target_engine, draft_active
        snap["pools"] = pools.with_adapt(pool_rows, adapt, self.adapting)
        snap["autoscaling"] = autoscaling
        # The step after a rejection, per draft, from the target replicas'
        # draft books (specserve.acceptance.branches), added up over the
        # replicas that reported: branch hit rate, coverage after an accepted
        # step vs after a rejection, wait per step.
        per_draft = replicas.branch_totals(time.time())
        snap["branches"] = ({d: {"kind": catalogue.kind_of(branches.split(d)[0], self.kinds),
                                 **branches.figures(c)} for d, c in sorted(per_draft.items())}
                            if per_draft or missing is None else missing)
        # Target replicas: those that reported (their rows on /metrics) and
        # those Serve runs (null where Serve cannot say).
        snap["target_replicas"] = {"reported": replicas.replicas(),
                                   "running": self.replicas.running()}
        # Why requests went where they did: the routers' target choices and
        # (from the target replica that answered) its draft choices, by reason
        # (specserve.control.affinity.REASONS); {} under Serve's default routing.
        engine = snap["target_engine"]
        snap["routing"] = {"target": figures["routing"].get("target"),
                           "drafts": engine.pop("draft_routing", None)
                           if isinstance(engine, dict) else engine}
        return snap

    async def metrics_text(self) -> str:
        _, pool_rows, adapt = await asyncio.gather(
            self._refresh_replica(), self.pool_rows(), self._adapt_figures())
        figures = await self._figures()
        now = time.time()
        stats, replicas = figures["stats"], figures["replicas"]
        stats.prune(now)
        replicas.prune(now)
        lines = [*prometheus_lines(stats, now, self.kinds),
                 *figures["outcomes"].prometheus_lines(),
                 *pools.prometheus_lines(pools.with_adapt(pool_rows, adapt, self.adapting)),
                 *replicas.prometheus_lines(now, self.kinds)]
        return "\n".join(lines) + "\n"


def _tally_copies() -> dict:
    """This process's affinity routers' tallies as Tally objects, for the ledger."""
    try:
        from deployments.routing import tally_copies
    except ImportError:  # no Ray Serve here (unit tests of the views)
        return {}
    return tally_copies()


def _routing_tallies() -> dict:
    """This process's affinity routers' tallies (deployments.routing), by deployment."""
    try:
        from deployments.routing import tallies
    except ImportError:  # no Ray Serve here (unit tests of the views)
        return {}
    return tallies()


def _serve_deployments() -> dict:
    from ray import serve

    app = serve.get_replica_context().app_name
    status = serve.status().applications.get(app)
    return {name: {getattr(s, "value", str(s)): n for s, n in d.replica_states.items()}
            for name, d in (status.deployments.items() if status else ())}


def _running_target_replicas() -> set[str] | None:
    """The running target replicas' ids, from the Serve controller's details
    (what Ray's dashboard shows); None when Serve cannot say (the gauges then
    fall back to how recently each replica reported)."""
    try:
        from ray import serve
        from ray.serve.context import _get_global_client

        app = serve.get_replica_context().app_name
        details = _get_global_client().get_serve_details()
        target = details["applications"][app]["deployments"]["target"]
        return {r["replica_id"] for r in target["replicas"] if r["state"] == "RUNNING"}
    except Exception as e:  # figures for people: never fail a view
        log.debug("serve details unavailable: %s", e)
        return None


def dashboard_page():
    """The ops page (static HTML + JS shipped in the package, no outside CDN)."""
    from importlib.resources import files

    from starlette.responses import HTMLResponse

    return HTMLResponse(files("specserve.dashboard").joinpath("index.html").read_text("utf-8"),
                        headers={"Cache-Control": "no-cache"})
