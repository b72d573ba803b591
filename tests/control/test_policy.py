"""The speculation policies alone: K control and the choice of draft pool."""

import dataclasses

import numpy as np
import pytest

from specserve.control import policy

from specserve.control.policy import (
    PoolView, Thresholds, StepCost, choose, choose_k, expected_tokens, is_fresh,
    modelled_cost, pool_k, pool_margin, predicted_rate, probe_gap, speedup,
)

TH = Thresholds()
MIN_REQUESTS, MIN_SAMPLES, PROBE_EVERY = TH.min_requests, TH.min_drafted_tokens, TH.probe_every


def test_expected_tokens_closed_form_and_edges():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)


def test_k_falls_with_acceptance_and_load_and_comes_back():
    ks = [choose_k(a, 8, load=0.0) for a in (0.95, 0.8, 0.6, 0.3, 0.05)]
    assert ks == sorted(ks, reverse=True) and ks[0] == 8 and ks[-1] == 0
    by_load = [choose_k(0.8, 8, load) for load in (0.0, 0.2, 0.5, 1.0)]
    assert by_load == sorted(by_load, reverse=True) and by_load[-1] == 0
    assert choose_k(0.8, 8, 1.0) == 0 and choose_k(0.8, 8, 0.0) > 0  # back when load drops
    assert choose_k(0.9, 0, 0.0) == 0


def test_speculation_never_chosen_when_it_cannot_pay():
    for a in (0.0, 0.2, 0.5, 0.9, 1.0):
        k = choose_k(a, 8, load=1.0)  # saturated: each verified token costs a full step
        assert k == 0 and speedup(a, 1, 1.0) <= 1.0 + 1e-9


def pool(name, acc, tokens=1000, cov=0.8, inflight=0):
    return PoolView(name, tokens, acc, cov, requests=10, inflight=inflight)


def test_fresh_pools_are_measured_first_at_full_k():
    fresh = PoolView("b", MIN_SAMPLES - 1, 0.0, 0.0, requests=0, inflight=0)
    c = choose([pool("a", 0.9), fresh], 4, 0.0, turn=0)
    assert c.pool == "b" and c.k == 4
    # A pool whose drafts never arrive stops being measured after a few requests.
    silent = PoolView("s", 0, 0.0, 0.0, requests=MIN_REQUESTS, inflight=0)
    assert choose([pool("a", 0.9), silent], 4, 0.0, turn=1).pool == "a"
    # ... or sooner, once its requests took enough target steps to know its coverage.
    late = PoolView("l", 3, 0.0, 0.02, requests=1, inflight=0, steps=TH.min_steps)
    assert not is_fresh(late) and is_fresh(dataclasses.replace(late, steps=TH.min_steps - 1))
    assert choose([late], 4, 0.0, turn=1).k == 0


def test_a_suffix_memory_is_judged_on_its_acceptance_not_its_steps():
    """The CI case: the README's two chat requests took 64+ target steps and
    drafted 8 tokens (4 trials) from the suffix memory; the edit that came next
    was held at K = 0 on those. A suffix pool costs no core and no wait, so
    the steps rule (for model drafts that seldom arrive) does not judge it."""
    suffix = PoolView("suffix", 8, 0.0, 0.04, requests=2, inflight=0, steps=88,
                      runs_model=False)
    model = dataclasses.replace(suffix, name="model", runs_model=True)
    assert is_fresh(suffix) and not is_fresh(model)
    assert choose([suffix], 4, 0.0, turn=1).k == 4 and choose([model], 4, 0.0, turn=1).k == 0
    # Judged once it drafted enough (or after min_requests), as before.
    assert not is_fresh(dataclasses.replace(suffix, draft_tokens=TH.min_drafted_tokens))
    assert not is_fresh(dataclasses.replace(suffix, requests=TH.min_requests))


