"""A suffix draft pool (`kind: suffix`, no model) in the Ray Serve app, through
`specserve serve` and the `openai` client: greedy text equals transformers'
target-only text, and the pool's drafts are accepted (`/v1/spec/stats`).

Long form, outside `make test`'s budget (a Serve app of its own, ~2 min here):
SPECSERVE_SERVE_SUFFIX=1 pytest tests/deployments/test_serve_suffix.py
(`make test-suffix-serve`).
"""

import os

import pytest

from conftest import SLOW_TARGET_ENV
from specserve.tools.serveproc import ServeProcess, get

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("SPECSERVE_SERVE_SUFFIX") != "1",
                       reason="long form: SPECSERVE_SERVE_SUFFIX=1 (make test-suffix-serve)"),
]

MAX_TOKENS = 48
# Answers that repeat: a tiny random model's greedy output loops.
PROMPTS = ["Hello world", "The quick brown fox", "Hello world again"]


def test_suffix_pool_through_serve(tiny_models, tmp_path):
    from openai import OpenAI
    from transformers import AutoTokenizer

    from specserve.testing.tiny import greedy_ids_for

    engine = {"dtype": "float32", "kv_cache_gib": 1}
    cfg = {
        "target": {"model": str(tiny_models["target"]), "name": "tiny",
                   "resources": {"cpus_per_worker": 1}, "engine": engine},
        "drafts": [{"name": "memory", "kind": "suffix",
                    "replicas": {"min_replicas": 1, "max_replicas": 1},
                    "resources": {"cpus_per_worker": 0.25}}],
        "speculation": {"num_speculative_tokens": 4},
        "ray": {"num_cpus": 4},
    }
    tok = AutoTokenizer.from_pretrained(str(tiny_models["target"]))
    want = [tok.decode(ids) for ids in greedy_ids_for(
        tiny_models["target"], [tok(p)["input_ids"] for p in PROMPTS], MAX_TOKENS)]
    server = ServeProcess(cfg, tmp_path, env=SLOW_TARGET_ENV)
    try:
        server.wait_ready("tiny")
        c = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        for _ in range(2):
            for prompt, text in zip(PROMPTS, want):
                r = c.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0.0, extra_body={"ignore_eos": True})
                got = r.choices[0].text
                # The same tokens; a last token that ends inside a UTF-8 character
                # is held back by the server's incremental detokenizer.
                assert got == text or (text.endswith("\ufffd") and got == text.rstrip("\ufffd"))
        status, stats = get(f"{server.url}/v1/spec/stats")
        assert status == 200
        pools = {d["model"]: d for d in stats["draft_models"]}
        assert pools["memory"]["accepted_tokens"] > 0, stats
    finally:
        code = server.stop(require_clean=True)
        assert code == 0, server.tail()
