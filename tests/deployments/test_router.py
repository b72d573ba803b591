"""The router's ingress (deployments/router.py) with a stand-in target handle: no
Ray, no engine. It forwards the body as it came and passes the target's answer
back (JSON and SSE), feeds the records to the acceptance picture, refuses what
is its own to refuse (401, 404 route, readable 413), says healthy only when a
target replica answers, retries once on a dead replica, and its ops views
answer at once while no target replica is up. Several routers show the same
figures from the ledger, through a router's and the ledger's restarts."""

import asyncio
import json
import logging

import pytest

from deployments.router import HEALTH_WAIT_S, Router
from fake_target import (FakeLedger, FakeRemote, FakeStream, FakeTarget, json_answer,
                         replica_report, sse_answer)
from specserve.acceptance.record import Acceptance, TargetReport
from specserve.acceptance.stats import RequestRecord
from specserve.openai_api import ApiError

CONFIG = {"target": {"model": "/nonexistent", "name": "tiny"},
          "drafts": [{"name": "same", "model": "/nonexistent"}],
          "speculation": {"num_speculative_tokens": 4},
          "http": {"max_body_bytes": 1000}}


def router(target, quotas=None, **http):
    config = json.loads(json.dumps(CONFIG))
    config["http"].update(http)
    config["quotas"] = quotas or {}
    return Router(config, target, ["same"], serve_metrics=False)


def record():
    return RequestRecord(
        TargetReport("t0", "same", "d0", Acceptance(k=4, output_tokens=10, draft_tokens=8,
                                                    accepted_histogram=(0, 0, 2, 0, 0))),
        ttft_s=0.1, duration_s=1.0, finished_at=0.0)


def request(method, path, body=b"", headers=None, chunks=None, disconnect=False):
    from starlette.requests import Request

    parts = list(chunks) if chunks is not None else [body]
    hdrs = {"content-type": "application/json", **(headers or {})}
    if chunks is None:
        hdrs["content-length"] = str(len(body))
    scope = {"type": "http", "method": method, "path": path, "query_string": b"",
             "headers": [(k.encode(), v.encode()) for k, v in hdrs.items()],
             "server": ("x", 80), "scheme": "http", "root_path": ""}
    read = []

    async def receive():
        if parts:
            chunk = parts.pop(0)
            read.append(len(chunk))
            return {"type": "http.request", "body": chunk, "more_body": bool(parts) or disconnect}
        if disconnect:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)

    req = Request(scope, receive)
    req.read_sizes = read
    return req


async def answer(r, req):
    """(status, headers, body bytes) of the router's response, sent over ASGI."""
    response = await r(req)
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        await asyncio.sleep(3600)

    await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict((k.decode(), v.decode()) for k, v in start["headers"]), body


def test_a_json_answer_is_passed_back_and_its_records_counted():
    async def go():
        reply = b'{"choices": [{"text": "hi"}]}'
        target = FakeTarget([FakeStream(json_answer(reply, records=[record(), record()]))])
        r = router(target)
        body = b'{"model": "tiny", "prompt": "x", "logprobs": 2, "whatever": [1]}'
        status, headers, got = await answer(r, request("POST", "/v1/completions", body))
        assert status == 200 and got == reply and headers["content-type"] == "application/json"
        method, path, _, fwd_headers, fwd_body, pool, k = target.calls[0]
        # the body goes on untouched, with the chosen pool and K
        assert (method, path, fwd_body) == ("POST", "/v1/completions", body)
        assert pool == "same" and k == 4
        assert ("content-type", "application/json") in fwd_headers
        assert r.stats.by_model["same"].requests == 2
        assert r.choice.inflight == {"same": 0}

    asyncio.run(go())


def test_an_sse_answer_streams_through_and_releases_once():
    async def go():
        events = [b'data: {"a": 1}\n\n', b"data: [DONE]\n\n"]
        stream = FakeStream(sse_answer(events, records=[record()]))
        r = router(FakeTarget([stream]))
        status, headers, got = await answer(
            r, request("POST", "/v1/chat/completions", b'{"stream": true}'))
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        assert got == b"".join(events)
        assert r.stats.by_model["same"].requests == 1
        assert r.choice.inflight == {"same": 0} and stream.cancelled == 1

    asyncio.run(go())


