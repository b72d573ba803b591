"""LedgerServer: the app's figures across router replicas, as one Serve replica.

A plain class; `deployments.app.build_app` wires it into Ray Serve (one
replica, no CPU). It runs `specserve.acceptance.ledger.Ledger`: every router
replica sends it batches (`add`) and renders /v1/spec/stats and /metrics from
its `view`, so the figures are the whole app's whichever router answers and
survive a router's restart. It checkpoints the ledger into Ray's internal
key-value store (the GCS) at most every CHECKPOINT_S while it changes, and a
restarted replica starts from the checkpoint: a restart of the ledger loses
at most what came after the last one. Never does: serve requests.
"""

from __future__ import annotations

import asyncio
import logging
import time

from specserve.acceptance.ledger import Ledger, RouterBatch

log = logging.getLogger("specserve.router")

CHECKPOINT_S = 2.0
KV_NAMESPACE = "specserve"


def checkpoint_key(app: str) -> bytes:
    return f"ledger/{app}".encode()


class _RayKV:
    """Ray's internal key-value store (kept in the GCS, outside any replica)."""

    def get(self, key: bytes) -> bytes | None:
        from ray.experimental.internal_kv import _internal_kv_get

        return _internal_kv_get(key, namespace=KV_NAMESPACE)

    def put(self, key: bytes, value: bytes) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(key, value, overwrite=True, namespace=KV_NAMESPACE)


def _app_name() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().app_name
    except Exception:  # outside Serve (tests)
        return "local"


class LedgerServer:
    def __init__(self, k: int, kv=None, app: str | None = None):
        """k: the configured K (the acceptance record's default K); kv: an
        object with get(key) / put(key, value) (default: Ray's internal KV)."""
        self.kv = kv or _RayKV()
        self.key = checkpoint_key(app or _app_name())
        self.ledger = self._restore(k)
        self._saving: asyncio.Task | None = None
        self._saved_at = float("-inf")

    def _restore(self, k: int) -> Ledger:
        try:
            data = self.kv.get(self.key)
        except Exception as e:  # the figures start over; serving is not affected
            log.warning("ledger checkpoint unreadable (%s): figures start from zero", e)
            return Ledger(k)
        if data is None:
            return Ledger(k)
        try:
            ledger = Ledger.loads(data)
        except ValueError as e:
            log.warning("%s: figures start from zero", e)
            return Ledger(k)
        log.info("ledger restored from its checkpoint (%d routers, %d target replicas)",
                 len(ledger.routers), len(ledger.replicas.replicas()))
        return ledger

    async def add(self, batch: RouterBatch) -> dict:
        """Apply a router's batch; the app's acceptance per draft model back."""
        by_model = self.ledger.add(batch, time.time())
        self._checkpoint_soon()
        return by_model

    async def view(self) -> dict:
        """The whole app's figures as of now (`Ledger.view`)."""
        return self.ledger.view(time.time())

    def _checkpoint_soon(self) -> None:
        if self._saving is not None and not self._saving.done():
            return
        self._saving = asyncio.get_running_loop().create_task(self._checkpoint())

    async def _checkpoint(self) -> None:
        while self.ledger.changed:
            await asyncio.sleep(max(0.0, self._saved_at + CHECKPOINT_S - time.monotonic()))
            self._saved_at = time.monotonic()
            data = self.ledger.dumps()
            try:
                await asyncio.to_thread(self.kv.put, self.key, data)
            except Exception as e:  # the next change tries again
                self.ledger.changed = True
                log.warning("ledger checkpoint failed: %s", e)
                return
