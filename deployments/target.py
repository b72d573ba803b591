"""TargetServer: one target replica (a vLLM engine whose proposer takes remote drafts).

A plain class; `deployments.app.build_app` wires it into Ray Serve with one
placement-group bundle per tensor-parallel worker. The replica starts its draft
sink (in TP rank 0, through the proposer) and serves vLLM's own OpenAI app
(`specserve.target.openai_app`) on its engine, wrapped in a `DraftingEngine`:
for each engine request (after vLLM's tokenization and chat templating) a
replica of the draft pool the router chose streams drafts to that sink. The
draft call is fire-and-forget: if no draft replica is healthy, slow or dead,
the request runs on the target alone, with the same output.

A dead engine (EngineCore crashed or killed) is never hidden behind vLLM's 500:
requests on it raise `TargetUnavailable` to the router (a retry, or a 503), and
a watcher thread ends the replica's process within ENGINE_WATCH_S +
DEAD_GRACE_S, so Serve starts a new replica at once instead of at its next
health check.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import socket
import threading
import time

from deployments import replica_name
from specserve import logs
from specserve.config import AppConfig
from specserve.openai_api import TargetUnavailable
from specserve.target import openai_app
from specserve.target.drafting import (ROUTE, DraftingEngine, DraftStream, FollowedDraft,
                                       NoDraft, Route)
from specserve.tls import TlsFiles

log = logging.getLogger("specserve.target")

# How often the watcher looks at the engine, and how long a replica with a dead
# engine lives on so that its in-flight calls answer the router first.
ENGINE_WATCH_S = 0.2
DEAD_GRACE_S = 1.0

# The draft book's counters in a report after an HTTP call are at most this old.
BRANCHES_MAX_AGE_S = 1.0


def _is_error(item) -> bool:
    """An item of vLLM's app that reports a failure: a 5xx start, or SSE chunks
    holding an error event (vLLM streams `data: {"error": ...}` when generation
    fails; inside a JSON string those quotes would be escaped)."""
    if isinstance(item, dict):
        return item.get("status", 0) >= 500
    return isinstance(item, (bytes, bytearray)) and b'data: {"error"' in item


def _end_process_tree() -> None:
    """SIGKILL this process's children (what is left of the engine: its worker
    outlives a killed EngineCore for seconds, holding memory), then exit."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass
    os._exit(1)


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return socket.gethostbyname(socket.gethostname())


