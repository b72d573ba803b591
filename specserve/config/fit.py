"""Whether a config can start: its engines against their models, its pools against the cluster.

Pure functions of a config and numbers the caller found (a model's context
length, a cluster's CPUs); the CLI reads those and calls these before Ray
starts, so an impossible config is a one-line error instead of a deployment
that never becomes ready. Owns:

- `context_problem`: a max_model_len longer than the model takes;
- `deploy_asks`: what each Serve deployment asks of Ray at deploy time (per
  replica, the resources of each bundle; replicas started), the same mapping
  `deployments/app.py` applies;
- `local_fit_problem`: a local cluster that cannot hold every deployment;
- `describe_ask` / `describe_free`: the words for a deployment that waits
  for resources (what it asks, what each node has free).
"""

from __future__ import annotations

import dataclasses

from specserve.config.replicas import Autoscaling, Resources
from specserve.config.schema import AppConfig

# Serve deployment names, as deployments/app.py names them.
TARGET_DEPLOYMENT = "target"


def draft_deployment(name: str) -> str:
    return f"draft-{name}"


def context_problem(where: str, max_model_len: int | None, model: str,
                    context: int | None) -> str | None:
    """Why `where`.engine.max_model_len cannot be used with `model`, or None."""
    if max_model_len is None or context is None or max_model_len <= context:
        return None
    return (f"{where}.engine.max_model_len {max_model_len} is more than the {context} tokens "
            f"{model} takes (its config.json); lower it, or set it to null for the model's own")


@dataclasses.dataclass(frozen=True)
class Ask:
    """What one Serve deployment asks of Ray when it is deployed."""

    deployment: str
    replicas: int              # started at deploy time
    bundles: tuple[dict, ...]  # per replica: Ray resources of each bundle (or the one actor)

    def per_replica(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for b in self.bundles:
            for k, v in b.items():
                out[k] = out.get(k, 0.0) + v
        return out

    def total(self) -> dict[str, float]:
        return {k: v * self.replicas for k, v in self.per_replica().items()}


def _resources(r: Resources) -> dict[str, float]:
    out = {"CPU": r.cpus_per_worker}
    if r.gpus_per_worker:
        out["GPU"] = r.gpus_per_worker
    if r.memory_gib:
        out["memory"] = r.memory_gib * (1 << 30)
    if r.accelerator_type:
        out[f"accelerator_type:{r.accelerator_type}"] = 0.001
    return out


def _started(r: Autoscaling) -> int:
    if r.min_replicas == r.max_replicas:
        return r.max_replicas
    return r.initial_replicas if r.initial_replicas is not None else r.min_replicas


def deploy_asks(cfg: AppConfig) -> list[Ask]:
    """The target (one bundle per TP worker; the replica actor sits in the
    first) and each draft pool (one actor per replica); the router asks nothing."""
    t = cfg.target
    asks = [Ask(TARGET_DEPLOYMENT, _started(t.replicas),
                tuple(_resources(t.resources) for _ in range(t.tensor_parallel_size)))]
    for d in cfg.drafts:
        asks.append(Ask(draft_deployment(d.name), _started(d.replicas), (_resources(d.resources),)))
    return asks


def local_fit_problem(cfg: AppConfig, cpus: float) -> str | None:
    """Why the deployments cannot all start on a local cluster of `cpus` CPUs, or None."""
    asks = [(a.deployment, a.total().get("CPU", 0.0)) for a in deploy_asks(cfg)]
    need = sum(c for _, c in asks)
    if need <= cpus + 1e-9:
        return None
    parts = ", ".join(f"{name} {c:g}" for name, c in asks)
    return (f"the deployments ask {need:g} CPUs ({parts}) of a local Ray cluster of {cpus:g}; "
            "lower resources.cpus_per_worker or replicas, or raise ray.num_cpus")


def _fmt(res: dict[str, float]) -> str:
    parts = []
    for k, v in sorted(res.items()):
        if k == "memory" or k == "object_store_memory":
            parts.append(f"{k} {v / (1 << 30):.1f} GiB")
        elif not k.startswith("node:"):
            parts.append(f"{k} {v:g}")
    return ", ".join(parts) or "nothing"


def describe_ask(ask: Ask) -> str:
    """'each replica asks CPU 1 (bundles: [CPU 1], [CPU 1])'."""
    text = f"each replica asks {_fmt(ask.per_replica())}"
    if len(ask.bundles) > 1:
        text += " in bundles " + ", ".join(f"[{_fmt(b)}]" for b in ask.bundles)
    return text


def describe_free(free_by_node: dict[str, dict[str, float]]) -> str:
    """'free: node 10.0.0.1: CPU 0, memory 3.2 GiB; node ...'."""
    if not free_by_node:
        return "free: no live node"
    return "free: " + "; ".join(f"node {node}: {_fmt(res)}"
                                for node, res in sorted(free_by_node.items()))
