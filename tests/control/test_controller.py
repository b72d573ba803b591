"""The K controller (specserve/control/controller.py) and the step-cost fit
(specserve/control/stepcost.py), alone: no engine, no Ray."""

import pytest

from specserve.acceptance.record import Acceptance, Figures
from specserve.control.controller import KController
from specserve.control.policy import StepCost, Thresholds, choose_k, predicted_rate
from specserve.control.stepcost import MIN_STEPS, StepCostFit

POOL = "draft"


def fitted(a, b, rows=(1, 2, 4, 8), k=4) -> StepCostFit:
    f = StepCostFit()
    for _ in range(MIN_STEPS):
        for r in rows:
            for extra in (0, k):
                tokens = r * (1 + extra)
                f.add(tokens, a + b * tokens)
    return f


def figures(alpha, k=4, requests=8, steps=100) -> Figures:
    # Full windows, independent acceptance alpha: steps with j accepted drafts.
    hist = [0] * (k + 1)
    for j in range(k):
        hist[j] = round(steps * alpha ** j * (1 - alpha))
    hist[k] = round(steps * alpha ** k)
    tokens = sum((j + 1) * n for j, n in enumerate(hist))
    return Figures.of(Acceptance(k, tokens, k * sum(hist), tuple(hist)) for _ in range(requests))


def choose(ctl, f, cost, rows=1):
    return ctl.choose({POOL: f}, {POOL: rows - 1}, load=0.0, cost=cost, rows=rows)


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


def test_fit_reports_cost():
    f = StepCostFit()
    assert f.cost() is None and f.as_dict() is None
    for _ in range(MIN_STEPS):
        for tokens in (1, 5, 9):
            f.add(tokens, 0.004 + 0.002 * tokens)
    assert f.cost() == StepCost(pytest.approx(0.004), pytest.approx(0.002))
    assert f.as_dict() == {"fixed_s": pytest.approx(0.004), "per_token_s": pytest.approx(0.002),
                           "steps": 3 * MIN_STEPS}


def test_measures_first_at_full_k():
    ctl = KController(4, {POOL: 1})
    c = choose(ctl, Figures(), None)
    assert c.k == 4 and c.pool == POOL and "measuring" in c.reason


def test_cheap_verification_and_good_draft_speculate():
    ctl = KController(4, {POOL: 1})
    f = figures(alpha=0.8)
    assert f.alpha == pytest.approx(0.8, abs=0.02)
    assert choose(ctl, f, fitted(a=0.020, b=0.0001).cost()).k == 4


def test_poor_draft_or_costly_verification_gives_k0_with_probes():
    poor = KController(4, {POOL: 1}, Thresholds(probe_every=8))
    cost, f = fitted(a=0.020, b=0.0005).cost(), figures(alpha=0.02)
    ks = [choose(poor, f, cost).k for _ in range(128)]
    # Probes only, ever more rarely: 8 requests after the start, then 16, 32, 64 after each.
    assert [i for i, k in enumerate(ks) if k] == [8, 25, 58, 123]
    assert poor.probes[POOL] == 4 and poor.idle[POOL] == 127 - 123
    # Once its figures pay again, the gaps start over.
    assert choose(poor, figures(alpha=0.8), fitted(a=0.020, b=0.0001).cost()).k == 4
    assert poor.probes[POOL] == 0 and poor.idle[POOL] == 0
    # A good draft on an engine where each verified token costs a full step.
    costly = KController(4, {POOL: 1}, Thresholds(probe_every=1000))
    costly.turn = 1
    assert choose(costly, figures(alpha=0.6), fitted(a=0.0, b=0.010).cost(), rows=4).k == 0


def test_an_adapting_pool_keeps_a_share_of_the_requests():
    """A pool that learns from the requests it drafts for (adapt.collect_share
    0.25: a collect gap of 4) is probed every 4 requests, not ever more rarely."""
    learning = KController(4, {POOL: 1}, Thresholds(probe_every=8), collect_gaps={POOL: 4})
    cost, f = fitted(a=0.020, b=0.0005).cost(), figures(alpha=0.02)
    ks = [choose(learning, f, cost).k for _ in range(40)]
    assert [i for i, k in enumerate(ks) if k] == list(range(4, 40, 5))
    assert learning.last.probe and "probing" in learning.last.reason
    # the live config may take the floor away: the probes space out again
    learning.configure(4, {POOL: 1}, Thresholds(probe_every=8))
    ks = [choose(learning, f, cost).k for _ in range(60)]
    assert sum(1 for k in ks if k) <= 2


