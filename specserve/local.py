"""LocalSpec: a draft process and a target engine on one machine, talking gRPC.

Owns the life of one local speculative-decoding setup, as `specserve generate`
and the tests use it: start a draft process (`specserve.draft.server`) and a
target vLLM engine whose proposer listens for drafts, run each request through
the same engine client as a Serve target replica (`DraftingEngine`: it
registers the request with the sink and then asks the draft process to draft
for it, Drafter.Start), and tear everything down. With no draft it is the
target alone with the same engine settings.

The draft is only ever a hint: if the draft process is missing, slow or dead,
requests run on the target alone and give the same greedy output.

A synthetic draft (`synthetic:A[@Dms]`, specserve/draft/synthetic.py) replays
the target's greedy output: given `replay` records, its process starts with
them; otherwise `record_replay` (which `run_prompts` calls) first runs the
prompts greedily on the target engine alone and then starts it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc

from specserve.acceptance.record import Acceptance, Figures
from specserve.config import lookahead_problem, lookahead_tokens
from specserve.engine import EngineSettings, cpu_binding
from specserve.target.engine import SpecTotals, TargetEngine
from specserve.ports import free_port
from specserve.v1 import spec_pb2, spec_pb2_grpc

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
        draft_ready_timeout: float = 300.0,
        sink_only: bool = False,
        tls=None,
        draft_tls=None,
        replay: list[tuple[list[int], list[int]]] | None = None,
        adaptive_k: bool = False,
        speculation=None,
        thresholds=None,
    ):
        """sink_only: no draft process, but the target's sink listens (k > 0) for
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
        self.draft_ready_timeout = draft_ready_timeout
        self.target_engine: TargetEngine | None = None
        self.engine = None  # the target's AsyncLLM
        self.totals: SpecTotals = SpecTotals()
        self.draft_process: subprocess.Popen | None = None
        self.sink_address: str | None = None
        self._draft_stub = None
        self._draft_channel = None
        self._tmp = tempfile.TemporaryDirectory(prefix="specserve-")
        self.draft_failures = 0
        self._client = None  # the DraftingEngine on the target engine, made on first use
        # sequence id -> (its registration ticket, its prompt ids), while it runs
        self.tickets: dict[str, tuple[str, list[int]]] = {}
        self._closing: set = set()  # Drafter.Cancel calls in flight
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
        return cpu_binding(self.tp)

    def _start_draft_process(self, extra: list[str] = ()) -> None:
        _, draft_cpus = self._cpu_binding()
        draft_env = dict(os.environ)
        if draft_cpus is not None:
            draft_env["VLLM_CPU_OMP_THREADS_BIND"] = draft_cpus
        control_port = free_port()
        self.draft_process = subprocess.Popen(
            [sys.executable, "-m", "specserve.draft.server", "--model", self.draft,
             "--port", str(control_port), "--seed", str(self.settings.seed),
             "--dtype", self.settings.dtype, "--max-num-seqs", str(self.settings.max_num_seqs)]
            + (["--max-model-len", str(self.settings.max_model_len)]
               if self.settings.max_model_len else [])
            # Its KV cache as the target's (CPU): without it vLLM reserves 92 % of
            # the memory for the draft, and refuses to start when the target,
            # loading at the same time, has taken more than 8 %.
            + (["--kv-cache-gib", str(int(self.settings.kv_cache_gib))]
               if self.settings.kv_cache_gib is not None else [])
            + (["--tls-ca", self.draft_tls.ca_file, "--tls-cert", self.draft_tls.cert_file,
                "--tls-key", self.draft_tls.key_file]
               + (["--tls-server-name", self.draft_tls.server_name]
                  if self.draft_tls.server_name else [])
               if self.draft_tls is not None else [])
            + ["--branch-fan-out", str(self.speculation.branch_fan_out),
               "--branch-budget", str(self.speculation.branch_alternatives()),
               "--branch-len", str(self.speculation.branch_tokens()),
               "--branch-positions", str(self.k + 1),
               "--name", f"{self.draft}/local-0"]
            + list(extra),
            stdout=sys.stderr, stderr=sys.stderr, stdin=subprocess.DEVNULL, env=draft_env,
        )
        self._draft_channel = grpc.aio.insecure_channel(f"127.0.0.1:{control_port}")
        self._draft_stub = spec_pb2_grpc.DrafterStub(self._draft_channel)

    async def _start_synthetic(self, replay) -> None:
        from specserve.draft.synthetic import write_replay

        path = Path(self._tmp.name) / "replay.jsonl"
        write_replay(path, replay)
        self._start_draft_process(["--replay", str(path), "--vocab-size",
                                   str(self.engine.model_config.get_vocab_size())])
        await self._wait_for_draft()

    async def record_replay(self, prompts_ids: list[list[int]], max_tokens: int) -> None:
        """Synthetic draft only: record the target's greedy output for these
        prompts (on the target engine, no drafts yet) and start the draft."""
        if self.synthetic is None or self.draft_process is not None:
            return
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        unique = [list(p) for p in dict.fromkeys(tuple(p) for p in prompts_ids)]
        outs = await asyncio.gather(*(self.generate(p, params) for p in unique))
        self.replay = list(zip(unique, outs))
        await self._start_synthetic(self.replay)

    async def _start(self) -> None:
        target_cpus, _ = self._cpu_binding()
        if self.draft is not None and self.synthetic is None:
            self._start_draft_process()  # it loads while the target engine starts
        # Building the engine blocks for a while; the draft process loads meanwhile.
        self.target_engine = TargetEngine.start(
            self.target, self.settings, tp=self.tp, k=self.k, tls=self.tls, cpus=target_cpus,
            max_wait_ms=self.speculation.max_wait_ms,
            release_after_steps=self.speculation.release_after_steps,
            max_stream_messages_per_s=self.speculation.max_stream_messages_per_s)
        self.engine, self.totals = self.target_engine.engine, self.target_engine.totals
        self.sink_address = self.target_engine.sink_address
        if self.synthetic is not None:
            if self.replay is not None:
                await self._start_synthetic(self.replay)
        elif self.draft is not None:
            await self._wait_for_draft()

    async def _wait_for_draft(self) -> None:
        deadline = time.monotonic() + self.draft_ready_timeout
        while True:
            if self.draft_process.poll() is not None:
                raise RuntimeError(
                    f"draft process exited with code {self.draft_process.returncode}; "
                    "see its log above")
            try:
                await self._draft_stub.Health(spec_pb2.HealthCheck(), timeout=2.0)
                return
            except grpc.aio.AioRpcError:
                if time.monotonic() > deadline:
                    raise RuntimeError("draft process did not become ready in time") from None
                await asyncio.sleep(0.5)

    async def aclose(self) -> None:
        if self._closing:  # the last requests' Drafter.Cancel calls
            await asyncio.wait(list(self._closing), timeout=5)
        if self._draft_channel is not None:
            await self._draft_channel.close()
            self._draft_channel = None
        if self.draft_process is not None and self.draft_process.poll() is None:
            self.draft_process.terminate()
            try:
                await asyncio.to_thread(self.draft_process.wait, 30)
            except subprocess.TimeoutExpired:
                self.draft_process.kill()
        if self.target_engine is not None:
            self.target_engine.shutdown()
            self.target_engine = self.engine = None
        self._tmp.cleanup()

    async def sink_figures(self) -> dict[str, dict]:
        """The target sink's counters per draft (DraftSink.Stats), {} without a sink."""
        if self.sink_address is None:
            return {}
        from specserve.wire import channel_factory

        channel = channel_factory(self.tls)(self.sink_address)
        try:
            msg = await spec_pb2_grpc.DraftSinkStub(channel).Stats(spec_pb2.StatsRequest(),
                                                                   timeout=10)
        finally:
            await channel.close()
        return {d.draft: {**dict(d.counters), "waits": d.waits,
                          "wait_seconds": d.wait_seconds, "steps": d.steps}
                for d in msg.drafts}

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
                cost=self.target_engine.step_costs.cost(), rows=running + 1)
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
                    ticket: str) -> "_LocalDraft":
        """DraftingEngine's open_draft: ask the draft process to draft for one
        registered sequence (Drafter.Start), in the background."""
        # tests that play the draft themselves (sink_only) read these
        self.tickets[rid] = (ticket, list(prompt_ids))
        return _LocalDraft(self, rid, prompt_ids, max_tokens, k if self.controller else 0,
                           ticket)

    async def _start_draft(self, rid: str, prompt_ids: list[int], max_tokens: int,
                           k: int, ticket: str) -> bool:
        if self._draft_stub is None:
            return False
        try:
            await self._draft_stub.Start(
                spec_pb2.StartDraft(
                    request_id=rid, prompt_token_ids=prompt_ids,
                    sink_address=self.sink_address, lookahead=self.lookahead,
                    max_tokens=max_tokens, max_draft_tokens=k, ticket=ticket,
                ),
                timeout=5.0,
            )
            return True
        except grpc.aio.AioRpcError as e:
            # Drafts are hints: the request runs on the target alone.
            self.draft_failures += 1
            if self.draft_failures == 1:
                log.warning("draft unavailable (%s); running target-only", e.code().name)
            return False

    async def _cancel_draft(self, rid: str) -> None:
        try:
            await self._draft_stub.Cancel(spec_pb2.CancelDraft(request_id=rid), timeout=2.0)
        except grpc.aio.AioRpcError:
            pass


class _LocalDraft:
    """One sequence's drafting by LocalSpec's draft process (a DraftStream)."""

    def __init__(self, spec: LocalSpec, rid: str, prompt_ids: list[int], max_tokens: int,
                 k: int, ticket: str):
        self.who = {"model": DRAFT_POOL, "k": k}
        self._spec, self._rid = spec, rid
        self._started = asyncio.get_running_loop().create_task(
            spec._start_draft(rid, prompt_ids, max_tokens, k, ticket))

    def close(self) -> None:
        self._spec.tickets.pop(self._rid, None)

        async def cancel():
            if await self._started:
                await self._spec._cancel_draft(self._rid)

        task = asyncio.get_running_loop().create_task(cancel())
        self._spec._closing.add(task)
        task.add_done_callback(self._spec._closing.discard)


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
