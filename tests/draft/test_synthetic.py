"""The synthetic draft `synthetic:A`: the rule alone, then against a live target.

End to end, over the real gRPC path: the measured conditional acceptance (from
vLLM's per-position counters) is within ±0.03 of A, and greedy output still
equals transformers' target-only output.
"""

import asyncio
import random

import pytest

from specserve.acceptance.record import Figures
from specserve.draft import synthetic
from specserve.draft.runner import DraftRunner

# ---- the rule ---------------------------------------------------------------------


def test_parse():
    assert synthetic.parse("synthetic:0.8") == synthetic.SyntheticSpec(0.8, 0.0, 0.6)
    assert synthetic.parse("synthetic:0.8@20ms,h0.3") == synthetic.SyntheticSpec(0.8, 20.0, 0.3)
    assert str(synthetic.parse("synthetic:0.8@20ms,h0.3")) == "synthetic:0.8@20ms,h0.3"
    assert synthetic.parse("synthetic:1@2.5ms") == synthetic.SyntheticSpec(1.0, 2.5)
    assert str(synthetic.parse("synthetic:0.80@2ms")) == "synthetic:0.8@2ms"
    for bad in ["synthetic:", "synthetic:1.5", "synthetic:0.8@2", "synthetic:x", "synth:0.8",
                "synthetic:0.8,h1.5", "synthetic:0.8,h"]:
        with pytest.raises(ValueError, match="synthetic"):
            synthetic.parse(bad)
    assert synthetic.is_synthetic("Synthetic:0.5") and not synthetic.is_synthetic("/models/x")


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 1.0])
def test_corruption_rate_and_determinism(alpha):
    rng = random.Random(1)
    truth = [rng.randrange(320) for _ in range(20000)]
    digest = synthetic.prompt_digest([5, 6, 7])
    drafted = [synthetic.drafted_token(t, alpha, 3, digest, p, 320) for p, t in enumerate(truth)]
    kept = sum(d == t for d, t in zip(drafted, truth)) / len(truth)
    assert abs(kept - alpha) < 0.015  # 20000 Bernoulli draws: SE <= 0.0036
    assert all(0 <= d < 320 for d in drafted)
    # Same (seed, prompt, position): same token; another seed or prompt: other draws.
    again = [synthetic.drafted_token(t, alpha, 3, digest, p, 320) for p, t in enumerate(truth)]
    assert again == drafted
    if 0 < alpha < 1:
        other = [synthetic.drafted_token(t, alpha, 4, digest, p, 320) for p, t in enumerate(truth)]
        assert other != drafted


@pytest.mark.parametrize("hit", [0.0, 0.6, 1.0])
def test_alternatives_hold_the_targets_token_at_the_recovery_hit_rate(hit):
    rng = random.Random(2)
    digest = synthetic.prompt_digest([1, 2])
    corrupted = found = 0
    ranks = [0] * synthetic.FAN_OUT
    for p in range(20000):
        t = rng.randrange(320)
        main = synthetic.drafted_token(t, 0.8, 3, digest, p, 320)
        alts = synthetic.alternatives(t, 0.8, hit, 3, digest, p, 320)
        assert len(alts) == len(set(alts)) == synthetic.FAN_OUT and main not in alts
        assert alts == synthetic.alternatives(t, 0.8, hit, 3, digest, p, 320)  # pure
        if main != t:
            corrupted += 1
            if t in alts:
                found += 1
                ranks[alts.index(t)] += 1
        else:
            assert t not in alts  # nothing to recover where the draft was right
    assert abs(found / corrupted - hit) < 0.03  # ~4000 draws: SE <= 0.008
    if found:  # rank i with probability 1/(i+1) / (1 + 1/2 + 1/3)
        shares = [n / found for n in ranks]
        assert shares == pytest.approx([6 / 11, 3 / 11, 2 / 11], abs=0.03)


