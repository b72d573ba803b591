"""Router: the HTTP ingress in front of the target and draft pools.

A plain class; `deployments.app.build_app` makes it the Serve ingress. It owns
the edge and nothing of the OpenAI protocol: authentication, the body-size
limit, the choice of draft pool and K for each request (`deployments.choice`),
forwarding the request as it came to a target replica (which answers with
vLLM's own OpenAI server, `deployments.target.TargetServer.http`) and passing
its response (JSON or SSE) back, and feeding the acceptance record with the
per-sequence records the target sends after the body. /healthz is 200 only
when a target replica can serve. The ops views (/v1/spec/stats, /metrics,
/dashboard) are `deployments.ops`'s. Router errors have OpenAI-style bodies;
nothing here can crash the app.

The request path, numbered as below in `_forward`:
  1. read the body (at most http.max_body_bytes; a larger one is drained, up
     to a bound, and answered 413 so the client can read the answer);
  2. choose the draft pool and K (generation routes only);
  3. call a target replica (retried once if the replica died before answering;
     a 429 when the target pool's queue is full, quotas.max_queued_requests);
  4. pass the response back; the records after the body go to the ops views;
     the in-flight slot is released once, however the response ends.
Steps 3 and 4 end by quotas.request_timeout_s: a 504, or an error event once
a stream has started; the target call is cancelled, so its engine request is
aborted.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging

from specserve.acceptance.outcomes import route_label
from specserve.acceptance.stats import SpecStats
from specserve.config import AppConfig
from specserve.openai_api import ApiError, TargetUnavailable

from deployments import replica_name
from deployments.choice import DraftChoice
from deployments.ops import OpsViews, ServeMetrics, dashboard_page

log = logging.getLogger("specserve.router")

# A request whose target replica dies before anything reached the client is
# run again (Serve routes it to a live replica, or waits for the restarted one).
TARGET_ATTEMPTS = 2

# A replica whose engine died answers TargetUnavailable for about a second
# before it ends (deployments/target.py DEAD_GRACE_S); the retry waits until it
# is gone, so that Serve sends it to another replica (or holds it for the new one).
DEAD_ENGINE_RETRY_S = 2.0

# The status of a request whose client left before its body arrived (nginx's
# 499): nobody reads it, but it is counted, and as an abort.
CLIENT_CLOSED = 499

# /healthz waits this long for a target replica to say its engine is up.
HEALTH_WAIT_S = 5.0

# Routes answered by the target replica's vLLM server; True: generation (drafts).
FORWARDED = {
    ("POST", "/v1/completions"): True,
    ("POST", "/v1/chat/completions"): True,
    ("POST", "/tokenize"): False,
    ("POST", "/detokenize"): False,
    ("GET", "/v1/models"): False,
}

# Request headers that describe this hop, not the request.
_HOP_HEADERS = {"host", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
                "proxy-authorization", "authorization", "content-length"}
_HOP_RESPONSE_HEADERS = {"content-length", "transfer-encoding", "connection", "date", "server"}
# The last event of an OpenAI stream.
_DONE = b"data: [DONE]\n\n"


def _engine_dead(e: BaseException) -> bool:
    """The replica serving a call is alive but its engine is dead."""
    # Ray re-raises a replica's exception as a RayTaskError that is also an
    # instance of the original class; `cause` covers a plain RayTaskError.
    return isinstance(e, TargetUnavailable) or isinstance(getattr(e, "cause", None),
                                                          TargetUnavailable)


def _replica_failed(e: BaseException) -> bool:
    """The replica serving a call died, became unreachable, or has a dead engine
    (not a bad request)."""
    from ray.exceptions import RayActorError

    return isinstance(e, RayActorError) or _engine_dead(e)


def _queue_full(e: BaseException) -> ApiError:
    return ApiError(429, f"the target pool is busy and its queue is full ({e}); retry "
                         "after a moment (quotas.max_queued_requests)",
                    type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})


def _timed_out(timeout_s: float) -> ApiError:
    return ApiError(504, f"the request took longer than {timeout_s:g} s and was stopped "
                         "(quotas.request_timeout_s)", type="server_error", code="timeout")


async def _next(stream, deadline: float | None):
    """The stream's next item; TimeoutError once the loop's clock passes
    `deadline` (None: no limit), StopAsyncIteration at its end."""
    # (asyncio.timeout_at schedules one timer and no task: this runs for
    # every chunk of every stream.)
    async with asyncio.timeout_at(deadline):
        return await stream.__anext__()


def _target_failed(e: BaseException) -> ApiError:
    return ApiError(503, "the target replica serving this request failed "
                         f"({type(e).__name__}); retry the request",
                    type="server_error", code="target_unavailable")


def _openai_error_shape(body: bytes, status: int) -> bytes:
    """An error body in OpenAI's shape. vLLM's server answers almost every error
    so, but a few come from the web framework as {"detail": ...} (a body that
    is not UTF-8, for one); those are rewrapped, the rest pass unchanged."""
    if status < 400:
        return body
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return body
    detail = data.get("detail") if isinstance(data, dict) else None
    message = detail if isinstance(detail, str) else body.decode("utf-8", "replace")[:500]
    return json.dumps(ApiError(status, message or f"HTTP {status}",
                               type="invalid_request_error" if status < 500
                               else "server_error").body()).encode()


class _Once:
    """Calls fn the first time it is called, never again."""

    def __init__(self, fn):
        self._fn = fn

    def __call__(self):
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


def _bounds(config: AppConfig) -> dict[str, tuple[int, int]]:
    """(min, max) replicas of every pool, for the ops views."""
    t = config.target
    return {"target": (t.replicas.min_replicas, t.replicas.max_replicas),
            **{d.name: (d.replicas.min_replicas, d.replicas.max_replicas)
               for d in config.drafts}}


def _json(body: dict, status: int = 200, headers: dict | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse(body, status_code=status, headers=headers)


def streaming_response(events, release, status: int = 200, headers: dict | None = None):
    """Streaming response that runs `release` once, however the stream ends.

    The events generator's own `finally` is not enough: when the client goes
    away before the body starts, Starlette cancels the response before it ever
    iterates the generator, and a generator that never started never runs its
    `finally`. So `release` also runs when the response's ASGI call ends, and,
    should the response never be called at all (the request was cancelled
    between returning it and sending it), when the response is collected."""
    import weakref

    from starlette.responses import StreamingResponse

    class _Response(StreamingResponse):
        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                release()

    response = _Response(events, status_code=status, headers=headers)
    loop = asyncio.get_running_loop()

    def collected():  # may run on any thread: hand over to the router's loop
        if not loop.is_closed():
            loop.call_soon_threadsafe(release)

    weakref.finalize(response, collected)
    return response


def bearer_matches(header: str, keys: tuple[str, ...]) -> bool:
    """Whether an Authorization header is "Bearer K" for one of keys. Every
    key is compared, each in constant time (hmac.compare_digest), so the time
    taken tells nothing about how much of a key was right."""
    given = header.encode()
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, f"Bearer {key}".encode())
    return found


def keys_for(path: str, api_keys: tuple[str, ...],
             metrics_keys: tuple[str, ...]) -> tuple[str, ...]:
    """The keys a request to `path` must bear one of (empty: none needed).
    /healthz and /dashboard are public (the page holds no figures: it asks for
    the key and sends it with every /v1/spec/stats call). /metrics takes its
    own scrape keys when there are any, and then only them: a scraper's
    credential opens nothing else and a client's API key does not read the
    fleet's figures; without scrape keys it goes with the API keys."""
    path = path.rstrip("/")
    if path in ("/healthz", "/dashboard"):
        return ()
    if path == "/metrics" and metrics_keys:
        return metrics_keys
    return api_keys


