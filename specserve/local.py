"""LocalSpec: a draft worker and a target engine on one machine, drafts over gRPC.

Owns the life of one local speculative-decoding setup, as `specserve generate`,
the bench, the calibration, `make gpu-check` and the tests use it: start a
target vLLM engine whose proposer listens for drafts and a draft worker
(`specserve.draft.worker.DraftWorker`, the one Serve's draft replicas run;
its vLLM engine in processes of its own), run each request through the same
engine client as a Serve target replica (`DraftingEngine`: it registers each
sequence with the sink, then follows the draft worker's entry point,
`DraftWorker.draft`, as a Serve target follows a draft replica's streaming
call), and tear everything down. Drafts reach the target's sink over the same
gRPC stream as in Serve. With no draft it is the target alone with the same
engine settings.

The draft is only ever a hint: if the draft is missing, slow or dead,
requests run on the target alone and give the same greedy output.

A synthetic draft (`synthetic:A[@Dms]`, specserve/draft/synthetic.py) replays
the target's greedy output: given `replay` records, its worker starts with
them; otherwise `record_replay` (which `run_prompts` calls) first runs the
prompts greedily on the target engine alone and then starts it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import tempfile
import time
import uuid
from pathlib import Path

from specserve.acceptance.record import Acceptance, Figures
from specserve.config import lookahead_problem, lookahead_tokens
from specserve.control.controller import COST_REFRESH_S
from specserve.engine import EngineSettings, cpu_binding
from specserve.target.drafting import DraftStream, FollowedDraft, NoDraft
from specserve.target.engine import SpecTotals, TargetEngine

log = logging.getLogger(__name__)

DRAFT_POOL = "draft"  # LocalSpec's one draft pool, as the K controller names it

@dataclasses.dataclass
class Output:
    prompt: str
    text: str
    token_ids: list[int]


class LocalSpec:
    """Use as `async with LocalSpec(...) as spec: await spec.generate(...)`."""

    def __init__(
        self,
        target: str,
        draft: str | None,
        k: int = 4,
        lookahead: int | None = None,
        tp: int = 1,
        settings: EngineSettings | None = None,
        sink_only: bool = False,
        tls=None,
        draft_tls=None,
        replay: list[tuple[list[int], list[int]]] | None = None,
        adaptive_k: bool = False,
        speculation=None,
        thresholds=None,
    ):
        """sink_only: no draft worker, but the target's sink listens (k > 0) for
        drafts from elsewhere; tests use it to play a draft themselves.
        tls: a specserve.tls.TlsFiles: mutual TLS between draft and sink.
        draft_tls: the draft's own files if they differ (tests: a wrong certificate).
        adaptive_k: choose each request's K in 0..k from measured step costs and
        acceptance (specserve/control/controller.py); K = 0 runs it on the target
        alone. thresholds: the controller's (control.policy.Thresholds).
        speculation: a specserve.config.SpeculationConfig for the branches (F,
        budget, length) and the bounded wait; None: its defaults."""
        if (draft is not None or sink_only) and k < 1:
            raise ValueError("num_speculative_tokens must be >= 1 with a draft")
        problem = lookahead_problem(k, lookahead, "K") if draft is not None else None
        if problem:
            raise ValueError(problem)
        from specserve.draft.synthetic import is_synthetic, parse

        self.target = target
        self.draft = draft
        self.synthetic = parse(draft) if is_synthetic(draft) else None
        self.replay = replay
        self.k = k if (draft is not None or sink_only) else 0
        self.sink_only = sink_only
        self.lookahead = lookahead_tokens(k, lookahead)
        self.tp = tp
        self.settings = settings or EngineSettings()
        self.target_engine: TargetEngine | None = None
        self.engine = None  # the target's AsyncLLM
        self.totals: SpecTotals = SpecTotals()
        self.draft_worker = None  # the DraftWorker, once started
        self.sink_address: str | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="specserve-")
        self._client = None  # the DraftingEngine on the target engine, made on first use
        # sequence id -> (its registration ticket, its prompt ids), while it runs
        self.tickets: dict[str, tuple[str, list[int]]] = {}
        self.tls = tls
        self.draft_tls = draft_tls if draft_tls is not None else tls
        from specserve.config import SpeculationConfig

        self.speculation = speculation or SpeculationConfig(num_speculative_tokens=max(k, 1))
        self.adaptive = None
        # adaptive K: the same controller the Serve router decides with, over
        # one draft pool; figures are this engine's finished requests.
        self.controller = None
        self.figures = Figures()
        if adaptive_k and self.k > 0:
            from specserve.control.controller import KController
            from specserve.control.policy import Thresholds

            self.controller = KController(self.k, {DRAFT_POOL: 1}, thresholds or Thresholds())
        self._cost_at = float("-inf")  # when the sink's step cost was last asked for
        self._cost_task: asyncio.Task | None = None

    # ---- lifecycle --------------------------------------------------------------

    async def __aenter__(self) -> "LocalSpec":
        try:
            await self._start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def _cpu_binding(self) -> tuple[str | None, str | None]:
        if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
            return None, None  # the user's choice
        # Any draft here (a model or synthetic) runs in processes beside the target.
        return cpu_binding(self.tp, model_draft=self.draft is not None)

    def _start_draft_worker(self, replay_path: str | None = None,
                            vocab_size: int | None = None) -> None:
        """The draft worker Serve's draft replicas run, with the target's engine
        settings (a CPU draft's KV cache as the target's: without it vLLM
        reserves 92 % of the memory for the draft) and its own cores."""
        from specserve.draft.runner import BranchPlan
        from specserve.draft.worker import DraftWorker

        _, draft_cpus = self._cpu_binding()
        spec = self.speculation
        plan = BranchPlan(spec.branch_fan_out, spec.branch_alternatives(),
                          spec.branch_tokens(), positions=self.k + 1)
        try:
            self.draft_worker = DraftWorker.start(
                self.draft, self.settings, tls=self.draft_tls, cpus=draft_cpus,
                replay_path=replay_path, vocab_size=vocab_size, branches=plan,
                name=f"{self.draft}/local-0")
        except ValueError as e:
            raise ValueError(f"draft: {e}") from None

    async def _start_synthetic(self, replay) -> None:
        from specserve.draft.synthetic import write_replay

        path = Path(self._tmp.name) / "replay.jsonl"
        write_replay(path, replay)
        self._start_draft_worker(str(path), self.engine.model_config.get_vocab_size())

    async def stop_draft(self) -> None:
        """Stop the draft worker (the target goes on alone; a later
        `_start_synthetic` starts another)."""
        if self.draft_worker is not None:
            worker, self.draft_worker = self.draft_worker, None
            await worker.close()

    async def record_replay(self, prompts_ids: list[list[int]], max_tokens: int) -> None:
        """Synthetic draft only: record the target's greedy output for these
        prompts (on the target engine, no drafts yet) and start the draft."""
        if self.synthetic is None or self.draft_worker is not None:
            return
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        unique = [list(p) for p in dict.fromkeys(tuple(p) for p in prompts_ids)]
        outs = await asyncio.gather(*(self.generate(p, params) for p in unique))
        self.replay = list(zip(unique, outs))
        await self._start_synthetic(self.replay)

    async def _start(self) -> None:
        target_cpus, _ = self._cpu_binding()
        # Building an engine blocks for a while: the target first, then the draft.
        self.target_engine = TargetEngine.start(
            self.target, self.settings, tp=self.tp, k=self.k, tls=self.tls, cpus=target_cpus,
            max_wait_ms=self.speculation.max_wait_ms,
            release_after_steps=self.speculation.release_after_steps,
            max_stream_messages_per_s=self.speculation.max_stream_messages_per_s,
            per_request_k=self.speculation.per_request_k)
        self.engine, self.totals = self.target_engine.engine, self.target_engine.totals
        self.sink_address = self.target_engine.sink_address
        if self.synthetic is not None:
            if self.replay is not None:
                await self._start_synthetic(self.replay)
        elif self.draft is not None:
            self._start_draft_worker()

    async def aclose(self) -> None:
        await self.stop_draft()
        if self._cost_task is not None and not self._cost_task.done():
            self._cost_task.cancel()
        if self.target_engine is not None:
            self.target_engine.shutdown()
            self.target_engine = self.engine = None
        self._tmp.cleanup()

    async def sink_figures(self) -> dict[str, dict]:
        """The target sink's counters per draft (DraftSink.Stats), {} without a sink."""
        return await self.target_engine.sink_stats()

    def _step_cost(self):
        """The target's step cost for the K controller (TargetEngine.step_cost),
        the sink's fit asked for in the background at most every COST_REFRESH_S,
        as the Serve router does (deployments.choice)."""
        from specserve.control.policy import StepCost

        now = time.monotonic()
        if now - self._cost_at >= COST_REFRESH_S and (
                self._cost_task is None or self._cost_task.done()):
            self._cost_at = now
            self._cost_task = asyncio.get_running_loop().create_task(self._refresh_cost())
        return StepCost.from_figures(self.target_engine.step_cost())

    async def _refresh_cost(self) -> None:
        try:
            await self.target_engine.sink_stats()
        except Exception as e:  # the last figures stay
            log.warning("sink step cost unavailable: %s", e)

    # ---- requests ---------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], sampling_params, on_output=None) -> list[int]:
        """Generate for one tokenized prompt; returns the output token ids.
        on_output(o) is called with vLLM's CompletionOutput (token ids so far,
        spec-decode figures at the end) at each engine step that produced some,
        for latency measurements."""
        rid = uuid.uuid4().hex
        k = self.k
        if self.controller is not None:
            running = self.totals.running
            choice = self.controller.choose(
                {DRAFT_POOL: self.figures}, {DRAFT_POOL: running},
                load=min(running / self.settings.max_num_seqs, 1.0),
                cost=self._step_cost(), rows=running + 1)
            k = choice.k
        from vllm.inputs import TokensPrompt

        from specserve.target.drafting import ROUTE, DraftingEngine, Route

        if self._client is None:
            self._client = DraftingEngine(self.engine, self._open_draft, self.k, "local")
        route = Route(DRAFT_POOL if k > 0 else None, k)
        token = ROUTE.set(route)
        final = None
        try:
            async for out in self._client.generate(
                TokensPrompt(prompt_token_ids=prompt_ids), sampling_params, rid
            ):
                final = out
                if on_output is not None:
                    on_output(out.outputs[0])
        finally:
            ROUTE.reset(token)
        o = final.outputs[0]
        if route.records and route.records[-1].report.draft_model is not None:
            self.figures.add(Acceptance.of_output(o, k))
        return list(o.token_ids)

    def _open_draft(self, pool: str, rid: str, prompt_ids: list[int], max_tokens: int, k: int,
                    ticket: str) -> DraftStream:
        """DraftingEngine's open_draft: follow the draft worker's entry point
        for one registered sequence, as a Serve target follows a draft replica."""
        # tests that play the draft themselves (sink_only) read these
        self.tickets[rid] = (ticket, list(prompt_ids))
        k = k if self.controller else 0  # 0: the sink's K for the request
        who = {"model": pool, "k": k}
        if self.draft_worker is None:
            return _Forget(NoDraft(who), self.tickets, rid)
        stream = self.draft_worker.draft(rid, prompt_ids, self.sink_address, self.lookahead,
                                         max_tokens, k, ticket)
        return _Forget(FollowedDraft(stream, who, rid), self.tickets, rid)


