"""deployments/target.py without Ray or an engine: a replica whose engine is
dead tells the router (TargetUnavailable, which the router retries or answers
503) instead of passing on vLLM's 500, and ends its own process so that Serve
replaces it at once."""

import asyncio
import threading
from types import SimpleNamespace

import pytest

from deployments import target
from specserve.openai_api import TargetUnavailable


def replica(errored: bool) -> target.TargetServer:
    server = target.TargetServer.__new__(target.TargetServer)  # no engine started
    server.engine = SimpleNamespace(errored=errored)
    return server


def test_a_request_on_a_dead_engine_raises_target_unavailable_before_anything_is_sent():
    async def go():
        calls = replica(errored=True).http("POST", "/v1/completions", "", [], b"{}")
        with pytest.raises(TargetUnavailable):
            await calls.__anext__()

    asyncio.run(go())


def test_the_watcher_ends_the_replica_soon_after_the_engine_dies(monkeypatch):
    server = replica(errored=False)
    ended = threading.Event()
    monkeypatch.setattr(target, "_end_process_tree", ended.set)
    monkeypatch.setattr(target, "ENGINE_WATCH_S", 0.01)
    monkeypatch.setattr(target, "DEAD_GRACE_S", 0.05)
    monkeypatch.setattr(target, "replica_name", lambda: "r0")
    watcher = threading.Thread(target=server._watch_engine, daemon=True)
    watcher.start()
    assert not ended.wait(0.2), "ended while the engine was alive"
    server.engine.errored = True
    assert ended.wait(5), "the replica did not end after its engine died"
    watcher.join(5)


def test_only_vllms_failures_on_a_dead_engine_become_target_unavailable():
    """An answer the engine finished before it died goes on as it is; a 5xx
    start or an SSE error event of vLLM's does not reach the client."""
    assert target._is_error({"status": 500, "headers": []})
    assert not target._is_error({"status": 200, "headers": []})
    assert not target._is_error({"status": 400, "headers": []})  # the client's error
    assert target._is_error(b'data: {"a": 1}\n\ndata: {"error": {"message": "dead"}}\n\n')
    assert not target._is_error(b'data: {"choices": [{"text": "data: {\\"error\\""}]}\n\n')
    assert not target._is_error(b"data: [DONE]\n\n")
