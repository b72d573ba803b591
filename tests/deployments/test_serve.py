"""The Ray Serve app through `specserve serve`, driven by the real `openai` client.

Greedy text equals transformers' target-only greedy text, through completions
and chat, streaming and not; bad requests get a 400 (an unknown model a
404) with an OpenAI-style error and the server keeps serving; with its only draft replica killed, requests are
still served (target alone); SIGTERM shuts everything down. The app runs two
router replicas: its figures add up over both and survive one killed.
"""

import os
import secrets
import signal
import time

import psutil
import pytest

from conftest import SLOW_TARGET_ENV
from specserve.tools.serveproc import ServeProcess, get, post

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
PROMPTS = ["Hello world", "The quick brown fox"]


def tiny_config(models, drafts, tp=1, draft_replicas=1):
    engine = {"dtype": "float32", "kv_cache_gib": 1}
    return {
        "target": {"model": str(models["target"]), "name": "tiny", "tensor_parallel_size": tp,
                   "resources": {"cpus_per_worker": 1}, "engine": engine},
        "drafts": [{"name": name, "model": str(models[m]),
                    "replicas": {"min_replicas": draft_replicas, "max_replicas": draft_replicas},
                    "resources": {"cpus_per_worker": 0.25}, "engine": engine}
                   for name, m in drafts],
        "speculation": {"num_speculative_tokens": 4},
        "ray": {"num_cpus": 4},
    }


@pytest.fixture(scope="module")
def app(tiny_models, tmp_path_factory):
    # Two draft pools: an unrelated model and the target itself. A slower target step (emulated, as in tests/conftest.py)
    # lets drafts arrive in time, so acceptance can be measured.
    # Two router replicas: every figure below is the app's (the ledger's),
    # whichever router answers.
    config = tiny_config(tiny_models, [("unrelated", "unrelated"), ("same", "target")])
    config["router"] = {"replicas": {"min_replicas": 2, "max_replicas": 2}}
    # The unrelated pool adapts (no training round within the tests: the
    # schedule is 30 min; no share of requests forced its way): the swap test
    # promotes a version by hand.
    config["drafts"][0]["adapt"] = {"enabled": True, "collect_share": 0,
                                    "versions_dir": str(tmp_path_factory.mktemp("versions"))}
    # Ray's token authentication on (what `specserve serve` takes from Ray's
    # own variables, as the chart's rayAuth sets them): the app serves with it.
    token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    server = ServeProcess(config, tmp_path_factory.mktemp("serve"),
                          env={**SLOW_TARGET_ENV, **token})
    try:
        server.wait_ready("tiny")
        yield server
    finally:
        code = server.stop(require_clean=True)
        assert code == 0, server.tail()


@pytest.fixture(scope="module")
def expected(tiny_models):
    """Target-only greedy text from transformers, for plain and chat prompts."""
    from transformers import AutoTokenizer

    from specserve.testing.tiny import greedy_ids_for

    tok = AutoTokenizer.from_pretrained(str(tiny_models["target"]))
    plain = [tok.decode(ids) for ids in greedy_ids_for(tiny_models["target"], [
        tok(p)["input_ids"] for p in PROMPTS], MAX_TOKENS)]
    chat_ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}],
                                       add_generation_prompt=True, tokenize=True)
    chat_ids = chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids
    chat = tok.decode(greedy_ids_for(tiny_models["target"], [list(chat_ids)], MAX_TOKENS)[0])
    return {"plain": plain, "chat": chat}


def client(app):
    from openai import OpenAI

    return OpenAI(base_url=f"{app.url}/v1", api_key="unused", max_retries=0, timeout=120)


GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})


def test_completions_match_target_only(app, expected):
    c = client(app)
    for prompt, want in zip(PROMPTS, expected["plain"]):
        r = c.completions.create(model="tiny", prompt=prompt, **GREEDY)
        assert r.choices[0].text == want
        assert r.usage.completion_tokens == MAX_TOKENS
        assert r.choices[0].finish_reason == "length"
        chunks = list(c.completions.create(model="tiny", prompt=prompt, stream=True, **GREEDY))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want