def test_errors_of_the_target_pass_through_with_their_status():
    async def go():
        err = b'{"error": {"message": "The model `x` does not exist.", "code": 404}}'
        r = router(FakeTarget([FakeStream(json_answer(err, status=404))]))
        status, _, got = await answer(r, request("POST", "/v1/completions", b'{"model": "x"}'))
        assert status == 404 and got == err

    asyncio.run(go())


def test_tokenize_and_models_are_forwarded_without_drafts():
    async def go():
        target = FakeTarget([FakeStream(json_answer(b'{"tokens": [1]}')),
                             FakeStream(json_answer(b'{"data": []}'))])
        r = router(target)
        await answer(r, request("POST", "/tokenize", b'{"prompt": "a"}'))
        await answer(r, request("GET", "/v1/models"))
        assert [(c[1], c[5], c[6]) for c in target.calls] == [
            ("/tokenize", None, 0), ("/v1/models", None, 0)]

    asyncio.run(go())


def test_a_body_over_the_limit_is_read_and_answered_413():
    async def go():
        r = router(FakeTarget())
        chunks = [b"x" * 600] * 4  # 2400 bytes, limit 1000, no content-length
        req = request("POST", "/v1/completions", chunks=chunks)
        status, headers, got = await answer(r, req)
        assert status == 413 and "body over 1000 bytes" in json.loads(got)["error"]["message"]
        assert sum(req.read_sizes) == 2400  # drained: the client has sent it all
        assert headers.get("connection") == "close"
        # a declared length over the limit, too
        big = request("POST", "/v1/completions", b"y" * 1001)
        assert (await answer(r, big))[0] == 413
        assert r.choice.inflight == {}

    asyncio.run(go())


def test_a_client_that_leaves_mid_body_is_counted_as_an_abort_not_a_fault(caplog):
    """The connection closes after part of the body: no target call, no 500 and
    no traceback in the log; the outcome counters show a 499 and an abort."""
    async def go():
        target = FakeTarget()
        r = router(target)
        r.ops._serve_status = lambda: {}
        req = request("POST", "/v1/completions", chunks=[b'{"prompt": '], disconnect=True)
        status, _, got = await answer(r, req)
        assert status == 499 and json.loads(got)["error"]["code"] == "client_closed"
        assert target.calls == [] and r.choice.inflight == {}
        _, _, text = await answer(r, request("GET", "/metrics"))
        return text.decode()

    with caplog.at_level(logging.WARNING):
        text = asyncio.run(go())
    assert 'specserve_http_responses_total{route="/v1/completions",status="499"} 1' in text
    assert 'specserve_http_aborts_total{route="/v1/completions"} 1' in text
    assert not [r for r in caplog.records if r.exc_info], caplog.text


def test_api_key_and_unknown_routes():
    async def go():
        r = router(FakeTarget(), api_key="sesame")
        status, _, got = await answer(r, request("POST", "/v1/completions", b"{}"))
        assert status == 401 and json.loads(got)["error"]["type"] == "authentication_error"
        status, _, got = await answer(r, request("GET", "/nope",
                                                 headers={"authorization": "Bearer sesame"}))
        assert status == 404 and json.loads(got)["error"]["code"] == "not_found"

    asyncio.run(go())


def test_any_of_several_keys_is_accepted_in_constant_time(monkeypatch):
    from deployments.router import bearer_matches

    monkeypatch.setenv("SPECSERVE_ROUTER_TEST_KEYS", "old-key,new-key")

    async def go():
        r = router(FakeTarget(), api_key_env="SPECSERVE_ROUTER_TEST_KEYS")
        for header, status in (("Bearer old-key", 404), ("Bearer new-key", 404),
                               ("Bearer old-keyX", 401), ("Bearer ", 401), ("", 401),
                               ("Bearer old-key,new-key", 401), ("Bearer nëw", 401)):
            got, _, _ = await answer(r, request("GET", "/nope",
                                                headers={"authorization": header}))
            assert got == status, header

    asyncio.run(go())
    compared = []
    monkeypatch.setattr("deployments.router.hmac.compare_digest",
                        lambda a, b: compared.append(b) or a == b)
    assert bearer_matches("Bearer a", ("a", "b", "c"))
    assert compared == [b"Bearer a", b"Bearer b", b"Bearer c"]  # no early exit


