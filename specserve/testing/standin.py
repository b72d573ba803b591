"""Stand-ins for the target and draft replicas that report where Ray put them.

Owns: `StandInTarget`, `StandInDraft` (constructors of deployments.target
.TargetServer / deployments.draft.DraftServer) and `ProbeWorker` (a vLLM worker
class that computes nothing). `deployments.app.build_app(cfg, StandInTarget,
StandInDraft)` deploys them with exactly the Serve options of the real app, so
a test on a loopback Ray cluster with fake GPUs sees the real placement:

- the target stand-in builds the target's vLLM config the way TargetServer
  does (specserve.target.engine), hands it the replica's placement group the
  same way, and then starts vLLM's Ray executor in a child process (where
  vLLM's engine core runs it), with ProbeWorker as the worker class: vLLM's
  code picks the bundles, creates one worker actor per GPU bundle and tells
  each its local rank and the node's GPU ids; each worker reports what it got.
  It is RayDistributedExecutor, not vLLM 0.32's default RayExecutorV2 (which
  the real TargetServer gets): that one drives real workers over message
  queues, while this one can run a worker class that computes nothing; both
  take the group handed over (ray_utils.initialize_ray_cluster) and put one
  worker actor on each GPU bundle of it.
- the draft stand-in reports its node and GPU ids.

Each replica writes one JSON file into $SPECSERVE_PROBE_DIR. Test code only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PROBE_DIR_ENV = "SPECSERVE_PROBE_DIR"
PROBE_ENV = "SPECSERVE_PROBE_REPLICA"  # must reach the workers (the sink's env does)


def _where() -> dict:
    import ray

    ctx = ray.get_runtime_context()
    return {"node_id": ctx.get_node_id(), "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "placement_group": ctx.get_placement_group_id()}


def _write(name: str, record: dict) -> None:
    out = Path(os.environ[PROBE_DIR_ENV])
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{name}.tmp"
    tmp.write_text(json.dumps(record))
    tmp.rename(out / f"{name}.json")


class ProbeWorker:
    """What vLLM's Ray executor instantiates in each worker actor (in place of
    the GPU worker): it keeps what the executor told it and reports it."""

    def __init__(self, vllm_config, local_rank: int, rank: int, distributed_init_method: str,
                 is_driver_worker: bool = False, **kwargs):
        self.vllm_config = vllm_config
        # vLLM's worker wrapper moves the node's GPU ids into the config.
        gpu_ids = getattr(vllm_config.parallel_config, "assigned_physical_gpu_ids", None)
        self.told = {"rank": rank, "local_rank": local_rank, "is_driver_worker": is_driver_worker,
                     "assigned_physical_gpu_ids": list(gpu_ids) if gpu_ids is not None else None}

    def init_device(self) -> None:
        pass

    def load_model(self) -> None:
        pass

    def placement(self) -> dict:
        return {**self.told, **_where(), "probe_env": os.environ.get(PROBE_ENV)}


def _engine_core(vllm_config, out) -> None:
    """Child process, as vLLM's engine core: run vLLM's Ray executor, report."""
    try:
        from vllm.v1.executor.ray_executor import RayDistributedExecutor

        executor = RayDistributedExecutor(vllm_config)
        out.put({"workers": executor.collective_rpc("placement")})
        executor.shutdown()
    except BaseException as e:  # reported to the replica, which fails with it
        import traceback

        out.put({"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})


class StandInTarget:
    def __init__(self, config: dict, drafts: dict | None = None):
        import multiprocessing

        from deployments import replica_name
        from specserve.config import AppConfig
        from specserve.placement import target_placement
        from specserve.engine import engine_args, settings_from, use_replica_placement_group

        cfg = AppConfig.model_validate(config)
        t = cfg.target
        place = target_placement(t)
        if place.executor != "ray":
            raise ValueError("StandInTarget places GPU workers; give the target gpus_per_worker")
        args = engine_args(t.model, settings_from(t.engine),
                           tensor_parallel_size=t.tensor_parallel_size,
                           distributed_executor_backend=place.executor)
        vllm_config = args.create_engine_config()
        vllm_config.parallel_config.worker_cls = f"{__name__}.ProbeWorker"
        use_replica_placement_group(vllm_config)
        self.name = replica_name()
        os.environ[PROBE_ENV] = self.name
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        core = ctx.Process(target=_engine_core, args=(vllm_config, out))
        core.start()
        got = out.get(timeout=600)
        core.join(60)
        if "error" in got:
            raise RuntimeError(f"vLLM's Ray executor failed: {got['error']}")
        self.record = {"kind": "target", "replica": self.name, "drafts": sorted(drafts or {}),
                       "actor": _where(), "workers": got["workers"]}
        _write(self.name.replace("#", "_"), self.record)

    def reconfigure(self, live: dict) -> None:
        """As TargetServer's (the builder gives both the live settings)."""

    def placement(self) -> dict:
        return self.record


class StandInDraft:
    def __init__(self, draft: dict, target_tp: int = 1, grpc_tls: dict | None = None,
                 speculation: dict | None = None):
        from deployments import replica_name

        self.name = replica_name()
        self.record = {"kind": "draft", "pool": draft["name"], "replica": self.name,
                       "actor": _where()}
        _write(self.name.replace("#", "_"), self.record)

    def active(self) -> int:
        return 0
