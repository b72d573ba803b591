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
/metrics is catalogued (`specserve.acceptance.catalogue`). Never does: serve
requests or choose drafts.
"""

from __future__ import annotations

import asyncio
import logging
import time

from specserve.acceptance import branches, catalogue
from specserve.acceptance.outcomes import HttpOutcomes
from specserve.acceptance.prometheus import prometheus_lines
from specserve.acceptance.replicas import ReplicaTable
from specserve.acceptance.stats import RequestRecord, SpecStats
from specserve.control import pools

log = logging.getLogger("specserve.router")

REMOTE_WAIT_S = 2.0  # longest an ops view waits for a figure from a replica
POOLS_CACHE_S = 2.0


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
                 running_targets=None):
        """kinds: AppConfig.draft_kinds(), every view's `kind` of a pool
        (catalogue.kind_of); serve_status(): the Serve app's {deployment:
        {state: count}} (default: from `serve.status()`); decisions():
        awaitable, the autoscaling decisions (default:
        `specserve.control.pools.fetch`, from Ray); metrics: a
        ServeMetrics or None; running_targets(): the ids of the running target
        replicas, or None when unknown (default: from Serve's details)."""
        self.stats = stats
        self.choice = choice
        self.target = target
        self.bounds = bounds
        self.kinds = kinds
        self.metrics = metrics
        self._serve_status = serve_status or _serve_deployments
        self._running_targets = running_targets or _running_target_replicas
        self._decisions = decisions or pools.fetch
        self._pools: tuple[float, list[dict]] = (float("-inf"), [])
        self._pools_task: asyncio.Task | None = None
        self.replicas = ReplicaTable()  # what each target replica last reported
        self.outcomes = HttpOutcomes()

    def record(self, r: RequestRecord) -> None:
        """A finished sequence (from the target) into the picture and the metrics."""
        self.stats.record(r)
        if self.metrics is not None:
            self.metrics.observe(r)

    def replica_report(self, report: dict) -> None:
        """A target replica's figures (TargetServer.metrics_report)."""
        self.replicas.update(report, time.time())

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

    async def stats_json(self) -> dict:
        snap = self.stats.snapshot(time.time(), self.kinds)
        c = self.choice
        snap["load"] = c.load()
        snap["last_choice"] = c.last_choice.reason if c.last_choice else None
        # What the K choice last used: the target's measured step cost (or the
        # load model until it is measured), rows, per-pool K.
        snap["k_choice"] = c.k_inputs
        # Slots held right now: router requests in flight, and (from the target
        # replica that answers) its engine's unfinished requests and each draft
        # pool's active drafting requests; vLLM's engine-wide counters of that
        # replica cross-check the per-request attribution above.
        snap["router_inflight"] = sum(c.inflight.values())
        (snap["target_engine"], snap["draft_active"], snap["pools"], snap["autoscaling"],
         missing) = await asyncio.gather(
            _within(self.target.spec_totals.remote(), "a target replica"),
            _within(self.target.draft_active.remote(), "a target replica"),
            self.pool_rows(),
            _within(self._decisions(), "the autoscaler"),
            self._refresh_replica())
        # The step after a rejection, per draft, from the target replicas'
        # draft books (specserve.acceptance.branches), added up over the
        # replicas that reported: branch hit rate, coverage after an accepted
        # step vs after a rejection, wait per step.
        per_draft = self.replicas.branch_totals(time.time())
        snap["branches"] = ({d: {"kind": catalogue.kind_of(branches.split(d)[0], self.kinds),
                                 **branches.figures(c)} for d, c in sorted(per_draft.items())}
                            if per_draft or missing is None else missing)
        # Target replicas: those that reported (their rows on /metrics) and
        # those Serve runs (null where Serve cannot say).
        snap["target_replicas"] = {"reported": self.replicas.replicas(),
                                   "running": self.replicas.running()}
        # Why requests went where they did: this router's target choices and
        # (from the target replica that answered) its draft choices, by reason
        # (specserve.control.affinity.REASONS); {} under Serve's default routing.
        engine = snap["target_engine"]
        snap["routing"] = {"target": _routing_tallies().get("target"),
                           "drafts": engine.pop("draft_routing", None)
                           if isinstance(engine, dict) else engine}
        return snap

    async def metrics_text(self) -> str:
        now = time.time()
        await self._refresh_replica()
        self.stats.prune(now)
        self.replicas.prune(now)
        lines = [*prometheus_lines(self.stats, now, self.kinds),
                 *self.outcomes.prometheus_lines(),
                 *pools.prometheus_lines(await self.pool_rows()),
                 *self.replicas.prometheus_lines(now, self.kinds)]
        return "\n".join(lines) + "\n"


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
