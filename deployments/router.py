"""Router: the HTTP ingress (OpenAI API) in front of the target and draft pools.

A plain class; `deployments.app.build_app` makes it the Serve ingress. It owns
the edge: authentication, request parsing and validation (through the pure
`specserve.openai_api`), tokenization (once, here), the choice of draft pool,
and turning the target's token stream into OpenAI responses or SSE; and the ops
views (/v1/spec/stats, /metrics, the /dashboard page). Bad input
gets a 4xx with an OpenAI-style error body; nothing here can crash the app.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from specserve import openai_api as api
from specserve.control import policy
from specserve.control import pools
from specserve.config import AppConfig
from specserve.acceptance.prometheus import prometheus_text
from specserve.acceptance.stats import RequestRecord, SpecStats
from specserve.control.controller import KController

log = logging.getLogger("specserve.router")


class ServeMetrics:
    """The same figures as ray.serve.metrics (exported by Ray's metrics agent
    with a `ray_` prefix), for clusters that scrape Ray rather than /metrics."""

    def __init__(self):
        from ray.serve.metrics import Counter, Histogram

        tags = ("draft_model", "draft_replica")
        self.draft_tokens = Counter("specserve_draft_tokens", tag_keys=tags,
                                    description="Drafted tokens the target verified.")
        self.accepted_tokens = Counter("specserve_accepted_tokens", tag_keys=tags,
                                       description="Drafted tokens the target accepted.")
        self.output_tokens = Counter("specserve_output_tokens", tag_keys=tags,
                                     description="Tokens emitted to clients.")
        self.ttft = Histogram("specserve_ttft_seconds", description="Time to first token.",
                              boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10])
        self.tpot = Histogram("specserve_tpot_seconds", description="Time per output token.",
                              boundaries=[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5])

    def observe(self, report, ttft: float, duration: float) -> None:
        tags = {"draft_model": report.draft_model or "none",
                "draft_replica": report.draft_replica or "none"}
        a = report.acceptance
        output_tokens = a.output_tokens
        for counter, value in ((self.draft_tokens, a.draft_tokens),
                               (self.accepted_tokens, a.accepted_tokens),
                               (self.output_tokens, output_tokens)):
            if value > 0:  # Ray's counters refuse increments of 0
                counter.inc(value, tags=tags)
        self.ttft.observe(ttft)
        if output_tokens > 1:
            self.tpot.observe((duration - ttft) / (output_tokens - 1))


def _dashboard_page():
    """The ops page (static HTML + JS shipped in the package, no outside CDN)."""
    from importlib.resources import files

    from starlette.responses import HTMLResponse

    return HTMLResponse(files("specserve.dashboard").joinpath("index.html").read_text("utf-8"),
                        headers={"Cache-Control": "no-cache"})


def _streaming_response(events, release):
    """SSE response that runs `release` once, however the stream ends.

    The events generator's own `finally` is not enough: when the client goes
    away before the body starts, Starlette cancels the response before it ever
    iterates the generator, and a generator that never started never runs its
    `finally`. So `release` also runs when the response's ASGI call ends, and,
    should the response never be called at all (the request was cancelled
    between returning it and sending it), when the response is collected."""
    import asyncio
    import weakref

    from starlette.responses import StreamingResponse

    class _Response(StreamingResponse):
        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                release()

    response = _Response(events, media_type="text/event-stream")
    loop = asyncio.get_running_loop()

    def collected():  # may run on any thread: hand over to the router's loop
        if not loop.is_closed():
            loop.call_soon_threadsafe(release)

    weakref.finalize(response, collected)
    return response


# How old the router's copy of the target's measured step cost may get.
COST_REFRESH_S = 2.0

# A request whose target replica dies before anything reached the client is
# run again (Serve routes it to a live replica, or waits for the restarted one).
TARGET_ATTEMPTS = 2


def _replica_failed(e: BaseException) -> bool:
    """The replica serving a call died or became unreachable (not a bad request)."""
    from ray.exceptions import RayActorError

    return isinstance(e, RayActorError)


def _target_failed(e: BaseException) -> api.ApiError:
    return api.ApiError(503, "the target replica serving this request failed "
                             f"({type(e).__name__}); retry the request",
                        type="server_error", code="target_unavailable")


class _Once:
    """Calls fn the first time it is called, never again."""

    def __init__(self, fn):
        self._fn = fn

    def __call__(self):
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


def _json(body: dict, status: int = 200):
    from starlette.responses import JSONResponse

    return JSONResponse(body, status_code=status)


class Router:
    def __init__(self, config: dict, target, draft_names: list[str]):
        from transformers import AutoConfig, AutoTokenizer

        from specserve.models import ensure_default_model

        self.config = AppConfig.model_validate(config)
        self.target = target
        self.draft_names = list(draft_names)
        model_dir = self.config.target.model or str(ensure_default_model())
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        hf = AutoConfig.from_pretrained(model_dir)
        self.max_model_len = (self.config.target.engine.max_model_len
                              or getattr(hf, "max_position_embeddings", None) or 2048)
        self.model_name = self.config.target.served_name()
        self.api_key = self.config.http.api_key_value()  # api_key_env: from a Secret
        self.max_body = self.config.http.max_body_bytes
        self.k_max = self.config.speculation.num_speculative_tokens
        self.stats = SpecStats(self.k_max)
        self.inflight: dict[str | None, int] = {}
        t = self.config.target
        self.capacity = max(t.replicas.max_replicas, 1) * t.engine.max_num_seqs
        self.replicas = {d.name: max(d.replicas.max_replicas, 1) for d in self.config.drafts}
        self.controller = KController(self.k_max, self.replicas,
                                      self.config.speculation.k_control.thresholds())
        self.metrics = ServeMetrics()
        self.bounds = {"target": (t.replicas.min_replicas, t.replicas.max_replicas),
                       **{d.name: (d.replicas.min_replicas, d.replicas.max_replicas)
                          for d in self.config.drafts}}
        self._pools: tuple[float, list[dict]] = (0.0, [])
        self.target_replicas = max(t.replicas.max_replicas, 1)
        # The target's measured step cost (from spec_totals), refreshed in the
        # background at most every COST_REFRESH_S: no remote call per request.
        self._cost: tuple[float, dict | None] = (float("-inf"), None)
        self._cost_task: asyncio.Task | None = None

    async def __call__(self, request):
        try:
            self._authorize(request)
            route = (request.method, request.url.path.rstrip("/") or "/")
            if route == ("GET", "/healthz"):
                return _json({"status": "ok"})
            if route == ("GET", "/dashboard"):
                return _dashboard_page()
            if route == ("GET", "/v1/models"):
                return _json(api.models_response([self.model_name]))
            if route == ("GET", "/v1/spec/stats"):
                snap = self.stats.snapshot(time.time())
                snap["load"] = self.load()
                last = self.controller.last
                snap["last_choice"] = last.reason if last else None
                # vLLM's engine-wide counters of the target replica that answers,
                # to cross-check the per-request attribution above.
                snap["target_engine"] = await self.target.spec_totals.remote()
                # What the K choice last used: the target's measured step cost
                # (or the load model until it is measured), rows, per-pool K.
                snap["k_choice"] = self.controller.inputs
                snap["pools"] = await self.pool_rows()
                snap["autoscaling"] = await pools.fetch()
                # Slots held right now: router requests in flight, and (from the
                # target replica that answers) its engine's unfinished requests
                # and each draft pool's active drafting requests.
                snap["router_inflight"] = sum(self.inflight.values())
                snap["draft_active"] = await self.target.draft_active.remote()
                return _json(snap)
            if route == ("GET", "/metrics"):
                from starlette.responses import PlainTextResponse

                text = prometheus_text(self.stats, time.time())
                text += "\n".join(pools.prometheus_lines(await self.pool_rows())) + "\n"
                return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
            if route == ("POST", "/v1/completions"):
                return await self._complete("completion", request)
            if route == ("POST", "/v1/chat/completions"):
                return await self._complete("chat", request)
            raise api.ApiError(404, f"no route for {request.method} {request.url.path}",
                               code="not_found")
        except api.ApiError as e:
            return _json(e.body(), e.status)
        except Exception as e:
            if _replica_failed(e):
                log.warning("target replica failed: %s", e)
                return _json(_target_failed(e).body(), 503)
            log.exception("request failed")
            return _json(api.ApiError(500, "internal error; see the server log",
                                      type="server_error").body(), 500)

    async def pool_rows(self) -> list[dict]:
        """Replica counts per pool from Serve's status (cached for 2 s)."""
        at, rows = self._pools
        if time.monotonic() - at < 2.0:
            return rows
        from ray import serve

        try:
            app = serve.get_replica_context().app_name
            status = (await asyncio.to_thread(serve.status)).applications.get(app)
            deployments = {name: {getattr(s, "value", str(s)): n
                                  for s, n in d.replica_states.items()}
                           for name, d in (status.deployments.items() if status else ())}
        except Exception as e:  # the figures are for people; never fail a request
            log.warning("serve status unavailable: %s", e)
            deployments = {}
        rows = pools.replica_counts(deployments, self.bounds)
        self._pools = (time.monotonic(), rows)
        return rows

    def _authorize(self, request) -> None:
        # The dashboard page holds no figures (it asks for the key and sends
        # it with every /v1/spec/stats call), so it is public like /healthz.
        if self.api_key is None or request.url.path.rstrip("/") in ("/healthz", "/dashboard"):
            return
        if request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            raise api.ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                               type="authentication_error", code="invalid_api_key")

    async def _read_body(self, request) -> bytes:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_body:
            raise api.ApiError(413, f"request body over {self.max_body} bytes")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body:
                raise api.ApiError(413, f"request body over {self.max_body} bytes")
        return body

    def _prompt_ids(self, req) -> list[int]:
        if isinstance(req, api.ChatCompletionRequest):
            ids = self.tokenizer.apply_chat_template(
                req.message_dicts(), add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            return list(ids)
        return list(self.tokenizer(req.prompt)["input_ids"])

    def load(self) -> float:
        """Share of the target pool's sequence slots in use (0..1)."""
        return min(sum(self.inflight.values()) / self.capacity, 1.0)

    def step_cost(self) -> dict | None:
        """The target's measured decode step cost ({"fixed_s", "per_token_s", "steps"}
        from spec_totals; None until measured), as last fetched. A fetch older than
        COST_REFRESH_S starts a refresh in the background; this request does not wait."""
        at, cost = self._cost
        if (time.monotonic() - at >= COST_REFRESH_S
                and (self._cost_task is None or self._cost_task.done())):
            self._cost_task = asyncio.get_running_loop().create_task(self._refresh_cost())
        return cost

    async def _refresh_cost(self) -> None:
        cost = self._cost[1]
        try:
            totals = await asyncio.wait_for(self.target.spec_totals.remote(), 10)
            cost = totals.get("step_cost")
        except Exception as e:  # the K choice falls back to the last figures
            log.warning("target step cost unavailable: %s", e)
        self._cost = (time.monotonic(), cost)

    def choose_draft(self) -> policy.Choice:
        """Draft pool and K for the next request (the K controller), from measured
        acceptance, coverage and the target's measured step cost (modelled from
        load until the target has measured it)."""
        measured = self.step_cost()
        cost = (policy.StepCost(measured["fixed_s"], measured["per_token_s"])
                if measured is not None else None)
        # decode rows per target replica, this request included
        rows = (sum(self.inflight.values()) + 1) / self.target_replicas
        choice = self.controller.choose(self.stats.by_model, self.inflight, self.load(),
                                        cost, rows)
        self.stats.current_k.update(self.controller.current_k)
        return choice

    async def _complete(self, kind: str, request):
        raw = await self._read_body(request)
        req = api.parse_request(kind, raw, [self.model_name])
        prompt_ids = self._prompt_ids(req)
        max_tokens = api.effective_max_tokens(req, len(prompt_ids), self.max_model_len)
        api.check_context(len(prompt_ids), max_tokens, self.max_model_len)
        params = {"max_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p,
                  "seed": req.seed, "stop": req.stop, "ignore_eos": req.ignore_eos}
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        started = time.monotonic()
        choice = self.choose_draft()
        self.inflight[choice.pool] = self.inflight.get(choice.pool, 0) + 1
        streaming = False
        try:
            for attempt in range(1, TARGET_ATTEMPTS + 1):
                try:
                    # a fresh engine id per attempt: the dead replica's drafts may linger
                    response = await self._run(kind, req, rid, prompt_ids, params, choice,
                                               started, rid if attempt == 1 else f"{rid}-{attempt}")
                    break
                except Exception as e:  # nothing was sent to the client yet
                    if not _replica_failed(e) or attempt == TARGET_ATTEMPTS:
                        raise
                    log.warning("target replica failed before %s answered (%s); retrying",
                                rid, type(e).__name__)
            streaming = req.stream  # the SSE generator now holds the in-flight count
            return response
        finally:
            if not streaming:
                self.inflight[choice.pool] -= 1

    async def _run(self, kind, req, rid, prompt_ids, params, choice, started, engine_rid):
        stream = self.target.options(stream=True).generate.remote(
            engine_rid, prompt_ids, params, choice.pool, choice.k)
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            first = None
        except ValueError as e:  # the target refused the request as asked
            raise api.ApiError(400, str(e).splitlines()[-1][:500]) from None
        ttft = time.monotonic() - started
        if req.stream:
            return self._sse(kind, req, rid, len(prompt_ids), first, stream, started, ttft,
                             choice.pool)
        text, n, finish = "", 0, None
        chunk = first
        while chunk is not None:
            text += chunk["text"]
            n += len(chunk["token_ids"])
            finish = chunk["finish_reason"] or finish
            self._observe(chunk, started, ttft)
            chunk = await anext(stream, None)
        build = api.chat_response if kind == "chat" else api.completion_response
        return _json(build(rid, self.model_name, text, api.finish_reason(finish),
                           len(prompt_ids), n, int(time.time())))

    def _observe(self, chunk: dict, started: float, ttft: float) -> None:
        """Add a finished request (its last chunk carries the target's report) to the stats."""
        report = chunk.get("report")
        if report is None:
            return
        duration = time.monotonic() - started
        self.stats.record(RequestRecord(report, ttft_s=ttft, duration_s=duration,
                                        finished_at=time.time()))
        self.metrics.observe(report, ttft, duration)

    def _sse(self, kind, req, rid, prompt_tokens, first, stream, started, ttft, pool):
        created = int(time.time())

        def free():  # a client that went away frees the engine slot
            stream.cancel()
            self.inflight[pool] -= 1

        release = _Once(free)

        async def events():
            n, chunk, is_first = 0, first, True
            try:
                while chunk is not None:
                    n += len(chunk["token_ids"])
                    self._observe(chunk, started, ttft)
                    reason = api.finish_reason(chunk["finish_reason"])
                    if kind == "chat":
                        body = api.chat_chunk(rid, self.model_name, chunk["text"], reason,
                                              created, first=is_first)
                    else:
                        body = api.completion_chunk(rid, self.model_name, chunk["text"],
                                                    reason, created)
                    is_first = False
                    yield api.sse(body)
                    chunk = await anext(stream, None)
                if req.include_usage:
                    yield api.sse(api.usage_chunk(rid, self.model_name, prompt_tokens, n,
                                                  created, kind=kind))
                yield api.SSE_DONE
            except Exception as e:  # the target failed mid-stream: say so, then end
                log.warning("stream %s failed: %s", rid, e)
                err = (_target_failed(e) if _replica_failed(e) else
                       api.ApiError(500, f"generation failed: {e}", type="server_error"))
                yield "data: " + json.dumps(err.body()) + "\n\n"
                yield api.SSE_DONE
            finally:
                release()

        return _streaming_response(events(), release)
