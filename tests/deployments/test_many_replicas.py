"""M:N on this machine: two target replicas and two draft pools (the tiny
target as a model draft, and a suffix memory) behind one router, the target
step slowed so that drafts keep up (conftest.SLOW_TARGET_ENV). In file order
on one app:

- multi-turn conversations spread over both targets: every greedy answer
  equals transformers' target-only answer, both target replicas serve, and
  drafts are accepted;
- one target replica SIGKILLed mid-run, with a live Prometheus scraping
  /metrics: in-flight requests finish correctly or end with a clear
  `target_unavailable` error after a correct prefix, the survivor serves new
  requests with drafts (the drafts re-attach to it), Serve brings the pool
  back to two, and no counter Prometheus holds ever went backwards
  (`resets()` over the whole run is 0 for every series: each target
  replica's rows carry its own label, the router sums them), and every
  panel of the Grafana dashboard has data;
- a draft replica SIGKILLed mid-run costs speed only: every in-flight answer
  is still exactly target-only's.
"""

import time

import pytest

from conftest import SLOW_TARGET_ENV
from grafana import as_promql, grafana_expressions
from prometheus_server import scraping
from serve_client import (in_threads, kill_replica, replica_processes, start_streams, stats,
                          wait_for)
from specserve.tools.serveproc import ServeProcess, get, post

pytestmark = pytest.mark.slow

CONVERSATIONS = ["The river", "Once upon a time", "def main():", "Dear team,"]
TURNS = 3
SHORT, LONG = 16, 800  # LONG: streams that outlive the kill, drafts accepted or not
ENGINE = {"dtype": "float32", "kv_cache_gib": 1, "max_model_len": 1024}


@pytest.fixture(scope="module")
def app(tiny_models, tmp_path_factory):
    target = str(tiny_models["target"])
    config = {
        "target": {"model": target, "name": "tiny",
                   "replicas": {"min_replicas": 2, "max_replicas": 2},
                   "resources": {"cpus_per_worker": 1}, "engine": ENGINE},
        "drafts": [{"name": "same", "model": target,
                    "resources": {"cpus_per_worker": 0.25}, "engine": ENGINE},
                   {"name": "memory", "kind": "suffix",
                    "resources": {"cpus_per_worker": 0.25}}],
        "speculation": {"num_speculative_tokens": 4},
        "ray": {"num_cpus": 4},
    }
    server = ServeProcess(config, tmp_path_factory.mktemp("serve"), env=SLOW_TARGET_ENV)
    try:
        server.wait_ready("tiny")
        yield server
    finally:
        server.stop(require_clean=True)


@pytest.fixture(scope="module")
def reference(tiny_models):
    """greedy(prompt text, max_tokens) -> transformers' target-only text."""
    from transformers import AutoTokenizer

    from specserve.testing.tiny import greedy_ids_for

    tok = AutoTokenizer.from_pretrained(str(tiny_models["target"]))
    cache: dict = {}

    def greedy(prompt: str, max_tokens: int) -> str:
        if (prompt, max_tokens) not in cache:
            (out,) = greedy_ids_for(tiny_models["target"], [tok(prompt)["input_ids"]],
                                    max_tokens)
            # vLLM holds back an incomplete UTF-8 sequence at the end.
            cache[prompt, max_tokens] = tok.decode(out).rstrip("\ufffd")
        return cache[prompt, max_tokens]

    return greedy


def complete(app, prompt, max_tokens, timeout=300):
    return post(f"{app.url}/v1/completions",
                {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                 "temperature": 0, "ignore_eos": True}, timeout=timeout)


def accepted_by_target(app) -> dict[str, int]:
    return {t["replica"]: t["accepted_tokens"] for t in stats(app)["targets"]}


def test_conversations_over_two_targets_and_two_pools_equal_target_only(app, reference):
    def converse(opening):
        prompt, turns = opening, []
        for turn in range(TURNS):
            status, reply = complete(app, prompt, SHORT)
            turns.append((prompt, status, reply))
            if status != 200:
                break
            prompt = f"{prompt}{reply['choices'][0]['text']}\nAnd then {turn}:"
        return turns

    threads, results = in_threads(converse, [(c,) for c in CONVERSATIONS])
    for t in threads:
        t.join(600)
    assert not any(t.is_alive() for t in threads), "a conversation hangs"
    for i in range(len(CONVERSATIONS)):
        turns = results[i]
        assert not isinstance(turns, Exception), turns
        for prompt, status, reply in turns:
            assert status == 200, reply
            assert reply["choices"][0]["text"] == reference(prompt, SHORT), prompt
    s = stats(app)
    served = {t["replica"]: t["requests"] for t in s["targets"]}
    print(f"\nrequests per target replica {served}; per draft pool "
          f"{ {m['model']: (m['draft_tokens'], m['accepted_tokens']) for m in s['draft_models']} }")
    assert len(served) == 2 and all(n > 0 for n in served.values()), served
    assert sum(m["accepted_tokens"] for m in s["draft_models"]) > 0, s["draft_models"]