class TargetServer:
    def __init__(self, config: dict, drafts: dict | None = None):
        from specserve.models import ensure_default_model
        from specserve.placement import target_placement
        from specserve.engine import cpu_binding, settings_from
        from specserve.target.engine import TargetEngine

        self.config = AppConfig.model_validate(config)
        logs.to_stderr("target")
        t = self.config.target
        self.drafts = dict(drafts or {})
        # The engine's K ceiling; the K in use (and W, when it follows K) may
        # change below it while the engine runs (`reconfigure`).
        engine_k = self.config.speculation.engine_k() if self.drafts else 0
        self._set_live(self.config)
        self.model_dir = t.model or str(ensure_default_model())
        openai_app.check_tool_call_parser(t.tool_call_parser)
        os.environ.update(t.resources.env)
        # A model draft needs cores of its own; suffix pools run no engine.
        target_cpus, _ = cpu_binding(t.tensor_parallel_size,
                                     model_draft=any(d.has_model for d in self.config.drafts))
        # On GPUs the replica actor holds no GPU: vLLM's Ray executor puts the
        # TP workers on the bundles of this replica (specserve.placement).
        executor = target_placement(t).executor
        self.target = TargetEngine.start(
            self.model_dir, settings_from(t.engine), tp=t.tensor_parallel_size, k=engine_k,
            sink_bind=f"0.0.0.0:{t.sink_port}", sink_host=_node_ip(),
            tls=TlsFiles.from_config(self.config.grpc_tls), cpus=target_cpus,
            max_wait_ms=self.config.speculation.max_wait_ms,
            release_after_steps=self.config.speculation.release_after_steps,
            max_stream_messages_per_s=self.config.speculation.max_stream_messages_per_s,
            per_request_k=self.config.speculation.per_request_k,
            distributed_executor_backend=None if executor == "uni" else executor,
            engine_metrics=True)  # vLLM's own metrics, for vLLM's dashboards
        # The engine and its counters; its measured decode step cost (a + b ·
        # tokens), which the router's K choice reads through spec_totals, is
        # self.target.step_cost().
        self.engine, self.totals = self.target.engine, self.target.totals
        self.max_model_len = self.target.max_model_len
        self.sink_address = self.target.sink_address
        from vllm.platforms import current_platform

        self.client = DraftingEngine(
            self.engine, self._open_draft, engine_k, replica_name(),
            live=lambda: (self.totals.running, self.totals.waiting),
            on_cpu=current_platform.is_cpu(), quotas=lambda: self.quotas)
        self._branches: tuple[float, dict] = (float("-inf"), {})  # (at, counters)
        self._branches_task: asyncio.Task | None = None
        self._app = None  # vLLM's OpenAI app, built on first use (it needs the loop)
        self._app_lock: asyncio.Lock | None = None
        threading.Thread(target=self._watch_engine, name="engine-watch", daemon=True).start()
        log.info("target %s ready (TP=%d, K=%d of at most %d, sink %s)", self.model_dir,
                 t.tensor_parallel_size, self.k, engine_k, self.sink_address)

    def reconfigure(self, live: dict) -> None:
        """The live settings (`specserve.config.live`: K within the engine's
        ceiling, quotas, ...), from Serve's user_config: at start and whenever
        the Serve config changes them. The engine keeps running."""
        from specserve.config.live import with_live

        self.config = with_live(self.config, live)
        self._set_live(self.config)
        log.info("target settings: K=%d, W=%d, quotas %s", self.k, self.lookahead,
                 self.quotas.model_dump())

    def _set_live(self, config: AppConfig) -> None:
        self.k = config.speculation.num_speculative_tokens if self.drafts else 0
        self.lookahead = config.lookahead_tokens()
        self.quotas = config.quotas

    async def http(self, method: str, path: str, query: str, headers: list, body: bytes,
                   draft: str | None = None, k: int = 0):
        """Serve one HTTP request with vLLM's OpenAI app (streaming call).

        draft, k: the draft pool to ask and at most this many drafted tokens
        per step, for every engine request this HTTP request makes (None, 0:
        the target alone). Yields {"status", "headers"}, the body's chunks,
        and last {"records": [RequestRecord, ...]}: one per finished sequence,
        with vLLM's spec-decode figures for it. Error bodies name specserve's
        config where vLLM's name its flags (`openai_app.config_hint`)."""
        self._raise_if_dead()
        app = await self._openai_app()
        route = Route(draft, min(k, self.k))
        context = contextvars.copy_context()  # the app's task runs in it
        context.run(ROUTE.set, route)
        calls = openai_app.call(app, method, path, query, headers, body, context)
        failed = False
        async with contextlib.aclosing(calls):
            async for item in calls:
                # vLLM answers a dead engine with a 500 (or an SSE error event):
                # the router is told instead, before the item reaches it. (An
                # answer the engine finished before it died goes on as it is.)
                if self.engine.errored and _is_error(item):
                    self._raise_if_dead()
                if isinstance(item, dict):
                    failed = item["status"] >= 400
                elif failed:
                    item = openai_app.config_hint(item)
                yield item
        yield {"records": route.records, "report": await self.metrics_report(fresh=False)}

    def _raise_if_dead(self) -> None:
        if self.engine.errored:
            raise TargetUnavailable("the target engine is dead; the replica is being replaced")

    def _watch_engine(self) -> None:
        """End this replica's process soon after its engine dies: Serve then
        replaces it at once (its health check would notice only every
        health_check_period_s), and the router's calls to it fail over."""
        while not self.engine.errored:
            time.sleep(ENGINE_WATCH_S)
        log.error("target engine is dead; ending replica %s in %g s so that Serve replaces it",
                  replica_name(), DEAD_GRACE_S)
        time.sleep(DEAD_GRACE_S)
        _end_process_tree()


    async def _openai_app(self):
        if self._app is None:
            self._app_lock = self._app_lock or asyncio.Lock()
            async with self._app_lock:
                if self._app is None:
                    t = self.config.target
                    self._app = await openai_app.build(self.client, self.model_dir,
                                                       t.served_name(), t.tool_call_parser,
                                                       quotas=lambda: self.quotas)
        return self._app

    def _open_draft(self, pool: str, request_id: str, prompt_ids: list[int],
                    max_tokens: int, k: int, ticket: str) -> DraftStream:
        """Ask a replica of `pool` to stream drafts for one sequence to our sink
        (registered there with `ticket`). Fire and forget: a dead or slow draft
        pool only costs speed."""
        who = {"model": pool, "k": k}
        if pool not in self.drafts:
            return NoDraft(who)
        from ray.serve.exceptions import RequestCancelledError

        call = self.drafts[pool].options(stream=True).draft.remote(
            request_id, prompt_ids, self.sink_address, self.lookahead, max_tokens, k, ticket)
        return FollowedDraft(call, who, request_id, cancel=call.cancel,
                             stopped=(RequestCancelledError,))

    def record_autoscaling_stats(self) -> dict:
        """Figures for specserve.control.autoscale.target_policy (Serve calls this)."""
        max_seqs = self.config.target.engine.max_num_seqs
        return {"load": self.totals.running / max_seqs, "waiting": float(self.totals.waiting)}

    def spec_totals(self) -> dict:
        t = self.totals
        return {"num_drafts": t.num_drafts, "draft_tokens": t.draft_tokens,
                "accepted_tokens": t.accepted_tokens,
                "accepted_per_position": list(t.accepted_per_position),
                # requests the engine holds now (running or waiting)
                "unfinished_requests": self.engine.get_num_unfinished_requests(),
                "running": t.running,
                # measured decode step cost, None until enough steps were seen
                # (the sink's, refreshed with the branch counters, else vLLM's)
                "step_cost": self.target.step_cost(),
                # this replica's draft replica choices, by pool and reason
                "draft_routing": _draft_tallies()}

    async def branch_counters(self) -> dict:
        """The sink's draft-book counters per draft ("model/replica"): branches,
        coverage after each outcome, the bounded wait (specserve.acceptance.branches).
        Also refreshes the sink's step cost fit (spec_totals)."""
        import grpc

        try:
            return await self.target.sink_stats()
        except grpc.aio.AioRpcError as e:
            log.warning("sink stats unavailable: %s", e.code().name)
            return {}

    async def metrics_report(self, fresh: bool = True) -> dict:
        """This replica's figures for the router's /metrics
        (specserve.acceptance.replicas): its engine's (vLLM's stat logger) and
        its sink's book counters. fresh=False (after every HTTP call) answers
        with book counters up to BRANCHES_MAX_AGE_S old and refreshes them in
        the background; fresh=True (a scrape) waits for them."""
        at, counters = self._branches
        if time.monotonic() - at > BRANCHES_MAX_AGE_S:
            if self._branches_task is None or self._branches_task.done():
                self._branches_task = asyncio.get_running_loop().create_task(
                    self._refresh_branches())
            if fresh:
                counters = await asyncio.shield(self._branches_task)
        # at: when these cumulative figures were taken (the router's ledger
        # keeps a replica's newest, whatever order the routers send them in)
        return {"replica": replica_name(), "model_name": self.config.target.served_name(),
                "at": time.time(), "engine": self.totals.snapshot(), "branches": counters}

    async def _refresh_branches(self) -> dict:
        counters = await self.branch_counters()
        self._branches = (time.monotonic(), counters)
        return counters

    async def draft_active(self) -> dict:
        """Requests each draft pool is drafting for now (from one replica of each)."""
        return await self._ask_drafts("active", self.drafts)

    async def draft_adapt(self) -> dict:
        """Each draft pool's adaptation figures (DraftServer.adapt, from one
        replica of each); None for a pool whose adapt is off (not asked)."""
        adapting = {d.name for d in self.config.drafts if d.adapt.enabled}
        asked = await self._ask_drafts("adapt", {name: handle for name, handle
                                                 in self.drafts.items() if name in adapting})
        return {name: asked.get(name) for name in self.drafts}

    @staticmethod
    async def _ask_drafts(method: str, handles: dict) -> dict:
        """`method` of one replica of each draft pool; "unavailable: ..." for a
        pool that does not answer."""
        out = {}
        for name, handle in handles.items():
            try:
                out[name] = await asyncio.wait_for(getattr(handle, method).remote(), 10)
            except Exception as e:  # a dead or restarting draft pool
                out[name] = f"unavailable: {type(e).__name__}"
        return out

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def ready(self) -> bool:
        """True once this replica's engine can serve (the router's /healthz)."""
        await self.engine.check_health()
        return True


def _draft_tallies() -> dict:
    """The draft pools' affinity routers' tallies in this process (deployments.routing)."""
    try:
        from deployments.routing import tallies
    except ImportError:  # no Ray Serve here (the class tested alone)
        return {}
    return tallies("draft-")

