"""The per-request quotas (specserve/target/quotas.py) alone, and where they
are applied without an engine: vLLM's app behind the request gate, and
DraftingEngine.generate on a stand-in engine."""

import asyncio
import json

import pytest

from specserve.config import QuotaConfig
from specserve.target.quotas import body_problem, completion_tokens, prompt_problem, prompts_in

Q = QuotaConfig(max_n=4, max_prompt_tokens=10, max_completion_tokens=20)


@pytest.mark.parametrize("body, field", [
    ({"n": 5}, "n"),
    ({"best_of": 5}, "best_of"),
    ({"n": 2, "prompt": ["a", "b", "c"]}, "n"),  # 6 sequences
    ({"n": 2, "prompt": [[1, 2], [3], [4]]}, "n"),
    ({"max_tokens": 21}, "max_tokens"),
    ({"max_completion_tokens": 21}, "max_completion_tokens"),
])
def test_bodies_over_a_quota_name_the_field_and_the_config_key(body, field):
    got, message = body_problem(body, Q)
    assert got == field and "quotas." in message


@pytest.mark.parametrize("body", [
    {}, {"n": 4}, {"n": 2, "prompt": ["a", "b"]}, {"n": 4, "prompt": [1, 2, 3]},
    {"max_tokens": 20}, {"max_completion_tokens": 20},
    {"n": "5"}, {"n": True}, {"max_tokens": None},  # vLLM's to refuse or take
])
def test_bodies_within_the_quotas_or_of_other_types_pass(body):
    assert body_problem(body, Q) is None


def test_prompts_are_counted_as_completions_reads_them():
    assert prompts_in({"prompt": "a"}) == prompts_in({"prompt": [1, 2]}) == 1
    assert prompts_in({"prompt": ["a", "b"]}) == prompts_in({"prompt": [[1], [2]]}) == 2
    assert prompts_in({"messages": []}) == 1


def test_no_completion_cap_by_default_and_max_tokens_is_bounded_by_one():
    assert body_problem({"max_tokens": 10**6, "n": 16}, QuotaConfig()) is None
    assert body_problem({"n": 17}, QuotaConfig())[0] == "n"
    assert completion_tokens(5000, QuotaConfig()) == 5000
    assert completion_tokens(5000, Q) == 20 and completion_tokens(7, Q) == 7
    assert completion_tokens(None, Q) == 20


def test_prompt_tokens():
    assert prompt_problem(10, Q) is None and prompt_problem(10**6, QuotaConfig()) is None
    field, message = prompt_problem(11, Q)
    assert field == "prompt" and "11 tokens" in message and "quotas.max_prompt_tokens" in message


def test_the_engine_client_refuses_a_long_prompt_and_bounds_max_tokens():
    from types import SimpleNamespace

    from vllm.exceptions import VLLMValidationError

    from specserve.target.drafting import DraftingEngine

    class Engine:
        def generate(self, *a, **kw):  # never reached on a refusal
            raise AssertionError

    quotas = Q
    client = DraftingEngine(Engine(), None, 0, "t0", quotas=lambda: quotas)
    params = SimpleNamespace(n=1, seed=None, temperature=0.0, max_tokens=1000)
    with pytest.raises(VLLMValidationError) as e:
        client.generate({"prompt_token_ids": list(range(11))}, params, "r")
    assert e.value.parameter == "prompt"
    client.generate({"prompt_token_ids": list(range(10))}, params, "r")
    assert params.max_tokens == 20
    quotas = QuotaConfig()  # changed while running: read per request
    client.generate({"prompt_token_ids": list(range(11))}, params, "r")


def test_the_gate_answers_vllms_400_for_a_body_over_the_quotas():
    from fastapi import FastAPI
    from vllm.entrypoints.openai.completion.api_router import router

    from specserve.target import openai_app

    inner = FastAPI()
    inner.include_router(router)
    app = openai_app.RequestGate(inner, openai_app.request_fields(inner), lambda: Q)

    async def post(body: dict):
        items = [item async for item in openai_app.call(
            app, "POST", "/v1/completions", "", [("content-type", "application/json")],
            json.dumps(body).encode())]
        return items[0]["status"], json.loads(b"".join(items[1:]))

    status, body = asyncio.run(post({"model": "m", "prompt": "x", "n": 5}))
    error = body["error"]
    assert status == 400 and error["param"] == "n" and "quotas.max_n" in error["message"]
    assert error["type"] == "BadRequestError"
