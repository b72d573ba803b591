"""The quotas (`quotas` in the config) on one running app through `specserve
serve`: n over the cap, a prompt over the cap, max_tokens over the cap, a full
target queue and a request past its timeout each get their clear OpenAI-style
4xx/5xx, and after each the next request is served. A timed-out request's
engine request is aborted (the engine holds no request right after, seconds
before it would have finished).

One app for the module; its target takes two requests at a time (one slot
is left for the router's own calls: its step-cost refresh, /v1/spec/stats),
with a queue of one, and steps slowly (emulated, tests/conftest.py) so that
requests last.
"""

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from specserve.testing import slow_target
from specserve.tools.serveproc import ServeProcess, get, post
from test_serve import tiny_config

pytestmark = pytest.mark.slow

QUOTAS = {"max_n": 2, "max_prompt_tokens": 32, "max_completion_tokens": 200,
          "max_queued_requests": 1, "request_timeout_s": 3}
STEP_MS = 50  # 200 tokens: 10 s, well past the timeout


@pytest.fixture(scope="module")
def app(tiny_models, tmp_path_factory):
    config = tiny_config(tiny_models, [("same", "target")])
    config["target"]["max_ongoing_requests"] = 2
    config["quotas"] = QUOTAS
    server = ServeProcess(config, tmp_path_factory.mktemp("serve-quotas"),
                          env=slow_target.env(STEP_MS))
    try:
        server.wait_ready("tiny")
        yield server
    finally:
        assert server.stop(require_clean=True) == 0, server.tail()


def still_serving(app):
    status, ok = post(f"{app.url}/v1/completions",
                      {"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert status == 200 and ok["usage"]["completion_tokens"] == 2, ok


def refused(app, path, body, status, param=None):
    got, err = post(f"{app.url}/v1/{path}", body)
    assert got == status, err
    assert set(err["error"]) >= {"message", "type", "code"}, err
    if param is not None:
        assert err["error"]["param"] == param, err
    return err["error"]


SAMPLED = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0.8}


def test_n_over_the_cap_gets_400_and_n_within_it_is_served(app):
    err = refused(app, "completions", {**SAMPLED, "n": 3}, 400, "n")
    assert "quotas.max_n" in err["message"]
    still_serving(app)
    # two prompts × n=2: four sequences
    err = refused(app, "completions", {**SAMPLED, "n": 2, "prompt": ["a", "b"]}, 400, "n")
    assert "4" in err["message"]
    still_serving(app)
    status, ok = post(f"{app.url}/v1/completions", {**SAMPLED, "n": 2})
    assert status == 200 and len(ok["choices"]) == 2, ok


def test_a_prompt_over_the_cap_gets_400(app):
    long = " ".join(["hello world"] * 20)
    status, counted = post(f"{app.url}/tokenize", {"model": "tiny", "prompt": long})
    assert status == 200 and counted["count"] > QUOTAS["max_prompt_tokens"], counted
    err = refused(app, "completions", {"model": "tiny", "prompt": long, "max_tokens": 2},
                  400, "prompt")
    assert "quotas.max_prompt_tokens" in err["message"]
    still_serving(app)
    refused(app, "chat/completions", {"model": "tiny", "max_tokens": 2,
                                      "messages": [{"role": "user", "content": long}]},
            400, "prompt")
    still_serving(app)


def test_max_tokens_over_the_cap_gets_400(app):
    err = refused(app, "completions", {"model": "tiny", "prompt": "hi", "max_tokens": 201},
                  400, "max_tokens")
    assert "quotas.max_completion_tokens" in err["message"]
    refused(app, "chat/completions", {"model": "tiny", "max_completion_tokens": 201,
                                      "messages": [{"role": "user", "content": "hi"}]},
            400, "max_completion_tokens")
    still_serving(app)


def test_a_full_queue_gets_429_with_retry_after(app):
    """Eight requests at once (released together) on a target that takes two,
    with a queue of one: at most three are held, so some get 429. (With four,
    a loaded CI machine once let the router see them one by one, and none was
    refused.)"""
    together = threading.Barrier(8)

    def one(i):
        together.wait()
        req = urllib.request.Request(
            f"{app.url}/v1/completions", method="POST",
            data=json.dumps({"model": "tiny", "prompt": f"load {i}", "max_tokens": 20,
                             "ignore_eos": True}).encode(),
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.headers, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, e.headers, json.loads(e.read())

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(8)))
    statuses = sorted(s for s, _, _ in answers)
    assert 200 in statuses and 429 in statuses, answers
    assert set(statuses) <= {200, 429, 504}, answers
    for status, headers, body in answers:
        if status == 429:
            assert headers.get("Retry-After") == "1", dict(headers)  # (any case)
            assert body["error"]["code"] == "queue_full", body
            assert "quotas.max_queued_requests" in body["error"]["message"]
    still_serving(app)


def engine_idle_within(app, seconds: float) -> bool:
    """Whether the target engine holds no request within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        status, stats = get(f"{app.url}/v1/spec/stats")
        if status == 200 and stats["target_engine"]["unfinished_requests"] == 0:
            return True
        time.sleep(0.2)
    return False


def test_a_request_past_the_timeout_is_stopped_and_its_engine_request_aborted(app):
    # 200 tokens take 10 s; stopped at 3 s, so its engine request would run
    # on for 7 s unless it is aborted.
    long = {"model": "tiny", "prompt": "tell me", "max_tokens": 200, "ignore_eos": True}
    t0 = time.monotonic()
    status, err = post(f"{app.url}/v1/completions", long)
    assert status == 504 and err["error"]["code"] == "timeout", err
    assert time.monotonic() - t0 < QUOTAS["request_timeout_s"] + 2
    assert engine_idle_within(app, 3), "the timed-out engine request ran on"
    # A stream: its chunks so far, then an error event and the end.
    req = urllib.request.Request(f"{app.url}/v1/completions", method="POST",
                                 data=json.dumps({**long, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [line[5:].strip() for line in r.read().decode().splitlines()
                  if line.startswith("data:")]
    assert events[-1] == "[DONE]", events
    assert json.loads(events[-2])["error"]["code"] == "timeout", events[-2:]
    assert any("choices" in json.loads(e) for e in events[:-2]), events
    assert engine_idle_within(app, 3), "the timed-out stream's engine request ran on"
    still_serving(app)