def test_a_suffix_memorys_margin_is_a_share_of_its_coverage():
    """What the README's default showed: α 0.5 over 4 % of the steps. At most a
    4 % gain, so a 3 % margin on the whole rate held it at K = 0; its drafted
    steps are far more than 3 % faster, and its misses cost nothing."""
    suffix = PoolView("suffix", 1000, 0.5, 0.04, requests=10, inflight=0, runs_model=False)
    model = dataclasses.replace(suffix, name="model", runs_model=True)
    assert pool_margin(model) == TH.margin and pool_margin(suffix) == pytest.approx(0.04 * TH.margin)
    for cost in (None, StepCost(0.046, 0.0), StepCost(0.015, 0.004)):
        gain = speedup(0.5, pool_k(suffix, 4, 0.0, cost), 0.0, cost, coverage=0.04) - 1.0
        assert 0.0 < gain < TH.margin
        assert pool_k(suffix, 4, 0.0, cost) > 0 and pool_k(model, 4, 0.0, cost) == 0
    # A memory whose drafts are mostly rejected still gets K = 0, at any coverage.
    for cov in (0.04, 0.5, 1.0):
        poor = dataclasses.replace(suffix, alpha=0.02, coverage=cov)
        assert pool_k(poor, 4, 0.0, StepCost(0.015, 0.004)) == 0


def test_the_better_pool_wins_and_a_bad_pool_gets_k_0():
    good, bad = pool("good", 0.85), pool("bad", 0.03)
    for turn in range(1, PROBE_EVERY):
        c = choose([bad, good], 4, 0.0, turn)
        assert c.pool == "good" and c.k > 0
    assert choose_k(bad.alpha, 4, 0.0) == 0


def test_low_acceptance_everywhere_serves_target_only_but_probes():
    def views(idle_x, idle_y, probes=0):
        return [dataclasses.replace(pool("x", 0.02), idle=idle_x, probes=probes),
                dataclasses.replace(pool("y", 0.03), idle=idle_y, probes=probes)]

    quiet = choose(views(PROBE_EVERY - 1, 3), 4, 0.0, turn=7)
    assert quiet.pool is None and quiet.k == 0 and not quiet.probe
    # Due after PROBE_EVERY requests at K = 0; the longest idle pool first.
    c = choose(views(PROBE_EVERY, PROBE_EVERY + 2), 4, 0.0, turn=7)
    assert (c.pool, c.k, c.probe) == ("y", 4, True)
    # After a probe that did not pay, twice as long.
    assert choose(views(PROBE_EVERY, PROBE_EVERY, probes=1), 4, 0.0, 7).pool is None
    assert choose(views(2 * PROBE_EVERY, 0, probes=1), 4, 0.0, 7).pool == "x"


def test_probe_gap_doubles_up_to_its_cap():
    assert [probe_gap(n) for n in range(6)] == [16, 32, 64, 128, 256, 256]
    assert probe_gap(10 ** 6) == TH.max_probe_every
    th = Thresholds(probe_every=5, max_probe_every=3)  # a cap below the gap: the gap
    assert probe_gap(0, th) == probe_gap(4, th) == 5


def test_saturated_target_gets_no_speculation_and_no_pools_means_none():
    assert choose([pool("good", 0.95)], 4, 1.0, 1).k == 0
    assert choose([], 4, 0.0, 0) .pool is None
    assert choose([pool("good", 0.9)], 0, 0.0, 0).k == 0


def test_modelled_cost_is_the_measured_model_with_one_row():
    # speedup = E / (1 + v K) with v the modelled verify cost, via the one rate model
    for load in (0.0, 0.3, 1.0):
        cost = modelled_cost(load)
        v = cost.per_token
        assert not cost.measured and cost.fixed + cost.per_token == pytest.approx(1.0)
        for k in (1, 3):
            assert speedup(0.7, k, load) == pytest.approx(expected_tokens(0.7, k) / (1 + v * k))
            assert speedup(0.7, k, cost=cost) == pytest.approx(speedup(0.7, k, load))


def test_coverage_lowers_the_gain_and_zero_coverage_means_k_0():
    gains = [speedup(0.8, 4, coverage=c) for c in (1.0, 0.5, 0.1, 0.0)]
    assert gains == sorted(gains, reverse=True) and gains[-1] == pytest.approx(1.0)
    assert choose_k(0.8, 4, coverage=1.0) == 4 and choose_k(0.95, 4, coverage=0.0) == 0