class Router:
    def __init__(self, config: dict, target, draft_names: list[str],
                 serve_metrics: bool = True, ledger=None):
        """target: the target deployment's handle; serve_metrics: also export
        the figures as Ray Serve metrics (needs Ray); ledger: the ledger
        deployment's handle (deployments.ledger; None: this router's figures
        only)."""
        self.config = AppConfig.model_validate(config)
        self.target = target
        self.api_keys = self.config.http.api_keys()  # api_key_env: from a Secret
        self.metrics_keys = self.config.http.metrics_keys()
        self.max_body = self.config.http.max_body_bytes
        self.timeout_s = self.config.quotas.request_timeout_s
        self.stats = SpecStats(self.config.speculation.num_speculative_tokens)
        self.choice = DraftChoice(self.config, target, draft_names, self.stats)
        kinds = self.config.draft_kinds()
        self.ops = OpsViews(self.stats, self.choice, target, _bounds(self.config), kinds,
                            metrics=ServeMetrics(kinds) if serve_metrics else None,
                            ledger=ledger, router=replica_name(),
                            adapting={d.name for d in self.config.drafts if d.adapt.enabled})

    def reconfigure(self, live: dict) -> None:
        """The live settings (`specserve.config.live`: K, the K controller's
        thresholds, quotas, replica bounds), from Serve's user_config: at start
        and whenever the Serve config changes them. What was measured is kept."""
        from specserve.config.live import with_live

        self.config = with_live(self.config, live)
        self.timeout_s = self.config.quotas.request_timeout_s
        self.stats.k = self.config.speculation.num_speculative_tokens
        self.choice.configure(self.config)
        self.ops.bounds = _bounds(self.config)
        log.info("router settings: K=%d, request timeout %s s", self.stats.k, self.timeout_s)

    async def __call__(self, request):
        """Every request's outcome is counted (specserve.acceptance.outcomes):
        its status, and its end (a streamed one ends when its stream does)."""
        from starlette.responses import StreamingResponse

        route = route_label(request.url.path)
        self.ops.start_flushing()
        outcomes = self.ops.outcomes
        outcomes.started(route)
        try:
            response = await self._answer(request, route)
        except BaseException:  # cancelled: the client went away
            outcomes.ended(route, aborted=True)
            raise
        outcomes.responded(route, response.status_code)
        if not isinstance(response, StreamingResponse):
            outcomes.ended(route, aborted=response.status_code == CLIENT_CLOSED)
        return response

    async def _answer(self, request, label: str):
        try:
            self._authorize(request)
            route = (request.method, request.url.path.rstrip("/") or "/")
            if route == ("GET", "/healthz"):
                return await self._health()
            if route == ("GET", "/dashboard"):
                return dashboard_page()
            if route == ("GET", "/v1/spec/stats"):
                return _json(await self.ops.stats_json())
            if route == ("GET", "/metrics"):
                from starlette.responses import PlainTextResponse

                return PlainTextResponse(await self.ops.metrics_text(),
                                         media_type="text/plain; version=0.0.4")
            if route in FORWARDED:
                return await self._forward(request, label, generates=FORWARDED[route])
            raise ApiError(404, f"no route for {request.method} {request.url.path}",
                           code="not_found")
        except ApiError as e:
            headers = dict(e.headers or {})
            if e.status == 413:
                headers["Connection"] = "close"
            return _json(e.body(), e.status, headers or None)
        except Exception as e:
            if _replica_failed(e):
                log.warning("target replica failed: %s", e)
                return _json(_target_failed(e).body(), 503)
            log.exception("request failed")
            return _json(ApiError(500, "internal error; see the server log",
                                  type="server_error").body(), 500)

    def _authorize(self, request) -> None:
        keys = keys_for(request.url.path, self.api_keys, self.metrics_keys)
        if keys and not bearer_matches(request.headers.get("authorization", ""), keys):
            what = "metrics key" if keys is self.metrics_keys else "API key"
            raise ApiError(401, f"missing or wrong {what}: send 'Authorization: Bearer KEY'",
                           type="authentication_error", code="invalid_api_key")

    async def _health(self):
        """200 once a target replica's engine answers; 503 (with why) until then.
        A full target queue (quotas.max_queued_requests) is 200 "busy": the
        replicas are up, and a readiness probe that took every router out of
        its Service while they are busy would turn load into an outage."""
        from ray.serve.exceptions import BackPressureError

        try:
            await asyncio.wait_for(self.target.ready.remote(), HEALTH_WAIT_S)
        except BackPressureError:
            return _json({"status": "busy"})
        except Exception as e:
            why = ("no target replica answered within "
                   f"{HEALTH_WAIT_S:g} s" if isinstance(e, asyncio.TimeoutError)
                   else f"the target replica is not ready ({type(e).__name__})")
            return _json(ApiError(503, why, type="server_error",
                                  code="target_unavailable").body(), 503)
        return _json({"status": "ok"})

    async def _read_body(self, request) -> bytes:
        """The body, at most max_body bytes. A larger one is read on (and
        dropped) up to 4x the limit, so the client has sent it all and reads
        the 413 (a server that answers mid-upload makes many clients see a
        reset connection instead); past that the connection is closed."""
        from starlette.requests import ClientDisconnect

        declared = request.headers.get("content-length")
        too_big = declared is not None and declared.isdigit() and int(declared) > self.max_body
        body, seen = bytearray(), 0
        try:
            async for chunk in request.stream():
                seen += len(chunk)
                if seen > self.max_body:
                    too_big = True
                if too_big:
                    body.clear()
                    if seen > 4 * self.max_body:
                        break
                else:
                    body += chunk
        except ClientDisconnect:  # nobody reads the answer: counted, not logged as a fault
            raise ApiError(CLIENT_CLOSED, "the client closed the connection before its body arrived",
                           code="client_closed") from None
        if too_big:
            raise ApiError(413, f"request body over {self.max_body} bytes "
                                f"(http.max_body_bytes)", code="request_too_large")
        return bytes(body)

    async def _forward(self, request, label: str, generates: bool):
        timeout = self.timeout_s
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        body = await self._read_body(request)  # 1.
        choice = None
        pool, k = None, 0
        if generates:  # 2.
            choice = self.choice.choose(self.ops.pool_waits())
            pool, k = choice.pool, choice.k
        headers = [(key, v) for key, v in request.headers.items() if key not in _HOP_HEADERS]
        self.choice.acquire(pool)
        release = _Once(lambda: self.choice.release(pool))
        try:
            stream, start = await self._call_target(  # 3.
                request.method, request.url.path, request.url.query, headers, body, pool, k,
                deadline)
        except asyncio.TimeoutError:
            release()
            raise _timed_out(timeout) from None
        except BaseException:
            release()
            raise
        return await self._respond(stream, start, release, label, deadline)  # 4.

    async def _call_target(self, method, path, query, headers, body, pool, k, deadline):
        from ray.serve.exceptions import BackPressureError

        for attempt in range(1, TARGET_ATTEMPTS + 1):
            stream = self.target.options(stream=True).http.remote(
                method, path, query, headers, body, pool, k)
            try:
                return stream, await _next(stream, deadline)
            except Exception as e:  # nothing was sent to the client yet
                if isinstance(e, BackPressureError):  # never assigned (and cancel()
                    raise _queue_full(e) from None    # would raise it again)
                stream.cancel()
                if not _replica_failed(e) or attempt == TARGET_ATTEMPTS:
                    raise
                log.warning("target replica failed before answering %s (%s); retrying",
                            path, type(e).__name__)
                if _engine_dead(e):
                    await asyncio.sleep(DEAD_ENGINE_RETRY_S)

    def _take_records(self, item) -> bool:
        """An item after the body: the target's records of finished sequences
        and its replica's figures."""
        if isinstance(item, dict) and "records" in item:
            for r in item["records"]:
                self.ops.record(r)
            if item.get("report") is not None:
                self.ops.replica_report(item["report"])
            return True
        return False

    async def _respond(self, stream, start: dict, release, label: str,
                       deadline: float | None):
        status = start["status"]
        headers = {key: v for key, v in start["headers"]
                   if key.lower() not in _HOP_RESPONSE_HEADERS}
        sse = headers.get("content-type", "").startswith("text/event-stream")
        if not sse:  # JSON: read it all, answer with a plain response
            from starlette.responses import Response

            try:
                body = bytearray()
                while True:
                    try:
                        item = await _next(stream, deadline)
                    except StopAsyncIteration:
                        break
                    if not self._take_records(item):
                        body += item
            except asyncio.TimeoutError:
                err = _timed_out(self.timeout_s)
                return _json(err.body(), err.status)
            finally:
                stream.cancel()
                release()
            return Response(_openai_error_shape(bytes(body), status), status_code=status,
                            headers=headers)

        finished = False  # the stream reached its end (else the client left)

        def free():  # a client that went away frees the engine slot
            stream.cancel()
            release()
            self.ops.outcomes.ended(label, aborted=not finished)

        once = _Once(free)

        async def events():
            nonlocal finished
            # The records come after the body; a client may hang up as soon as
            # it reads [DONE] (openai's does), which would cancel this before
            # they are taken: [DONE] is passed on once the target's stream ends.
            done = None
            try:
                while True:
                    try:
                        item = await _next(stream, deadline)
                    except StopAsyncIteration:
                        break
                    if self._take_records(item):
                        continue
                    if isinstance(item, bytes) and item.endswith(_DONE):
                        done = item
                    else:
                        yield item
                finished = True
                if done is not None:
                    yield done
            except Exception as e:  # the target failed or took too long: say so, then end
                finished = True
                if done is not None:  # the body was whole; only its records are lost
                    log.warning("no records after a finished stream: %r", e)
                    yield done
                    return
                self.ops.outcomes.stream_failed(label)
                log.warning("stream failed: %r", e)
                err = (_timed_out(self.timeout_s) if isinstance(e, asyncio.TimeoutError) else
                       _target_failed(e) if _replica_failed(e) else
                       ApiError(500, f"generation failed: {e}", type="server_error"))
                yield ("data: " + json.dumps(err.body()) + "\n\n").encode()
                yield _DONE
            finally:
                once()

        return streaming_response(events(), once, status, headers)
