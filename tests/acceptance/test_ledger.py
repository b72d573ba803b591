"""The ledger (specserve/acceptance/ledger.py): batches from several routers
add up once each, a router's restart or a lost answer never takes a counter
back, a dead router's requests in flight leave the gauge, an older target
report never replaces a newer one, and a checkpoint restores it all."""

import pytest

from specserve.acceptance.ledger import Ledger, Outbox
from specserve.acceptance.outcomes import HttpOutcomes
from specserve.acceptance.record import Acceptance, TargetReport
from specserve.acceptance.stats import RequestRecord

ROUTE = "/v1/completions"


def record(tokens=10, draft="same"):
    return RequestRecord(
        TargetReport("t0", draft, "d0", Acceptance(k=4, output_tokens=tokens, draft_tokens=8,
                                                   accepted_histogram=(0, 0, 2, 0, 0))),
        ttft_s=0.1, duration_s=1.0, finished_at=0.0)


def served(outcomes: HttpOutcomes, outbox: Outbox, n: int, status=200):
    for _ in range(n):
        outcomes.started(ROUTE)
        outcomes.responded(ROUTE, status)
        outcomes.ended(ROUTE)
        outbox.record(record())


def deliver(ledger, outbox, outcomes, now=0.0):
    while (batch := outbox.pending(outcomes)) is not None:
        ledger.add(batch, now)
        outbox.acked(batch.seq)
        if not outbox.has_unsent():
            return


def totals(ledger, now=0.0):
    view = ledger.view(now)
    return (view["stats"].by_model["same"].requests,
            view["outcomes"].responses[(ROUTE, "200")])


def test_two_routers_add_up_and_a_resent_batch_counts_once():
    ledger = Ledger(4)
    a, b = (Outbox("a"), HttpOutcomes()), (Outbox("b"), HttpOutcomes())
    served(a[1], a[0], 3)
    served(b[1], b[0], 2)
    batch = a[0].pending(a[1])
    ledger.add(batch, 0.0)  # applied, but the answer was lost: not acknowledged
    deliver(ledger, *a)  # resent with the same number
    deliver(ledger, *b)
    assert totals(ledger) == (5, 5)
    served(a[1], a[0], 1)
    deliver(ledger, *a)
    assert totals(ledger) == (6, 6)
    assert ledger.view(0.0)["routers"] == ["a", "b"]


def test_a_restarted_router_adds_to_what_was_counted():
    ledger = Ledger(4)
    served(*(old := (HttpOutcomes(), Outbox("a-1"))), 4)
    deliver(ledger, old[1], old[0])
    before = totals(ledger)
    new = (Outbox("a-2"), HttpOutcomes())  # a new replica id, counters from zero
    served(new[1], new[0], 1)
    deliver(ledger, *new)
    assert totals(ledger) == (before[0] + 1, before[1] + 1)


def test_a_silent_router_leaves_the_inflight_gauge_and_later_the_table():
    ledger = Ledger(4, grace_s=100, live_s=10)
    outbox, outcomes = Outbox("a"), HttpOutcomes()
    outcomes.started(ROUTE)  # a request in flight when the router dies
    deliver(ledger, outbox, outcomes, now=0.0)
    assert ledger.view(5.0)["outcomes"].inflight[ROUTE] == 1
    assert ledger.view(11.0)["outcomes"].inflight[ROUTE] == 0
    assert "a" in ledger.routers
    ledger.view(101.0)
    assert "a" not in ledger.routers


def test_an_older_target_report_does_not_replace_a_newer_one():
    ledger = Ledger(4)
    outbox, outcomes = Outbox("a"), HttpOutcomes()
    outbox.report({"replica": "t0", "at": 2.0, "engine": {"draft_tokens": 20}})
    deliver(ledger, outbox, outcomes)
    other = Outbox("b")
    other.report({"replica": "t0", "at": 1.0, "engine": {"draft_tokens": 10}})
    deliver(ledger, other, outcomes)
    assert ledger.replicas._rows["t0"].report["engine"]["draft_tokens"] == 20


def test_the_outbox_keeps_only_the_newest_report_of_a_replica():
    outbox = Outbox("a")
    outbox.report({"replica": "t0", "at": 1.0})
    outbox.report({"replica": "t1", "at": 1.0})
    outbox.report({"replica": "t0", "at": 2.0})
    batch = outbox.pending(HttpOutcomes())
    assert sorted((r["replica"], r["at"]) for r in batch.reports) == [("t0", 2.0), ("t1", 1.0)]


def test_unsent_batches_are_bounded_and_the_drop_is_counted():
    outbox, outcomes = Outbox("a", max_unsent_records=5), HttpOutcomes()
    for _ in range(4):  # the ledger does not answer: nothing is acknowledged
        served(outcomes, outbox, 2)
        outbox.pending(outcomes)
    assert outbox.unsent_records() <= 5 and outbox.dropped_records == 4
    ledger = Ledger(4)
    deliver(ledger, outbox, outcomes)
    # the responses are counts since the last batch sent, so none is lost
    assert totals(ledger) == (4, 8)


def test_a_checkpoint_restores_the_ledger_and_a_foreign_one_is_refused():
    ledger = Ledger(4)
    outbox, outcomes = Outbox("a"), HttpOutcomes()
    served(outcomes, outbox, 3)
    deliver(ledger, outbox, outcomes)
    assert ledger.changed
    data = ledger.dumps()
    assert not ledger.changed
    restored = Ledger.loads(data)
    assert totals(restored) == totals(ledger) == (3, 3)
    # the router's next batch, and a resend of the last one, after the restore
    served(outcomes, outbox, 1)
    deliver(restored, outbox, outcomes)
    assert totals(restored) == (4, 4)
    with pytest.raises(ValueError, match="not a ledger checkpoint"):
        Ledger.loads(b"garbage")
    import pickle

    with pytest.raises(ValueError, match="another version"):
        Ledger.loads(pickle.dumps((0, ledger)))


def test_routing_tallies_add_up_over_routers_and_outlive_a_pruned_one():
    from specserve.control.affinity import Tally

    ledger = Ledger(4, grace_s=100, live_s=10)
    for name, reason, n in (("a", "prefix", 3), ("b", "load", 2)):
        t = Tally()
        for _ in range(n):
            t.count(reason, matched=1, keys=2)
        ledger.add(Outbox(name).pending(HttpOutcomes(), {"target": t}), 0.0)
    choices = ledger.view(1.0)["routing"]["target"]
    assert (choices["choices"]["prefix"], choices["choices"]["load"]) == (3, 2)
    assert choices["prefix_match_rate"] == 0.5
    b = Outbox("b")
    b._seq = 1  # b goes on; a falls silent and is pruned
    ledger.add(b.pending(HttpOutcomes(), {"target": Tally()}), 150.0)
    assert ledger.view(150.0)["routing"]["target"]["choices"]["prefix"] == 3
    assert "a" not in ledger.routers and "a" not in ledger.tallies
