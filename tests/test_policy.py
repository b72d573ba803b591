"""The speculation policies alone: K control and the choice of draft pool."""

import pytest

from specserve.policy import (
    MIN_REQUESTS, MIN_SAMPLES, PROBE_EVERY, PoolView, choose, choose_k, expected_tokens, speedup,
)


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


def test_the_better_pool_wins_and_a_bad_pool_gets_k_0():
    good, bad = pool("good", 0.85), pool("bad", 0.03)
    for turn in range(1, PROBE_EVERY):
        c = choose([bad, good], 4, 0.0, turn)
        assert c.pool == "good" and c.k > 0
    assert choose_k(bad.acceptance_rate, 4, 0.0) == 0


def test_low_acceptance_everywhere_serves_target_only_but_probes():
    pools = [pool("x", 0.02), pool("y", 0.03)]
    picks = [choose(pools, 4, 0.0, t) for t in range(1, 2 * PROBE_EVERY + 1)]
    assert sum(c.pool is not None for c in picks) == 2  # one probe per PROBE_EVERY turns
    assert all(c.k == 0 for c in picks if c.pool is None)


def test_saturated_target_gets_no_speculation_and_no_pools_means_none():
    assert choose([pool("good", 0.95)], 4, 1.0, 1).k == 0
    assert choose([], 4, 0.0, 0) .pool is None
    assert choose([pool("good", 0.9)], 0, 0.0, 0).k == 0
