"""The hybrid draft (specserve/draft/hybrid.py): the choice between the memory
and the model (pure), the per-source acceptance from verified tokens, and
HybridDraftModel over a scripted model and a real suffix memory: the memory's
tokens where they score above the model's measured acceptance, the model's
elsewhere, the model's request stopped when the memory takes over, the memory's
draft as a branch where the model's token won, and with the DraftRunner the
target's tokens only ever learned. Its config kind and draft spec. The engine
path is tests/test_generate.py::test_hybrid_draft."""

import asyncio

import pytest

from specserve.config import ConfigError, DraftConfig, SuffixConfig
from specserve.draft.hybrid import (MEMORY, MODEL, HybridDraftModel, SourceTally, is_hybrid,
                                    memory_wins, model_expected_tokens, model_of)
from specserve.draft.runner import DraftRunner
from specserve.draft.suffix import SuffixDraftModel

from test_suffix import Link, _run_request


def test_model_expected_tokens_is_the_geometric_sum():
    assert model_expected_tokens(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert model_expected_tokens(1.0, 4) == 4.0
    assert model_expected_tokens(0.0, 4) == 0.0


def test_the_memory_wins_where_its_score_reaches_the_models_expectation():
    # A 4-token memory draft that the walk gives 0.9 at every prefix: score 3.6.
    assert memory_wins(4, 3.6, 0.5)  # the model expects 0.94
    assert not memory_wins(4, 3.6, 0.97)  # the model expects 3.71
    assert memory_wins(1, 0.5, 0.5)  # a tie: the memory costs no model step
    assert not memory_wins(1, 0.2, 0.5)
    assert not memory_wins(0, 0.0, 0.0)  # nothing to send


def test_each_source_is_scored_on_the_positions_it_drafted():
    t = SourceTally()
    t.drafted_tokens("r", 10, [1, 2], MEMORY)
    t.drafted_tokens("r", 12, [3, 4, 5], MODEL)
    t.verified("r", [0] * 10 + [1, 2, 3, 9, 5, 6])
    # memory: 2 agreed; model: 1 agreed, then a rejection at 13; 14 is void.
    assert (t.agreed[MEMORY], t.rejected[MEMORY]) == (1 + 2, 1)
    assert (t.agreed[MODEL], t.rejected[MODEL]) == (1 + 1, 1 + 1)
    assert t.alpha(MODEL) == pytest.approx(0.5)
    t.verified("r", [0] * 20)  # nothing of the line is left to score
    assert (t.agreed[MODEL], t.rejected[MODEL]) == (2, 2)


def test_a_restarted_line_voids_what_was_drafted_after_its_start():
    t = SourceTally()
    t.drafted_tokens("r", 5, [1, 2, 3], MODEL)
    t.restart("r", 6)
    t.verified("r", [0] * 5 + [1, 7, 7])
    assert (t.agreed[MODEL], t.rejected[MODEL]) == (2, 1)


class ScriptedModel:
    """A draft model that continues any context with `line` from where the
    context ends (tokens past it are 0), and records the requests it was
    asked for and which were closed early."""

    max_model_len = 1 << 20

    def __init__(self, line):
        self.line = line
        self.asked: list[tuple[str, int]] = []  # (segment id, context length)
        self.closed: list[str] = []

    async def continue_tokens(self, segment_id, request_id, tokens, max_tokens):
        self.asked.append((segment_id, len(tokens)))
        try:
            for i in range(len(tokens), len(tokens) + max_tokens):
                await asyncio.sleep(0)
                yield [self.line[i] if i < len(self.line) else 0]
        except GeneratorExit:
            self.closed.append(segment_id)
            raise


def _drain(gen_factory):
    async def go():
        out = []
        async for new in gen_factory():
            out.extend(new)
        return out
    return asyncio.run(go())


REPEATED = [500 + i for i in range(12)]


def test_memory_tokens_where_it_knows_the_continuation_model_tokens_elsewhere():
    # The memory learned REPEATED from an earlier request; the model agrees
    # with nothing (it continues with 7s).
    memory = SuffixDraftModel(SuffixConfig(min_prob=0.1))
    memory.observe("earlier", [1] + REPEATED + [2])
    model = ScriptedModel([7] * 100)
    hybrid = HybridDraftModel(model, memory)
    context = [3, 4] + REPEATED[:3]  # matches 3 tokens of the earlier request
    out = _drain(lambda: hybrid.continue_tokens("s", "r", context, 12))
    # The memory drafts on from its match (length up to the match: 3, then
    # longer as it grows) ...
    assert out[:9] == REPEATED[3:12]
    # ... and where it has nothing more, the model drafts.
    assert out[-1] == 7 and len(out) == 12
    assert hybrid.tally.drafted[MEMORY] >= 9 and hybrid.tally.drafted[MODEL] >= 1


def test_the_model_is_stopped_where_the_memory_takes_over():
    memory = SuffixDraftModel(SuffixConfig(min_prob=0.1))
    memory.observe("earlier", [9, 8] + REPEATED)
    # The model drafts 9, 8 itself (the memory knows nothing after [5, 6]);
    # then the memory matches [9, 8] and takes over.
    model = ScriptedModel([5, 6, 9, 8] + [7] * 100)
    hybrid = HybridDraftModel(model, memory)
    out = _drain(lambda: hybrid.continue_tokens("s", "r", [5, 6], 6))
    assert out[:2] == [9, 8] and out[2:6] == REPEATED[:4], out
    assert model.asked[0] == ("s.1", 2) and "s.1" in model.closed


def test_a_model_that_drafts_well_keeps_the_line_over_a_weak_memory():
    memory = SuffixDraftModel(SuffixConfig(min_prob=0.1))
    memory.observe("a", [1, 2, 40])
    memory.observe("b", [1, 2, 41])
    memory.observe("c", [1, 2, 42])  # after [1, 2]: three continuations, 1/3 each
    model = ScriptedModel([1, 2, 50, 51, 52, 53])
    hybrid = HybridDraftModel(model, memory)
    for _ in range(40):  # the model's measured acceptance: high
        hybrid.tally.agreed[MODEL] += 1
    out = _drain(lambda: hybrid.continue_tokens("s", "r", [1, 2], 4))
    assert out == [50, 51, 52, 53]
    # Where the model's token won, the memory's draft there is a branch.
    branches = hybrid.branches("r", [1, 2] + out, 2, 3, 4)
    assert branches and branches[0][0] in (40, 41, 42) and all(b[0] != 50 for b in branches)


def test_with_the_runner_it_learns_only_the_targets_tokens():
    memory = SuffixDraftModel(SuffixConfig())
    model = ScriptedModel([0] * 100)  # a model that is always wrong
    hybrid = HybridDraftModel(model, memory)
    link = Link()

    async def go():
        runner = DraftRunner(hybrid, link_factory=lambda a: link)
        await _run_request(runner, link, "first", [1, 2] + REPEATED, REPEATED[:8])
        await _run_request(runner, link, "second", [3, 4] + REPEATED[:2], REPEATED[2:10])
        await runner.close()
    asyncio.run(go())
    # The second request's drafts come from what the target verified (the
    # memory), not from the model's zeros: its sent windows hold REPEATED.
    sent = [t for _, tokens, _ in link.sent["second"] for t in tokens]
    assert set(REPEATED[3:10]) <= set(sent)
    assert memory.draft("probe", [1, 2] + REPEATED[:4], 4).tokens == REPEATED[4:8]
    # The model's zeros were rejected: its measured acceptance fell below the prior.
    assert hybrid.tally.alpha(MODEL) < 0.5


def test_the_config_kind_and_the_draft_spec():
    d = DraftConfig(name="h", kind="hybrid", model="default")
    assert d.draft_spec == "hybrid:default" and d.has_model
    assert not DraftConfig(name="s", kind="suffix").has_model
    with pytest.raises((ConfigError, ValueError), match="kind hybrid needs a model folder"):
        DraftConfig(name="h", kind="hybrid")
    assert is_hybrid("hybrid:/m") and model_of("hybrid:/m") == "/m" and not is_hybrid("/m")
    with pytest.raises(ValueError, match="hybrid:FOLDER"):
        model_of("hybrid:")
