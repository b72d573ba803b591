"""The one target engine builder, and vLLM's own counters.

Owns how specserve starts a target: a vLLM AsyncLLM whose speculative config
plugs in the remote-draft proposer (K > 0), whose draft sink listens where the
caller says, with a stat logger that adds up vLLM's spec-decode statistics (the
ground truth for acceptance) and feeds the measured decode step cost. Serve's
target replica (`deployments/target.py`), `LocalSpec` (`specserve generate`,
the bench, the GPU check) and the bench's co-located baseline all start their
engine with `TargetEngine.start`; where they differ they pass a parameter.

The engine launch both sides share (`EngineSettings`, engine arguments, start
and shutdown, CPU binding) is `specserve.engine`'s. It never routes requests.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from specserve.acceptance.catalogue import E2E_BUCKETS_S, ITL_BUCKETS_S, TTFT_BUCKETS_S
from specserve.acceptance.stats import LatencyHistogram
from specserve.control.stepcost import StepCostFit
from specserve.engine import (EngineSettings, apply_cpu_env, engine_args, scoped_env,
                              shutdown_engine, start_engine)
from specserve.target import proposer, worker_hook

log = logging.getLogger(__name__)

# Test-only: the class path of a proposer to use instead of RemoteDraftProposer
# (specserve/testing/slow_target.py emulates a slower target step with it).
ENV_PROPOSER_CLASS = "SPECSERVE_PROPOSER_CLASS"


@dataclasses.dataclass
class SpecTotals:
    """vLLM's spec-decode counters, summed over engine steps."""

    num_drafts: int = 0  # request-steps that verified at least one drafted token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    draft_per_position: list[int] = dataclasses.field(default_factory=list)
    steps: int = 0  # engine steps that produced output (prefill or decode)
    running: int = 0  # the engine's batch and queue at its last step
    waiting: int = 0
    # The rest of what vLLM's Prometheus logger exports (vllm/v1/metrics/
    # loggers.py), for /metrics under vLLM's names (specserve.acceptance.replicas).
    kv_cache_usage: float = 0.0  # at the last step, 1.0 = full
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft: LatencyHistogram = dataclasses.field(
        default_factory=lambda: LatencyHistogram(TTFT_BUCKETS_S))
    itl: LatencyHistogram = dataclasses.field(
        default_factory=lambda: LatencyHistogram(ITL_BUCKETS_S))
    tpot: LatencyHistogram = dataclasses.field(  # per finished request
        default_factory=lambda: LatencyHistogram(ITL_BUCKETS_S))
    e2e: LatencyHistogram = dataclasses.field(
        default_factory=lambda: LatencyHistogram(E2E_BUCKETS_S))
    # Called with (tokens a decode step verified, seconds since the previous
    # step) for each decode step that followed a busy one: what the step-cost
    # fit is fed with.
    step_observer: Callable[[int, float], None] | None = None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)
    _last_step: float | None = None

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def add_engine_stats(self, scheduler_stats, iteration_stats) -> None:
        """The figures vLLM's PrometheusStatLogger.record takes from a step."""
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs
            self.kv_cache_usage = scheduler_stats.kv_cache_usage
            self.prefix_cache_queries += scheduler_stats.prefix_cache_stats.queries
            self.prefix_cache_hits += scheduler_stats.prefix_cache_stats.hits
        if iteration_stats is None:
            return
        self.prompt_tokens += iteration_stats.num_prompt_tokens
        self.generation_tokens += iteration_stats.num_generation_tokens
        for v in iteration_stats.time_to_first_tokens_iter:
            self.ttft.observe(v)
        for v in iteration_stats.inter_token_latencies_iter:
            self.itl.observe(v)
        for f in iteration_stats.finished_requests:
            self.e2e.observe(f.e2e_latency)
            self.tpot.observe(f.mean_time_per_output_token)

    def snapshot(self) -> dict:
        """The engine's figures now, as plain values (copies)."""
        with self.lock:
            return copy.deepcopy({"running": self.running, "waiting": self.waiting,
                "kv_cache_usage": self.kv_cache_usage,
                "prefix_cache_queries": self.prefix_cache_queries,
                "prefix_cache_hits": self.prefix_cache_hits,
                "prompt_tokens": self.prompt_tokens,
                "generation_tokens": self.generation_tokens,
                "num_drafts": self.num_drafts, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position),
                "ttft": self.ttft, "itl": self.itl, "tpot": self.tpot, "e2e": self.e2e})


