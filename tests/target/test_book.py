"""The draft book alone: rows found by request key, positions confirmed by the
tokens gained, bounds, stale drafts, registration and attachment."""

import numpy as np
import pytest

from specserve.target.book import (
    ALREADY_EXISTS,
    INVALID_ARGUMENT,
    NOT_FOUND,
    RESOURCE_EXHAUSTED,
    BookError,
    BookStats,
    DraftBook,
)

K = 3


def h(*tokens):
    return np.array(tokens, dtype=np.int32)


def book(**kw):
    return DraftBook(vocab_size=100, **kw)


def test_proposes_drafts_for_the_row_whose_history_prefixes_them():
    b = book()
    b.open(("s", "r1"), [1, 2, 3])
    b.extend(("s", "r1"), 3, [10, 11, 12, 13, 14])
    # After prefill the target sampled 10: history [1 2 3 10].
    props, updates = b.propose([h(1, 2, 3, 10)], K, K + 1, keys=[("s", "r1")])
    assert props == [[11, 12, 13]]
    assert [(u.key, u.position, u.token_ids) for u in updates] == [(("s", "r1"), 3, [10])]


def test_rows_are_found_by_key_and_unknown_rows_get_nothing():
    b = book()
    b.open(("s", "a"), [1, 2])
    b.extend(("s", "a"), 2, [5, 6, 7])
    b.open(("s", "b"), [3, 4])
    b.extend(("s", "b"), 2, [8, 9])
    props, _ = b.propose([h(9, 9, 9), h(3, 4, 8), h(1, 2, 5), h(1, 2, 5)], K, K + 1,
                         keys=[("s", "x"), ("s", "b"), ("s", "a"), None])
    assert props == [[], [9], [6, 7], []]
    # Without keys nothing is matched, whatever the histories.
    assert b.propose([h(3, 4, 8, 9)], K, K + 1)[0] == [[]]


def test_a_history_that_agrees_with_a_prompt_is_not_enough():
    """A row is never matched by its tokens: another request's row with the
    same prompt gets nothing, and nothing of it is reported."""
    b = book()
    b.open(("s", "a"), [1, 2])
    b.extend(("s", "a"), 2, [5, 6, 7])
    props, updates = b.propose([h(1, 2, 5)], K, K + 1, keys=[("t", "other")])
    assert props == [[]] and updates == []


def test_only_the_tokens_gained_are_read():
    """The step reads the row's history from the verified position on: a
    prompt the row does not share is never compared (the row is the key's)."""
    b = book()
    b.open(("s", "r"), [1, 2, 3])
    b.extend(("s", "r"), 3, [10, 11, 12])
    props, _ = b.propose([h(7, 7, 7, 10)], K, K + 1, keys=[("s", "r")])
    assert props == [[11, 12]]


def test_rejection_drops_pending_drafts_and_reports_the_recovered_token():
    b = book()
    b.open(("s", "r"), [1, 2])
    b.extend(("s", "r"), 2, [5, 6, 7, 8])
    b.propose([h(1, 2, 5)], K, K + 1, keys=[("s", "r")])  # verified up to 3
    # The target accepted 6 and then sampled 40 instead of 7.
    props, updates = b.propose([h(1, 2, 5, 6, 40)], K, K + 1, keys=[("s", "r")])
    assert props == [[]]
    assert updates[0].position == 3 and updates[0].token_ids == [6, 40]
    seq, verified = b.sequence(("s", "r"))
    assert seq == [1, 2, 5, 6, 40] and verified == 5
    # A late draft built on the rejected branch is refused by the overlap check ...
    assert b.extend(("s", "r"), 3, [6, 7, 8, 9]) == 0
    # ... and one built on the target's history is taken.
    assert b.extend(("s", "r"), 5, [41, 42]) == 2
    props, _ = b.propose([h(1, 2, 5, 6, 40, 41)], K, K + 1, keys=[("s", "r")])
    assert props == [[42]]


def test_overlapping_window_appends_only_new_tokens():
    b = book()
    b.open(("s", "r"), [1])
    assert b.extend(("s", "r"), 1, [2]) == 1
    assert b.extend(("s", "r"), 1, [2, 3]) == 1
    assert b.extend(("s", "r"), 1, [2, 3, 4]) == 1
    assert b.sequence(("s", "r"))[0] == [1, 2, 3, 4]
    # A gap (position past the end) is dropped, as is a duplicate.
    assert b.extend(("s", "r"), 9, [5]) == 0
    assert b.extend(("s", "r"), 1, [2, 3]) == 0
    assert b.stats.stale_messages == 1


