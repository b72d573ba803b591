"""The engine launch both sides use: vLLM engines for targets and drafts.

Owns `EngineSettings` (the knobs target and draft engines share) and the
engine arguments built from them, starting an AsyncLLM and knowing its
processes (`start_engine`, with vLLM's Ray executor placed in the Serve
replica's placement group), shutting it down so nothing is orphaned, and the
CPU core binding of engines on one machine. The target side
(`specserve.target.engine`) and the draft side (`specserve.draft.worker`)
both start their engines here; neither imports the other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

log = logging.getLogger(__name__)


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


def engine_args(model: str, s: EngineSettings, **extra):
    """vLLM AsyncEngineArgs for a target or a draft with these settings."""
    from vllm.engine.arg_utils import AsyncEngineArgs

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
    args.update(extra)
    return AsyncEngineArgs(**args)


def cpu_binding(tp: int, cores: int | None = None,
                model_draft: bool = False) -> tuple[str | None, str | None]:
    """OpenMP core lists (target, draft) for vLLM CPU engines on one machine.

    Without a model draft (target only, or suffix pools, which run no engine)
    the target takes every core: TP=1 one rank on all of them, TP=N the cores
    split into N contiguous lists. With a model draft, vLLM's "auto" binding
    would put both engines on the same core, and a draft that shares the
    target's core can never run ahead of it: with TP=1 the target gets core 0
    and the draft the rest (what separate hardware would give); with TP=N each
    target rank gets one core and the draft shares them all. Ignored on GPUs.
    """
    cores = cores or os.cpu_count() or 1
    if not model_draft:
        if tp > cores:
            return None, None
        each = cores // tp
        return "|".join(_span(i * each, (i + 1) * each - 1) for i in range(tp)), None
    if tp == 1 and cores >= 2:
        return "0", str(cores - 1) if cores == 2 else f"{cores // 2}-{cores - 1}"
    if 1 < tp <= cores:
        return "|".join(str(i) for i in range(tp)), f"0-{cores - 1}"
    return None, None


def _span(first: int, last: int) -> str:
    """An OpenMP core list of first..last ("3" for one core)."""
    return str(first) if first == last else f"{first}-{last}"


@contextlib.contextmanager
def scoped_env(values: dict[str, str | None]):
    """Set (None: unset) environment variables for the block, then restore
    them: an engine's processes read their settings from the environment they
    inherit at spawn, and two engines in one process (LocalSpec's target and
    draft) need different ones (their core lists)."""
    before = {var: os.environ.get(var) for var in values}

    def put(vals):
        for var, value in vals.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value

    put(values)
    try:
        yield
    finally:
        put(before)


def apply_cpu_env(s: EngineSettings) -> None:
    """vLLM CPU reads its KV cache size from the environment (GiB)."""
    if s.kv_cache_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(s.kv_cache_gib))


# The draft sink's settings (specserve.target.proposer, specserve.tls) are
# environment variables with this prefix; vLLM's Ray executor copies only
# VLLM_*-like variables to its workers unless told to copy more.
SPECSERVE_ENV_PREFIX = "SPECSERVE_"


def use_replica_placement_group(vllm_config) -> None:
    """Let vLLM's Ray executor place the engine's TP workers in this Serve
    replica's placement group, one per GPU bundle (what Ray Serve LLM does;
    specserve.placement sizes the bundles).

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


def start_engine(args, **kwargs):
    """AsyncLLM from engine args, also returning the processes it started.

    With the Ray executor (GPU targets in Serve) the workers go in the calling
    replica's placement group (`use_replica_placement_group`)."""
    import psutil
    from vllm.v1.engine.async_llm import AsyncLLM

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    if args.distributed_executor_backend == "ray":
        vllm_config = args.create_engine_config()
        use_replica_placement_group(vllm_config)
        engine = AsyncLLM.from_vllm_config(vllm_config, disable_log_stats=args.disable_log_stats,
                                           **kwargs)
    else:
        engine = AsyncLLM.from_engine_args(args, **kwargs)
    procs = [p for p in me.children(recursive=True)
             if p.pid not in before and not _is_resource_tracker(p)]
    return engine, procs


def _is_resource_tracker(p) -> bool:
    """multiprocessing's resource tracker, started with the engine's first
    spawned process, lives as long as we do: not an engine process to wait for
    (waiting for it cost every shutdown its full timeout)."""
    import psutil

    try:
        return "resource_tracker" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def shutdown_engine(engine, procs, timeout: float = 15.0) -> None:
    """Shut an AsyncLLM down and make sure its processes are gone.

    vLLM's shutdown signals its engine-core and worker processes and returns;
    a caller that exits right after can leave them orphaned. Wait for them,
    and kill what is still there after `timeout` seconds.
    """
    import psutil

    engine.shutdown()
    # AsyncLLM.__del__ calls shutdown() again; at interpreter exit that finds
    # vLLM's module globals already None and prints a TypeError traceback.
    # Once is enough: the instance's own attribute shadows the method.
    engine.shutdown = lambda *args, **kwargs: None
    _, alive = psutil.wait_procs([p for p in procs if p.is_running()], timeout=timeout)
    for p in alive:
        log.warning("engine process %d did not exit; killing it", p.pid)
        p.kill()