def test_measured_verify_cost_decides():
    # The default draft here: alpha 0.30, coverage 0.12. Verification nearly free
    # (GPU-like): K=1 pays a little; each token a fifth of a step (CPU): it does not.
    cheap, cpu = StepCost(0.020, 0.00002), StepCost(0.015, 0.004)
    assert choose_k(0.30, 4, cost=cheap, coverage=0.9) > 0
    assert choose_k(0.30, 4, cost=cpu, coverage=0.12, margin=0.03) == 0
    # A good draft still pays on the CPU at one row, and stops paying with many rows.
    assert choose_k(0.9, 4, cost=cpu, rows=1, coverage=0.9) > 0
    assert choose_k(0.9, 4, cost=cpu, rows=64, coverage=0.9) == 0
    # The K chosen is the argmax of the predicted rate.
    for alpha in (0.5, 0.7, 0.9):
        k = choose_k(alpha, 8, cost=cpu, rows=2, coverage=0.8)
        rates = [predicted_rate(alpha, 0.8, j, 2, cpu.fixed, cpu.per_token) for j in range(9)]
        assert rates[k] == pytest.approx(max(rates))


def test_a_pools_wait_per_step_enters_the_step_cost():
    """rate(K) = tokens / (a + b · tokens + w): w, the pool's measured wait per
    step, at K > 0 only; ignored by the modelled cost (no seconds there)."""
    gpu = StepCost(0.020, 0.00002)
    a, b, w = gpu.fixed, gpu.per_token, 0.010
    assert predicted_rate(0.8, 0.9, 3, 2, a, b, w) == pytest.approx(
        2 * (1 + 0.9 * (expected_tokens(0.8, 3) - 1)) / (a + b * 2 * (1 + 0.9 * 3) + w))
    assert predicted_rate(0.8, 0.9, 0, 2, a, b, w) == predicted_rate(0.8, 0.9, 0, 2, a, b)
    waits = [speedup(0.6, 4, cost=gpu, coverage=0.9, wait_s=w) for w in (0.0, 0.005, 0.02)]
    assert waits == sorted(waits, reverse=True) and waits[0] > waits[-1]
    # A wait as long as a step takes a fair draft from K > 0 to K = 0 ...
    assert choose_k(0.6, 4, cost=gpu, coverage=0.9, margin=0.03) > 0
    assert choose_k(0.6, 4, cost=gpu, coverage=0.9, margin=0.03, wait_s=0.02) == 0
    # ... and the modelled cost does not see it.
    assert speedup(0.6, 4, load=0.2, wait_s=1.0) == speedup(0.6, 4, load=0.2)
    # Same α and coverage: the pool whose drafts keep the target waiting loses.
    slow = PoolView("model", 5000, 0.6, 0.9, requests=100, inflight=0, wait_s=0.008)
    quick = dataclasses.replace(slow, name="suffix", wait_s=0.0)
    assert choose([slow, quick], 4, 0.0, 1, cost=gpu, rows=1).pool == "suffix"
    assert pool_k(slow, 4, 0.0, gpu, 1) <= pool_k(quick, 4, 0.0, gpu, 1)


def test_free_verification_is_floored_at_v_idle():
    free = StepCost(0.025, 0.0)  # an emulated slow step: verifying costs nothing measurable
    assert speedup(0.5, 2, cost=free) == pytest.approx(speedup(0.5, 2, load=0.0))
    assert choose_k(0.04, 4, cost=free, coverage=0.9, margin=0.03) == 0
    assert choose_k(0.95, 4, cost=free, coverage=0.9, margin=0.03) == 4


def test_router_choice_uses_measured_cost_and_coverage_and_probes():
    cpu = StepCost(0.015, 0.004)
    default = PoolView("default", 5000, 0.30, 0.12, requests=100, inflight=0)
    # The modelled cost (5% of a step per token) says speculate; the measured one says no.
    assert pool_k(default, 4, 0.0) > 0 and pool_k(default, 4, 0.0, cpu, 1) == 0
    picks = [choose([dataclasses.replace(default, idle=t)], 4, 0.0, t, cost=cpu, rows=1)
             for t in range(1, 2 * PROBE_EVERY + 1)]
    probes = [c for c in picks if c.pool is not None]
    assert len(probes) == PROBE_EVERY + 1 and all(c.k == 4 and c.probe for c in probes)
    assert "ms/token" in probes[0].reason  # re-measured, at full K, once due
    assert all(c.k == 0 and "ms/token" in c.reason for c in picks if c.pool is None)
    good = PoolView("good", 5000, 0.9, 0.9, requests=100, inflight=0)
    c = choose([default, good], 4, 0.0, 1, cost=cpu, rows=1)
    assert c.pool == "good" and c.k == pool_k(good, 4, 0.0, cpu, 1) > 0
    fresh = PoolView("new", 0, 0.0, 0.0, requests=0, inflight=0)
    assert pool_k(fresh, 4, 1.0, cpu, 64) == 4


