"""specserve.adapt.guard: swap only past the margin, on enough held-out positions. Pure."""

from __future__ import annotations

import pytest

from specserve.adapt.guard import HeldOutAlpha, judge
from specserve.tools.distill.recipe import greedy_agreement


def test_a_candidate_past_the_margin_swaps():
    d = judge(HeldOutAlpha(330, 1000), HeldOutAlpha(450, 1000), margin=0.02, min_positions=500)
    assert d.swap
    assert d.reason.startswith("swap: candidate α 0.450 > serving α 0.330 + margin 0.02")


@pytest.mark.parametrize("candidate", [330, 340, 350])
def test_a_candidate_within_the_margin_is_refused(candidate):
    d = judge(HeldOutAlpha(330, 1000), HeldOutAlpha(candidate, 1000), margin=0.02,
              min_positions=500)
    assert not d.swap
    assert f"candidate α {candidate / 1000:.3f} ≤ serving α 0.330 + margin 0.02" in d.reason


def test_too_few_positions_are_refused_however_good_the_candidate():
    d = judge(HeldOutAlpha(1, 10), HeldOutAlpha(10, 10), margin=0.02, min_positions=500)
    assert not d.swap and "too few held-out positions (10 < 500)" in d.reason
    d = judge(HeldOutAlpha(0, 0), HeldOutAlpha(0, 0), margin=0.0, min_positions=0)
    assert not d.swap and "too few held-out positions" in d.reason


def test_figures_from_different_slices_or_out_of_range_are_refused():
    d = judge(HeldOutAlpha(300, 1000), HeldOutAlpha(600, 1200), margin=0.02, min_positions=10)
    assert not d.swap and "different held-out positions" in d.reason
    d = judge(HeldOutAlpha(300, 1000), HeldOutAlpha(1001, 1000), margin=0.02, min_positions=10)
    assert not d.swap and "out of range" in d.reason


def test_a_poisoned_candidate_is_refused():
    # A draft trained on random text agrees with the target's tokens by chance only.
    target_next = [i % 50 for i in range(2000)]
    serving = HeldOutAlpha.of(greedy_agreement([t if i % 3 else -1 for i, t in
                                                enumerate(target_next)], target_next))
    poisoned = HeldOutAlpha.of(greedy_agreement([(t * 7 + 1) % 50 for t in target_next],
                                                target_next))
    d = judge(serving, poisoned, margin=0.02, min_positions=1000)
    assert not d.swap and d.reason.startswith("refused: candidate α")
    assert HeldOutAlpha(0, 0).alpha is None
