"""The capacity simulator (specserve/tools/simulate/) against cases solved by hand.

All runs are seeded and deterministic. Step costs are constants unless a test
says otherwise, so a target step takes T ms whatever its batch holds, and the
arithmetic below is exact up to sampling noise (bounded by the run lengths).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import run_cli

from specserve.control.policy import expected_tokens
from specserve.tools.simulate.model import simulate, sweep
from specserve.tools.simulate.profile import (DataPlaneCost, DraftCost, Profile, StepProfile,
                                              TargetCost)
from specserve.tools.simulate.scenario import Prices, Scenario, cost_per_hour

T = 10.0  # ms per target step


def profile(draft_ms: float = 0.0, target_ms: float = T, colocated_ms: float | None = None,
            **draft_kw) -> Profile:
    return Profile(TargetCost(StepProfile.constant(target_ms)),
                   DraftCost(StepProfile.constant(draft_ms), **draft_kw),
                   None if colocated_ms is None else StepProfile.constant(colocated_ms))


def one_request(**kw) -> Scenario:
    base = dict(targets=1, drafts=1, concurrency=1, requests=4, output_len=2000, prompt_len=16)
    base.update(kw)
    return Scenario(**base)


@pytest.mark.parametrize("alpha,k", [(0.0, 3), (0.6, 2), (0.8, 4), (0.9, 8), (1.0, 4)])
def test_instant_draft_one_target_no_queueing(alpha, k):
    """One target, one request at a time, draft step 0 ms, no network delay.

    The draft is always W >= K tokens ahead when a step starts, so every decode
    step verifies K drafts (fewer only where the request has fewer tokens left,
    as the real draft drafts up to the output's end; the prefill step of each
    request has none). With independent acceptance alpha the step emits
    1 + (number of leading accepted drafts) tokens:
        E = sum_{i=0..K} alpha^i = (1 - alpha^(K+1)) / (1 - alpha).
    Throughput = E / T.
    """
    r = simulate(profile(), one_request(k=k, alpha=alpha, lookahead=2 * k, requests=8))
    # every step but the 8 prefills, each request's last one included
    assert r.steps_with_drafts == r.request_steps - 8
    expected = expected_tokens(alpha, k)
    assert expected == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1)
    # 16000 tokens; the per-step count has sd <= ~2.5, so its mean is within ~1%.
    assert r.mean_accepted_length == pytest.approx(expected, rel=0.02)
    steps_per_request = r.request_steps / 8
    assert r.throughput_tok_s == pytest.approx(2000 / (steps_per_request * T / 1000), rel=1e-9)
    assert r.throughput_tok_s == pytest.approx(expected / T * 1000, rel=0.03)
    if alpha in (0.0, 1.0):  # no randomness at all
        assert r.acceptance_rate == alpha


def test_draft_slower_than_k_per_step():
    """alpha = 1, draft step D = 8 ms < T = 10 ms, K = 8, W = 64, no delay.

    Let r = T/D = 1.25 draft tokens per target step. If n drafts wait at a step,
    it verifies all of them and emits n + 1 (bonus); meanwhile the draft made r_i
    more tokens (1 or 2), so the next step finds n' = n + r_i - (n + 1) = r_i - 1
    waiting. So each step emits r_{i-1} tokens: throughput = r/T = 1/D = 125
    tokens/s (the draft's pace), and drafts wait exactly at the steps after which
    the draft made 2 tokens: coverage = r - 1 = 0.25.
    """
    r = simulate(profile(draft_ms=8.0), one_request(k=8, alpha=1.0, lookahead=64))
    assert r.throughput_tok_s == pytest.approx(125.0, rel=0.01)
    assert r.coverage == pytest.approx(0.25, abs=0.01)
    assert r.acceptance_rate == 1.0


def test_draft_faster_than_k_per_step_is_capped_by_k():
    """alpha = 1, D = 1 ms: the draft makes 10 tokens per step, more than K + 1 = 5,
    so it stays ahead (W = 40 bounds it) and every decode step emits K + 1."""
    r = simulate(profile(draft_ms=1.0), one_request(k=4, alpha=1.0, lookahead=40))
    assert r.throughput_tok_s == pytest.approx(500.0, rel=0.01)
    assert r.tokens_per_request_step == pytest.approx(5.0, rel=0.01)


def test_draft_slower_than_the_target_never_helps():
    """D = 12 ms > T = 10 ms: the target alone makes a token every T, faster than
    the draft makes any, so the draft is behind from the start and never catches
    up (it keeps checking its tokens against the verified ones). Coverage 0,
    throughput 1/T = 100 tokens/s, exactly."""
    r = simulate(profile(draft_ms=12.0), one_request(k=4, alpha=1.0, lookahead=8, requests=2,
                                                     output_len=500))
    assert r.steps_with_drafts == 0
    assert r.throughput_tok_s == pytest.approx(100.0, rel=1e-9)


@pytest.mark.parametrize("alpha,k", [(0.5, 2), (0.7, 3), (0.9, 4)])
def test_late_drafts_markov_chain(alpha, k):
    """Instant draft, RTT R = 4 ms < T, W = 4K (the window always holds K drafts).

    A target step starts as soon as the previous one ends, so a window the draft
    builds after hearing a step's result arrives R after that step ended: during
    the next step. Two states at step start: A (K valid drafts waiting) and N
    (none valid).
      From A: all K accepted (alpha^K) and the draft's token at the bonus
        position right (alpha) -> A; otherwise -> N.   P(A->A) = alpha^(K+1)
      From N: the window arriving during the step starts at the position this
        step decodes; it is valid for the next step if that token is right.
        P(N->A) = alpha
    Stationary: pi_A = alpha / (alpha + 1 - alpha^(K+1)) = coverage, and tokens
    per step = pi_A * E + (1 - pi_A), E = (1 - alpha^(K+1)) / (1 - alpha).
    """
    r = simulate(profile(), one_request(k=k, alpha=alpha, lookahead=4 * k, rtt_ms=4.0,
                                        requests=10, output_len=3000))
    pi_a = alpha / (alpha + 1 - alpha ** (k + 1))
    per_step = pi_a * expected_tokens(alpha, k) + 1 - pi_a
    assert r.coverage == pytest.approx(pi_a, abs=0.02)
    assert r.tokens_per_request_step == pytest.approx(per_step, rel=0.03)
    assert r.throughput_tok_s == pytest.approx(per_step / T * 1000, rel=0.03)


def test_colocated_baseline_pays_k_draft_steps_per_step():
    """vLLM draft_model: drafts always there, every step costs T + K * c.
    Throughput = E / (T + K c)."""
    c, k, alpha = 1.5, 3, 0.7
    r = simulate(profile(colocated_ms=c), one_request(k=k, alpha=alpha, drafts=0, colocated=True,
                                                      requests=8))
    e = expected_tokens(alpha, k)
    assert r.request_steps - 16 <= r.steps_with_drafts <= r.request_steps - 8
    assert r.mean_accepted_length == pytest.approx(e, rel=0.02)
    assert r.throughput_tok_s == pytest.approx(e / (T + k * c) * 1000, rel=0.03)


def test_target_only_batching_and_replicas():
    """K = 0, constant step cost: batching is free, so 8 requests on one target make
    8 tokens per step, and two targets make twice that; TPOT = T exactly."""
    base = Scenario(k=0, drafts=0, concurrency=8, requests=16, output_len=50)
    one = simulate(profile(), base)
    two = simulate(profile(), dataclasses.replace(base, targets=2, concurrency=16, requests=32))
    assert one.throughput_tok_s == pytest.approx(8 * 1000 / T)
    assert two.throughput_tok_s == pytest.approx(2 * one.throughput_tok_s)
    assert one.tpot_ms["p50"] == pytest.approx(T) and one.tpot_ms["p99"] == pytest.approx(T)
    assert one.coverage == 0.0


def test_step_cost_grows_with_tokens():
    """Piecewise-linear cost in query tokens: verifying K drafts per row makes a
    step dearer, which is what limits speculation at high batch."""
    cost = StepProfile(((1, 10.0), (64, 10.0), (512, 40.0)))
    assert cost(1) == 10.0 and cost(64) == 10.0
    assert cost(288) == pytest.approx(25.0)
    assert cost(1024) == pytest.approx(40.0 + 30.0 * 512 / 448)  # the last slope goes on
    p = Profile(TargetCost(cost), DraftCost(StepProfile.constant(0.0)))
    small = simulate(p, Scenario(k=4, alpha=0.8, concurrency=4, requests=8, output_len=200))
    big = simulate(p, Scenario(k=4, alpha=0.8, concurrency=128, requests=128, output_len=200))
    assert small.tpot_ms["p50"] < big.tpot_ms["p50"]


def test_poisson_light_load_has_no_queueing():
    """Arrivals far apart: throughput = arrival rate x output length, TTFT = one
    prefill step (T + prefill per token x prompt)."""
    p = Profile(TargetCost(StepProfile.constant(T), prefill_ms_per_token=0.1), None)
    r = simulate(p, Scenario(k=0, drafts=0, concurrency=None, rate_per_s=0.5, requests=40,
                             prompt_len=100, output_len=20))
    assert r.ttft_ms["p50"] == pytest.approx(T + 10.0)
    assert r.ttft_ms["p99"] <= 2 * (T + 10.0)  # at worst one other prefill step ahead
    assert r.tpot_ms["p50"] == pytest.approx(T)


def test_prefill_budget_spreads_a_burst_over_steps():
    """16 requests arrive at once with 1000-token prompts and a 4096-token prefill
    budget: 4 are admitted per step, so their first tokens come at 1, 2, 3, 4
    steps of T + 4 * 1000 * 0.01 ms (their decode rides along, free here)."""
    p = Profile(TargetCost(StepProfile.constant(T), prefill_ms_per_token=0.01,
                           max_prefill_tokens=4096), None)
    r = simulate(p, Scenario(k=0, drafts=0, concurrency=16, requests=16, prompt_len=1000,
                             output_len=8))
    step = T + 40.0
    assert r.ttft_ms["p50"] == pytest.approx(2.5 * step)  # halfway between steps 2 and 3
    assert r.ttft_ms["p99"] == pytest.approx(4 * step, rel=0.02)


def test_deterministic_for_a_seed():
    sc = Scenario(k=4, alpha=0.7, rtt_ms=2.0, concurrency=None, rate_per_s=50, requests=40)
    p = profile(draft_ms=2.0)
    a, b = simulate(p, sc), simulate(p, sc)
    assert a.to_dict() == b.to_dict()
    c = simulate(p, dataclasses.replace(sc, seed=1))
    assert c.to_dict() != a.to_dict()


def test_sweep_ranks_by_goodput_per_dollar():
    """Draft step 2 ms per request in its batch, T = 30 ms, 16 requests in flight.
    One draft replica drafts for all 16 (32 ms per token: slower than the target,
    useless); four replicas (8 ms) keep up; eight (4 ms) barely add. With cheap
    draft GPUs the best is a few drafts with K > 0; with draft GPUs dearer than
    the target's, target-only wins."""
    p = Profile(TargetCost(StepProfile.constant(30.0), gpus=8),
                DraftCost(StepProfile(((1, 2.0), (16, 32.0)))))
    base = Scenario(concurrency=16, requests=64, output_len=128, alpha=0.8)
    cheap = sweep(p, base, drafts=[1, 2, 4, 8], ks=[0, 2, 4], prices=Prices(4.0, 0.5))
    per_dollar = [r.goodput_tokens_per_dollar for r in cheap]
    assert per_dollar == sorted(per_dollar, reverse=True)
    assert len(cheap) == 1 + 2 * 4  # K = 0 once, with no drafts
    assert sum(r.scenario.k == 0 for r in cheap) == 1
    best = cheap[0]
    assert best.scenario.k > 0 and best.scenario.drafts in (2, 4, 8)
    one_draft = next(r for r in cheap if r.scenario.drafts == 1 and r.scenario.k == 4)
    assert one_draft.coverage < 0.05  # the single draft replica never gets ahead
    assert best.cost_per_hour == pytest.approx(8 * 4.0 + best.scenario.drafts * 0.5)
    dear = sweep(p, base, drafts=[1, 2, 4, 8], ks=[0, 2, 4], prices=Prices(4.0, 100.0))
    assert dear[0].scenario.k == 0


def test_cost_per_hour():
    p = Profile(TargetCost(StepProfile.constant(1.0), gpus=8), DraftCost(StepProfile.constant(1.0)))
    assert cost_per_hour(p, Scenario(targets=2, drafts=3, k=4), Prices(3.0, 0.5)) == 2 * 8 * 3 + 1.5
    assert cost_per_hour(p, Scenario(targets=2, drafts=3, k=0), Prices(3.0, 0.5)) == 48.0


def test_profile_round_trip_and_errors():
    p = Profile(TargetCost(StepProfile(((1, 5.0), (32, 9.0)), per_seq_ms=0.01), 0.02, 0.3, 8, 128, 4096),
                DraftCost(StepProfile(((1, 1.0), (8, 2.0))), 0.001, 0.5, 1), StepProfile.constant(0.7),
                source="test")
    assert Profile.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    plane = DataPlaneCost(StepProfile(((8, 0.1), (256, 1.5))), StepProfile.constant(3.0))
    with_plane = dataclasses.replace(p, dataplane=plane)
    assert Profile.from_dict(json.loads(json.dumps(with_plane.to_dict()))) == with_plane
    with pytest.raises(ValueError, match="format"):
        Profile.from_dict({"format": "other/9", "target": {"step_ms": 1}})
    with pytest.raises(ValueError, match="target"):
        Profile.from_dict({"draft": {"step_ms": 1}})
    with pytest.raises(ValueError, match="lookahead"):
        simulate(p, Scenario(k=4, lookahead=4))
    with pytest.raises(ValueError, match="exactly one"):
        simulate(p, Scenario(concurrency=None, rate_per_s=None))
    with pytest.raises(ValueError, match="draft"):
        simulate(Profile(p.target), Scenario(k=4, drafts=1))
    with pytest.raises(ValueError, match="colocated_draft"):
        simulate(Profile(p.target, p.draft), Scenario(k=4, drafts=0, colocated=True))


def test_the_data_planes_costs_by_rows():
    """The data plane's propose() cost is paid by every speculative step (at
    the step's rows), and its round trip delays drafts as the network does."""
    sc = one_request(k=4, alpha=0.8, lookahead=8, requests=4, output_len=500)
    base = simulate(profile(), sc)
    # 1 ms of propose() at one row: every decode step with drafts takes T + 1.
    slow = simulate(dataclasses.replace(profile(), dataplane=DataPlaneCost(
        StepProfile(((1, 1.0), (256, 5.0))), StepProfile.constant(0.0))), sc)
    assert slow.mean_accepted_length == pytest.approx(base.mean_accepted_length, rel=0.05)
    assert slow.throughput_tok_s == pytest.approx(
        base.throughput_tok_s * T / (T + 1.0), rel=0.03)
    # A round trip of 2 target steps is the network's: the same as rtt_ms.
    late = simulate(dataclasses.replace(profile(), dataplane=DataPlaneCost(
        StepProfile.constant(0.0), StepProfile.constant(2 * T))), sc)
    net = simulate(profile(), dataclasses.replace(sc, rtt_ms=2 * T))
    assert late.throughput_tok_s == pytest.approx(net.throughput_tok_s, rel=1e-9)
    assert late.throughput_tok_s < base.throughput_tok_s


def test_latency_percentiles_are_the_benchs():
    # ttft_ms / tpot_ms use the one percentile definition (linear interpolation).
    r = simulate(profile(), one_request(k=0, drafts=0, requests=5, concurrency=1))
    assert r.ttft_ms["p50"] <= r.ttft_ms["p90"] <= r.ttft_ms["p99"]
    assert r.tpot_ms == {"p50": pytest.approx(T), "p90": pytest.approx(T),
                         "p99": pytest.approx(T)}


def test_cli(tmp_path):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(profile(draft_ms=1.0, colocated_ms=2.0).to_dict()))
    r = run_cli("simulate", "--profile", str(prof), "--alpha", "0.8", "--concurrency", "4",
                "--requests", "8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["results"][0]["mode"] == "disaggregated"
    assert out["results"][0]["throughput_tok_s"] > 0
    r = run_cli("simulate", "--profile", str(prof), "--sweep-k", "0,2,4", "--sweep-drafts", "1,2",
                "--target-gpu-price", "4", "--draft-gpu-price", "1", "--requests", "8")
    assert r.returncode == 0, r.stderr
    assert "best goodput per dollar" in r.stdout and "| colocated |" in r.stdout
    bad = run_cli("simulate", "--profile", str(tmp_path / "missing.json"))
    assert bad.returncode == 2 and "specserve.tools.gpucheck" in bad.stderr
    bad = run_cli("simulate", "--target-step-ms", "10", "--draft-step-ms", "1", "-k", "4",
                  "--lookahead", "3")
    assert bad.returncode == 2 and "lookahead" in bad.stderr
    bad = run_cli("simulate", "--target-step-ms", "10", "--sweep-k", "0,4")
    assert bad.returncode == 2 and "price" in bad.stderr


def test_branches_cover_the_step_after_a_rejection():
    """Instant draft, RTT R = 4 ms < T: after a rejection the next step starts
    before the draft heard of it, so without branches it runs draftless (the
    late-drafts chain above). With branch_hit = 1 every rejection's outcome was
    pre-drafted: every decode step finds drafts and the throughput is the ideal
    E(alpha, K) / T; with branch_hit = h, a share h of those steps is covered."""
    alpha, k = 0.7, 3
    base = dict(k=k, alpha=alpha, lookahead=4 * k, rtt_ms=4.0, requests=4, output_len=2000)
    none = simulate(profile(), one_request(**base))
    full = simulate(profile(), one_request(**base, branch_hit=1.0))
    half = simulate(profile(), one_request(**base, branch_hit=0.5))
    ideal = expected_tokens(alpha, k) / T * 1000
    assert none.branch_hits == 0 and none.throughput_tok_s < 0.85 * ideal
    assert full.branch_hit_rate == 1.0 and full.throughput_tok_s == pytest.approx(ideal, rel=0.04)
    assert full.coverage > 0.99 * (full.request_steps - 8) / full.request_steps
    assert none.throughput_tok_s < half.throughput_tok_s < full.throughput_tok_s
    assert half.branch_hit_rate == pytest.approx(0.5, abs=0.05)


def test_a_wrong_first_token_is_a_rejection_branches_cover():
    """The draft drafts from the prompt while the target prefills, so the first
    decode step is judged like any other: where the draft's first token was
    wrong, a branch covers it (the real book counts it as a rejection). Short
    outputs, RTT R = 4 ms > 0: with branch_hit = 1 every decode step of every
    request finds drafts, its first one included (before, a wrong first token
    left the first decode step draftless: about half the requests here)."""
    sc = one_request(k=3, alpha=0.5, lookahead=12, rtt_ms=4.0, requests=200, output_len=8,
                     branch_hit=1.0)
    r = simulate(profile(), sc)
    assert r.steps_with_drafts == r.request_steps - 200  # all but the prefills
    assert r.branch_hits > 200 * 0.5 * 0.8  # the first tokens' rejections among them


def test_the_bounded_wait_holds_steps_only_when_it_pays():
    """Draft 3 ms a token, T = 30 ms: after a rejection without a branch, holding
    the step a few draft tokens pays at one request; the waits are bounded."""
    base = dict(k=4, alpha=0.8, lookahead=8, rtt_ms=1.0, requests=2, output_len=400)
    p = profile(draft_ms=3.0, target_ms=30.0)
    plain = simulate(p, one_request(**base))
    waited = simulate(p, one_request(**base, max_wait_ms=20.0))
    assert plain.waits == 0 and waited.waits > 0
    assert waited.wait_ms / waited.waits <= 20.0
    assert waited.coverage > plain.coverage
    assert waited.throughput_tok_s > plain.throughput_tok_s
    # A draft too slow to pay for any wait: never held.
    slow = simulate(profile(draft_ms=40.0, target_ms=30.0), one_request(**base, max_wait_ms=20.0))
    assert slow.waits == 0
