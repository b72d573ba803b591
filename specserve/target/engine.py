"""Engine settings shared by the target and the draft, and vLLM's own counters.

Owns: how specserve builds vLLM AsyncLLM engines (one place, so target-only and
speculative runs use the same settings), and `SpecCounters`, a stat logger that
adds up vLLM's own spec-decode statistics (the ground truth for acceptance).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable

from specserve.target import proposer


@dataclasses.dataclass
class EngineSettings:
    """Knobs common to target and draft engines."""

    max_model_len: int | None = None
    max_num_seqs: int = 64
    seed: int = 0
    dtype: str = "auto"
    enforce_eager: bool = True
    kv_cache_gib: int | None = None  # CPU only: VLLM_CPU_KVCACHE_SPACE (whole GiB)
    enable_prefix_caching: bool = True
    load_format: str = "auto"  # "dummy": random weights made by the engine (measurements)


def settings_from(engine) -> EngineSettings:
    """EngineSettings from the config model's EngineConfig (specserve.config)."""
    return EngineSettings(max_model_len=engine.max_model_len, max_num_seqs=engine.max_num_seqs,
                          seed=engine.seed, dtype=engine.dtype, kv_cache_gib=engine.kv_cache_gib,
                          enforce_eager=engine.enforce_eager)


def _common_args(model: str, s: EngineSettings) -> dict:
    args = dict(
        model=model,
        tokenizer=model,
        seed=s.seed,
        dtype=s.dtype,
        max_num_seqs=s.max_num_seqs,
        enforce_eager=s.enforce_eager,
        enable_prefix_caching=s.enable_prefix_caching,
        disable_log_stats=False,
    )
    if s.max_model_len is not None:
        args["max_model_len"] = s.max_model_len
    if s.load_format != "auto":
        args["load_format"] = s.load_format
    return args


def cpu_binding(tp: int, cores: int | None = None) -> tuple[str | None, str | None]:
    """OpenMP core lists (target, draft) for vLLM CPU engines on one machine.

    vLLM's "auto" binding puts every engine on the same core; a draft that
    shares the target's core can never run ahead of it. With TP=1 the target
    gets core 0 and the draft the rest (what separate hardware would give);
    with TP=N each target rank gets one core and the draft shares them all.
    """
    cores = cores or os.cpu_count() or 1
    if tp == 1 and cores >= 2:
        return "0", str(cores - 1) if cores == 2 else f"{cores // 2}-{cores - 1}"
    if 1 < tp <= cores:
        return "|".join(str(i) for i in range(tp)), f"0-{cores - 1}"
    return None, None


def apply_cpu_env(s: EngineSettings) -> None:
    """vLLM CPU reads its KV cache size from the environment (GiB)."""
    if s.kv_cache_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(s.kv_cache_gib))


def target_engine_args(model: str, s: EngineSettings, tp: int = 1, k: int = 0,
                       executor: str | None = None):
    """AsyncEngineArgs for a target; k > 0 plugs in the remote-draft proposer.

    executor: vLLM's distributed_executor_backend ("ray" on GPUs, see
    specserve.placement); None: "mp" for TP > 1, vLLM's choice for TP = 1."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = _common_args(model, s)
    args["tensor_parallel_size"] = tp
    if executor is None and tp > 1:
        executor = "mp"
    if executor is not None:
        args["distributed_executor_backend"] = executor
    if k > 0:
        args["speculative_config"] = proposer.speculative_config(k)
        # vLLM's own per-request acceptance (a histogram of accepted counts per
        # verify step), returned with each finished request: what the router
        # attributes to the draft replica that drafted it.
        args["per_request_spec_decode_metrics"] = "summary"
    return AsyncEngineArgs(**args)


# The draft sink's settings (specserve.target.proposer, specserve.tls) are
# environment variables with this prefix; vLLM's Ray executor copies only
# VLLM_*-like variables to its workers unless told to copy more.
SPECSERVE_ENV_PREFIX = "SPECSERVE_"


def use_replica_placement_group(vllm_config) -> None:
    """Let vLLM's Ray executor place the engine's TP workers in this Serve
    replica's placement group, one per GPU bundle (what Ray Serve LLM does).

    The engine core runs in a child process that joins the cluster as a new
    driver: without the group handed over in `parallel_config` it would make a
    nested placement group of its own (ray#59064 / vllm#29688), and without
    RAY_ADDRESS it would start a cluster of its own."""
    import ray

    pg = ray.util.get_current_placement_group()
    if pg is None:
        raise RuntimeError("the Ray executor needs the replica's placement group; run the "
                           "target through deployments.app.build_app (placement_group_bundles)")
    vllm_config.parallel_config.placement_group = pg
    os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    extra = os.environ.get("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", "")
    if SPECSERVE_ENV_PREFIX not in extra.split(","):
        os.environ["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] = ",".join(
            p for p in (extra, SPECSERVE_ENV_PREFIX) if p)


def start_target_engine(engine_args, stat_loggers=None):
    """The AsyncLLM of a target replica (the one place it is started in Serve)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    vllm_config = engine_args.create_engine_config()
    if vllm_config.parallel_config.distributed_executor_backend == "ray":
        use_replica_placement_group(vllm_config)
    return AsyncLLM.from_vllm_config(vllm_config, stat_loggers=stat_loggers,
                                     disable_log_stats=engine_args.disable_log_stats)


def draft_engine_args(model: str, s: EngineSettings):
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(**_common_args(model, s))


@dataclasses.dataclass
class SpecTotals:
    """vLLM's spec-decode counters, summed over engine steps."""

    num_drafts: int = 0  # request-steps that verified at least one drafted token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    draft_per_position: list[int] = dataclasses.field(default_factory=list)
    running: int = 0  # the engine's batch and queue at its last step
    waiting: int = 0
    # Called with (tokens a decode step verified, seconds since the previous
    # step) for each decode step that followed a busy one: what adaptive K fits
    # its step costs on.
    step_observer: Callable[[int, float], None] | None = None
    _last_step: float | None = None

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


def spec_counter_factory():
    """(factory for AsyncLLM(stat_loggers=[...]), the totals it fills)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    totals = SpecTotals()
    lock = threading.Lock()

    class SpecCounters(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            sd = getattr(scheduler_stats, "spec_decoding_stats", None) if scheduler_stats else None
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
            if scheduler_stats is not None:
                totals.running = scheduler_stats.num_running_reqs
                totals.waiting = scheduler_stats.num_waiting_reqs
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