# ---- branches and the bounded wait ---------------------------------------------------


def test_fan_out_splits_the_budget_geometrically_and_respects_the_bounds():
    from specserve.control.policy import fan_out

    f = fan_out(0.8, positions=8, budget=12, max_fan_out=3)
    assert sum(f) == 12 and all(0 <= x <= 3 for x in f)
    assert f == sorted(f, reverse=True)  # fewer alternatives further out
    assert f[0] == 3 and f[-1] < 3
    # Poor drafts put everything near the verified position; good ones spread it.
    near = fan_out(0.3, positions=8, budget=6, max_fan_out=6)
    far = fan_out(0.95, positions=8, budget=6, max_fan_out=6)
    assert near[0] > far[0] and sum(1 for x in far if x) > sum(1 for x in near if x)
    # The split follows P_j^(1/(1+r)): the ratio of neighbours is alpha^(2/3) for r = 0.5.
    big = fan_out(0.5, positions=3, budget=1000, max_fan_out=10**6)
    assert abs(big[1] / big[0] - 0.5 ** (2 / 3)) < 0.01
    assert fan_out(0.8, 4, 0, 3) == [0, 0, 0, 0] and fan_out(0.8, 0, 5, 3) == []
    assert sum(fan_out(0.8, 4, 100, 2)) == 8  # capped by positions x max_fan_out
    assert fan_out(0.0, 4, 5, 3) == [3, 0, 0, 0]  # never accepted: only offset 0 can reject


def test_wait_bound_is_zero_when_waiting_does_not_pay_and_never_unbounded():
    from specserve.control.policy import MAX_WAIT_S, wait_bound

    step = 0.065
    one = wait_bound(0.8, 4, rows=1, waiting_rows=1, step_s=step, draft_token_s=0.02)
    assert 0.0 < one <= MAX_WAIT_S
    assert abs(one / 0.02 - round(one / 0.02)) < 1e-9  # a whole number of draft tokens
    # Nobody waiting, poor drafts, no known draft speed, a slow draft: no wait.
    assert wait_bound(0.8, 4, 1, 0, step, 0.02) == 0.0
    assert wait_bound(0.05, 4, 1, 1, step, 0.02) == 0.0
    assert wait_bound(0.8, 4, 1, 1, step, None) == 0.0
    assert wait_bound(0.8, 4, 1, 1, step, 1.0) == 0.0
    # A big batch with drafts waiting: delaying everybody for one row does not pay.
    assert wait_bound(0.8, 4, rows=64, waiting_rows=1, step_s=step, draft_token_s=0.02) == 0.0
    # The bound falls as the batch grows, and the cap holds for any input.
    bounds = [wait_bound(0.8, 4, r, 1, step, 0.01) for r in (1, 2, 4, 8, 16)]
    assert bounds == sorted(bounds, reverse=True)
    assert wait_bound(0.99, 16, 1, 1, 10.0, 0.001, max_wait_s=0.05) <= 0.05


def test_the_wait_deadline_percentile_rises_with_the_rows_waiting():
    from specserve.control.policy import round_trip_percentile

    assert round_trip_percentile(1) == 90.0
    assert round_trip_percentile(0) == 90.0  # no row: as for one
    # m independent round trips all under the q-th percentile: (q/100)^m = 0.9.
    for m in (2, 4, 8):
        assert abs((round_trip_percentile(m) / 100.0) ** m - 0.9) < 1e-12
    qs = [round_trip_percentile(m) for m in (1, 2, 4, 8, 64)]
    assert qs == sorted(qs) and qs[-1] < 100.0
    assert round_trip_percentile(3, all_in=0.5) < round_trip_percentile(3)