def test_target_running_past_the_drafts_keeps_matching():
    b = book()
    b.open(("s", "r"), [1, 2])
    # No drafts: the target decodes alone for several steps (1 token per step).
    for n in range(3, 9):
        hist = h(*range(1, n + 1))
        props, _ = b.propose([hist], K, K + 1, keys=[("s", "r")])
        assert props == [[]]
    assert b.sequence(("s", "r"))[1] == 8
    b.extend(("s", "r"), 8, [9, 10])
    props, _ = b.propose([h(*range(1, 9))], K, K + 1, keys=[("s", "r")])
    assert props == [[9, 10]]


def test_a_late_open_catches_up_with_the_row():
    b = book()
    b.open(("s", "r"), [7, 7])
    b.extend(("s", "r"), 2, [1, 2, 3, 4, 5, 6, 7, 8])
    # The target is already 5 tokens past the prompt (more than K+1 ahead).
    props, updates = b.propose([h(7, 7, 1, 2, 3, 4, 5)], K, K + 1, keys=[("s", "r")])
    assert props == [[6, 7, 8]]
    assert updates[0].token_ids == [1, 2, 3, 4, 5]


def test_partial_prefill_rows_are_left_alone():
    b = book()
    b.open(("s", "r"), [1, 2])
    b.extend(("s", "r"), 2, [3, 4])
    props, updates = b.propose([h(1, 2)], K, K + 1, active=[False], keys=[("s", "r")])
    assert props == [[]] and updates == []


def test_two_rows_with_the_same_history_take_two_requests():
    b = book()
    for rid in ("a", "b"):
        b.open(("s", rid), [1, 2])
        b.extend(("s", rid), 2, [3, 4, 5])
    props, updates = b.propose([h(1, 2, 3), h(1, 2, 3)], K, K + 1,
                               keys=[("s", "a"), ("s", "b")])
    assert props == [[4, 5], [4, 5]]
    assert {u.key for u in updates} == {("s", "a"), ("s", "b")}


def test_pending_drafts_are_bounded_per_request():
    b = book(max_pending=4)
    b.open(("s", "r"), [1])
    assert b.extend(("s", "r"), 1, list(range(10, 30))) == 4
    assert b.sequence(("s", "r"))[0] == [1, 10, 11, 12, 13]
    # Room opens as the target verifies.
    b.propose([h(1, 10, 11)], K, K + 1, keys=[("s", "r")])
    assert b.extend(("s", "r"), 3, [12, 13, 14, 15, 16]) == 2


def test_bad_messages_raise_book_errors_with_grpc_codes():
    b = book(max_requests=2, max_prompt_len=8)
    b.open(("s", "a"), [1])
    with pytest.raises(BookError) as e:
        b.open(("s", "a"), [1])
    assert e.value.code == ALREADY_EXISTS
    with pytest.raises(BookError) as e:
        b.extend(("s", "nope"), 1, [2])
    assert e.value.code == NOT_FOUND
    for bad in ([100], [-1], [5, 1 << 40]):
        with pytest.raises(BookError) as e:
            b.extend(("s", "a"), 1, bad)
        assert e.value.code == INVALID_ARGUMENT and "vocabulary" in e.value.message
    with pytest.raises(BookError) as e:
        b.open(("s", "long"), list(range(9)))
    assert e.value.code == INVALID_ARGUMENT
    with pytest.raises(BookError) as e:
        b.open(("s", "empty"), [])
    assert e.value.code == INVALID_ARGUMENT
    b.open(("s", "b"), [2])
    with pytest.raises(BookError) as e:
        b.open(("s", "c"), [3])
    assert e.value.code == RESOURCE_EXHAUSTED
    assert len(b) == 2


def test_close_all_drops_only_that_streams_requests():
    b = book()
    b.open((1, "x"), [1])
    b.open((1, "y"), [2])
    b.open((2, "x"), [3])
    b.extend((1, "x"), 1, [5, 6])
    b.extend((2, "x"), 1, [5, 6])
    assert b.close_all(1) == 2
    # detached, still the target's; the other stream's request keeps its drafts
    assert (1, "x") in b and (2, "x") in b
    props, updates = b.propose([h(1, 5), h(3, 5)], K, K + 1, keys=[(1, "x"), (2, "x")])
    assert props == [[], [6]]
    assert [u.key for u in updates] == [(2, "x")]  # nothing goes to a stream that left


def test_request_ids_are_scoped_to_their_stream():
    b = book()
    b.open((1, "r"), [1, 2])
    b.open((2, "r"), [1, 2])
    b.extend((2, "r"), 2, [9, 9])
    b.extend((1, "r"), 2, [3, 4])
    assert b.sequence((1, "r"))[0] == [1, 2, 3, 4]
    assert b.sequence((2, "r"))[0] == [1, 2, 9, 9]


