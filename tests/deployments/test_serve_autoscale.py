"""The draft pool's autoscaling policy on a running app: load makes it ask for
more replicas (the drafts arrive late: the draft is a model many times the
target's size, so on two shared cores it cannot keep ahead), idleness brings
it back down. (With the target itself as the draft, whether it kept ahead
depended on the machine's speed that day.)"""

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from specserve.tools.serveproc import ServeProcess
from test_serve import tiny_config

pytestmark = pytest.mark.slow


def wait_for_log(server, pattern, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, server.tail(10**7))
        if m:
            return m
        time.sleep(1)
    return None


def test_draft_pool_scales_up_under_load_and_down_when_idle(tiny_models, tmp_path):
    from openai import OpenAI

    from specserve.testing.tiny import build_model

    slow = build_model(tmp_path / "slow-draft", seed=3, layers=6, hidden=1024)
    config = tiny_config({**tiny_models, "slow": slow}, [("slow", "slow")])
    # Never judged by the K controller, so the pool keeps drafting at full K
    # however late its drafts are (judged, it would get K = 0 and sit idle).
    never = 10**9
    config["speculation"]["k_control"] = {"min_drafted_tokens": never, "min_requests": never,
                                          "min_steps": never}
    config["drafts"][0]["replicas"] = {"min_replicas": 1, "max_replicas": 2,
                                       "upscale_delay_s": 1, "downscale_delay_s": 4}
    server = ServeProcess(config, tmp_path)
    try:
        server.wait_ready("tiny")
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                        timeout=300)

        def one(i):
            client.completions.create(model="tiny", prompt=f"load {i}", max_tokens=200,
                                      temperature=0.0, extra_body={"ignore_eos": True})

        up = None
        with ThreadPoolExecutor(6) as pool:
            deadline = time.monotonic() + 240
            while up is None and time.monotonic() < deadline:
                list(pool.map(one, range(6)))
                up = re.search(r"specserve autoscale draft-slow: 1 -> 2 replicas: (drafts late[^\n]*)",
                               server.tail(10**7))
        assert up, "the draft policy never asked for a second replica under load"
        down = wait_for_log(server, r"specserve autoscale draft-slow: \d -> 1 replicas: idle", 180)
        assert down, "the draft policy never scaled back down when idle"
    finally:
        assert server.stop(require_clean=True) == 0, server.tail()
