"""The swap on a real vLLM engine: `specserve.adapt.adapter.reload_weights`
loads another version's weights into a running draft engine in place, and the
engine's greedy output becomes that version's (transformers is the oracle)."""

from __future__ import annotations

import uuid

import pytest

from conftest import PROMPTS, Loop
from specserve.testing.tiny import greedy_reference

pytestmark = pytest.mark.slow

TOKENS = 12


async def greedy(engine, ids: list[int]) -> list[int]:
    from vllm import SamplingParams

    out = None
    async for out in engine.generate({"prompt_token_ids": ids},
                                     SamplingParams(max_tokens=TOKENS, temperature=0.0,
                                                    ignore_eos=True), str(uuid.uuid4())):
        pass
    return list(out.outputs[0].token_ids)


def test_reload_weights_swaps_a_running_engines_weights_in_place(tiny_models):
    from transformers import AutoTokenizer

    from specserve.adapt.adapter import reload_weights
    from specserve.engine import (EngineSettings, apply_cpu_env, engine_args, shutdown_engine,
                                  start_engine)

    target, other = str(tiny_models["target"]), str(tiny_models["unrelated"])
    ids = AutoTokenizer.from_pretrained(target)(PROMPTS[1], add_special_tokens=False)["input_ids"]
    (want_target,) = greedy_reference(target, [PROMPTS[1]], TOKENS)
    (want_other,) = greedy_reference(other, [PROMPTS[1]], TOKENS)
    assert want_target != want_other  # else the swap would not show

    loop = Loop()
    settings = EngineSettings(max_model_len=256, max_num_seqs=4, dtype="float32")
    apply_cpu_env(settings)
    engine, procs = start_engine(engine_args(target, settings))
    try:
        assert loop.run(greedy(engine, ids)) == want_target
        loop.run(reload_weights(engine, other))
        assert loop.run(greedy(engine, ids)) == want_other  # the prefix cache was dropped too
        loop.run(reload_weights(engine, target))  # a rollback
        assert loop.run(greedy(engine, ids)) == want_target
    finally:
        shutdown_engine(engine, procs)
        loop.close()
