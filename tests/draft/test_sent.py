"""The draft side's record of what it sent a sink (specserve.draft.sent):
deltas, branches once, and healing from the sink's verified updates."""

from specserve.draft.sent import SentWindows


def test_a_growing_window_goes_out_as_its_new_tokens_only():
    s = SentWindows()
    assert s.delta("r", 3, [10]) == (3, [])
    assert s.tokens_from("r", 3) == (3, [10])
    assert s.delta("r", 3, [10, 11, 12]) == (4, [])
    assert s.tokens_from("r", 4) == (4, [11, 12])
    assert s.delta("r", 3, [10, 11, 12]) is None  # nothing new
    # the target verified 10 (the window now starts at 4): still nothing new
    assert s.delta("r", 4, [11, 12]) is None
    assert s.delta("r", 4, [11, 12, 13]) == (6, [])


def test_a_window_that_changes_goes_out_from_the_change_with_its_branches_again():
    s = SentWindows()
    s.delta("r", 3, [10, 11, 12], [(4, [50]), (5, [60])])
    # the same branches are not sent twice; a new one is
    assert s.delta("r", 3, [10, 11, 12, 13], [(4, [50]), (5, [60]), (6, [70])]) \
        == (6, [(6, [70])])
    # a rewrite from position 5: the sink drops its branches from 5 on, so
    # those still wanted go again (the one at 4 it keeps)
    assert s.delta("r", 3, [10, 11, 99], [(4, [50]), (5, [60])]) == (5, [(5, [60])])
    # a branch goes once per (fork, alternative), however its continuation grows
    assert s.delta("r", 3, [10, 11, 99, 5], [(4, [50, 1])]) == (6, [])


def test_a_window_from_elsewhere_goes_out_whole():
    s = SentWindows()
    s.delta("r", 3, [10, 11])
    assert s.delta("r", 9, [20, 21]) == (9, [])  # past the record: a new window
    assert s.tokens_from("r", 0) == (9, [20, 21])


def test_verified_tokens_that_differ_cut_the_record():
    s = SentWindows()
    s.delta("r", 3, [10, 11, 12, 13], [(5, [60])])
    # the target took 10 and then 77 at position 4: the sink dropped 11.. and branches
    assert s.heard("r", 3, [10, 77], held=5) is None
    # the draft's next window after its rollback (from 5) goes out whole
    assert s.delta("r", 5, [30, 31], [(6, [60])]) == (5, [(6, [60])])


def test_what_the_sink_says_it_lacks_is_sent_again():
    s = SentWindows()
    s.delta("r", 3, [10, 11, 12, 13], [(4, [50]), (5, [60])])
    # the target verified 10; the sink holds drafts only up to 5 (it dropped 12, 13)
    assert s.heard("r", 3, [10], held=5) == (5, [(5, [60])])
    assert s.tokens_from("r", 5) == (5, [12, 13])
    # all held, or the sink did not say: nothing to send again
    assert s.heard("r", 4, [11], held=7) is None
    assert s.heard("r", 5, [12], held=0) is None


def test_forget_and_clear_start_over():
    s = SentWindows()
    s.delta("r", 3, [10, 11])
    s.forget("r")
    assert s.delta("r", 3, [10, 11]) == (3, [])
    s.clear()
    assert s.heard("r", 3, [10], held=3) is None
    assert s.delta("r", 3, [10, 11]) == (3, [])