def test_branches_follow_the_main_line_and_grow_with_it():
    replay = synthetic.Replay([([1, 2], list(range(10, 30)))])
    model = synthetic.SyntheticDraftModel(synthetic.parse("synthetic:0.5,h1"), replay, 320)
    digest = synthetic.prompt_digest([1, 2])
    seq = [1, 2, *range(10, 30)]
    main = [1, 2] + [synthetic.drafted_token(seq[q], 0.5, 0, digest, q, 320) for q in range(2, 8)]
    for fork in range(2, 8):
        bs = model.branches("r", main, fork, 2, length=3)
        assert len(bs) == 2 and all(b[0] != main[fork] for b in bs)
        # Continued by the main line's own draws, only as far as it is drafted.
        assert all(b[1:] == main[fork + 1 : fork + 4] for b in bs)
        if main[fork] != seq[fork]:  # corrupted, H = 1: the target's token is offered
            assert any(b[0] == seq[fork] for b in model.branches("r", main, fork, 4, 3))
    assert model.branches("r", main, 1, 2, 3) == [] and model.branches("r", main, 8, 2, 3) == []
    assert model.branches("r", [7, 7, 7], 2, 2, 3) == []  # unknown prompt


def test_replay_lookup_and_divergence(tmp_path):
    path = tmp_path / "replay.jsonl"
    synthetic.write_replay(path, [([1, 2], [10, 11, 12]), ([1, 2, 3], [20, 21])])
    replay = synthetic.Replay.load(path)
    assert len(replay) == 2
    seq, n, _ = replay.find([1, 2, 3, 20])
    assert (seq, n) == ([1, 2, 3, 20, 21], 3)  # the longest recorded prompt wins
    assert replay.find([1, 2, 10])[1] == 2
    assert replay.find([9, 9]) is None


async def _draft(model, tokens, max_tokens=100):
    out = []
    async for new in model.continue_tokens("s", "r", tokens, max_tokens):
        out.extend(new)
    return out


def test_model_replays_corrupts_and_falls_silent():
    truth = list(range(100, 160))
    replay = synthetic.Replay([([1, 2], truth)])
    spec = synthetic.SyntheticSpec(0.7)
    model = synthetic.SyntheticDraftModel(spec, replay, vocab_size=320, seed=0)
    drafted = asyncio.run(_draft(model, [1, 2]))
    assert len(drafted) == len(truth)
    digest = synthetic.prompt_digest([1, 2])
    assert drafted == [synthetic.drafted_token(t, 0.7, 0, digest, 2 + i, 320)
                       for i, t in enumerate(truth)]
    assert 0 < sum(d != t for d, t in zip(drafted, truth)) < len(truth)
    # Continuing from its own (corrupted) drafts: the same tokens further on.
    assert asyncio.run(_draft(model, [1, 2] + drafted[:10], 5)) == drafted[10:15]
    # The target left the recorded path: nothing. Past the record, unknown prompt: nothing.
    wrong = truth[0] + 1 if drafted[0] != truth[0] + 1 else truth[0] + 2
    assert asyncio.run(_draft(model, [1, 2, wrong])) == []
    assert asyncio.run(_draft(model, [1, 2] + truth)) == []
    assert asyncio.run(_draft(model, [7, 7])) == [] and model.unknown_prompts == 1


def test_model_looks_a_requests_record_up_once():
    truth = list(range(100, 140))
    replay = synthetic.Replay([([1, 2], truth), ([5, 6, 7], truth)])
    finds = []
    find = replay.find
    replay.find = lambda tokens: finds.append(list(tokens)) or find(tokens)
    model = synthetic.SyntheticDraftModel(synthetic.SyntheticSpec(0.7), replay, vocab_size=320)
    first = asyncio.run(_draft(model, [1, 2], 10))
    assert asyncio.run(_draft(model, [1, 2] + first[:4], 6)) == first[4:10]
    assert model.branches("r", [1, 2] + first, 3, 2, 4)
    assert len(finds) == 1  # one lookup for the request's segments and branches
    # The same id with another prompt is looked up again, and so is a forgotten one.
    assert asyncio.run(_draft(model, [5, 6, 7], 3))
    model.forget("r", before=5)
    asyncio.run(_draft(model, [5, 6, 7], 3))
    assert len(finds) == 2
    model.forget("r")
    asyncio.run(_draft(model, [5, 6, 7], 3))
    assert len(finds) == 3


