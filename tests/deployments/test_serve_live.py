"""Changes to a running app through `specserve serve` (the config file edited,
then SIGHUP: the app's Serve config applied again, as `serve deploy` and
KubeRay apply it): a change of K (within speculation.max_speculative_tokens)
and of the quotas reaches the running replicas, whose target engine keeps its
process, and takes effect; a change of the target model replaces the target
replica (a new engine process) and serves the new model.
"""

import copy
import re
import time

import pytest

from conftest import SLOW_TARGET_ENV
from serve_client import engine_core, replica_processes
from specserve.tools.serveproc import ServeProcess, get, post
from test_serve import tiny_config

pytestmark = pytest.mark.slow


def engine_pids(server) -> dict[str, int]:
    """Process ids of the target replica and of its engine core."""
    out = {}
    for replica in replica_processes(server, "target"):
        out["replica"] = replica.pid
        core = engine_core(replica)
        if core is not None:
            out["engine"] = core.pid
    return out


def pool_k(server) -> int:
    """The K the router gives the 'same' pool (one request first, so it decides)."""
    post(f"{server.url}/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4})
    _, stats = get(f"{server.url}/v1/spec/stats")
    return {d["model"]: d["k"] for d in stats["draft_models"]}["same"]


def greedy(server, prompt="Hello world"):
    status, body = post(f"{server.url}/v1/completions",
                        {"model": "tiny", "prompt": prompt, "max_tokens": 16,
                         "temperature": 0.0, "ignore_eos": True})
    assert status == 200, body
    return body["choices"][0]["text"]


def test_k_and_quotas_change_without_an_engine_restart_and_a_model_change_restarts(
        tiny_models, tmp_path):
    config = tiny_config(tiny_models, [("same", "target")])
    config["speculation"] = {"num_speculative_tokens": 4, "max_speculative_tokens": 4}
    server = ServeProcess(config, tmp_path, env=SLOW_TARGET_ENV)
    try:
        server.wait_ready("tiny")
        before = engine_pids(server)
        assert set(before) == {"replica", "engine"}, before
        text = greedy(server)
        assert pool_k(server) == 4

        # K 4 -> 2 and a tighter n quota: the same engine, the new settings.
        live = copy.deepcopy(config)
        live["speculation"]["num_speculative_tokens"] = 2
        live["quotas"] = {"max_n": 1}
        server.apply(live)
        assert "live settings only" in server.tail(10**8)
        deadline = time.monotonic() + 60
        while pool_k(server) != 2 and time.monotonic() < deadline:
            time.sleep(1)
        assert pool_k(server) == 2
        assert re.search(r"target settings: K=2", server.tail(10**8))
        status, err = post(f"{server.url}/v1/completions",
                           {"model": "tiny", "prompt": "hi", "max_tokens": 2, "n": 2,
                            "temperature": 0.8})
        assert status == 400 and "quotas.max_n" in err["error"]["message"], err
        assert engine_pids(server) == before
        assert greedy(server) == text  # the target's output, whatever K

        # Another target model: a new target replica and engine.
        other = copy.deepcopy(live)
        other["target"]["model"] = str(tiny_models["perturbed"])
        server.apply(other)
        assert "the replicas are replaced" in server.tail(10**8)
        server.wait_ready("tiny")
        after = engine_pids(server)
        assert after.get("engine") not in (None, before["engine"]), (before, after)
        assert f"target {tiny_models['perturbed']} ready" in server.tail(10**8)
        greedy(server)
    finally:
        assert server.stop(require_clean=True) == 0, server.tail()