def test_garbage_never_grows_memory_past_the_bounds():
    rng = np.random.default_rng(0)
    b = book(max_requests=16, max_pending=8)
    for i in range(16):
        b.open(("s", str(i)), rng.integers(0, 100, 4).tolist())
    for _ in range(5000):
        rid = str(int(rng.integers(0, 16)))
        b.extend(("s", rid), int(rng.integers(0, 12)), rng.integers(0, 100, 5).tolist())
    for i in range(16):
        seq, verified = b.sequence(("s", str(i)))
        assert len(seq) <= verified + 8


def test_same_prompt_rows_bind_to_the_request_whose_drafts_they_follow():
    b = book()
    b.open(("s", "a"), [1, 2])
    b.extend(("s", "a"), 2, [3, 4, 5])
    b.open(("s", "b"), [1, 2])
    b.extend(("s", "b"), 2, [7, 8, 9])
    # Sampling sent the two rows different ways; each finds its own branch.
    props, _ = b.propose([h(1, 2, 7), h(1, 2, 3)], K, K + 1, keys=[("s", "b"), ("s", "a")])
    assert props == [[8, 9], [4, 5]]


def test_a_request_opened_with_its_own_k_gets_at_most_k_tokens():
    b = book()
    b.open(("s", "r"), [1], k=2)
    b.extend(("s", "r"), 1, [2, 3, 4, 5, 6])
    props, _ = b.propose([h(1, 2)], 4, 5, keys=[("s", "r")])
    assert props == [[3, 4]]


# ---- branches (the speculation cache) ---------------------------------------------


def _rejected_at_40(b, branches):
    """S = [1 2 | 5 6 7 8], verified through 5; the target then accepts 6 and
    samples 40 instead of 7."""
    b.open(("s", "r"), [1, 2])
    b.extend(("s", "r"), 2, [5, 6, 7, 8], branches=branches)
    assert b.propose([h(1, 2, 5)], K, K + 1, keys=[("s", "r")])[0] == [[6, 7, 8]]
    return b.propose([h(1, 2, 5, 6, 40)], K, K + 1, keys=[("s", "r")])


def test_a_branch_with_the_targets_token_is_proposed_right_after_the_rejection():
    b = book()
    props, updates = _rejected_at_40(b, [(4, [40, 41, 42, 43, 44]), (4, [50, 51])])
    assert props == [[41, 42, 43]]
    assert updates[0].token_ids == [6, 40]
    assert b.sequence(("s", "r")) == ([1, 2, 5, 6, 40, 41, 42, 43, 44], 5)
    s = b.stats
    assert (s.branch_hits, s.steps_after_rejected, s.covered_after_rejected) == (1, 1, 1)
    assert b.branch_tokens == 0 and not b.misses  # the other branch is gone, the hit adopted
    # The next step follows the adopted branch like any draft.
    b.extend(("s", "r"), 5, [41, 42, 43, 44, 45, 46])
    assert b.propose([h(1, 2, 5, 6, 40, 41, 42, 43, 44)], K, K + 1, keys=[("s", "r")])[0] == [[45, 46]]
    assert b.stats.steps_after_accepted == 1 and b.stats.covered_after_accepted == 1
    assert b.stats.accepted_tokens == 1 + 3


def test_a_miss_is_listed_for_the_wait_and_refilled_when_drafts_arrive():
    b = book()
    props, _ = _rejected_at_40(b, [(4, [50, 51]), (3, [60, 61])])
    assert props == [[]]
    assert b.misses == [(0, ("s", "r"))] and b.stats.wait_rows == 1
    assert b.refill([5], K) == {}  # nothing arrived yet
    b.propose([h(9, 9)], K, K + 1, keys=[None])  # another step: the miss list is per step
    assert b.misses == []
    b2 = book()
    _rejected_at_40(b2, [])
    b2.extend(("s", "r"), 5, [41, 42, 43, 44])
    assert b2.refill([5], K) == {0: [41, 42, 43]}
    assert (b2.stats.wait_hits, b2.stats.covered_after_rejected) == (1, 1)
    # The refilled proposal is judged like any other at the next step.
    b2.propose([h(1, 2, 5, 6, 40, 41, 42, 43, 44)], K, K + 1, keys=[("s", "r")])
    assert b2.stats.accepted_tokens == 1 + 3


