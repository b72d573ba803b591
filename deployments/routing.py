"""Serve request routers that choose a replica by prefix within a load bound.

Ray Serve's request-router API (`ray.serve.request_router.RequestRouter`, set
per deployment by `deployments.app.build_app` through `request_router_config`,
`routing:` in the config) runs the router in the process of each caller of a
deployment handle: `TargetAffinityRouter` in the router replicas (choosing the
target replica of each HTTP request), `DraftAffinityRouter` in the target
replicas (choosing the draft replica of each engine request). Both are
adapters: the choice is `specserve.control.affinity.choose`, the memory of
which replica got which prefix its `PrefixIndex`. The load is what Serve's own
router knows, each replica's requests in flight (its queue-length cache,
probed where unknown). Ray Serve LLM's `PrefixCacheAffinityRouter` is the
model; it is not used as is because it keeps its tree in a detached actor that
it calls with a blocking `ray.get` on every request, reads a text prompt from
an argument's `.prompt` / `.messages` (ours are the raw body, and the draft's
are token ids), and says nothing of why it chose.

The index learns where a request went in `on_request_routed`, which Serve
calls when a replica accepts it (Serve's strict max_ongoing_requests: on,
except for handles used through Ray Client).

Calls without a prefix (the target's /v1/models, health and figures; a body
that is not a single conversation) go by Serve's power of two choices. Each
router counts its choices by reason (`specserve.control.affinity.Tally`),
readable in its process with `tallies()`, for /v1/spec/stats. Never does:
read more of a request than its messages, prompt or prompt token ids.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    FIFOMixin, LocalityMixin, MultiplexMixin, PendingRequest, ReplicaID, RequestRouter,
    RunningReplica,
)

from specserve.control.affinity import PrefixIndex, Tally, choose, conversation_text, prefix_keys

log = logging.getLogger("specserve.routing")

# Prefix granularity: characters of a target request's text, token ids of a
# draft request's prompt (a CPU engine's KV block is 128 tokens, a GPU's 16).
TARGET_CHUNK_CHARS = 64
DRAFT_CHUNK_TOKENS = 16

# Choices waiting for Serve to confirm where the request went (bounded: a
# request cancelled while it waits for a replica is never confirmed).
_MAX_OPEN = 10_000

# This process's routers' tallies, by deployment name.
_TALLIES: dict[str, Tally] = {}


def tallies(prefix: str = "") -> dict[str, dict]:
    """The choices of this process's affinity routers, by deployment, by reason."""
    return {name: t.snapshot() for name, t in sorted(list(_TALLIES.items()))
            if name.startswith(prefix)}


def tally_copies(prefix: str = "") -> dict[str, Tally]:
    """The same as Tally objects (copies), for the ledger (specserve.acceptance.ledger)."""
    return {name: copy.deepcopy(t) for name, t in sorted(list(_TALLIES.items()))
            if name.startswith(prefix)}


class _AffinityRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    # FIFOMixin, as Serve's default router: without it Serve hands a replica
    # to the pending request with the routed request's internal id, which all
    # the calls one caller request makes share (the router's /v1/spec/stats
    # asks a target replica three things at once; a target opens n draft
    # streams for n > 1): one of them was then never routed.
    chunk = 1

    def initialize_state(self, max_extra_requests: int = 4, capacity: int = 200_000):
        self._max_extra = max_extra_requests
        self._index = PrefixIndex(capacity)
        self._open: OrderedDict[object, tuple] = OrderedDict()
        name = self._deployment_id.name if self._deployment_id else "?"
        # Serve ships this class to the caller by value (cloudpickle), with
        # its own copy of this module's globals: the registry is reached
        # through the imported module, the one `tallies()` reads.
        import deployments.routing as home

        self._tally = home._TALLIES.setdefault(name, Tally())

    def sequence(self, pending_request: PendingRequest):
        """The request's text or token ids to match prefixes on; None: none."""
        raise NotImplementedError

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None):
        keys = []
        if pending_request is not None and pending_request.args:
            try:
                keys = prefix_keys(self.sequence(pending_request), self.chunk)
            except Exception as e:  # routing must never fail a request
                log.warning("no prefix for routing: %r", e)
        if not keys or not candidate_replicas:
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(
                self, candidate_replicas, pending_request)
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        loads = await self._loads(candidate_replicas)
        c = choose(list(by_id), loads, self._index.match(keys, by_id), keys[0], self._max_extra)
        # By the request's future: its internal id is shared (see FIFOMixin above).
        rid = pending_request.future
        self._open[rid] = (keys, c.order[0], c.reason, c.matched)
        self._open.move_to_end(rid)
        while len(self._open) > _MAX_OPEN:
            self._open.popitem(last=False)
        # Serve takes the first rank's replica unless it is full, then the
        # least loaded of the rest.
        return [[by_id[c.order[0]]], [by_id[r] for r in c.order[1:]]]

    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        loads, unknown = {}, []
        for r in replicas:
            n = self._replica_queue_len_cache.get(r.replica_id)
            if n is None:
                unknown.append(r)
            else:
                loads[r.replica_id.to_full_id_str()] = n
        if unknown:
            for r, n in await self._probe_queue_lens(unknown, 0):
                if n is not None:
                    loads[r.replica_id.to_full_id_str()] = n
        return loads

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        opened = self._open.pop(pending_request.future, None)
        if opened is None:
            return
        keys, preferred, reason, matched = opened
        chosen = replica_id.to_full_id_str()
        if chosen != preferred:  # the preferred replica was full
            reason, matched = "full", self._index.match(keys, [chosen])[chosen]
        self._tally.count(reason, matched, len(keys))
        self._index.insert(keys, chosen)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self._index.drop(replica_id.to_full_id_str())

    def update_replicas(self, replicas: list[RunningReplica]):
        old = set(self._replica_id_set)
        super().update_replicas(replicas)
        for gone in old - set(self._replica_id_set):
            self._index.drop(gone.to_full_id_str())


class TargetAffinityRouter(_AffinityRouter):
    """The target replica for an HTTP request (`TargetServer.http`'s arguments:
    method, path, query, headers, body, ...): by its chat messages or prompt."""

    chunk = TARGET_CHUNK_CHARS

    def sequence(self, pending_request: PendingRequest):
        args = pending_request.args
        if len(args) < 5 or args[0] != "POST" or not isinstance(args[4], (bytes, bytearray)):
            return None
        return conversation_text(args[4])


class DraftAffinityRouter(_AffinityRouter):
    """The draft replica for an engine request (`DraftServer.draft`'s
    arguments: request id, prompt token ids, ...): by its prompt's token ids."""

    chunk = DRAFT_CHUNK_TOKENS

    def sequence(self, pending_request: PendingRequest):
        args = pending_request.args
        return args[1] if len(args) > 1 and isinstance(args[1], list) else None
