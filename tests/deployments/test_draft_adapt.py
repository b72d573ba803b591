"""deployments/draft.py's DraftServer (a plain class) with `adapt.enabled`: the
config's buffer reaches the runner, the pool's version store opens with v0, and
`adapt()` answers the figures /v1/spec/stats shows. No Ray, no engine: the
worker's model is a stand-in."""

from __future__ import annotations

import asyncio

import pytest

from specserve.draft.runner import DraftRunner
from specserve.draft.worker import DraftWorker


class Echo:
    """Drafts nothing: the test is about what the replica collects."""

    max_model_len = 1000

    async def continue_tokens(self, segment_id, request_id, tokens, max_tokens):
        return
        yield


@pytest.fixture
def no_engine(monkeypatch):
    def start(cls, model, settings, *, adapt=None, **kwargs):
        link = type("Link", (), {"open": lambda *a: None, "close_request": lambda *a: None,
                                 "send_done": lambda *a: None,
                                 "close": staticmethod(lambda: asyncio.sleep(0))})()
        return cls(DraftRunner(Echo(), link_factory=lambda address: link, adapt=adapt),
                   None, [])
    monkeypatch.setattr(DraftWorker, "start", classmethod(start))


def test_an_adapting_draft_replica_collects_and_reports(tmp_path, no_engine):
    from deployments.draft import DraftServer

    server = DraftServer({"name": "small", "model": "/models/draft",
                          "adapt": {"enabled": True, "versions_dir": str(tmp_path / "v"),
                                    "heldout_share": 0.5}},
                         speculation={"num_speculative_tokens": 4})

    async def traffic():
        for i in range(20):
            server.runner.start(f"r{i}", [1, 2, 3], "sink:1", lookahead=4, max_tokens=10)
            server.runner._on_verified(f"r{i}", 3, [4, 5, 6])
            server.runner.cancel(f"r{i}")
        await server.runner.close()

    asyncio.run(traffic())
    figures = server.adapt()
    assert figures == {"version": "v0", "heldout_alpha_serving": None,
                       "heldout_alpha_candidate": None, "buffer_tokens": 120,
                       "heldout_tokens": figures["heldout_tokens"], "swaps": 0,
                       "rollbacks": 0, "rounds": 0, "train_seconds": 0.0, "last_round": None}
    assert server.adapter.loaded == "v0" and server.adapter.task is None  # starts on a call
    assert 0 < figures["heldout_tokens"] < 120
    assert server.versions.versions()[0]["source"] == "/models/draft"


def test_a_draft_replica_without_adapt_collects_nothing(no_engine):
    from deployments.draft import DraftServer

    server = DraftServer({"name": "small", "model": "/models/draft"},
                         speculation={"num_speculative_tokens": 4})
    assert server.adapt() is None and server.runner.adapt is None


def test_a_target_replica_asks_only_the_adapting_pools():
    """TargetServer.draft_adapt (the way the router's stats reach the draft
    pools), on a stand-in replica: no engine."""
    from types import SimpleNamespace

    from deployments.target import TargetServer
    from fake_target import FakeRemote
    from specserve.config import AppConfig

    config = AppConfig.from_dict({"drafts": [
        {"name": "a", "model": "/m", "adapt": {"enabled": True}},
        {"name": "b", "model": "/m"},
        {"name": "dead", "model": "/m", "adapt": {"enabled": True}}]})
    handles = {"a": SimpleNamespace(adapt=FakeRemote({"version": "v0"}), active=FakeRemote(2)),
               "b": SimpleNamespace(adapt=FakeRemote({"version": "v9"}), active=FakeRemote(0)),
               "dead": SimpleNamespace(adapt=FakeRemote(error=RuntimeError()),
                                       active=FakeRemote(error=RuntimeError()))}
    replica = SimpleNamespace(config=config, drafts=handles,
                              _ask_drafts=TargetServer._ask_drafts)
    assert asyncio.run(TargetServer.draft_adapt(replica)) == {
        "a": {"version": "v0"}, "b": None, "dead": "unavailable: RuntimeError"}
    assert handles["b"].adapt.calls == 0
    assert asyncio.run(TargetServer.draft_active(replica)) == {
        "a": 2, "b": 0, "dead": "unavailable: RuntimeError"}
