"""The acceptance record and every figure derived from it (specserve.acceptance.record)."""

import pytest

from specserve.acceptance.record import (
    Acceptance, Figures, per_position_acceptance, percentile, plain_acceptance_for,
)


def test_record_figures_follow_the_histogram():
    # 3 verify steps with drafts: accepted 0, 2 and 4 of 4 drafted each.
    a = Acceptance(k=4, output_tokens=20, draft_tokens=12, accepted_histogram=(1, 0, 1, 0, 1))
    assert a.accepted_tokens == 6
    assert a.steps_with_drafts == 3
    assert a.steps == 14  # 20 tokens - 6 accepted
    assert a.accepted_per_position(4) == [2, 2, 1, 1]
    assert Acceptance(k=0, output_tokens=5).steps == 5


def test_alpha_is_conditional_acceptance_up_to_each_requests_k():
    f = Figures()
    # K=4: 10 steps with drafts; positions tried 10 + 6 + 3 + 1, accepted 6 + 3 + 1 + 0
    f.add(Acceptance(4, 30, 40, (4, 3, 2, 1, 0)))
    assert f.alpha == pytest.approx(10 / 20) and f.acceptance_rate == pytest.approx(10 / 40)
    # K=1 (a window of one): only position 0 is tried, 5 times, 2 accepted
    f.add(Acceptance(1, 20, 5, (3, 2, 0, 0, 0)))
    assert f.alpha == pytest.approx(12 / 25)
    assert f.as_dict()["alpha"] == f.alpha


def test_engine_counters_give_the_same_alpha_as_the_histograms():
    # 100 steps with K=3 full windows; 80 accepted at 0, 64 at 1, 51 at 2.
    acc, drafted = [80, 64, 51], [100, 100, 100]
    assert per_position_acceptance(acc, drafted) == [0.8, 0.8, 51 / 64]
    f = Figures.of_engine(output_tokens=495, num_drafts=100, draft_tokens=300,
                          accepted_per_position=acc, draft_per_position=drafted)
    assert f.alpha == pytest.approx(195 / 244) and f.steps == 300
    assert f.coverage == pytest.approx(100 / 300)
    # The same steps as per-request histograms (20 steps accepted 0, 16 one, ...).
    hist = (20, 16, 13, 51)
    per_request = Figures.of([Acceptance(3, 495, 300, hist)])
    assert per_request.alpha == pytest.approx(f.alpha)
    assert per_request.accepted_per_position == acc
    assert Figures.of_engine(0, 0, 0, [], []).alpha == 0.0
    # vLLM's plain rate for the same draft is far lower than alpha.
    assert plain_acceptance_for(0.8, 4) == pytest.approx((3.3616 - 1) / 4)


def test_percentile_is_linear_interpolation():
    assert percentile([3, 1, 2], 50) == 2
    assert percentile([1, 2], 99) == pytest.approx(1.99)
    assert percentile([0.1, 0.3], 50) == pytest.approx(0.2)
    assert percentile([], 50) is None
