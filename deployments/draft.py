"""DraftServer: one draft replica (the draft worker, specserve/draft/worker.py).

A plain class; `deployments.app.build_app` wires it into Ray Serve. A target
replica asks for drafts with a *streaming* call to `draft(...)`: drafting lasts
as long as that call, and cancelling it (the target is done) stops drafting. So
no later call has to find this same replica again, and a dead draft replica
simply ends the call: the target goes on alone.

With `adapt.enabled` the replica's runner feeds an AdaptBuffer with the
verified tokens it receives, the replica opens its pool's version store, and
its DraftAdapter trains, judges and swaps the draft engine's weights
(specserve/adapt/); `adapt()` answers their figures. The buffer holds user
text and stays in this process (and the training process it starts).
"""

from __future__ import annotations

import logging
import os

from deployments import replica_name
from specserve import logs
from specserve.config import DraftConfig

log = logging.getLogger("specserve.draft")


class DraftServer:
    def __init__(self, draft: dict, target_tp: int = 1, grpc_tls: dict | None = None,
                 speculation: dict | None = None):
        from specserve.adapt.buffer import AdaptBuffer
        from specserve.config import SpeculationConfig
        from specserve.draft.runner import BranchPlan
        from specserve.draft.worker import DraftWorker
        from specserve.engine import cpu_binding, settings_from
        from specserve.tls import TlsFiles

        self.config = DraftConfig.model_validate(draft)
        logs.to_stderr("draft")
        os.environ.update(self.config.resources.env)
        _, draft_cpus = cpu_binding(target_tp, model_draft=self.config.has_model)
        spec = SpeculationConfig.model_validate(speculation or {})
        # Pre-drafted outcomes: top-F alternatives from the engine's logprobs,
        # continued as batched engine requests (cheap on an accelerator).
        plan = BranchPlan(spec.branch_fan_out, spec.branch_alternatives(), spec.branch_tokens(),
                          positions=spec.num_speculative_tokens + 1)
        adapt = self.config.adapt
        self.adapt_buffer = AdaptBuffer.from_config(adapt) if adapt.enabled else None
        self.versions = self._open_versions() if adapt.enabled else None
        self.worker = DraftWorker.start(self.config.draft_spec, settings_from(self.config.engine),
                                        tls=TlsFiles.from_config(grpc_tls), cpus=draft_cpus,
                                        branches=plan, suffix=self.config.suffix,
                                        name=f"{self.config.name}/{replica_name()}",
                                        adapt=self.adapt_buffer)
        self.runner = self.worker.runner
        self.adapter = self._adapter(draft_cpus) if self.versions is not None else None

    def _adapter(self, cpus: str | None):
        """The pool's DraftAdapter over this replica's engine (kinds model and
        hybrid; the config refuses adapt on suffix pools)."""
        from specserve.adapt.adapter import DraftAdapter, reload_weights
        from specserve.draft.hybrid import is_hybrid, model_of
        from specserve.models import resolve_draft

        engine = self.worker.engine
        spec = self.config.draft_spec
        source = str(resolve_draft(model_of(spec) if is_hybrid(spec) else spec))
        return DraftAdapter(self.config.adapt, self.adapt_buffer, self.versions, source,
                            load=lambda folder: reload_weights(engine, folder), cpus=cpus)

    def _open_versions(self):
        """The pool's version store (v0: this pool's model); None, with a
        warning, when its folder cannot be written: collection goes on."""
        from specserve.adapt.versions import VersionStore

        root = self.config.adapt.versions_root(self.config.name)
        try:
            return VersionStore(root, source=self.config.model)
        except OSError as e:
            log.warning("adapt: no version store at %s (%s); collecting without one", root, e)
            return None

    async def draft(self, request_id: str, prompt_ids: list[int], sink_address: str,
                    lookahead: int, max_tokens: int, k: int = 0, ticket: str = ""):
        """Draft for one request until the caller cancels (a streaming call:
        the draft worker's one entry point, DraftWorker.draft); ticket: the
        one the target registered the request with at its sink."""
        log.debug("drafting %s for %s", request_id, sink_address)
        self._start_adapter()
        version = {"version": self.adapter.loaded} if self.adapter is not None else {}
        async for hello in self.worker.draft(request_id, prompt_ids, sink_address, lookahead,
                                             max_tokens, k, ticket):
            yield {**hello, "replica": replica_name(), "model": self.config.name, **version}

    def _start_adapter(self) -> None:
        """Its loop runs on the replica's event loop (started from a call: the
        constructor may run outside it)."""
        if self.adapter is not None and self.adapter.task is None:
            self.adapter.start()

    def active(self) -> int:
        """Requests this replica is drafting for now."""
        return self.runner.active()

    def record_autoscaling_stats(self) -> dict:
        """Figures for specserve.control.autoscale.draft_policy (Serve calls this).
        active counts the requests the target gave up on this replica's drafts
        (they came too late) as well: demand it could not serve, not idleness;
        released counts those alone (coverage no longer sees them)."""
        coverage, lag = self.runner.timeliness()
        return {"coverage": coverage, "lag": lag, "active": float(self.runner.assigned()),
                "released": float(self.runner.released())}

    def adapt(self) -> dict | None:
        """This replica's adaptation figures (specserve.adapt.figures); None
        when the pool's adapt is off."""
        from specserve.adapt.figures import adapt_figures

        if self.adapt_buffer is None:
            return None
        return adapt_figures(self.adapt_buffer,
                             self.versions.figures() if self.versions is not None else None,
                             self.adapter.figures if self.adapter is not None else None,
                             self.adapter.loaded if self.adapter is not None else None)

    def __del__(self) -> None:
        """Serve's graceful shutdown of the replica: a training round stops
        and the pool's train lock goes with it (specserve.adapt.adapter)."""
        adapter = getattr(self, "adapter", None)
        if adapter is not None:
            adapter.abandon()

    async def check_health(self) -> None:
        self._start_adapter()
        await self.worker.check_health()