def test_a_finished_row_is_not_a_step_nor_a_miss():
    """vLLM proposes for a row in the step that ends its request; with the
    request's end known, that row gets nothing, counts as no step and is not
    waited for (without it, every request would end in a miss)."""
    b = book()
    b.open(("s", "r"), [1, 2], end=7)  # 5 output tokens
    b.extend(("s", "r"), 2, [5, 6, 7, 8])
    assert b.propose([h(1, 2, 5)], K, K + 1, keys=[("s", "r")])[0] == [[6, 7, 8]]
    props, updates = b.propose([h(1, 2, 5, 6, 7, 8, 9)], K, K + 1, keys=[("s", "r")])  # all accepted: done
    assert props == [[]] and b.misses == []
    assert updates[0].token_ids == [6, 7, 8, 9]  # still reported
    s = b.stats
    assert (s.steps_after_accepted, s.wait_rows, s.accepted_tokens) == (0, 0, 3)
    # Without the end, the same row is a step after an accepted one, and a miss.
    b2 = book()
    b2.open(("s", "r"), [1, 2])
    b2.extend(("s", "r"), 2, [5, 6, 7, 8])
    b2.propose([h(1, 2, 5)], K, K + 1, keys=[("s", "r")])
    assert b2.propose([h(1, 2, 5, 6, 7, 8, 9)], K, K + 1, keys=[("s", "r")])[0] == [[]]
    assert b2.misses == [(0, ("s", "r"))] and b2.stats.steps_after_accepted == 1


def test_branches_at_unknown_positions_or_without_an_alternative_are_dropped():
    b = book()
    b.open(("s", "r"), [1, 2])
    b.extend(("s", "r"), 2, [5, 6, 7, 8])
    b.propose([h(1, 2, 5, 6)], K, K + 1, keys=[("s", "r")])  # verified through 6 (position 3)
    bad = [(3, [41, 42]),  # forks at a verified position
           (1, [41]),  # inside the prompt
           (9, [41]),  # past the window
           (5, [8, 9]),  # S's own token there: not an alternative
           (4, [])]  # empty
    b.extend(("s", "r"), 4, [7, 8], branches=bad)
    assert b.stats.branches_dropped == len(bad) and b.branch_tokens == 0
    # A stale message's branches go with it.
    b.extend(("s", "r"), 2, [5, 99, 7], branches=[(4, [70, 71])])
    assert b.stats.branches_dropped == len(bad) + 1 and b.branch_tokens == 0
    assert b.propose([h(1, 2, 5, 6, 7)], K, K + 1, keys=[("s", "r")])[0] == [[8]]


def test_a_branch_may_fork_at_any_drafted_position_the_book_holds():
    """Drafts arrive as deltas: a branch comes with a later message than the
    drafted token it is an alternative to, so it may fork outside its own
    message's window, wherever the book holds a drafted token."""
    b = book()
    b.open(("s", "r"), [1, 2])
    b.extend(("s", "r"), 2, [5, 6, 7])
    # a delta at the end (position 5) with a branch forking at 3, before it
    b.extend(("s", "r"), 5, [8], branches=[(3, [60, 61])])
    assert b.stats.branches_buffered == 1 and b.branch_tokens == 2
    # a message with no tokens at all, only a branch
    b.extend(("s", "r"), 6, [], branches=[(4, [70])])
    assert b.stats.branches_buffered == 2
    # the target rejects 6 at position 3 with 60: the branch is S now
    props, _ = b.propose([h(1, 2, 5, 60)], K, K + 1, keys=[("s", "r")])
    assert props == [[61]] and b.stats.branch_hits == 1


def test_branch_floods_are_cut_at_the_bounds():
    b = book(max_branches=4, max_branch_len=3, max_branch_tokens=10)
    b.open(("s", "r"), [1, 2])
    flood = [(2 + j % 4, [50 + j, 1, 2, 3, 4, 5]) for j in range(40)]
    b.extend(("s", "r"), 2, [5, 6, 7, 8], branches=flood)
    entry_branches = b._entries[("s", "r")].branches
    assert len(entry_branches) <= 4 and all(len(t) <= 3 for t in entry_branches.values())
    assert b.branch_tokens <= 10
    assert b.stats.branches_buffered + b.stats.branches_dropped == 40
    b.close(("s", "r"))
    assert b.branch_tokens == 0


def test_branches_die_when_their_position_is_verified_or_s_changes_before_them():
    b = book()
    b.open(("s", "r"), [1, 2])
    b.extend(("s", "r"), 2, [5, 6, 7, 8], branches=[(3, [60, 61]), (5, [80, 81])])
    assert b.branch_tokens == 4
    b.propose([h(1, 2, 5, 6)], K, K + 1, keys=[("s", "r")])  # position 3 verified as 6: (3, 60) is dead
    assert b.branch_tokens == 2
    # A newer window for the same verified history replaces S from position 4 on,
    # and the branch that forked off the old S there goes too.
    b.extend(("s", "r"), 4, [70, 71])
    assert b.sequence(("s", "r"))[0] == [1, 2, 5, 6, 70, 71]
    assert b.branch_tokens == 0 and b.stats.rewritten_messages == 1


