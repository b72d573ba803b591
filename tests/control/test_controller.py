"""Adaptive K from measured step costs and acceptance (specserve/adaptive.py), alone."""

import pytest

from specserve.control.controller import (
    MIN_STEPS, AdaptiveK, StepCostFit, accepted_positions,
)
from specserve.control.policy import MARGIN, StepCost, choose_k, predicted_rate


def feed_costs(ctl, a, b, rows=(1, 2, 4, 8), k=4):
    for _ in range(MIN_STEPS):
        for r in rows:
            for extra in (0, k):
                tokens = r * (1 + extra)
                ctl.observe_step(tokens, a + b * tokens)


def feed_draft(ctl, alpha, k=4, requests=8, steps=100):
    # Full windows, independent acceptance alpha: steps with j accepted drafts.
    hist = [0] * (k + 1)
    for j in range(k):
        hist[j] = round(steps * alpha ** j * (1 - alpha))
    hist[k] = round(steps * alpha ** k)
    for _ in range(requests):
        tokens = sum((j + 1) * n for j, n in enumerate(hist))
        ctl.observe_request(tokens, hist, k * sum(hist))


def test_fit_recovers_a_line_and_clamps():
    f = StepCostFit()
    assert f.fit() is None
    for x in range(1, 40):
        f.add(x, 0.010 + 0.002 * x)
    a, b = f.fit()
    assert a == pytest.approx(0.010) and b == pytest.approx(0.002)
    g = StepCostFit()
    for _ in range(20):
        g.add(5, 0.02)
    assert g.fit() == (pytest.approx(0.02), 0.0)  # no spread: all fixed cost


def test_histogram_to_positions():
    assert accepted_positions([5, 3, 2]) == [5, 2]
    assert accepted_positions([1]) == []


def test_measures_first_at_full_k():
    ctl = AdaptiveK(4)
    assert ctl.choose(1) == 4 and "measuring" in ctl.last_reason


def test_cheap_verification_and_good_draft_speculate():
    ctl = AdaptiveK(4)
    feed_costs(ctl, a=0.020, b=0.0001)  # a GPU-like step: extra tokens nearly free
    feed_draft(ctl, alpha=0.8)
    assert ctl.draft.alpha == pytest.approx(0.8, abs=0.02)
    assert ctl.choose(1) == 4


def test_poor_draft_or_costly_verification_gives_k0_with_probes():
    poor = AdaptiveK(4, probe_every=8)
    feed_costs(poor, a=0.020, b=0.0005)
    feed_draft(poor, alpha=0.02)
    ks = [poor.choose(1) for _ in range(32)]
    assert ks.count(0) == 28 and ks.count(4) == 4  # probes only
    # A good draft on an engine where each verified token costs a full step.
    costly = AdaptiveK(4, probe_every=1000)
    feed_costs(costly, a=0.0, b=0.010)
    feed_draft(costly, alpha=0.6)
    assert costly.choose(4) == 0


def test_k_follows_the_model():
    # The choice is the argmax of the predicted rate, and falls with load.
    ctl = AdaptiveK(8, probe_every=1000)
    feed_costs(ctl, a=0.010, b=0.001, k=8)
    feed_draft(ctl, alpha=0.7, k=8)
    a, b = ctl.costs.fit()
    for rows in (1, 8, 64):
        k = ctl.choose(rows)
        rates = [predicted_rate(ctl.draft.alpha, ctl.draft.coverage, j, rows, a, b)
                 for j in range(9)]
        assert rates[k] == max(rates) or (k == 0 and max(rates) < rates[0] * 1.03)
    assert ctl.choose(1) > ctl.choose(64)


def test_draft_that_never_arrives_is_not_used():
    ctl = AdaptiveK(4, probe_every=1000)
    feed_costs(ctl, a=0.020, b=0.0001)
    for _ in range(8):  # requests ran at K=4, but no step found drafts
        ctl.observe_request(50, [0, 0, 0, 0, 0], 0)
    assert ctl.draft.coverage == 0.0 and ctl.choose(1) == 0


def test_fit_reports_cost_and_decides_like_the_router_policy():
    f = StepCostFit()
    assert f.cost() is None and f.as_dict() is None
    for _ in range(MIN_STEPS):
        for tokens in (1, 5, 9):
            f.add(tokens, 0.004 + 0.002 * tokens)
    cost = f.cost()
    assert cost == StepCost(pytest.approx(0.004), pytest.approx(0.002))
    assert f.as_dict() == {"fixed_s": pytest.approx(0.004), "per_token_s": pytest.approx(0.002),
                           "steps": 3 * MIN_STEPS}
    # One model: AdaptiveK's K is policy.choose_k's for the same figures.
    for alpha in (0.3, 0.6, 0.9):
        ctl = AdaptiveK(4, probe_every=1000)
        ctl.costs = f
        feed_draft(ctl, alpha=alpha)
        for rows in (1, 4):
            assert ctl.choose(rows) == choose_k(ctl.draft.alpha, 4, cost=cost, rows=rows,
                                                coverage=ctl.draft.coverage, margin=MARGIN)


def test_alpha_counts_only_the_positions_each_request_drafted():
    ctl = AdaptiveK(4)
    ctl.observe_request(30, [4, 3, 2, 1, 0], 40)  # K=4: positions tried 10 + 6 + 3 + 1
    assert ctl.draft.alpha == pytest.approx(10 / 20)
    ctl.observe_request(20, [3, 2, 0, 0, 0], 5, k=1)  # K=1: only position 0, 5 times
    assert ctl.draft.alpha == pytest.approx(12 / 25)