def test_a_target_replica_killed_mid_run(app, reference, tmp_path):
    # Eight streams at once: the router's load bound (4 more than the least
    # loaded) puts at least three on each target replica, so whichever is
    # killed holds streams, and it is chosen before they start (finding the
    # busy one by its CPU after they started let them all end first once).
    prompts = [f"{c} {more}" for c in CONVERSATIONS for more in ("once more", "and again")]
    with scraping(app.url, tmp_path) as prom:
        prom.wait_for("specserve_requests_total", 60, "a first scrape of the router")
        before = set(stats(app)["target_replicas"]["running"] or [])
        assert len(before) == 2, before
        # Exactly the two running replicas' processes (a replica Serve is still
        # stopping would otherwise be a victim that holds no stream).
        def two_targets():
            found = replica_processes(app, "target")
            return found if len(found) == 2 else None

        targets = wait_for(two_targets, 120, "two target replica processes")
        victim = targets[0]
        streams, results = start_streams(app, prompts, LONG, 300)
        kill_replica(app, "target", victim)
        for t in streams:
            t.join(300)
        assert not any(t.is_alive() for t in streams), "an in-flight request hangs"
        for j, prompt in enumerate(prompts):
            text, error, done = results[j]
            want = reference(prompt, LONG)
            assert done, results[j]  # every stream ends with [DONE]
            if error is not None:  # the dead replica's: a clear error after a correct prefix
                assert error["code"] == "target_unavailable" and error["message"], error
                assert want.startswith(text), (text, want)
            else:  # the survivor's (or finished before the kill)
                assert text == want
        assert any(results[j][1] is not None for j in range(len(prompts))), \
            (f"no stream was on the killed replica {victim.pid} (of {[p.pid for p in targets]}); "
             "the test proves nothing")

        # The survivor serves new requests, with drafts: they re-attach to it.
        survivor_accepted = accepted_by_target(app)

        def served_with_drafts():
            status, reply = complete(app, prompts[0], SHORT, timeout=120)
            assert status in (200, 503), (status, reply)
            if status == 503:  # sent to the dead replica before Serve noticed
                assert reply["error"]["code"] == "target_unavailable", reply
                return False
            assert reply["choices"][0]["text"] == reference(prompts[0], SHORT)
            now = accepted_by_target(app)
            return any(n > survivor_accepted.get(r, 0) for r, n in now.items())

        wait_for(served_with_drafts, 240, "drafts accepted after the kill", interval=0.5)
        # Serve brings the target pool back to two replicas, one of them new.
        wait_for(lambda: len(set(stats(app)["target_replicas"]["running"] or []) - before) == 1
                 and len(stats(app)["target_replicas"]["running"]) == 2,
                 300, "a replacement target replica", interval=2)
        wait_for(lambda: get(f"{app.url}/healthz", timeout=10)[0] == 200, 300,
                 "the app healthy again")
        for prompt in prompts[:2]:  # both replicas serve correctly again
            status, reply = complete(app, prompt, SHORT)
            assert status == 200 and reply["choices"][0]["text"] == reference(prompt, SHORT)
        time.sleep(3)  # a last scrape after the traffic

        # No counter went backwards across the death and the replacement: the
        # dead replica's rows stay (until their grace ends) or stop, never reset.
        counters = [n for n in prom.names()
                    if n.startswith(("specserve_", "vllm:"))
                    and n.endswith(("_total", "_count", "_bucket"))]
        assert len(counters) > 20 and "specserve_branch_hits_total" in counters, counters
        for name in counters:  # (a range function drops the name: one query each)
            reset = prom.query(f"resets({name}[15m]) > 0")
            assert not reset, (name, [r["metric"] for r in reset])
        # Every panel of the Grafana dashboard has data with two target replicas
        # (ray_* series come from Ray's metrics agents, another scrape job).
        for expr in grafana_expressions():
            if "ray_" not in expr:
                assert prom.query(as_promql(expr)), expr
        (up,) = prom.query('up{job="specserve"}')
        assert up["value"][1] == "1", up  # /metrics answers after the replacement
        scrapes, answered, slowest = (float(prom.query(q)[0]["value"][1]) for q in (
            'count_over_time(up{job="specserve"}[15m])', 'sum_over_time(up{job="specserve"}[15m])',
            'max_over_time(scrape_duration_seconds{job="specserve"}[15m])'))
        print(f"\n{len(counters)} counter series names, none reset; scrapes answered "
              f"{answered:.0f} / {scrapes:.0f} (1 s timeout), slowest {slowest:.2f} s")


def test_a_draft_replica_killed_mid_run_costs_speed_only(app, reference):
    prompts = [f"{c} at last" for c in CONVERSATIONS]
    [victim] = replica_processes(app, "draft-same")  # before the streams: the lookup is slow
    streams, results = start_streams(app, prompts, LONG, 300)
    kill_replica(app, "draft-same", victim)
    for t in streams:
        t.join(300)
    assert not any(t.is_alive() for t in streams), "an in-flight request hangs"
    for j, prompt in enumerate(prompts):
        text, error, done = results[j]
        assert error is None and done and text == reference(prompt, LONG), results[j]
