"""The Serve request routers of deployments/routing.py, without a cluster:
fake replicas behind Ray Serve's own RequestRouter machinery (queue-length
cache, ranks), as Ray's router tests drive it."""

import asyncio
import json

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from deployments import routing
from deployments.routing import DraftAffinityRouter, TargetAffinityRouter


class FakeReplica:
    """What a RunningReplica shows a request router."""

    def __init__(self, name: str, deployment: DeploymentID, queue_len: int = 0):
        self.replica_id = ReplicaID(name, deployment)
        self.queue_len = queue_len
        self.max_ongoing_requests = 8
        self.node_id, self.availability_zone = "node", None
        self.multiplexed_model_ids: set[str] = set()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


def _router(cls, replicas: list[FakeReplica]):
    r = cls(deployment_id=replicas[0].replica_id.deployment_id,
            handle_source=DeploymentHandleSource.REPLICA, use_replica_queue_len_cache=True)
    r.initialize_state(max_extra_requests=2)
    r.update_replicas(replicas)
    return r


def _request(n: int, *args) -> PendingRequest:
    return PendingRequest(args=list(args), kwargs={},
                          metadata=RequestMetadata(request_id=f"r{n}", internal_request_id=f"i{n}"))


def _chat(*turns: str) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 4, "messages": [
        {"role": "system", "content": "You answer questions about rivers. " * 3},
        *({"role": "user", "content": t} for t in turns)]}).encode()


async def _route(router, replicas, pending) -> str:
    """Where Serve sends the request: the first rank's least loaded replica
    that is not full (RequestRouter._select_from_candidate_replicas)."""
    for rank in await router.choose_replicas(replicas, pending):
        chosen = await router._select_from_candidate_replicas(rank, 0)
        if chosen is not None:
            router.on_request_routed(pending, chosen.replica_id, None)
            return chosen.replica_id.unique_id
    raise AssertionError("no replica")


@pytest.fixture(autouse=True)
def _fresh_tallies(monkeypatch):
    monkeypatch.setattr(routing, "_TALLIES", {})


def test_a_conversation_follows_its_prefix_within_the_load_bound():
    async def go():
        dep = DeploymentID(name="target", app_name="specserve")
        a, b = FakeReplica("a", dep), FakeReplica("b", dep)
        router = _router(TargetAffinityRouter, [a, b])
        await asyncio.sleep(0)  # the routers' first probe of the new replicas
        first = await _route(router, [a, b], _request(1, "POST", "/v1/chat/completions", "",
                                                      [], _chat("Where is the Nile?")))
        home = {"a": a, "b": b}[first]
        other = b if home is a else a
        # The next turn goes home, busier by up to the bound...
        home.queue_len, other.queue_len = 2, 0
        router._replica_queue_len_cache.update(home.replica_id, 2)
        router._replica_queue_len_cache.update(other.replica_id, 0)
        body = _chat("Where is the Nile?", "And the Amazon?")
        assert await _route(router, [a, b], _request(2, "POST", "/v1/chat/completions", "",
                                                     [], body)) == first
        # ... and elsewhere past it.
        router._replica_queue_len_cache.update(home.replica_id, 3)
        assert await _route(router, [a, b], _request(3, "POST", "/v1/chat/completions", "",
                                                     [], body)) != first
        # A full home replica (within the bound, the only one holding the
        # prefix: request 3 taught the index the other one): Serve's next rank.
        router._index.drop(other.replica_id.to_full_id_str())
        home.queue_len, other.queue_len = 8, 7
        router._replica_queue_len_cache.update(home.replica_id, 8)
        router._replica_queue_len_cache.update(other.replica_id, 7)
        assert await _route(router, [a, b], _request(4, "POST", "/v1/chat/completions", "",
                                                     [], body)) != first
        # No prefix (a GET, a short prompt): power of two choices, not counted.
        await _route(router, [a, b], _request(5, "GET", "/v1/models", "", [], b""))
        tally = routing.tallies()["target"]
        assert tally["choices"] == {"load": 1, "prefix": 1, "balance": 1, "full": 1}, tally
        # A replica that goes away is forgotten.
        router.update_replicas([other])
        assert all(home.replica_id.to_full_id_str() not in h
                   for h in router._index._keys.values())

    asyncio.run(go())


def test_draft_requests_go_to_the_replica_that_drafted_their_prefix():
    async def go():
        dep = DeploymentID(name="draft-same", app_name="specserve")
        reps = [FakeReplica(n, dep) for n in "xyz"]
        router = _router(DraftAffinityRouter, reps)
        await asyncio.sleep(0)
        prompt = list(range(3, 83))
        seen = set()
        for turn in range(4):
            prompt = prompt + [7 + turn] * 20  # the next turn: the last one's ids, and more
            seen.add(await _route(router, reps, _request(turn, f"req-{turn}", prompt,
                                                         "sink:1", 9, 16, 4, "ticket")))
        assert len(seen) == 1
        assert routing.tallies("draft-")["draft-same"]["choices"]["prefix"] == 3

    asyncio.run(go())


def test_calls_that_share_a_caller_request_are_all_routed():
    # The calls one caller request makes share its internal request id (the
    # router's /v1/spec/stats asks a target replica three things at once):
    # Serve's own routing loop must route each of them.
    async def go():
        dep = DeploymentID(name="target", app_name="specserve")
        reps = [FakeReplica("a", dep), FakeReplica("b", dep)]
        router = _router(TargetAffinityRouter, reps)
        await asyncio.sleep(0)
        calls = [PendingRequest(args=list(args), kwargs={}, metadata=RequestMetadata(
            request_id="r", internal_request_id="shared")) for args in
            [(), ("POST", "/v1/chat/completions", "", [], _chat("Where is the Nile?")), ()]]
        chosen = await asyncio.wait_for(
            asyncio.gather(*(router._choose_replica_for_request(c) for c in calls)), 10)
        assert len(chosen) == 3

    asyncio.run(go())
