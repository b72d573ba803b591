"""The router's K choice with the target's measured step cost (deployments/choice.py),
with a stand-in target handle: no Ray, no engine."""

import asyncio

import pytest

from deployments.choice import COST_REFRESH_S, DraftChoice
from fake_target import FakeTarget
from specserve.acceptance.record import Acceptance, TargetReport
from specserve.acceptance.stats import RequestRecord, SpecStats
from specserve.config import AppConfig
from specserve.control import policy

PROBE_EVERY = policy.Thresholds().probe_every


def router(step_cost, k_max=4):
    config = {"target": {"model": "/nonexistent", "engine": {"max_num_seqs": 64}},
              "drafts": [{"name": "smollm2-distill", "model": "/nonexistent"}],
              "speculation": {"num_speculative_tokens": k_max}}
    r = DraftChoice(AppConfig.model_validate(config), FakeTarget(step_cost=step_cost),
                    ["smollm2-distill"], SpecStats(k_max))
    r.controller.turn = 1
    return r


def record(r, requests=8):
    """Finished requests like the default draft's here: alpha 0.29, coverage 0.12."""
    for _ in range(requests):  # 200 steps, 24 with drafts, 10 of 96 drafted tokens accepted
        r.stats.record(RequestRecord(
            TargetReport("t0", "smollm2-distill", "d0",
                         Acceptance(k=4, output_tokens=200 + 10, draft_tokens=96,
                                    accepted_histogram=(16, 6, 2, 0, 0))),
            ttft_s=0.1, duration_s=2.0, finished_at=0.0))


def test_measured_cost_is_fetched_in_the_background_and_used():
    async def go():
        cpu = {"fixed_s": 0.015, "per_token_s": 0.004, "steps": 100}
        r = router(cpu)
        record(r)
        first = r.choose()  # nothing fetched yet: the load model decides
        assert r.controller.inputs["cost_source"] == "modelled" and r.controller.inputs["step_cost"] is None
        await r._cost_task  # the background fetch completes
        assert r.target.spec_totals.calls == 1
        picks = [r.choose() for _ in range(2 * PROBE_EVERY)]
        assert r.target.spec_totals.calls == 1  # cached for COST_REFRESH_S: one call
        assert r.controller.inputs["cost_source"] == "measured" and r.controller.inputs["step_cost"] == {
            k: v for k, v in cpu.items() if k != "steps"}
        pool = r.controller.inputs["pools"]["smollm2-distill"]
        assert pool["alpha"] == pytest.approx(10 / 34) and pool["coverage"] == pytest.approx(0.12)
        assert pool["k"] == 0 and r.stats.current_k["smollm2-distill"] == 0, (first, pool)
        # held at K=0, but probed at full K PROBE_EVERY requests after its last
        # request at K > 0 (the first choice), then twice as long
        assert [i for i, c in enumerate(picks) if c.pool is not None] == [PROBE_EVERY]
        assert picks[PROBE_EVERY].k == 4 and picks[PROBE_EVERY].probe
        assert all(c.k == 0 for c in picks if c.pool is None)
        # an old copy is refreshed (in the background)
        r._cost = (r._cost[0] - COST_REFRESH_S, r._cost[1])
        r.choose()
        await r._cost_task
        assert r.target.spec_totals.calls == 2
        return first

    first = asyncio.run(go())
    # The load model alone (5% of a step per token) would have speculated.
    assert first.k > 0


def test_cheap_verification_keeps_a_good_draft_speculating():
    async def go():
        r = router({"fixed_s": 0.025, "per_token_s": 0.00001, "steps": 100})
        for _ in range(8):  # alpha ~0.95, drafts at most steps
            r.stats.record(RequestRecord(
                TargetReport("t0", "smollm2-distill", "d0",
                             Acceptance(k=4, output_tokens=100, draft_tokens=80,
                                        accepted_histogram=(0, 1, 1, 1, 17))),
                ttft_s=0.1, duration_s=2.0, finished_at=0.0))
        r.choose()
        await r._cost_task
        c = r.choose()
        assert r.controller.inputs["cost_source"] == "measured"
        assert c.pool == "smollm2-distill" and c.k == 4
        assert r.controller.inputs["pools"]["smollm2-distill"]["predicted_speedup"] > 2

    asyncio.run(go())
