"""The K controller: which draft pool and how many drafted tokens (K) for the next request.

A small stateful object around the pure policy (`specserve.control.policy`):
it keeps the turn counter (for measuring fresh pools in turn), how long each
pool has been held at K = 0 and how often it was probed since (for spacing
its probes), the last choice and the inputs it decided with (shown in
/v1/spec/stats). The Serve router and `LocalSpec` (`specserve generate`, the
bench's `specserve` system, the GPU check) both decide with one of these, so
the same figures give the same decision everywhere.

Pure: fed with numbers (acceptance `Figures` per pool, requests in flight,
the target's measured step cost, each pool's measured wait per step), no Ray,
no clock.
"""

from __future__ import annotations

import collections
import logging

from specserve.acceptance.catalogue import kind_of
from specserve.acceptance.record import Figures
from specserve.control import policy

log = logging.getLogger(__name__)

# How old a caller's copy of the target's measured step cost may get (the
# router's and LocalSpec's: both refresh it in the background, no request waits).
COST_REFRESH_S = 2.0


class KController:
    def __init__(self, k_max: int, pools: dict[str, int],
                 thresholds: policy.Thresholds = policy.Thresholds(),
                 kinds: dict[str, str] | None = None, collect_gaps: dict[str, int] | None = None):
        """k_max: the target's K; pools: draft pool name -> its replicas; kinds:
        AppConfig.draft_kinds() (shown with each pool's inputs); collect_gaps:
        adapting pool -> its collect gap (AppConfig.collect_gaps())."""
        self.k_max = k_max
        self.pools = dict(pools)
        self.kinds = dict(kinds or {})
        self.collect_gaps = dict(collect_gaps or {})
        self.thresholds = thresholds
        self.turn = 0
        self.last: policy.Choice | None = None
        self.inputs: dict = {}
        self.current_k: dict[str, int] = {}
        # per pool: requests since it last ran one at K > 0, and the probes since
        # its figures last gave it K > 0 (policy.probe_gap spaces the probes).
        self.idle: dict[str, int] = {name: 0 for name in self.pools}
        self.probes: dict[str, int] = {name: 0 for name in self.pools}
        self.decisions: collections.Counter = collections.Counter()

    def configure(self, k_max: int, pools: dict[str, int],
                  thresholds: policy.Thresholds, kinds: dict[str, str] | None = None,
                  collect_gaps: dict[str, int] | None = None) -> None:
        """New settings while running (the live config): K, replicas per pool,
        thresholds, kinds, collect gaps. What was measured and the probe
        spacing are kept."""
        self.k_max, self.pools, self.thresholds = k_max, dict(pools), thresholds
        self.kinds = dict(kinds or {})
        self.collect_gaps = dict(collect_gaps or {})
        for name in self.pools:
            self.idle.setdefault(name, 0)
            self.probes.setdefault(name, 0)

    def choose(self, figures: dict[str, Figures], inflight: dict[str | None, int], load: float,
               cost: policy.StepCost | None = None, rows: float = 1.0,
               waits: dict[str, float] | None = None) -> policy.Choice:
        """Pool and K for the next request.

        figures: acceptance per pool so far; inflight: requests using each pool
        now (None: the target alone); load: share of the target's sequence slots
        in use (the model stands in for the step cost until `cost` is measured);
        rows: decode rows per target replica with this request; waits: seconds
        per step the target held for each pool's drafts
        (specserve.acceptance.branches.pool_waits; a pool not in it: unmeasured, 0)."""
        waits = waits or {}
        th = self.thresholds
        views = []
        for name, replicas in self.pools.items():
            f = figures.get(name) or Figures()
            views.append(policy.PoolView(
                name=name, draft_tokens=f.draft_tokens, alpha=f.alpha, coverage=f.coverage,
                requests=f.requests, inflight=inflight.get(name, 0), replicas=replicas,
                steps=f.steps, idle=self.idle[name], probes=self.probes[name],
                wait_s=waits.get(name, 0.0), collect_gap=self.collect_gaps.get(name),
                runs_model=kind_of(name, self.kinds) != "suffix"))
        if cost is None:
            rows = 1.0
        choice = policy.choose(views, self.k_max, load, self.turn, cost, rows, th)
        self.turn += 1
        for name in self.idle:
            self.idle[name] += 1
        if choice.pool is not None and choice.k > 0:
            self.idle[choice.pool] = 0
            self.probes[choice.pool] = self.probes[choice.pool] + 1 if choice.probe else 0
        per_pool = {}
        for v in views:  # the K each pool would get now (shown in the stats)
            k = policy.pool_k(v, self.k_max, load, cost, rows, th)
            self.current_k[v.name] = k
            per_pool[v.name] = {
                "kind": kind_of(v.name, self.kinds), "k": k, "alpha": v.alpha,
                "coverage": v.coverage,
                "wait_ms_per_step": waits[v.name] * 1e3 if v.name in waits else None,
                "predicted_speedup": policy.speedup(v.alpha, k, load, cost, rows, v.coverage,
                                                    v.wait_s)}
        self.inputs = {"step_cost": (None if cost is None else
                                     {"fixed_s": cost.fixed, "per_token_s": cost.per_token}),
                       "cost_source": "measured" if cost is not None else "modelled",
                       "modelled_verify_cost": None if cost is not None else policy.verify_cost(load),
                       "rows": rows, "load": load, "pools": per_pool}
        if self.last is None or choice.reason != self.last.reason:
            log.info("draft choice: %s", choice.reason)
        self.last = choice
        self.decisions[choice.k] += 1
        return choice
