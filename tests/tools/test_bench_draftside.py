"""`specserve bench draftside` (specserve/tools/bench/draftside.py) in short:
its figures, and its runner phase through the real DraftRunner, SinkLink and
gRPC to the sink that accepts everything (its own process), with the model
that costs nothing (the ceiling phase's) instead of a vLLM engine: every drafted token comes back verified, in
fewer messages than tokens. The long form (a vLLM draft engine, 256 requests)
is documented in docs/benchmarks.md."""

import asyncio

import pytest

from specserve.tools.bench.draftside import (DraftSideArgs, InstantModel, compare,
                                             phase_figures, prompts, runner_phase,
                                             start_echo_sink, table)


def test_phase_figures_and_the_comparison():
    engine = phase_figures(1000, 2.0, 0.5)
    runner = phase_figures(1000, 2.5, 1.0)
    assert engine["tokens_per_s"] == 500 and engine["cpu_us_per_token"] == 500
    c = compare(engine, runner, batches=100, wire_tokens=1100)
    assert c["rate_vs_engine"] == pytest.approx(0.8)
    assert c["python_us_per_token"] == pytest.approx(500)
    assert c["batches_per_s"] == 40 and c["tokens_per_batch"] == 10
    assert "runner + link" in table({"engine": engine, "runner": runner, **c})


def test_prompts_are_seeded_and_in_the_vocabulary():
    a, b = prompts(3, 8, 1000, 1), prompts(3, 8, 1000, 1)
    assert a == b and a != prompts(3, 8, 1000, 2)
    assert all(100 <= t < 900 for p in a for t in p)


def test_every_drafted_token_is_verified_through_the_real_link():
    sink, address = start_echo_sink()
    try:
        a = DraftSideArgs(draft="scripted", requests=16, prompt_tokens=8, max_tokens=40)
        fig, batches, wire_tokens = asyncio.run(asyncio.wait_for(
            runner_phase(InstantModel(), prompts(16, 8, 1000, 0), a, address), 60))
    finally:
        sink.kill()
    assert fig["tokens"] == 16 * 40
    assert wire_tokens >= 16 * 40  # every token went out (once, unless re-sent)
    assert 0 < batches < 16 * 40  # coalesced: many requests' tokens per message
