"""The suffix draft (specserve/draft/suffix.py) with the DraftRunner and a fake
sink link: it learns only verified tokens, drafts a request from its own
history and from other requests' (the fleet memory), and not from others'
when sharing is off. Its config kind (DraftConfig kind: suffix). The engine
path is tests/test_generate.py::test_suffix_draft."""

import asyncio

import pytest

from specserve.config import AppConfig, ConfigError, DraftConfig, SuffixConfig
from specserve.draft.runner import BranchPlan, DraftRunner
from specserve.draft.suffix import SuffixDraftModel, is_suffix


class Link:
    """Records what the runner sends, per request: (position, tokens, branches)."""

    def __init__(self):
        self.sent: dict[str, list] = {}

    def open(self, *a, **kw): pass
    def close_request(self, *a): pass
    async def close(self): pass

    def send_draft(self, rid, position, tokens, branches=()):
        self.sent.setdefault(rid, []).append((position, list(tokens), list(branches)))

    def send_done(self, rid, end, last): pass


async def _settle():
    for _ in range(50):
        await asyncio.sleep(0)


def _run_request(runner, link, rid, prompt, output):
    """Start a request and verify `output` one token at a time, as a target would."""
    async def go():
        runner.start(rid, prompt, "sink", lookahead=8, max_tokens=len(output) + 1)
        await _settle()
        for i, t in enumerate(output):
            runner._on_verified(rid, len(prompt) + i, [t])
            await _settle()
        runner.cancel(rid)
    return go()


LINE = [300 + i for i in range(30)]  # a "file" the answer repeats


def test_drafts_from_its_own_prompt():
    model = SuffixDraftModel(SuffixConfig(share=False))
    link = Link()

    async def go():
        runner = DraftRunner(model, link_factory=lambda a: link)
        await _run_request(runner, link, "r", [1, 2] + LINE + [9], LINE[:12])
        await runner.close()
    asyncio.run(go())
    # Once the answer starts repeating the prompt's line, the drafts are the
    # line's next tokens, longer as the match grows, up to the lookahead (8).
    drafts = [(p, t) for p, t, _ in link.sent["r"]]
    assert drafts[0] == (2 + 31 + 1, [LINE[1]]), drafts
    assert any(p == 34 and t[:8] == LINE[1:9] for p, t in drafts), drafts


@pytest.mark.parametrize("share", [True, False])
def test_fleet_memory_serves_another_request(share):
    model = SuffixDraftModel(SuffixConfig(share=share))
    link = Link()
    answer = [500 + i for i in range(20)]

    async def go():
        runner = DraftRunner(model, link_factory=lambda a: link)
        # Request a (on any target) answers with `answer`; b asks the same later.
        await _run_request(runner, link, "a", [7, 8, 9], answer)
        await _run_request(runner, link, "b", [1, 7, 8, 9], answer[:6])
        await runner.close()
    asyncio.run(go())
    first = link.sent.get("b", [])
    if share:
        # b's first draft, before any verified token: a's answer, from the prompt's match.
        assert first and first[0][0] == 4 and first[0][1][:3] == answer[:3], first
        assert model.fleet is not None and "a" in model.fleet and "b" in model.fleet
    else:
        assert not first or first[0][0] > 4  # nothing to draft from at the prompt
        assert model.fleet is None


def test_learns_only_verified_tokens_and_forgets_finished_requests():
    model = SuffixDraftModel(SuffixConfig())
    model.observe("r", [1, 2, 3])
    model.observe("r", [1, 2, 3, 4, 5])
    assert model.fleet.length("r") == 5 and model._own["r"].length("r") == 5
    model.forget("r")
    assert "r" not in model._own and "r" in model.fleet  # the fleet keeps what it learnt


def test_branches_are_the_other_continuations():
    model = SuffixDraftModel(SuffixConfig(), fan_out=2)
    for i, tail in enumerate([[10, 11, 12], [10, 11, 12], [20, 21, 22]]):
        model.observe(f"old{i}", [1, 2, 3, *tail])

    async def go():
        runner = DraftRunner(model, link_factory=lambda a: link, branches=BranchPlan(2, 6, 3))
        runner.start("new", [5, 1, 2, 3], "sink", lookahead=4, max_tokens=8)
        await _settle()
        await runner.close()
    link = Link()
    asyncio.run(go())
    pos, tokens, branches = link.sent["new"][0]
    assert pos == 4 and tokens[:3] == [10, 11, 12]
    assert (4, [20, 21, 22]) in [(p, b) for p, b in branches], branches


def test_flood_of_distinct_requests_stays_bounded():
    cfg = SuffixConfig(max_tokens=2000, max_requests=20, max_request_tokens=400, max_depth=8)
    model = SuffixDraftModel(cfg, max_live=16)
    for i in range(60):
        prompt = [(i * 7919 + j * 104729) % 50_000 for j in range(1000)]  # huge, distinct
        model.observe(f"r{i}", prompt)
        assert model.fleet.tokens <= 2000 and len(model.fleet) <= 20
        assert len(model._own) <= 16
        assert all(ix.tokens <= 400 for ix in model._own.values())
    assert model.fleet.nodes <= 2000 * 8 and model.fleet.evicted > 0


def test_config_kind_suffix():
    d = DraftConfig(name="memory", kind="suffix", suffix={"share": False, "max_tokens": 1000})
    assert d.draft_spec == "suffix" and is_suffix(d.draft_spec) and not d.suffix.share
    assert DraftConfig(name="m", model="default").draft_spec == "default"
    with pytest.raises(ValueError, match="needs a model folder"):
        DraftConfig(name="m")
    with pytest.raises(ValueError, match="runs no model"):
        DraftConfig(name="m", kind="suffix", model="default")
    with pytest.raises(ConfigError, match="suffix"):
        AppConfig.from_dict({"drafts": [{"name": "m", "kind": "suffix",
                                         "suffix": {"max_tokens": 0}}]})


def test_the_serve_draft_replica_runs_a_suffix_pool_without_an_engine():
    """deployments/draft.py's DraftServer (a plain class) with kind: suffix."""
    from deployments.draft import DraftServer

    server = DraftServer({"name": "memory", "kind": "suffix", "suffix": {"share": False}},
                         speculation={"num_speculative_tokens": 4})
    try:
        assert server.worker.engine is None
        model = server.runner.model
        assert isinstance(model, SuffixDraftModel) and model.fleet is None
        assert server.runner.plan is not None  # branches from the memory's alternatives
    finally:
        asyncio.run(server.worker.close())