def test_wait_bound_counts_the_round_trip_to_the_first_fresh_draft():
    from specserve.control.policy import wait_bound

    # A draft that sends everything at once after a 3 ms round trip: wait ~3 ms.
    w = wait_bound(0.8, 4, 1, 1, 0.065, 0.0, first_token_s=0.003)
    assert w == 0.003
    # 20 ms to the first token, 20 ms per token after it: whole draft tokens.
    w = wait_bound(0.8, 4, 1, 1, 0.065, 0.02, first_token_s=0.021)
    assert w in (0.021, 0.041, 0.061, 0.081)
    # Without a first-token latency and no per-token time: nothing to go on.
    assert wait_bound(0.8, 4, 1, 1, 0.065, 0.0) == 0.0


def test_wait_bound_uses_the_measured_cost_of_a_verified_token():
    from specserve.control.policy import StepCost, wait_bound

    # 8 rows, 2 of them after a rejection with no branch, a draft that answers
    # in 2 ms. Modelled (a verified token costs 5 % of a step) the wait does not
    # pay; with the measured cost of a CPU verify step at this batch
    # (0.1 s + 4 ms a token) it does: the wait holds 8 rows for 2 ms, the two
    # rows verify K drafts each instead of none.
    args = dict(alpha=0.8, k=4, rows=8, waiting_rows=2, step_s=0.25, draft_token_s=0.0,
                coverage=0.76, max_wait_s=0.05, first_token_s=0.002)
    assert wait_bound(**args) == 0.0
    assert wait_bound(**args, cost=StepCost(0.1, 0.004)) == 0.002
    # ... and for one such row of the eight too: the measured cost is used as
    # measured (4 ms, not the floor of 5 % of a one-row step).
    assert wait_bound(**{**args, "waiting_rows": 1}, cost=StepCost(0.1, 0.004)) == 0.002
    # A verify step where every token costs as much as a whole row's step: no.
    assert wait_bound(**args, cost=StepCost(0.0, 0.03)) == 0.0


def test_row_k_is_the_marginal_rule_of_the_rate_model():
    """A drafted token pays on one row of a batch exactly when its chance of
    acceptance beats price = b x the batch's output rate: check row_k against
    the batch's predicted rate, token by token, and at its edges."""
    a, b, rows = 0.020, 0.0004, 8  # seconds; a CPU-like step at C = 8
    for alpha in (0.1, 0.3, 0.5, 0.8, 0.95):
        for others_k in (0, 2):
            # the other rows' tokens and emitted tokens per step
            tokens = (rows - 1) * (1 + others_k)
            emitted = (rows - 1) * policy.expected_tokens(alpha, others_k)
            k = int(policy.row_k(np.array([alpha]), np.array([4]),
                                 b * (emitted + 1) / (a + b * (tokens + 1)))[0])

            def rate(j):  # this row drafting j, priced at its K = 0 batch
                return ((emitted + policy.expected_tokens(alpha, j))
                        / (a + b * (tokens + 1 + j)))
            # each token up to k raised the rate, the next would not have
            assert all(rate(j) > rate(j - 1) for j in range(1, k + 1)), (alpha, k)
            assert k == 4 or rate(k + 1) <= rate(k), (alpha, k)
    got = policy.row_k(np.array([0.0, 0.5, 0.5, 1.0, 0.9]), np.array([4, 4, 2, 3, 4]), 0.25)
    assert got.tolist() == [0, 1, 1, 3, 4]  # 0.5^2 = 0.25 is not above it; 0.9^4 = 0.66
    assert policy.row_k(np.array([0.5]), np.array([4]), 0.0).tolist() == [4]  # no price: K
    assert policy.row_k(np.array([1.0]), np.array([4]), 1.0).tolist() == [0]  # nothing pays
    # b as every policy counts it: floored at V_IDLE of a one-row step
    assert policy.token_cost(policy.StepCost(0.019, 0.0)) == pytest.approx(0.001)
    assert policy.token_cost(policy.StepCost(0.019, 0.002)) == 0.002


def test_a_step_cost_from_the_targets_figures():
    assert StepCost.from_figures({"fixed_s": 0.05, "per_token_s": 0.001, "steps": 20,
                                  "source": "sink"}) == StepCost(0.05, 0.001)
    assert StepCost.from_figures(None) is None
