"""Autoscaling of the draft and target pools: pure decisions, and the Ray Serve
policy functions that feed them.

Decisions are pure functions of figures the replicas report through
`record_autoscaling_stats` (averaged by Serve over its look-back window):
- a draft replica reports `coverage` (share of the target's verified updates
  that found this replica's drafts already ahead), `lag` (tokens it was behind
  the verified position when an update arrived), `active` (requests assigned
  to it) and `released` (those of them the target gave up because their drafts
  kept coming too late: they get no more updates, so `coverage` no longer sees
  them, and the policy counts them as uncovered and late);
- a target replica reports `load` (running requests / max_num_seqs) and
  `waiting` (its engine's queue).

The draft pool grows while its drafts arrive late under load (low coverage with
lag, or with released requests) and shrinks when idle; the target pool grows
with queueing or full batches and shrinks when mostly empty. Bounds and delays
come from the config (Serve applies upscale/downscale delays around these
functions). Every decision is logged with its reason when it changes, exported
as a gauge (one series per pool, no reason label) and published for the
router's stats and dashboard (`specserve.control.pools`).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from specserve.control import pools

# These policies run inside the Serve controller, whose own logger ("ray.serve")
# is the one that reaches the controller's log and the driver's console.
log = logging.getLogger("ray.serve")

LOW_COVERAGE = 0.5  # below this, drafts often arrive too late to be used
LAG_TOKENS = 1.0  # ... and this far behind the verified position on average
BUSY = 1.0  # active draft requests per replica that count as "under load"


@dataclasses.dataclass
class Decision:
    replicas: int
    reason: str


def _clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, n))


def draft_pool(current: int, lo: int, hi: int, coverage: float | None, lag: float | None,
               active: float | None, released: float | None = None) -> Decision:
    """Replicas for a draft pool. Per replica, means: active, the requests
    assigned; released, those of them the target gave up as late (None: 0)."""
    if active is None:
        return Decision(_clamp(current, lo, hi), "no figures yet")
    if active < 0.05:
        return Decision(_clamp(current - 1, lo, hi), f"idle (active {active:.2f} per replica)")
    if coverage is None or lag is None or active < BUSY:
        return Decision(_clamp(current, lo, hi), "keeping up")
    # A released request's steps find no drafts at all, and its draft hears of
    # them no more: its coverage is 0, and it was released for being late.
    given_up = min(released or 0.0, active)
    covered = coverage * (1.0 - given_up / active)
    if covered < LOW_COVERAGE and (lag >= LAG_TOKENS or given_up > 0):
        counted = f" counting {given_up:.1f} released as uncovered" if given_up else ""
        return Decision(_clamp(current + 1, lo, hi),
                        f"drafts late under load (coverage {covered:.2f} < {LOW_COVERAGE}"
                        f"{counted}, lag {lag:.1f} tokens, active {active:.1f} per replica)")
    return Decision(_clamp(current, lo, hi), "keeping up")


def target_pool(current: int, lo: int, hi: int, load: float | None,
                waiting: float | None) -> Decision:
    """Replicas for the target pool. load: running / max_num_seqs; waiting:
    queued requests; both per replica."""
    if load is None:
        return Decision(_clamp(current, lo, hi), "no figures yet")
    if (waiting or 0) > 0.5 or load >= 0.9:
        return Decision(_clamp(current + 1, lo, hi),
                        f"queueing (load {load:.2f}, waiting {waiting or 0:.1f} per replica)")
    if load < 0.25 and current > lo:
        return Decision(_clamp(current - 1, lo, hi), f"light load ({load:.2f})")
    return Decision(_clamp(current, lo, hi), "steady")


# ---- Ray Serve policy functions (run in the Serve controller) -------------------

def _mean(per_replica: dict | None) -> float | None:
    values = list((per_replica or {}).values())
    return sum(values) / len(values) if values else None


def _apply(ctx, decision: Decision, pool: str):
    state = dict(ctx.policy_state or {})
    if state.get("reason") != decision.reason or state.get("replicas") != decision.replicas:
        log.info("specserve autoscale %s: %d -> %d replicas: %s", pool, ctx.current_num_replicas,
                 decision.replicas, decision.reason)
        _export(pool, decision)
        # For /v1/spec/stats and the /dashboard page (specserve.control.pools).
        pools.publish(time.time(), pools.pool_name(pool) or pool, ctx.current_num_replicas,
                      decision.replicas, decision.reason)
    state.update(reason=decision.reason, replicas=decision.replicas)
    return decision.replicas, state


def _export(pool: str, decision: Decision) -> None:
    try:
        from ray.serve.metrics import Gauge

        from specserve.acceptance import catalogue

        # One series per pool: the reason (free text with figures in it) goes
        # to the decision log (log line, /v1/spec/stats, /dashboard), never a
        # label, which would make a new series for every decision.
        m = catalogue.RAY["specserve_autoscale_desired_replicas"]
        Gauge(m.name, description=m.help, tag_keys=m.labels).set(decision.replicas,
                                                                 tags={"pool": pool})
    except Exception:  # metrics are best effort; the decision stands
        pass


def draft_policy(ctx):
    m = ctx.aggregated_metrics or {}
    d = draft_pool(ctx.current_num_replicas, ctx.capacity_adjusted_min_replicas,
                   ctx.capacity_adjusted_max_replicas, _mean(m.get("coverage")),
                   _mean(m.get("lag")), _mean(m.get("active")), _mean(m.get("released")))
    return _apply(ctx, d, ctx.deployment_name)


def target_policy(ctx):
    m = ctx.aggregated_metrics or {}
    d = target_pool(ctx.current_num_replicas, ctx.capacity_adjusted_min_replicas,
                    ctx.capacity_adjusted_max_replicas, _mean(m.get("load")),
                    _mean(m.get("waiting")))
    return _apply(ctx, d, ctx.deployment_name)