@pytest.mark.parametrize("api_key", [None, "sesame"])
def test_metrics_takes_its_own_scrape_key_and_only_it(monkeypatch, api_key):
    """http.metrics_key_env: /metrics refuses without the scrape key and
    serves with it; an API key does not open it, nor the scrape key the API."""
    from deployments.router import keys_for

    monkeypatch.setattr("deployments.ops.REMOTE_WAIT_S", 0.05)
    monkeypatch.setenv("SPECSERVE_ROUTER_TEST_METRICS", "scrape-1 scrape-2")

    async def go():
        target = FakeTarget()
        target.spec_totals.hang = target.draft_active.hang = target.metrics_report.hang = True
        r = router(target, api_key=api_key, metrics_key_env="SPECSERVE_ROUTER_TEST_METRICS")
        for header, status in (("", 401), ("Bearer sesame", 401), ("Bearer scrape-1", 200),
                               ("Bearer scrape-2", 200), ("Bearer scrape-", 401)):
            got, _, text = await asyncio.wait_for(answer(r, request(
                "GET", "/metrics", headers={"authorization": header})), 5)
            assert got == status, header
            if status == 200:
                assert b"specserve_" in text
            else:
                assert b"metrics key" in text
        # The scrape key opens nothing else (404: past authorization).
        got, _, _ = await answer(r, request("GET", "/nope",
                                            headers={"authorization": "Bearer scrape-1"}))
        assert got == (401 if api_key else 404)
        got, _, _ = await answer(r, request("GET", "/nope",
                                            headers={"authorization": f"Bearer {api_key}"}))
        assert got == 404

    asyncio.run(go())
    # Without scrape keys /metrics goes with the API keys, as before.
    assert keys_for("/metrics/", ("k",), ()) == ("k",)
    assert keys_for("/healthz", ("k",), ("m",)) == ()
    monkeypatch.delenv("SPECSERVE_ROUTER_TEST_METRICS")
    with pytest.raises(Exception, match="metrics_key_env: the environment variable"):
        router(FakeTarget(), metrics_key_env="SPECSERVE_ROUTER_TEST_METRICS")


def test_healthz_needs_a_target_replica_that_answers(monkeypatch):
    from ray.serve.exceptions import BackPressureError

    monkeypatch.setattr("deployments.router.HEALTH_WAIT_S", 0.05)

    async def go():
        status, _, got = await answer(router(FakeTarget(ready=False)),
                                      request("GET", "/healthz"))
        assert status == 503 and json.loads(got)["error"]["code"] == "target_unavailable"
        status, _, got = await answer(router(FakeTarget()), request("GET", "/healthz"))
        assert status == 200 and json.loads(got) == {"status": "ok"}
        busy = FakeTarget()  # its queue is full (quotas.max_queued_requests)
        busy.ready = FakeRemote(error=BackPressureError(num_queued_requests=1,
                                                        max_queued_requests=1))
        status, _, got = await answer(router(busy), request("GET", "/healthz"))
        assert status == 200 and json.loads(got) == {"status": "busy"}

    asyncio.run(go())
    assert HEALTH_WAIT_S > 0.05  # the real wait is longer


def test_ops_views_answer_at_once_without_a_target_replica(monkeypatch):
    monkeypatch.setattr("deployments.ops.REMOTE_WAIT_S", 0.05)

    async def go():
        target = FakeTarget(ready=False)
        target.spec_totals.hang = target.draft_active.hang = target.metrics_report.hang = True
        r = router(target)
        r.ops._serve_status = lambda: {}  # no Ray here: Serve's status and the
        r.ops._decisions = target.spec_totals.remote  # autoscaler are stand-ins (hanging)
        status, _, got = await asyncio.wait_for(answer(r, request("GET", "/v1/spec/stats")), 5)
        snap = json.loads(got)
        assert status == 200 and snap["target_engine"].startswith("unavailable")
        assert snap["router_inflight"] == 0
        status, _, text = await asyncio.wait_for(answer(r, request("GET", "/metrics")), 5)
        assert status == 200 and b"specserve_" in text

    asyncio.run(go())