def test_chat_completions_match_target_only(app, expected):
    c = client(app)
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    r = c.chat.completions.create(model="tiny", messages=msgs, **GREEDY)
    assert r.choices[0].message.content == expected["chat"]
    assert r.choices[0].message.role == "assistant"
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == expected["chat"]
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_models_and_health(app):
    assert get(f"{app.url}/healthz") == (200, {"status": "ok"})
    status, body = get(f"{app.url}/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["tiny"]


@pytest.mark.parametrize("path, body, needle", [
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": 5000}, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "x", "temperature": -1}, "temperature"),
    ("completions", b'{"model": "tiny", "prompt": ', "JSON"),
    ("completions", {"model": "tiny", "prompt": "x" * 1100}, "context"),
    ("chat/completions", {"model": "tiny", "messages": []}, "empty conversation"),
    ("completions", {"model": "tiny", "prompt": "x", "logit_bias": {"5": 1}}, "logit_bias"),
    ("completions", {"model": "tiny", "prompt": "x", "temperature": 1.0, "seed": 3}, "seed"),
    # no target.tool_call_parser in this config: tools with tool_choice auto (the default)
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "tools": [{"type": "function", "function": {"name": "f"}}]},
     "target.tool_call_parser"),
])
def test_bad_requests_get_400_and_the_server_keeps_serving(app, path, body, needle):
    status, err = post(f"{app.url}/v1/{path}", body)
    assert status == 400, err
    assert set(err["error"]) >= {"message", "type", "code"}
    assert needle in err["error"]["message"], err
    status, ok = post(f"{app.url}/v1/completions",
                      {"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert status == 200 and ok["usage"]["completion_tokens"] == 2


def test_an_unknown_model_gets_404(app):
    status, err = post(f"{app.url}/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404 and "does not exist" in err["error"]["message"], err
    assert err["error"]["param"] == "model"


def test_acceptance_steers_requests_and_k(app, expected):
    """Both pools are measured first; then the good draft gets the requests and
    the unrelated one's K drops to 0. The figures add up to vLLM's counters."""
    c = client(app)
    for _ in range(6):
        for prompt in PROMPTS:
            c.completions.create(model="tiny", prompt=prompt, **GREEDY)
    status, before = get(f"{app.url}/v1/spec/stats")
    assert status == 200
    by_model = {d["model"]: d for d in before["draft_models"]}
    assert set(by_model) == {"unrelated", "same"}, before
    for d in before["drafts"]:
        assert {"model", "replica", "draft_tokens", "accepted_tokens", "acceptance_rate",
                "accepted_per_position", "coverage", "k", "draft_lag"} <= set(d)
    for t in before["targets"]:
        assert {"replica", "target_steps", "batch_size", "queue_length",
                "output_tokens_per_s"} <= set(t)
    assert {"ttft_p50_s", "tpot_p50_s", "output_tokens_per_s",
            "goodput_tokens_per_s"} <= set(before["end_to_end"])
    same, unrelated = by_model["same"], by_model["unrelated"]
    assert same["draft_tokens"] > 0 and same["acceptance_rate"] >= 0.9, same
    assert unrelated["acceptance_rate"] < 0.3, unrelated
    assert same["k"] == 4 and unrelated["k"] == 0, (same, unrelated)
    # New requests go to the good draft.
    for prompt in PROMPTS * 2:
        c.completions.create(model="tiny", prompt=prompt, **GREEDY)
    _, after = get(f"{app.url}/v1/spec/stats")
    grown = {d["model"]: d["requests"] - by_model[d["model"]]["requests"]
             for d in after["draft_models"]}
    assert grown["same"] >= 3 and grown.get("unrelated", 0) <= 1, grown
    # The per-request attribution adds up to vLLM's engine-wide counters.
    engine = after["target_engine"]
    assert sum(d["draft_tokens"] for d in after["drafts"]) == engine["draft_tokens"]
    assert sum(d["accepted_tokens"] for d in after["drafts"]) == engine["accepted_tokens"]


def test_routing_by_prefix_says_why(app, tiny_models):
    """A three-turn conversation goes through the prefix routers (target and
    draft, `routing:`): /v1/spec/stats counts each choice and how much of
    the prefix the chosen replica held; greedy text = target-only."""
    from transformers import AutoTokenizer

    from specserve.testing.tiny import greedy_ids_for

    tok = AutoTokenizer.from_pretrained(str(tiny_models["target"]))
    c = client(app)

    def counts(snap, key):
        tallies = snap["routing"][key] or {}
        if key == "target":
            tallies = {"target": tallies} if tallies else {}
        return sum(n for t in tallies.values() for n in t["choices"].values())

    _, before = get(f"{app.url}/v1/spec/stats")
    msgs = [{"role": "system", "content": "Answer in the voice of a patient librarian. " * 2},
            {"role": "user", "content": PROMPTS[1]}]
    # Three turns: the app has two routers, each with its own prefix index;
    # by the third turn a router that saw an earlier turn routes one.
    for turn in range(3):
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        want = tok.decode(greedy_ids_for(tiny_models["target"], [list(ids)], MAX_TOKENS)[0])
        r = c.chat.completions.create(model="tiny", messages=msgs, **GREEDY)
        assert r.choices[0].message.content == want, turn
        msgs += [{"role": "assistant", "content": want}, {"role": "user", "content": "More."}]
    _, after = get(f"{app.url}/v1/spec/stats")
    assert counts(after, "target") == counts(before, "target") + 3, after["routing"]
    assert counts(after, "drafts") >= counts(before, "drafts") + 1, after["routing"]
    # A later turn found an earlier turn's prefix on the replica it went to.
    assert after["routing"]["target"]["prefix_match_rate"] > 0, after["routing"]


def test_vllm_benchmark_client_reports_acceptance(app, tiny_models):
    """vLLM's own benchmark client (`vllm bench serve`; the `vllm` script is not
    installed here, so its module) reads acceptance from specserve's /metrics."""
    from vllm.benchmarks import serve as bench
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    bench.add_cli_args(parser)
    model = str(tiny_models["target"])
    args = parser.parse_args([
        "--base-url", app.url, "--endpoint", "/v1/completions", "--model", model,
        "--served-model-name", "tiny", "--dataset-name", "random", "--random-input-len", "16",
        "--random-output-len", "24", "--num-prompts", "6", "--max-concurrency", "2",
        "--ignore-eos", "--temperature", "0", "--disable-tqdm", "--ready-check-timeout-sec", "0"])
    result = bench.main(args)
    assert result["completed"] == 6, result
    # Drafts from the "same" pool (the target's own model) are accepted.
    assert result["spec_decode_draft_tokens"] > 0, result
    assert 0 < result["spec_decode_acceptance_rate"] <= 100, result
    assert len(result["spec_decode_per_position_acceptance_rates"]) >= 1, result


def test_metrics_are_prometheus_text(app):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from specserve.acceptance import catalogue

    with urllib.request.urlopen(f"{app.url}/metrics", timeout=30) as r:
        text = r.read().decode()
    assert 'specserve_draft_tokens_total{draft_model="same"' in text
    assert "# TYPE specserve_accepted_tokens_total counter" in text
    # The whole scrape parses, every family is catalogued, and the target's
    # figures carry the replica that counted them.
    families = {f.name for f in text_string_to_metric_families(text)}
    assert {n.removesuffix("_total") for n in catalogue.BY_NAME} == families
    assert 'vllm:num_requests_running{model_name="tiny",engine="0",target_replica="' in text
    # The router knows the running target replica from Serve, and it is the
    # one that reported: its gauges are shown.
    deadline = time.monotonic() + 60  # Serve's details come in the background
    while True:
        _, snap = get(f"{app.url}/v1/spec/stats")
        running = snap["target_replicas"]["running"]
        if running is not None or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert running and running == snap["target_replicas"]["reported"], snap["target_replicas"]
    assert f'specserve_target_batch_size{{target_replica="{running[0]}"}}' in text


def _counter(text: str, name: str, **labels) -> float:
    """The sum of a counter's samples (those with `labels`) in a scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


def _scrape(app) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{app.url}/metrics", timeout=30) as r:
        return r.read().decode()


def test_figures_add_up_over_routers_and_survive_one_killed(app, expected):
    """Both routers feed the ledger: /v1/spec/stats names them and its
    request count grows by exactly the requests sent, whichever router
    answered; with a router replica killed, no counter goes back."""
    ok = dict(route="/v1/completions", status="200")
    c = client(app)
    deadline = time.monotonic() + 60  # both routers have sent their first batch
    while len((figures := get(f"{app.url}/v1/spec/stats")[1]["figures"])["routers"] or []) < 2:
        assert time.monotonic() < deadline, figures
        time.sleep(1)
    assert figures["source"] == "ledger", figures
    before = _scrape(app)
    for prompt in PROMPTS * 3:
        assert c.completions.create(model="tiny", prompt=prompt, **GREEDY).choices[0].text
    # (each router sends its records right after the response: give the
    # last one's a moment to land before the scrape that another router answers)
    deadline = time.monotonic() + 10
    while True:
        after = _scrape(app)
        grown = [_counter(after, n, **labels) - _counter(before, n, **labels)
                 for n, labels in (("specserve_http_responses_total", ok),
                                   ("specserve_requests_total", {}))]
        if min(grown) >= 6 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert grown == [6, 6]
    routers = [p for p in psutil.Process(app.proc.pid).children(recursive=True)
               if "ServeReplica:specserve:router" in " ".join(p.cmdline())]
    assert len(routers) == 2, routers
    os.kill(routers[0].pid, signal.SIGKILL)
    served = 0
    deadline = time.monotonic() + 90
    while served < 2:  # Serve's proxy may pick the dead router until it knows
        assert time.monotonic() < deadline, "no request served after a router was killed"
        try:
            r = c.completions.create(model="tiny", prompt=PROMPTS[0], **GREEDY)
            assert r.choices[0].text == expected["plain"][0]
            served += 1
        except Exception:  # the dead router's connection
            time.sleep(1)
    later = _scrape(app)
    for name, labels in (("specserve_http_responses_total", ok),
                         ("specserve_requests_total", {}),
                         ("specserve_output_tokens_total", {})):
        assert _counter(later, name, **labels) >= _counter(after, name, **labels), name
    assert (_counter(later, "specserve_http_responses_total", **ok)
            >= _counter(after, "specserve_http_responses_total", **ok) + 2)


def test_a_swap_with_requests_in_flight(app, expected, tiny_models):
    """A version promoted in the pool's store (what a training round that
    passed the guard does) is loaded by the running draft replica in place
    while requests stream: none fails, every greedy text is target-only's,
    and /v1/spec/stats shows the new version."""
    import shutil
    import threading

    from specserve.adapt.versions import VersionStore
    from specserve.config import AppConfig

    pool = AppConfig.from_yaml(app.config_path).drafts[0]
    store = VersionStore(pool.adapt.versions_root(pool.name))

    def adapt_row():
        rows = get(f"{app.url}/v1/spec/stats")[1]["pools"]
        return next(r["adapt"] for r in rows if isinstance(r.get("adapt"), dict))

    assert adapt_row()["version"] == "v0"
    stop, texts, errors = threading.Event(), [], []

    def stream(prompt, want):
        c = client(app)
        while not stop.is_set():
            try:
                chunks = c.completions.create(model="tiny", prompt=prompt, stream=True, **GREEDY)
                texts.append(("".join(ch.choices[0].text for ch in chunks if ch.choices), want))
            except Exception as e:
                errors.append(repr(e))
    clients = [threading.Thread(target=stream, args=pair)
               for pair in zip(PROMPTS, expected["plain"])]
    for t in clients:
        t.start()
    try:
        weights = store.root / ".by-hand"
        shutil.copytree(tiny_models["target"], weights)  # same shapes: the target's weights
        version = store.record_candidate("v0", 0.1, 0.9, "swap: by hand", weights=weights)
        store.promote(version, "swap: by hand")
        deadline = time.monotonic() + 60
        while (row := adapt_row())["version"] != version:  # the replica loaded it
            assert time.monotonic() < deadline, row
            time.sleep(1)
        seen = len(texts)
        while len(texts) < seen + 4 and time.monotonic() < deadline + 60:
            time.sleep(0.2)  # more requests after the swap
    finally:
        stop.set()
        for t in clients:
            t.join(120)
    assert errors == []
    assert len(texts) >= seen + 4 and all(text == want for text, want in texts)
    assert (row["swaps"], row["rollbacks"]) == (1, 0)
    # back to the shipped weights (`specserve adapt rollback`): followed too
    store.rollback("by hand")
    deadline = time.monotonic() + 60
    while adapt_row()["version"] != "v0":
        assert time.monotonic() < deadline
        time.sleep(1)


def test_served_by_the_target_alone_when_the_draft_replica_dies(app, expected):
    drafts = [p for p in psutil.Process(app.proc.pid).children(recursive=True)
              if "ServeReplica:specserve:draft-" in " ".join(p.cmdline())]
    assert drafts, "no draft replica process found"
    for p in drafts:
        os.kill(p.pid, signal.SIGKILL)
    c = client(app)
    t0 = time.monotonic()
    for prompt, want in zip(PROMPTS, expected["plain"]):
        r = c.completions.create(model="tiny", prompt=prompt, **GREEDY)
        assert r.choices[0].text == want
    assert time.monotonic() - t0 < 60


def test_stop_strings_cut_the_text(app, expected):
    want = expected["plain"][0]
    stop = want[6:8]
    assert stop and stop in want
    r = client(app).completions.create(model="tiny", prompt=PROMPTS[0], stop=[stop], **GREEDY)
    assert r.choices[0].text == want[: want.index(stop)]
    assert r.choices[0].finish_reason == "stop"