class _Forget:
    """A draft stream that also forgets the sequence's ticket when it closes."""

    def __init__(self, stream: DraftStream, tickets: dict, rid: str):
        self._stream, self._tickets, self._rid = stream, tickets, rid
        self.who = stream.who

    def close(self) -> None:
        self._tickets.pop(self._rid, None)
        self._stream.close()


def sampling_params(max_tokens: int, temperature: float, ignore_eos: bool):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos,
    )


async def run_prompts(spec: LocalSpec, tokenizer, prompts: list[str], params) -> list[Output]:
    """All prompts concurrently; outputs in prompt order."""
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    await spec.record_replay(ids, params.max_tokens)
    outs = await asyncio.gather(*(spec.generate(i, params) for i in ids))
    return [
        Output(prompt=p, text=tokenizer.decode(o, skip_special_tokens=True), token_ids=o)
        for p, o in zip(prompts, outs)
    ]


def stats_dict(totals: SpecTotals, outputs: list[Output], k: int) -> dict:
    """The CLI's stats block, from vLLM's spec-decode counters.

    target_steps counts request-steps (one verification forward per request):
    every step emits one target-sampled token plus the accepted drafts, so
    steps = output tokens - accepted tokens.
    """
    per_pos = list(totals.accepted_per_position) + [0] * (k - len(totals.accepted_per_position))
    emitted = sum(len(o.token_ids) for o in outputs)
    return {
        "draft_tokens": totals.draft_tokens,
        "accepted_tokens": totals.accepted_tokens,
        "acceptance_rate": totals.acceptance_rate,
        "accepted_per_position": per_pos[:k] if k else [],
        "target_steps": max(emitted - totals.accepted_tokens, 0),
        "steps_with_drafts": totals.num_drafts,
    }