def test_each_adapting_pool_row_carries_its_replicas_adapt_figures():
    """/v1/spec/stats: a pool with adapt on shows what a replica of it
    answered (through a target replica), one with adapt off shows null, and
    the target replica is not asked at all when no pool adapts."""
    config = {**json.loads(json.dumps(CONFIG)),
              "drafts": [{"name": "same", "model": "/nonexistent", "adapt": {"enabled": True}},
                         {"name": "plain", "model": "/nonexistent"}]}
    figures = {"version": "v0", "heldout_alpha_serving": None,
               "heldout_alpha_candidate": None, "buffer_tokens": 120, "heldout_tokens": 30,
               "swaps": 0, "rollbacks": 0}

    async def go(cfg, names):
        target = FakeTarget()
        target.draft_adapt = FakeRemote({"same": figures, "plain": None})
        r = Router(cfg, target, names, serve_metrics=False)
        r.ops._serve_status = lambda: {}
        r.ops._decisions = FakeRemote([]).remote
        _, _, stats = await answer(r, request("GET", "/v1/spec/stats"))
        _, _, text = await answer(r, request("GET", "/metrics"))
        return json.loads(stats), target.draft_adapt.calls, text.decode()

    snap, calls, text = asyncio.run(go(config, ["same", "plain"]))
    rows = {row["pool"]: row for row in snap["pools"]}
    assert rows["same"]["adapt"] == figures and calls == 2  # the stats, then /metrics
    assert rows["plain"]["adapt"] is None and "adapt" not in rows["target"]
    # /metrics: the same figures (no sample for an alpha not measured yet)
    assert 'specserve_adapt_buffer_tokens{pool="same",kind="model"} 120' in text
    assert 'specserve_adapt_version_info{pool="same",kind="model",version="v0"} 1' in text
    assert 'specserve_adapt_swaps_total{pool="same",kind="model"} 0' in text
    adapt = [line for line in text.splitlines() if line.startswith("specserve_adapt")]
    assert not any("alpha" in line or 'pool="plain"' in line for line in adapt)
    snap, calls, text = asyncio.run(go(json.loads(json.dumps(CONFIG)), ["same"]))
    assert [row.get("adapt") for row in snap["pools"]] == [None, None] and calls == 0
    assert "specserve_adapt" not in text


def test_a_dead_replica_before_the_answer_is_retried_once():
    from ray.exceptions import RayActorError

    async def go():
        dead = FakeStream([], error=RayActorError())
        target = FakeTarget([dead, FakeStream(json_answer(b'{"ok": 1}'))])
        r = router(target)
        status, _, got = await answer(r, request("POST", "/v1/completions", b"{}"))
        assert status == 200 and got == b'{"ok": 1}' and len(target.calls) == 2
        both_dead = FakeTarget([FakeStream([], error=RayActorError()),
                                FakeStream([], error=RayActorError())])
        r = router(both_dead)
        status, _, got = await answer(r, request("POST", "/v1/completions", b"{}"))
        assert status == 503 and json.loads(got)["error"]["code"] == "target_unavailable"
        assert r.choice.inflight == {"same": 0}

    asyncio.run(go())


def dead_engine():
    """TargetUnavailable as Ray hands it to the router: a RayTaskError that is
    also an instance of the replica's exception."""
    from ray.exceptions import RayTaskError

    from specserve.openai_api import TargetUnavailable

    return RayTaskError("http", "Traceback ...", TargetUnavailable("engine dead")
                        ).as_instanceof_cause()


