"""The pools as operators see them: replica counts per pool and the recent
autoscaling decisions with their reasons (for /v1/spec/stats, /metrics and the
/dashboard page).

Pure parts (no Ray, no clock): `DecisionLog` keeps the latest decisions,
`pool_name` maps Serve deployment names to pools, `replica_counts` turns Serve's
status into counts per pool, `with_adapt` adds each draft pool's adaptation
figures (`specserve.adapt.figures`), `prometheus_lines` exports the counts
and those figures (`ADAPT_GAUGES`, the swaps and rollbacks counters, the
serving version as an info gauge).

Ray glue (best effort; a failure never touches a decision or a request): the
autoscaling policies run in the Serve controller (`specserve.control.autoscale`), the
figures are shown by the router, so the decisions travel through one small
named actor, `DECISIONS_ACTOR` in the Serve namespace. The controller creates
it on its first decision (`publish`), so it lives and dies with the controller;
the router reads it (`fetch`). Pools with fixed replicas run no policy: no
decisions, which the page shows as such.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque

from specserve.acceptance.catalogue import kind_of
from specserve.acceptance.exposition import family

log = logging.getLogger("specserve.control.pools")

DECISIONS_ACTOR = "specserve-autoscale-decisions"
NAMESPACE = "serve"  # the Serve controller's and replicas' namespace
KEEP = 50


@dataclasses.dataclass
class DecisionEntry:
    at: float  # unix time
    pool: str
    previous: int  # replicas when the policy decided
    replicas: int  # replicas it asked for
    reason: str

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class DecisionLog:
    """The latest autoscaling decisions, newest first when read."""

    def __init__(self, keep: int = KEEP):
        self.entries: deque[DecisionEntry] = deque(maxlen=keep)

    def record(self, at: float, pool: str, previous: int, replicas: int, reason: str) -> None:
        self.entries.append(DecisionEntry(at, pool, previous, replicas, reason))

    def recent(self, n: int = 20) -> list[dict]:
        return [e.as_dict() for e in reversed(list(self.entries)[-n:])]


def pool_name(deployment: str) -> str | None:
    """'target' -> 'target', 'draft-llama-1b' -> 'llama-1b', 'router' -> None."""
    if deployment == "target":
        return "target"
    if deployment.startswith("draft-"):
        return deployment[len("draft-"):]
    return None


def replica_counts(deployments: dict[str, dict[str, int]],
                   bounds: dict[str, tuple[int, int]],
                   kinds: dict[str, str]) -> list[dict]:
    """One row per pool: its `kind` (catalogue.kind_of), replicas by Serve
    state (RUNNING, STARTING, ...), `running`, and the configured bounds.

    deployments: deployment name -> {state: count} (Serve's replica_states);
    bounds: pool -> (min_replicas, max_replicas), from the config; kinds:
    AppConfig.draft_kinds(). Pools of the config that Serve does not report
    (yet) appear with 0 running."""
    rows = {}
    for deployment, states in deployments.items():
        pool = pool_name(deployment)
        if pool is None:
            continue
        states = {str(k): int(v) for k, v in states.items() if int(v) > 0}
        lo, hi = bounds.get(pool, (None, None))
        rows[pool] = {"pool": pool, "kind": kind_of(pool, kinds), "deployment": deployment,
                      "states": states,
                      "running": states.get("RUNNING", 0), "min_replicas": lo,
                      "max_replicas": hi}
    for pool, (lo, hi) in bounds.items():
        if pool not in rows:
            deployment = "target" if pool == "target" else f"draft-{pool}"
            rows[pool] = {"pool": pool, "kind": kind_of(pool, kinds), "deployment": deployment,
                          "states": {}, "running": 0, "min_replicas": lo, "max_replicas": hi}
    # The target first, then the drafts by name.
    return sorted(rows.values(), key=lambda r: (r["pool"] != "target", r["pool"]))


def with_adapt(rows: list[dict], figures: dict | str, adapting: set[str]) -> list[dict]:
    """`replica_counts` rows, each draft pool's with `adapt`: its figures as
    a replica answered them (TargetServer.draft_adapt), why they are missing
    ("unavailable: ..."), or None where the pool's adapt is off. figures: pool
    -> figures, or one "unavailable: ..." for all; adapting: the pools with
    adapt on. New rows: the ones given are left as they were."""
    out = []
    for row in rows:
        pool = row["pool"]
        if pool == "target":
            out.append(row)
            continue
        if pool not in adapting:
            adapt = None
        elif isinstance(figures, str):
            adapt = figures
        else:
            adapt = figures.get(pool) or "unavailable: no replica answered"
        out.append({**row, "adapt": adapt})
    return out


# /metrics family -> its `adapt` figure. A null figure (an alpha not measured
# yet) writes no sample rather than a made-up number.
ADAPT_GAUGES = {"specserve_adapt_heldout_alpha_serving": "heldout_alpha_serving",
                "specserve_adapt_heldout_alpha_candidate": "heldout_alpha_candidate",
                "specserve_adapt_buffer_tokens": "buffer_tokens",
                "specserve_adapt_heldout_tokens": "heldout_tokens",
                "specserve_adapt_train_seconds": "train_seconds"}
# Counted by the pool's version store (specserve.adapt.versions, shared by the
# pool's replicas and kept on disk), so they never go back whichever replica
# answers. `rounds` is one replica's own count: on /v1/spec/stats only.
ADAPT_COUNTERS = {"specserve_adapt_swaps_total": "swaps",
                  "specserve_adapt_rollbacks_total": "rollbacks"}


def prometheus_lines(pools: list[dict]) -> list[str]:
    """Replica counts per pool; with `with_adapt` rows, each adapting pool's
    figures too (the adapt families are written only when some pool's row
    holds figures: none while no pool adapts or none answered)."""
    lines = family("specserve_pool_replicas",
                   [({"pool": row["pool"], "kind": row["kind"]}, row["running"])
                    for row in pools])
    adapting = [(row, row["adapt"]) for row in pools if isinstance(row.get("adapt"), dict)]
    if not adapting:
        return lines
    for name, key in {**ADAPT_GAUGES, **ADAPT_COUNTERS}.items():
        lines += family(name, [({"pool": row["pool"], "kind": row["kind"]}, figures[key])
                               for row, figures in adapting
                               if figures.get(key) is not None])
    # The serving version, info style: 1 on the version serving now.
    lines += family("specserve_adapt_version_info",
                    [({"pool": row["pool"], "kind": row["kind"],
                       "version": figures["version"]}, 1)
                     for row, figures in adapting if figures.get("version") is not None])
    return lines


# ---- Ray glue -------------------------------------------------------------------

_handle = None


def publish(at: float, pool: str, previous: int, replicas: int, reason: str) -> None:
    """Record one decision in the decisions actor (from the Serve controller).
    Fire and forget; logs and carries on if Ray refuses."""
    global _handle
    try:
        import ray

        if not ray.is_initialized():  # not in a Ray process (e.g. a unit test)
            return
        if _handle is None:
            _handle = ray.remote(DecisionLog).options(
                name=DECISIONS_ACTOR, namespace=NAMESPACE, get_if_exists=True,
                num_cpus=0, max_restarts=-1).remote()
        _handle.record.remote(at, pool, previous, replicas, reason)
    except Exception as e:  # observability only: the decision stands
        _handle = None
        log.warning("could not publish the autoscaling decision for %s: %s", pool, e)


async def fetch(n: int = 20) -> list[dict]:
    """The latest decisions (newest first); [] while no policy has decided."""
    import asyncio

    import ray

    try:
        actor = await asyncio.to_thread(ray.get_actor, DECISIONS_ACTOR, namespace=NAMESPACE)
    except ValueError:  # not created: no pool autoscales, or no decision yet
        return []
    try:
        return await actor.recent.remote(n)
    except Exception as e:  # observability only: the stats go on without them
        log.warning("autoscaling decisions unavailable: %s", e)
        return []