def test_hostile_branches_keep_memory_bounded():
    rng = np.random.default_rng(1)
    b = book(max_requests=8, max_pending=8, max_branches=6, max_branch_len=5,
             max_branch_tokens=100)
    for i in range(8):
        b.open(("s", str(i)), [1, 2, 3])
    for step in range(3000):
        rid = str(int(rng.integers(0, 8)))
        pos = int(rng.integers(0, 14))
        branches = [(int(rng.integers(0, 16)), rng.integers(0, 100, int(rng.integers(0, 9))).tolist())
                    for _ in range(int(rng.integers(0, 12)))]
        b.extend(("s", rid), pos, rng.integers(0, 100, 4).tolist(), branches=branches)
        if step % 7 == 0:
            hist = [h(1, 2, 3, *rng.integers(0, 100, int(rng.integers(0, 3))).tolist())]
            b.propose(hist, K, K + 1, keys=[("s", rid)])
        assert b.branch_tokens <= 100
    total = sum(e.branch_tokens for e in b._entries.values())
    assert total == b.branch_tokens
    for e in b._entries.values():
        assert len(e.branches) <= 6
        assert all(len(t) <= 5 and fork >= e.verified for (fork, _), t in e.branches.items())


def test_conditional_acceptance_is_exact_with_short_windows():
    """vLLM's per-position counters cannot tell a short window from a
    rejection; the book knows what it proposed."""
    from specserve.acceptance.record import position_trials

    b = book()
    b.open(("s", "r"), [1])
    b.extend(("s", "r"), 1, [2, 3])
    assert b.propose([h(1, 2)], K, K + 1, keys=[("s", "r")])[0] == [[3]]  # a window of one
    b.extend(("s", "r"), 3, [4, 5, 6])
    assert b.propose([h(1, 2, 3, 4)], K, K + 1, keys=[("s", "r")])[0] == [[5, 6]]  # 3 accepted, bonus 4
    b.propose([h(1, 2, 3, 4, 9)], K, K + 1, keys=[("s", "r")])  # 5 rejected
    s = b.stats
    assert (s.accepted_tokens, s.alpha_trials) == (1, 2) and s.alpha == 0.5
    assert (s.steps_after_accepted, s.steps_after_rejected) == (1, 1)
    # From vLLM's counters (drafted per position [2, 1], accepted [1, 0]) the
    # estimate cannot know position 1 was never tried after the short window.
    assert sum([1, 0]) / sum(position_trials([1, 0], [2, 1])) == 1 / 3


def test_stats_are_kept_per_stream_too():
    b = book()
    b.open((1, "r"), [1, 2])
    b.open((2, "r"), [3, 4])
    b.extend((1, "r"), 2, [5, 6], branches=[(2, [7, 8])])
    b.extend((2, "r"), 2, [9])
    b.propose([h(1, 2, 7), h(3, 4, 9)], K, K + 1, keys=[(1, "r"), (2, "r")])
    assert b.stream_stats[1].branch_messages == 1 and b.stream_stats[2].branch_messages == 0
    b.propose([h(1, 2, 7, 8), h(3, 4, 9, 10)], K, K + 1, keys=[(1, "r"), (2, "r")])
    total = BookStats()
    for st in b.stream_stats.values():
        total.add(st)
    assert total.verified_steps == b.stats.verified_steps == 1


def test_per_stream_counts_split_a_mixed_step_exactly():
    """Rows of two streams in one step: each stream's counters get its own
    rows' counts (flags and token counts), and they sum to the totals."""
    b = book()
    b.open((1, "a"), [1, 2])
    b.open((2, "b"), [3, 4])
    b.open((2, "c"), [5, 6])
    b.extend((1, "a"), 2, [7, 8, 9])
    b.extend((2, "b"), 2, [10, 11])
    b.extend((2, "c"), 2, [12])
    keys = [(1, "a"), (2, "b"), (2, "c")]
    b.propose([h(1, 2), h(3, 4), h(5, 6)], K, K + 1, keys=keys)
    # a: all 3 accepted; b: 1 of 2 (11 rejected); c: its 1 accepted
    b.propose([h(1, 2, 7, 8, 9, 20), h(3, 4, 10, 30), h(5, 6, 12, 40)], K, K + 1, keys=keys)
    one, two = b.stream_stats[1], b.stream_stats[2]
    assert (one.verified_steps, one.accepted_tokens) == (1, 3)
    assert (two.verified_steps, two.accepted_tokens) == (2, 2)
    assert (one.steps_after_accepted, two.steps_after_accepted, two.steps_after_rejected) \
        == (1, 1, 1)
    assert b.stats.accepted_tokens == 5 and b.stats.verified_steps == 3