def test_k_follows_the_model():
    # The choice is the argmax of the predicted rate, and falls with load.
    ctl = KController(8, {POOL: 1}, Thresholds(probe_every=1000))
    ctl.turn = 1
    fit, f = fitted(a=0.010, b=0.001, k=8), figures(alpha=0.7, k=8)
    a, b = fit.fit()
    for rows in (1, 8, 64):
        k = choose(ctl, f, fit.cost(), rows).k
        rates = [predicted_rate(f.alpha, f.coverage, j, rows, a, b) for j in range(9)]
        assert rates[k] == max(rates) or (k == 0 and max(rates) < rates[0] * 1.03)
    assert choose(ctl, f, fit.cost(), 1).k > choose(ctl, f, fit.cost(), 64).k


def test_draft_that_never_arrives_is_not_used():
    ctl = KController(4, {POOL: 1}, Thresholds(probe_every=1000))
    ctl.turn = 1
    # requests ran at K=4, but no step found drafts
    f = Figures.of(Acceptance(4, 50, 0, (0, 0, 0, 0, 0)) for _ in range(8))
    assert f.coverage == 0.0 and choose(ctl, f, fitted(a=0.020, b=0.0001).cost()).k == 0


def test_decides_like_the_policy():
    cost = fitted(a=0.004, b=0.002).cost()
    for alpha in (0.3, 0.6, 0.9):
        ctl = KController(4, {POOL: 1}, Thresholds(probe_every=1000))
        ctl.turn = 1
        f = figures(alpha=alpha)
        for rows in (1, 4):
            assert choose(ctl, f, cost, rows).k == choose_k(
                f.alpha, 4, cost=cost, rows=rows, coverage=f.coverage,
                margin=Thresholds().margin)
        assert ctl.inputs["cost_source"] == "measured"
        assert ctl.current_k[POOL] == ctl.last.k or ctl.last.pool is None


def test_each_pools_kind_and_wait_are_its_inputs():
    cost = fitted(a=0.020, b=0.00002).cost()
    ctl = KController(4, {"big": 1, "sfx": 1}, Thresholds(probe_every=1000),
                      kinds={"big": "model", "sfx": "suffix"})
    ctl.turn = 1
    f = figures(alpha=0.6)
    c = ctl.choose({"big": f, "sfx": f}, {}, load=0.0, cost=cost, rows=1,
                   waits={"big": 0.030})
    pools = ctl.inputs["pools"]
    assert (pools["big"]["kind"], pools["sfx"]["kind"]) == ("model", "suffix")
    assert pools["big"]["wait_ms_per_step"] == pytest.approx(30.0)
    assert pools["sfx"]["wait_ms_per_step"] is None  # not measured: no wait counted
    # The same acceptance: the pool that keeps the target waiting 30 ms a step loses.
    assert c.pool == "sfx" and pools["big"]["k"] < pools["sfx"]["k"]
    assert pools["big"]["predicted_speedup"] < pools["sfx"]["predicted_speedup"]


def test_a_suffix_pool_is_judged_as_a_suffix_memory():
    """The controller tells the policy which pools run no model (their kind):
    the same figures (2 requests, 88 steps, 8 drafted tokens) leave a suffix
    pool fresh, at full K, and judge a model pool."""
    for kind, k in (("suffix", 4), ("model", 0), ("hybrid", 0)):
        ctl = KController(4, {"p": 1}, Thresholds(probe_every=1000), kinds={"p": kind})
        ctl.turn = 1
        f = Figures(requests=2, output_tokens=90, draft_tokens=8, accepted_tokens=0,
                    steps=88, steps_with_drafts=2, alpha_trials=4)
        assert ctl.choose({"p": f}, {}, load=0.0).k == k, kind


def test_thresholds_come_from_the_config():
    from specserve.config import AppConfig

    cfg = AppConfig.from_dict({"speculation": {"k_control": {"probe_every": 5, "margin": 0.1}}})
    th = cfg.speculation.k_control.thresholds()
    assert th == Thresholds(min_drafted_tokens=64, min_requests=4, probe_every=5, margin=0.1)
    cfg = AppConfig.from_dict({"speculation": {"k_control": {"probe_every": 5,
                                                             "max_probe_every": 40}}})
    assert cfg.speculation.k_control.thresholds().max_probe_every == 40
    with pytest.raises(ValueError, match=r"max_probe_every \(4\) must be at least probe_every \(5\)"):
        AppConfig.from_dict({"speculation": {"k_control": {"probe_every": 5,
                                                           "max_probe_every": 4}}})