def test_a_dead_engine_is_a_failed_replica_retried_or_503_never_a_500(monkeypatch):
    import deployments.router

    monkeypatch.setattr(deployments.router, "DEAD_ENGINE_RETRY_S", 0.0)

    async def go():
        # Before the answer: retried (on another replica, or the restarted one).
        target = FakeTarget([FakeStream([], error=dead_engine()),
                             FakeStream(json_answer(b'{"ok": 1}'))])
        r = router(target)
        status, _, got = await answer(r, request("POST", "/v1/completions", b"{}"))
        assert status == 200 and got == b'{"ok": 1}' and len(target.calls) == 2
        # Mid-stream: the stream ends with the target_unavailable error event.
        start = sse_answer([b'data: {"a": 1}\n\n'], records=[record()])[0]
        stream = FakeStream([start, b'data: {"a": 1}\n\n'], then=dead_engine())
        r = router(FakeTarget([stream]))
        status, _, got = await answer(
            r, request("POST", "/v1/chat/completions", b'{"stream": true}'))
        events = got.decode().split("\n\n")
        assert status == 200 and events[0] == 'data: {"a": 1}', events
        assert json.loads(events[1][len("data: "):])["error"]["code"] == "target_unavailable"
        assert events[2] == "data: [DONE]" and r.choice.inflight == {"same": 0}

    asyncio.run(go())


def test_error_body_shape():
    e = ApiError(401, "bad key", type="authentication_error", code="invalid_api_key")
    assert e.body() == {"error": {"message": "bad key", "type": "authentication_error",
                                  "param": None, "code": "invalid_api_key"}}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_generation_routes_get_a_draft_choice(path):
    async def go():
        target = FakeTarget([FakeStream(json_answer(b"{}"))])
        r = router(target)
        await answer(r, request("POST", path, b"{}"))
        assert r.choice.last_choice is not None and target.calls[0][5] == "same"

    asyncio.run(go())


def test_an_error_body_not_in_openais_shape_is_rewrapped():
    async def go():
        detail = b'{"detail": "There was an error parsing the body"}'
        ok = b'{"error": {"message": "m", "type": "t", "param": null, "code": 400}}'
        r = router(FakeTarget([FakeStream(json_answer(detail, status=400)),
                               FakeStream(json_answer(ok, status=400))]))
        status, _, got = await answer(r, request("POST", "/v1/completions", b"\x00\x00"))
        assert status == 400 and json.loads(got)["error"]["message"] == (
            "There was an error parsing the body")
        status, _, got = await answer(r, request("POST", "/v1/completions", b"{}"))
        assert got == ok  # vLLM's own error bodies pass unchanged

    asyncio.run(go())


def test_a_full_target_queue_is_a_429_with_retry_after_and_the_next_request_is_served():
    from ray.serve.exceptions import BackPressureError

    async def go():
        full = FakeStream([], error=BackPressureError(num_queued_requests=2,
                                                      max_queued_requests=2))
        target = FakeTarget([full, FakeStream(json_answer(b'{"ok": 1}'))])
        r = router(target)
        status, headers, got = await answer(r, request("POST", "/v1/completions", b"{}"))
        err = json.loads(got)["error"]
        assert status == 429 and headers["retry-after"] == "1"
        assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
        assert "quotas.max_queued_requests" in err["message"]
        assert len(target.calls) == 1  # not retried
        status, _, got = await answer(r, request("POST", "/v1/completions", b"{}"))
        assert (status, got) == (200, b'{"ok": 1}')
        assert r.choice.inflight == {"same": 0}

    asyncio.run(go())


@pytest.mark.parametrize("hang_after", [0, 1])  # before the answer starts, or after
def test_a_json_request_past_the_timeout_gets_504_and_its_target_call_is_cancelled(hang_after):
    async def go():
        slow = FakeStream(json_answer(b'{"choices": []}'), hang_after=hang_after)
        r = router(FakeTarget([slow]), quotas={"request_timeout_s": 0.2})
        status, _, got = await answer(r, request("POST", "/v1/completions", b"{}"))
        err = json.loads(got)["error"]
        assert status == 504 and err["code"] == "timeout", got
        assert "quotas.request_timeout_s" in err["message"]
        assert slow.cancelled >= 1 and r.choice.inflight == {"same": 0}

    asyncio.run(go())