def test_runner_waits_when_the_model_has_nothing():
    """A segment that yields nothing must not be retried in a busy loop."""

    class Silent:
        max_model_len = 1000
        calls = 0

        async def continue_tokens(self, *a):
            Silent.calls += 1
            return
            yield

    class Link:
        def open(self, *a, **kw): pass
        def send_draft(self, *a): pass
        def send_done(self, *a): pass
        def close_request(self, *a): pass
        async def close(self): pass

    async def go():
        runner = DraftRunner(Silent(), link_factory=lambda a: Link())
        runner.start("r", [1, 2], "sink", lookahead=4, max_tokens=10)
        for _ in range(200):
            await asyncio.sleep(0)
        before = Silent.calls
        runner._on_verified("r", 2, [5])  # the target moved on: ask the model again
        for _ in range(200):
            await asyncio.sleep(0)
        await runner.close()
        return before, Silent.calls

    before, after = asyncio.run(go())
    assert before == 1 and after == 2


# ---- against a live target ----------------------------------------------------------

ALPHA = 0.8
PROMPTS = ["Hello world", "The quick brown fox", "abc", "Speculative decoding on CPU",
           "one two three", "lorem ipsum", "zzz", "A synthetic draft"]
TOKENS = 256  # 8 x 256 output tokens: ~1600 trials, SE of alpha-hat ~0.01


@pytest.mark.slow
def test_acceptance_is_alpha_and_output_is_target_only(tiny_models):
    from transformers import AutoTokenizer

    from specserve.engine import EngineSettings
    from specserve.local import LocalSpec, run_prompts, sampling_params
    from specserve.testing.tiny import greedy_reference

    target = str(tiny_models["target"])
    tok = AutoTokenizer.from_pretrained(target)

    from specserve.config import SpeculationConfig

    async def run():
        settings = EngineSettings(dtype="float32", kv_cache_gib=1)
        # Every step proposes the full K: vLLM's per-position counters, from
        # which alpha is read here, cannot tell a shorter window from a
        # rejection (per_request_k would shorten them where they do not pay).
        spec_config = SpeculationConfig(num_speculative_tokens=4, per_request_k=False)
        async with LocalSpec(target, f"synthetic:{ALPHA}", k=4, lookahead=8,
                             settings=settings, speculation=spec_config) as spec:
            outs = await run_prompts(spec, tok, PROMPTS, sampling_params(TOKENS, 0.0, True))
            return outs, spec.totals

    outs, totals = asyncio.run(run())
    reference = greedy_reference(target, PROMPTS, TOKENS)
    assert [o.token_ids for o in outs] == reference
    f = Figures.of_engine(sum(len(o.token_ids) for o in outs), totals.num_drafts,
                          totals.draft_tokens, totals.accepted_per_position,
                          totals.draft_per_position)
    alpha_hat, trials = f.alpha, f.alpha_trials
    assert trials >= 1200, totals  # enough drafts reached the target to judge
    assert abs(alpha_hat - ALPHA) <= 0.03, (alpha_hat, totals)
    # ... while vLLM's plain accepted/drafted is well below alpha.
    assert totals.acceptance_rate < ALPHA - 0.1, totals


@pytest.mark.slow  # two CLI subprocesses, no engine
def test_cli_refuses_bad_or_unsupported_synthetic_drafts(tiny_models):
    from conftest import run_cli

    proc = run_cli("generate", "--target", str(tiny_models["target"]),
                   "--draft", "synthetic:1.5", "--prompt", "x")
    assert proc.returncode == 2 and "outside [0, 1]" in proc.stderr
    proc = run_cli("serve", "--target", str(tiny_models["target"]), "--draft", "synthetic:0.8")
    assert proc.returncode == 2 and "generate' and 'specserve bench' only" in proc.stderr
