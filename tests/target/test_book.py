"""The draft book alone: matching drafts to rows by history, bounds, stale drafts."""

import numpy as np
import pytest

from specserve.target.book import (
    ALREADY_EXISTS,
    INVALID_ARGUMENT,
    NOT_FOUND,
    RESOURCE_EXHAUSTED,
    BookError,
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
    props, updates = b.propose([h(1, 2, 3, 10)], K, K + 1)
    assert props == [[11, 12, 13]]
    assert [(u.key, u.position, u.token_ids) for u in updates] == [(("s", "r1"), 3, [10])]


def test_row_order_does_not_matter_and_unrelated_rows_get_nothing():
    b = book()
    b.open(("s", "a"), [1, 2])
    b.extend(("s", "a"), 2, [5, 6, 7])
    b.open(("s", "b"), [3, 4])
    b.extend(("s", "b"), 2, [8, 9])
    props, _ = b.propose([h(9, 9, 9), h(3, 4, 8), h(1, 2, 5)], K, K + 1)
    assert props == [[], [9], [6, 7]]


def test_rejection_drops_pending_drafts_and_reports_the_recovered_token():
    b = book()
    b.open(("s", "r"), [1, 2])
    b.extend(("s", "r"), 2, [5, 6, 7, 8])
    b.propose([h(1, 2, 5)], K, K + 1)  # verified up to 3
    # The target accepted 6 and then sampled 40 instead of 7.
    props, updates = b.propose([h(1, 2, 5, 6, 40)], K, K + 1)
    assert props == [[]]
    assert updates[0].position == 3 and updates[0].token_ids == [6, 40]
    seq, verified = b.sequence(("s", "r"))
    assert seq == [1, 2, 5, 6, 40] and verified == 5
    # A late draft built on the rejected branch is refused by the overlap check ...
    assert b.extend(("s", "r"), 3, [6, 7, 8, 9]) == 0
    # ... and one built on the target's history is taken.
    assert b.extend(("s", "r"), 5, [41, 42]) == 2
    props, _ = b.propose([h(1, 2, 5, 6, 40, 41)], K, K + 1)
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
        props, _ = b.propose([hist], K, K + 1)
        assert props == [[]]
    assert b.sequence(("s", "r"))[1] == 8
    b.extend(("s", "r"), 8, [9, 10])
    props, _ = b.propose([h(*range(1, 9))], K, K + 1)
    assert props == [[9, 10]]


def test_late_open_is_found_by_the_slow_path():
    b = book()
    b.open(("s", "r"), [7, 7])
    b.extend(("s", "r"), 2, [1, 2, 3, 4, 5, 6, 7, 8])
    # The target is already 5 tokens past the prompt (more than K+1 ahead).
    props, updates = b.propose([h(7, 7, 1, 2, 3, 4, 5)], K, K + 1)
    assert props == [[6, 7, 8]]
    assert updates[0].token_ids == [1, 2, 3, 4, 5]


def test_partial_prefill_rows_are_left_alone():
    b = book()
    b.open(("s", "r"), [1, 2])
    b.extend(("s", "r"), 2, [3, 4])
    props, updates = b.propose([h(1, 2)], K, K + 1, active=[False])
    assert props == [[]] and updates == []


def test_two_rows_with_the_same_history_take_two_requests():
    b = book()
    for rid in ("a", "b"):
        b.open(("s", rid), [1, 2])
        b.extend(("s", rid), 2, [3, 4, 5])
    props, updates = b.propose([h(1, 2, 3), h(1, 2, 3)], K, K + 1)
    assert props == [[4, 5], [4, 5]]
    assert {u.key for u in updates} == {("s", "a"), ("s", "b")}


def test_pending_drafts_are_bounded_per_request():
    b = book(max_pending=4)
    b.open(("s", "r"), [1])
    assert b.extend(("s", "r"), 1, list(range(10, 30))) == 4
    assert b.sequence(("s", "r"))[0] == [1, 10, 11, 12, 13]
    # Room opens as the target verifies.
    b.propose([h(1, 10, 11)], K, K + 1)
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
    assert b.close_all(1) == 2
    assert (2, "x") in b and (1, "x") not in b
    props, _ = b.propose([h(1, 5), h(3, 5)], K, K + 1)
    assert props == [[], []]


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
    props, _ = b.propose([h(1, 2, 7), h(1, 2, 3)], K, K + 1)
    assert props == [[8, 9], [4, 5]]


def test_a_request_opened_with_its_own_k_gets_at_most_k_tokens():
    b = book()
    b.open(("s", "r"), [1], k=2)
    b.extend(("s", "r"), 1, [2, 3, 4, 5, 6])
    props, _ = b.propose([h(1, 2)], 4, 5)
    assert props == [[3, 4]]