def test_a_stream_past_the_timeout_ends_with_an_error_event_and_is_cancelled():
    async def go():
        first = b'data: {"a": 1}\n\n'
        slow = FakeStream(sse_answer([first, b"data: [DONE]\n\n"]), hang_after=2)
        r = router(FakeTarget([slow]), quotas={"request_timeout_s": 0.2})
        status, _, got = await answer(r, request("POST", "/v1/completions", b"{}"))
        assert status == 200 and got.startswith(first) and got.endswith(b"data: [DONE]\n\n")
        event = json.loads(got[len(first):].split(b"\n\n")[0][len(b"data: "):])
        assert event["error"]["code"] == "timeout"
        assert slow.cancelled >= 1 and r.choice.inflight == {"same": 0}

    asyncio.run(go())


def test_metrics_label_target_figures_by_replica_and_count_http_outcomes():
    """Two target replicas report (after their answers, and one at the scrape):
    one series each; the router counts statuses and a client that left."""
    async def go():
        events = [b'data: {"a": 1}\n\n', b"data: [DONE]\n\n"]
        target = FakeTarget([
            FakeStream(json_answer(b"{}", records=[record()],
                                   report=replica_report("t1", branch_hits=3))),
            FakeStream(sse_answer(events, records=[record()],
                                  report=replica_report("t2", branch_hits=4))),
            FakeStream(sse_answer(events, records=[record()]))])
        r = router(target)
        r.ops._serve_status = lambda: {}
        await answer(r, request("POST", "/v1/completions", b"{}"))
        await answer(r, request("POST", "/v1/chat/completions", b'{"stream": true}'))
        left = await r(request("POST", "/v1/chat/completions", b'{"stream": true}'))
        del left  # the client went away before the response was sent
        import gc

        gc.collect()
        await asyncio.sleep(0.05)
        _, _, text = await answer(r, request("GET", "/metrics"))
        return text.decode()

    text = asyncio.run(go())
    for replica, hits in (("t0", 1), ("t1", 3), ("t2", 4)):  # t0 answered the scrape
        assert (f'specserve_branch_hits_total{{target_replica="{replica}",draft_model="same",'
                f'draft_replica="d0",kind="model"}} {hits}') in text
        assert (f'vllm:spec_decode_num_draft_tokens_total{{model_name="tiny",engine="0",'
                f'target_replica="{replica}"}} 8') in text
    assert 'specserve_http_responses_total{route="/v1/completions",status="200"} 1' in text
    assert 'specserve_http_responses_total{route="/v1/chat/completions",status="200"} 2' in text
    assert 'specserve_http_aborts_total{route="/v1/chat/completions"} 1' in text
    assert 'specserve_http_inflight{route="/v1/chat/completions"} 0' in text
    assert 'specserve_http_inflight{route="/metrics"} 1' in text  # this scrape


def test_each_pool_shows_its_kind_and_its_measured_wait_enters_the_k_choice():
    """A model pool and a suffix pool: every view names each pool's kind; the
    wait per step the target replicas report per pool is the K choice's w."""
    config = {**json.loads(json.dumps(CONFIG)),
              "drafts": [{"name": "same", "model": "/nonexistent"},
                         {"name": "sfx", "kind": "suffix"}]}
    waited = {**replica_report("t1"), "branches": {
        "same/d0": {"wait_seconds": 0.5, "steps": 100},  # 5 ms a step
        "sfx/s0": {"wait_seconds": 0.0, "steps": 50}}}

    async def go():
        target = FakeTarget([FakeStream(json_answer(b"{}", records=[record()], report=waited)),
                             FakeStream(json_answer(b"{}"))])
        r = Router(config, target, ["same", "sfx"], serve_metrics=False)
        r.ops._serve_status = lambda: {}
        r.ops._decisions = FakeRemote([]).remote
        for _ in range(2):
            await answer(r, request("POST", "/v1/completions", b"{}"))
        _, _, stats = await answer(r, request("GET", "/v1/spec/stats"))
        _, _, text = await answer(r, request("GET", "/metrics"))
        return json.loads(stats), text.decode()

    snap, text = asyncio.run(go())
    k_pools = snap["k_choice"]["pools"]
    assert {p: (v["kind"], v["wait_ms_per_step"]) for p, v in k_pools.items()} == {
        "same": ("model", pytest.approx(5.0)), "sfx": ("suffix", 0.0)}
    assert {p["pool"]: p["kind"] for p in snap["pools"]} == {
        "target": "target", "same": "model", "sfx": "suffix"}
    assert [(m["model"], m["kind"]) for m in snap["draft_models"]] == [("same", "model")]
    assert [(d["model"], d["kind"]) for d in snap["drafts"]] == [("same", "model")]
    assert {d: b["kind"] for d, b in snap["branches"].items()} == {
        "same/d0": "model", "sfx/s0": "suffix"}
    assert snap["branches"]["same/d0"]["wait_ms_per_step"] == pytest.approx(5.0)
    assert 'specserve_pool_replicas{pool="sfx",kind="suffix"} 0' in text
    assert 'specserve_k{draft_model="same",kind="model"}' in text
    assert ('specserve_draft_tokens_total{draft_model="none",draft_replica="none",kind="none"} 0'
            in text)
    assert ('specserve_proposer_steps_total{target_replica="t1",draft_model="sfx",'
            'draft_replica="s0",kind="suffix"} 50') in text