def test_a_wrong_token_after_the_accepted_window_is_a_rejection_too():
    """All proposed tokens accepted, but S's next token (the bonus position)
    is not the target's: the branch for it is taken, and it counts as a
    rejection (the draft's token there was wrong)."""
    b = book()
    b.open(("s", "r"), [1, 2])
    b.extend(("s", "r"), 2, [5, 6, 7, 8, 9], branches=[(6, [60, 61, 62])])
    assert b.propose([h(1, 2, 5)], K, K + 1, keys=[("s", "r")])[0] == [[6, 7, 8]]
    props, _ = b.propose([h(1, 2, 5, 6, 7, 8, 60)], K, K + 1, keys=[("s", "r")])  # 9 was wrong: 60
    assert props == [[61, 62]]
    s = b.stats
    assert (s.steps_after_rejected, s.branch_hits, s.accepted_tokens) == (1, 1, 3)


def test_a_request_without_drafts_for_release_after_steps_is_released():
    """release_after = 3, counted per request over its steps in a row without a
    proposal; a step that gets drafts (at once or from the wait's refill)
    starts the count over; a finishing row counts as no step."""
    b = book(release_after=3)
    b.open(("s", "r"), [1, 2], end=20)
    hist = [1, 2]
    for _ in range(2):
        hist.append(9)
        assert b.propose([h(*hist)], K, K + 1, keys=[("s", "r")])[0] == [[]]
        assert b.release_uncovered() == []
    b.extend(("s", "r"), len(hist), [30, 31])  # drafts in time: the count starts over
    assert b.propose([h(*hist)], K, K + 1, keys=[("s", "r")])[0] == [[30, 31]]
    hist += [30, 31, 7]
    # a step after an accepted window finds nothing (a miss) but the wait's
    # refill brings drafts: that step had drafts, so the count starts over
    assert b.propose([h(*hist)], K, K + 1, keys=[("s", "r")])[0] == [[]]
    assert b.misses == [(0, ("s", "r"))]
    b.extend(("s", "r"), len(hist), [40])
    assert b.refill([len(hist)], K) == {0: [40]}
    assert b.release_uncovered() == []
    hist += [40, 8]
    for n in (1, 2, 3):
        assert b.propose([h(*hist)], K, K + 1, keys=[("s", "r")])[0] == [[]]
        hist.append(9)
        assert b.release_uncovered() == ([(("s", "r"), 3, "s")] if n == 3 else [])
    # released: detached from its draft, still the target's (registered)
    assert ("s", "r") in b and b.stats.released == 1 and b.stats.closed == 0
    assert b.extend(("s", "r"), len(hist), [1, 2], stream="s") == 0  # in flight: dropped
    assert b.propose([h(*hist)], K, K + 1, keys=[("s", "r")])[0] == [[]]
    assert b.release_uncovered() == []  # a detached request is not released again
    assert b.detach(("s", "r"), "s") is False  # its draft's close: nothing left
    assert b.close(("s", "r")) is True  # the target's end
    with pytest.raises(BookError) as e:  # after the close it is unknown again
        b.extend(("s", "r"), len(hist), [1, 2], stream="s")
    assert e.value.code == NOT_FOUND
    # never with release_after = 0
    b0 = book()
    b0.open(("s", "r"), [1, 2])
    for i in range(50):
        b0.propose([h(1, 2, *([9] * (i + 1)))], K, K + 1, keys=[("s", "r")])
        assert b0.release_uncovered() == []


# ---- registration: the target owns the entry, a draft attaches ----------------------


def test_a_draft_can_only_attach_to_a_registered_request_and_only_one_draft_at_a_time():
    b = book()
    with pytest.raises(BookError) as e:
        b.attach("r", stream=1)
    assert e.value.code == NOT_FOUND
    b.register("r", [1, 2], k=2, end=10)
    b.attach("r", stream=1)
    with pytest.raises(BookError) as e:
        b.attach("r", stream=2)
    assert e.value.code == ALREADY_EXISTS
    with pytest.raises(BookError) as e:  # another stream cannot extend it either
        b.extend("r", 2, [5, 6], stream=2)
    assert e.value.code == NOT_FOUND
    assert b.extend("r", 2, [5, 6, 7], stream=1) == 3
    props, updates = b.propose([h(1, 2, 5)], K, K + 1, keys=["r"])
    assert props == [[6, 7]]  # the target's K for it: 2
    assert [(u.key, u.stream, u.token_ids) for u in updates] == [("r", 1, [5])]


