"""Figures of the step after a rejection, from per-draft book counters."""

from specserve.acceptance import branches


def test_figures_from_counters_and_spans():
    before = {"steps_after_rejected": 10, "branch_hits": 4, "covered_after_rejected": 6,
              "steps_after_accepted": 20, "covered_after_accepted": 19, "wait_rows": 4,
              "wait_hits": 2, "wait_seconds": 0.5, "steps": 100, "accepted_tokens": 80,
              "alpha_trials": 100}
    after = {k: 2 * v for k, v in before.items()}
    f = branches.figures(branches.minus(after, before))
    assert f["branch_hit_rate"] == 0.4 and f["coverage_after_rejected"] == 0.6
    assert f["coverage_after_accepted"] == 19 / 20 and f["wait_hit_rate"] == 0.5
    assert f["wait_ms_per_step"] == 5.0 and f["book_alpha"] == 0.8
    empty = branches.figures({})
    assert empty["branch_hit_rate"] is None and empty["wait_ms_per_step"] is None
    assert branches.total({"a/0": {"branch_hits": 1}, "a/1": {"branch_hits": 2}}) == {
        "branch_hits": 3}


def test_pool_waits_add_up_the_replicas_of_each_pool():
    per_draft = {"big/r1": {"wait_seconds": 0.3, "steps": 10},
                 "big/r2": {"wait_seconds": 0.1, "steps": 30},
                 "sfx/r1": {"wait_seconds": 0.0, "steps": 50},
                 "idle/r1": {"wait_seconds": 0.0, "steps": 0},  # no steps: not measured
                 "old": {"wait_seconds": 0.2, "steps": 4}}  # a key without a replica
    assert branches.pool_waits(per_draft) == {"big": 0.01, "sfx": 0.0, "old": 0.05}
    assert branches.split("big/r1") == ("big", "r1") and branches.split("old") == ("old", "?")
    assert branches.split("a/b/c") == ("a/b", "c")