def test_routers_show_the_apps_figures_from_the_ledger_through_restarts(monkeypatch):
    """Two routers feed one ledger (deployments/ledger.py): each one's views
    count both routers' requests; a router restarted (new id, counters from
    zero) and the ledger restarted from its checkpoint take nothing back; with
    the ledger gone a view says it shows this router's figures only."""
    from deployments import ledger as ledger_module
    from deployments.ledger import LedgerServer
    from specserve.acceptance.ledger import Outbox

    monkeypatch.setattr(ledger_module, "CHECKPOINT_S", 0.0)
    monkeypatch.setattr("deployments.ops.REMOTE_WAIT_S", 0.2)
    kv = {}
    store = type("KV", (), {"get": staticmethod(kv.get), "put": staticmethod(kv.__setitem__)})()

    def new_router(name, ledger, requests):
        target = FakeTarget([FakeStream(json_answer(b"{}", records=[record()]))
                             for _ in range(requests)])
        r = Router(json.loads(json.dumps(CONFIG)), target, ["same"], serve_metrics=False,
                   ledger=ledger)
        r.ops.outbox = Outbox(name)  # one process here: replica ids by hand
        r.ops._serve_status = lambda: {}
        r.ops._decisions = target.draft_active.remote
        return r

    async def requests_seen(r):
        _, _, got = await answer(r, request("GET", "/v1/spec/stats"))
        snap = json.loads(got)
        return snap["draft_models"][0]["requests"], snap["figures"]

    async def served(r, n):
        for _ in range(n):
            status, _, _ = await answer(r, request("POST", "/v1/completions", b"{}"))
            assert status == 200

    async def go():
        ledger = FakeLedger(LedgerServer(4, kv=store, app="test"))
        a, b = new_router("a", ledger, 2), new_router("b", ledger, 1)
        await served(a, 2)
        await served(b, 1)
        await asyncio.sleep(0.05)  # records go to the ledger right after each response
        seen_b, figures = await requests_seen(b)
        seen_a, _ = await requests_seen(a)
        assert seen_a == seen_b == 3 and figures["source"] == "ledger", (seen_a, seen_b, figures)
        assert figures["routers"] == ["a", "b"]
        _, _, text = await answer(b, request("GET", "/metrics"))
        assert 'specserve_http_responses_total{route="/v1/completions",status="200"} 3' in text.decode()
        # router a restarts: a new replica, its own counts from zero
        a = new_router("a2", ledger, 1)
        await served(a, 1)
        assert (await requests_seen(b))[0] == 4
        # the ledger restarts from its checkpoint
        await asyncio.sleep(0.05)  # the checkpoint is written in the background
        restarted = FakeLedger(LedgerServer(4, kv=store, app="test"))
        a.ops.ledger = b.ops.ledger = restarted
        assert (await requests_seen(a))[0] == 4
        # no ledger: this router's own figures, and why
        a.ops.ledger = b.ops.ledger = type("Gone", (), {"add": FakeRemote(hang=True),
                                                       "view": FakeRemote(hang=True)})()
        seen, figures = await requests_seen(a)
        assert seen == 1 and figures["source"] == "this router", figures
        assert figures["why"].startswith("unavailable") and figures["unsent_records"] >= 0

    asyncio.run(go())