def test_a_reattached_draft_hears_what_it_missed_from_where_it_knows():
    b = book()
    b.register("r", [1, 2])
    b.attach("r", stream=1)
    b.extend("r", 2, [5, 6], stream=1)
    b.propose([h(1, 2, 5)], K, K + 1, keys=["r"])
    assert b.close_all(1) == 1
    # the target decodes on alone; nothing is reported while no draft is attached
    props, updates = b.propose([h(1, 2, 5, 6, 8)], K, K + 1, keys=["r"])
    assert props == [[]] and updates == []
    b.attach("r", stream=2, known=3)  # the draft knows [1 2 5]
    props, updates = b.propose([h(1, 2, 5, 6, 8, 9)], K, K + 1, keys=["r"])
    assert [(u.position, u.token_ids, u.stream) for u in updates] == [(3, [6, 8, 9], 2)]


def test_a_batch_of_windows_lands_as_the_same_windows_one_by_one():
    """extend_batch over many requests at once leaves every S, branch and
    counter as extending them one message at a time does (random windows:
    fresh, overlapping, stale, rewriting, with and without branches)."""
    rng = np.random.default_rng(3)
    one, many = book(max_branches=4, max_branch_len=5), book(max_branches=4, max_branch_len=5)
    keys = [("s", str(i)) for i in range(12)]
    for b in (one, many):
        for key in keys:
            b.open(key, [1, 2, 3])
    for step in range(60):
        batch = []
        for key in keys:
            if rng.random() < 0.3:
                continue
            length = one.sequence(key)[1]
            pos = int(rng.integers(max(3, length - 2), length + 3))
            toks = rng.integers(0, 6, int(rng.integers(0, 6))).tolist()
            branches = [(int(pos + rng.integers(0, 4)), rng.integers(0, 6, int(rng.integers(1, 4))).tolist())
                        for _ in range(int(rng.integers(0, 3)))]
            batch.append((key, pos, toks, branches))
        for key, pos, toks, branches in batch:
            one.extend(key, pos, toks, branches)
        many.extend_batch(
            None, [b[0] for b in batch], [b[1] for b in batch], [len(b[2]) for b in batch],
            [t for b in batch for t in b[2]],
            branch_of=[i for i, b in enumerate(batch) for _ in b[3]],
            forks=[f for b in batch for f, _ in b[3]],
            bcounts=[len(t) for b in batch for _, t in b[3]],
            btokens=[x for b in batch for _, t in b[3] for x in t])
        if step % 3 == 0:  # the target verifies a token of some rows
            rows = [h(*one.sequence(key)[0][: one.sequence(key)[1] + 1]) for key in keys]
            for b in (one, many):
                b.propose(rows, K, K + 1, keys=keys)
        for key in keys:
            assert one.sequence(key) == many.sequence(key), (step, key)
            assert {f: t.tolist() for f, t in one._entries[key].branches.items()} == \
                {f: t.tolist() for f, t in many._entries[key].branches.items()}, (step, key)
    assert one.stats == many.stats and one.branch_tokens == many.branch_tokens


def test_a_malformed_batch_is_refused_whole_and_bad_entries_alone():
    b = book()
    b.open(("s", "a"), [1, 2])
    b.open(("s", "b"), [1, 2])
    with pytest.raises(BookError) as e:  # counts do not add up to the tokens
        b.extend_batch("s", [("s", "a")], [2], [3], [5, 6])
    assert e.value.code == INVALID_ARGUMENT
    added, errors = b.extend_batch("s", [("s", "a"), ("s", "zz"), ("s", "b")], [2, 2, 2],
                                   [2, 1, 2], [5, 6, 7, 500, 9])
    assert added.tolist() == [2, 0, 0]
    assert [(k, err.code) for k, err in errors] == [(("s", "zz"), NOT_FOUND),
                                                    (("s", "b"), INVALID_ARGUMENT)]
    assert b.sequence(("s", "a"))[0] == [1, 2, 5, 6] and b.sequence(("s", "b"))[0] == [1, 2]


def test_verified_tokens_split_by_the_stream_they_go_to():
    b = book()
    b.open((1, "a"), [1, 2])
    b.open((2, "b"), [3, 4])
    b.open((1, "c"), [5, 6])
    tok = np.array([[1, 2, 7, 8], [3, 4, 9, 0], [5, 6, 10, 11]])
    _, verified = b.propose_rows(tok, np.array([4, 3, 4]), K, K + 1,
                                 keys=[(1, "a"), (2, "b"), (1, "c")])
    parts = verified.by_stream()
    assert sorted(parts) == [1, 2]
    assert [(u.key, u.position, u.token_ids) for u in parts[1].updates()] == [
        ((1, "a"), 2, [7, 8]), ((1, "c"), 2, [10, 11])]
    assert [(u.key, u.token_ids) for u in parts[2].updates()] == [((2, "b"), [9])]


