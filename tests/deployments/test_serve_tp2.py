"""One app with a tensor-parallel (TP=2) target and two draft replicas: eight
concurrent streaming requests all complete with the target-only output."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from specserve.tools.serveproc import ServeProcess
from test_serve import tiny_config

pytestmark = pytest.mark.slow

PROMPTS = [f"Request number {i}: tell me something" for i in range(8)]
MAX_TOKENS = 32


def test_eight_concurrent_streams_on_tp2_with_two_draft_replicas(tiny_models, tmp_path):
    from openai import OpenAI
    from transformers import AutoTokenizer

    from specserve.testing.tiny import greedy_ids_for

    tok = AutoTokenizer.from_pretrained(str(tiny_models["target"]))
    want = [tok.decode(ids) for ids in greedy_ids_for(
        tiny_models["target"], [tok(p)["input_ids"] for p in PROMPTS], MAX_TOKENS)]
    config = tiny_config(tiny_models, [("same", "target")], tp=2, draft_replicas=2)
    server = ServeProcess(config, tmp_path)
    try:
        server.wait_ready("tiny")
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                        timeout=300)

        def stream(prompt):
            chunks = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                stream=True, extra_body={"ignore_eos": True})
            return "".join(c.choices[0].text for c in chunks if c.choices)

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(stream, PROMPTS))
        assert got == want
        log = server.tail(200000)
        assert "draft-same" in log and "tensor_parallel_size=2" in log
    finally:
        assert server.stop(require_clean=True) == 0, server.tail()
