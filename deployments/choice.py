"""DraftChoice: the router's controller state (which draft pool, which K, for each request).

Owns: the requests in flight per pool and the target's measured step cost as
last fetched (refreshed in the background, never waited on by a request); the
decision is the K controller's (`specserve.control.controller.KController`,
the one LocalSpec uses too), from the acceptance record's measured α and
coverage (the whole app's, from the ledger, when there is one); what it last decided and why is shown in /v1/spec/stats. Never does: HTTP, or anything with a request's body.

Built from the config and a target handle whose `spec_totals.remote()` is
awaitable, so it is tested with a stand-in handle (tests/deployments/test_router_k.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

from specserve.acceptance.stats import SpecStats
from specserve.config import AppConfig
from specserve.control import policy
from specserve.control.controller import COST_REFRESH_S, KController

log = logging.getLogger("specserve.router")

class DraftChoice:
    def __init__(self, config: AppConfig, target, draft_names: list[str], stats: SpecStats):
        self.target = target
        self.draft_names = list(draft_names)
        self.stats = stats
        # The app's acceptance per draft model, every router's requests (from
        # the ledger, deployments.ops.OpsViews.flush); None: this router's own.
        self.fleet_by_model: dict | None = None
        self.inflight: dict[str | None, int] = {}
        self.controller = KController(0, {})
        self.configure(config)
        # The target's measured step cost (from spec_totals), refreshed in the
        # background at most every COST_REFRESH_S: no remote call per request.
        self._cost: tuple[float, dict | None] = (float("-inf"), None)
        self._cost_task: asyncio.Task | None = None

    def configure(self, config: AppConfig) -> None:
        """Take the settings that may change while the app runs (K, the K
        controller's thresholds, the pools' replica bounds)."""
        self.k_max = config.speculation.num_speculative_tokens
        t = config.target
        self.capacity = max(t.replicas.max_replicas, 1) * t.engine.max_num_seqs
        self.replicas = {d.name: max(d.replicas.max_replicas, 1) for d in config.drafts}
        self.target_replicas = max(t.replicas.max_replicas, 1)
        self.controller.configure(self.k_max, self.replicas,
                                  config.speculation.k_control.thresholds(),
                                  config.draft_kinds(), config.collect_gaps())

    # ---- requests in flight ---------------------------------------------------

    def acquire(self, pool: str | None) -> None:
        self.inflight[pool] = self.inflight.get(pool, 0) + 1

    def release(self, pool: str | None) -> None:
        self.inflight[pool] -= 1

    def load(self) -> float:
        """Share of the target pool's sequence slots in use (0..1)."""
        return min(sum(self.inflight.values()) / self.capacity, 1.0)

    # ---- the target's measured step cost ----------------------------------------

    def step_cost(self) -> dict | None:
        """The target's measured decode step cost ({"fixed_s", "per_token_s", "steps"}
        from spec_totals; None until measured), as last fetched. A fetch older than
        COST_REFRESH_S starts a refresh in the background; this request does not wait."""
        at, cost = self._cost
        if (time.monotonic() - at >= COST_REFRESH_S
                and (self._cost_task is None or self._cost_task.done())):
            self._cost_task = asyncio.get_running_loop().create_task(self._refresh_cost())
        return cost

    async def _refresh_cost(self) -> None:
        cost = self._cost[1]
        try:
            totals = await asyncio.wait_for(self.target.spec_totals.remote(), 10)
            cost = totals.get("step_cost")
        except Exception as e:  # the K choice falls back to the last figures
            log.warning("target step cost unavailable: %s", e)
        self._cost = (time.monotonic(), cost)

    # ---- the decision -------------------------------------------------------------

    def choose(self, waits: dict[str, float] | None = None) -> policy.Choice:
        """Draft pool and K for the next request (the K controller), from measured
        acceptance, coverage, the target's measured step cost (modelled from
        load until the target has measured it) and `waits`, each pool's
        measured wait per step in seconds (specserve.acceptance.branches.pool_waits)."""
        cost = policy.StepCost.from_figures(self.step_cost())
        # decode rows per target replica, this request included
        rows = (sum(self.inflight.values()) + 1) / self.target_replicas
        by_model = self.stats.by_model if self.fleet_by_model is None else self.fleet_by_model
        choice = self.controller.choose(by_model, self.inflight, self.load(),
                                        cost, rows, waits)
        self.stats.current_k.update(self.controller.current_k)
        return choice

    @property
    def last_choice(self) -> policy.Choice | None:
        return self.controller.last

    @property
    def k_inputs(self) -> dict:
        return self.controller.inputs