def spec_counter_factory():
    """(factory for AsyncLLM(stat_loggers=[...]), the totals it fills)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    totals = SpecTotals()
    lock = totals.lock

    class SpecCounters(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            sd = getattr(scheduler_stats, "spec_decoding_stats", None) if scheduler_stats else None
            if iteration_stats is not None:  # vLLM makes one per step with outputs
                totals.steps += 1
            if totals.step_observer is not None and iteration_stats is not None:
                now = time.monotonic()
                # Decode steps only: a prefill step's interval also holds the
                # client's time between one request and the next.
                if (totals._last_step is not None and totals.running > 0
                        and iteration_stats.num_prompt_tokens == 0):
                    accepted = sd.num_accepted_tokens if sd is not None else 0
                    drafted = sd.num_draft_tokens if sd is not None else 0
                    rows = max(iteration_stats.num_generation_tokens - accepted, 0)
                    totals.step_observer(rows + drafted, now - totals._last_step)
                totals._last_step = now
            with lock:
                totals.add_engine_stats(scheduler_stats, iteration_stats)
            if sd is None:
                return
            with lock:
                totals.num_drafts += sd.num_drafts
                totals.draft_tokens += sd.num_draft_tokens
                totals.accepted_tokens += sd.num_accepted_tokens
                for name, src in (("accepted_per_position", sd.num_accepted_tokens_per_pos),
                                  ("draft_per_position", sd.num_draft_tokens_per_pos)):
                    dst = getattr(totals, name)
                    if len(dst) < len(src):
                        dst.extend([0] * (len(src) - len(dst)))
                    for i, v in enumerate(src):
                        dst[i] += v

        def log_engine_initialized(self):
            pass

    return SpecCounters, totals


@dataclasses.dataclass
class TargetEngine:
    """A started target: the AsyncLLM, its counters, its measured step cost,
    where its draft sink listens (None without one) and its processes."""

    engine: object
    totals: SpecTotals
    step_costs: StepCostFit
    sink_address: str | None
    procs: list
    k: int
    tls: object = None  # specserve.tls.TlsFiles of the sink's port (None: plaintext)
    # The sink's step cost fit as its last Stats answer gave it (sink_stats).
    sink_cost: dict | None = None

    @classmethod
    def start(cls, model: str, settings: EngineSettings, *, tp: int = 1, k: int = 0,
              sink_bind: str = "127.0.0.1:0", sink_host: str = "127.0.0.1", tls=None,
              cpus: str | None = None, distributed_executor_backend: str | None = None,
              speculative_config: dict | None = None,
              max_wait_ms: float = 0.0, release_after_steps: int = 0,
              max_stream_messages_per_s: int = 2000, per_request_k: bool = False,
              engine_metrics: bool = False) -> "TargetEngine":
        """Start a target engine (blocks while vLLM loads).

        k > 0: the remote-draft proposer with K drafted tokens per step, its sink
          bound to `sink_bind` and advertised as `sink_host`:port; `tls` (a
          specserve.tls.TlsFiles) makes the sink require mutual TLS.
        cpus: the OpenMP core list of the engine's processes (CPU engines).
        speculative_config: another vLLM speculative config instead of ours
          (the bench's co-located `draft_model` baseline); no sink then.
        max_wait_ms: the sink's bounded wait at most (SpeculationConfig.max_wait_ms).
        release_after_steps: the sink gives a request's drafts up after this
          many steps in a row without any (SpeculationConfig.release_after_steps).
        max_stream_messages_per_s: a draft stream sending more is cut off
          (SpeculationConfig.max_stream_messages_per_s).
        per_request_k: the sink proposes per request only the drafted tokens
          that pay (SpeculationConfig.per_request_k).
        engine_metrics: also export vLLM's own engine metrics (vllm:* as
          ray_vllm_*, spec-decode counters included) through Ray's metrics
          agent, as Ray Serve LLM does (Serve replicas only: it needs Ray).
        """
        from specserve.target.sink_settings import ENV as SINK_ENV
        from specserve.target.sink_settings import SinkSettings

        apply_cpu_env(settings)
        extra: dict = {"tensor_parallel_size": tp}
        if tp > 1:
            extra["distributed_executor_backend"] = distributed_executor_backend or "mp"
        elif distributed_executor_backend:
            extra["distributed_executor_backend"] = distributed_executor_backend
        tmp = tempfile.TemporaryDirectory(prefix="specserve-target-")
        port_file = Path(tmp.name) / "sink.port"
        # The engine builds the proposer in its own worker processes, which
        # read their settings from the environment they inherit at spawn.
        env: dict[str, str | None] = {SINK_ENV: None}
        if speculative_config is not None:
            extra["speculative_config"] = speculative_config
            k = 0
        elif k > 0:
            if tls is not None:
                tls.read()  # a missing file fails here, with its path
            env.update(SinkSettings(sink_bind, str(port_file), max_wait_ms=max_wait_ms,
                                    release_after_steps=release_after_steps,
                                    max_stream_messages_per_s=max_stream_messages_per_s,
                                    per_request_k=per_request_k, tls=tls).to_env())
            extra["speculative_config"] = proposer.speculative_config(
                k, os.environ.get(ENV_PROPOSER_CLASS) or proposer.CLASS_PATH)
            # The engine client registers requests with the sink through it.
            extra["worker_extension_cls"] = worker_hook.CLASS_PATH
        if "speculative_config" in extra:
            # vLLM's own per-request acceptance (a histogram of accepted counts
            # per verify step), returned with each finished request.
            extra["per_request_spec_decode_metrics"] = "summary"
        if cpus is not None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
        factory, totals = spec_counter_factory()
        step_costs = StepCostFit()
        totals.step_observer = step_costs.add
        with scoped_env(env):
            loggers = [factory]
            if engine_metrics:
                from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

                loggers.append(RayPrometheusStatLogger)
            engine, procs = start_engine(engine_args(model, settings, **extra),
                                         stat_loggers=loggers)
        try:
            sink = f"{sink_host}:{int(port_file.read_text())}" if k > 0 else None
        finally:
            tmp.cleanup()
        return cls(engine, totals, step_costs, sink, procs, k, tls)

    @property
    def max_model_len(self) -> int:
        return self.engine.model_config.max_model_len

    async def sink_stats(self) -> dict[str, dict]:
        """The sink's counters per draft (DraftSink.Stats: the book's, and its
        bounded wait), {} without a sink. Keeps the sink's step cost fit for
        `step_cost`. Raises grpc.aio.AioRpcError where the sink does not answer."""
        if self.sink_address is None:
            return {}
        from specserve.v1 import spec_pb2, spec_pb2_grpc
        from specserve.wire import channel_factory

        port = self.sink_address.rsplit(":", 1)[1]
        channel = channel_factory(self.tls)(f"127.0.0.1:{port}")
        try:
            msg = await spec_pb2_grpc.DraftSinkStub(channel).Stats(spec_pb2.StatsRequest(),
                                                                   timeout=10)
        finally:
            await channel.close()
        if msg.HasField("step_cost"):
            c = msg.step_cost
            self.sink_cost = {"fixed_s": c.fixed_s, "per_token_s": c.per_token_s,
                              "steps": c.steps, "source": "sink"}
        return {d.draft: {**dict(d.counters), "waits": d.waits,
                          "wait_seconds": d.wait_seconds, "steps": d.steps}
                for d in msg.drafts}

    def step_cost(self) -> dict | None:
        """The decode step's cost for the K controller ({"fixed_s",
        "per_token_s", "steps", "source"}; None until measured). The sink's fit
        where it has one (as of the last `sink_stats`): it times each step
        inside the engine, from the end of one propose() to the next, against
        the tokens that step verified, so the bounded wait, which the rate
        model adds per pool (`policy.speedup`'s wait_s), is not counted twice.
        Else the stat logger's, over the intervals between vLLM's step records
        (the wait included). Both read about the same cost per token here (8
        rows, 2026-12-06: 0.95 against 0.83 ms/token)."""
        if self.sink_cost is not None:
            return self.sink_cost
        fit = self.step_costs.as_dict()
        return None if fit is None else {**fit, "source": "engine"}

    def shutdown(self) -> None:
        shutdown_engine(self.engine, self.procs)