def test_a_draft_that_says_it_has_nothing_more_ends_the_wait_for_that_history_only():
    """A DraftBatch's done: the request is answered (the bounded wait can stop)
    while the book's verified position is where the draft's whole window
    starts and its drafts end where the window does. A done sent before the
    draft heard the target's last step is told apart; a rejection or new drafts
    make the request unanswered again."""
    key = ("s", "r")
    b = book()
    _rejected_at_40(b, [])  # S = [1 2 5 6 40], verified 5, nothing drafted past it
    assert b.misses == [(0, key)] and not b.answered(key, K)

    def done(position, tokens):
        added, errors = b.extend_batch(None, [key], [position], [len(tokens)], tokens,
                                       done=[0])
        assert errors == []
        return int(added[0])

    # Sent before the draft heard of 40: built on 7 (stale), ...
    assert done(3, [6, 7, 8]) == 0 and not b.answered(key, K)
    # ... or agreeing with the target but from a verified position it has left.
    assert done(3, [6, 40]) == 0 and not b.answered(key, K)
    # Heard it, and found nothing to draft.
    assert done(5, []) == 0 and b.answered(key, K)
    assert b.refill([5], K) == {}  # answered with nothing: no proposal, no hit
    # New drafts after it: waiting again until they reach K or the draft says done.
    b.extend(key, 5, [41])
    assert not b.answered(key, K)
    assert done(5, [41, 42]) == 1 and b.answered(key, K)
    # A malformed done index refuses the batch.
    with pytest.raises(BookError):
        b.extend_batch(None, [key], [7], [0], [], done=[1])
    # The next rejection (the target took 41 and then 50): not answered until the
    # draft says so for the new history.
    b.propose([h(1, 2, 5, 6, 40)], K, K + 1, keys=[key])
    b.propose([h(1, 2, 5, 6, 40, 41, 50)], K, K + 1, keys=[key])
    assert b.misses == [(0, key)] and not b.answered(key, K)
    assert done(5, [41, 42]) == 0 and not b.answered(key, K)  # before it heard
    assert done(7, []) == 0 and b.answered(key, K)
    b.detach(key)  # a draft that attaches again has said nothing yet
    assert not b.answered(key, K)


def test_a_request_whose_drafts_fail_stops_costing_its_batch_but_probes():
    """With a price (policy.row_k), each request gets the drafted tokens its
    own acceptance says pay: one whose drafts are always rejected falls to
    none after its first step and tries one token every PROBE_EVERY steps, is
    never waited for nor given up as draftless; one whose drafts are always
    accepted keeps its K. Without a price both get K. (Each request's α
    starts as its stream's: here each has a stream of its own.)"""
    from specserve.target.book_step import PROBE_EVERY

    def run(price):
        b = book(release_after=3)
        bad, good = ("s1", "bad"), ("s2", "good")  # two drafts: their own priors
        b.open(bad, [1, 2])
        b.open(good, [1, 3])
        hb, hg = [1, 2, 9], [1, 3, 9]
        lens, misses = [], 0
        # A draft that hears each step in time: it drafts on from the target's
        # token; `bad`'s drafts the target never takes, `good`'s always.
        b.extend(bad, 2, [9, 50, 51, 52, 53])
        b.extend(good, 2, [9, 60, 61, 62, 63])
        for step in range(2 * PROBE_EVERY + 1):
            props, _ = b.propose([h(*hb), h(*hg)], 4, 5, keys=[bad, good], price=price)
            lens.append((len(props[0]), len(props[1])))
            misses += len(b.misses)
            hb.append(10 + step % 5)  # a rejection: the target's own token
            b.extend(bad, len(hb) - 1, [hb[-1], 50, 51, 52, 53])
            hg.extend(props[1] + [70])  # all accepted, and the bonus
            b.extend(good, len(hg) - 1, [70, 60, 61, 62, 63])
        return b, lens, misses

    b, lens, misses = run(0.2)
    probes = [4] + ([0] * (PROBE_EVERY - 1) + [1]) * 2
    assert [bad for bad, _ in lens] == probes
    assert all(good == 4 for _, good in lens)
    assert misses == 0 and b.stats.released == 0
    # Coverage counts what the draft had, not what was worth proposing.
    assert b.stats.steps_after_rejected == b.stats.covered_after_rejected > 0
    b0, lens0, _ = run(0.0)
    assert all(pair == (4, 4) for pair in lens0)
    assert b.stats.proposed_tokens < b0.stats.proposed_tokens
