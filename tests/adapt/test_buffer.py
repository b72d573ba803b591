"""specserve.adapt.buffer: bounds under a flood, the held-out split, junk input. Pure."""

from __future__ import annotations

import random

import pytest

from specserve.adapt.buffer import AdaptBuffer, is_heldout


def make(max_tokens=1000, context=8, per_request=40, share=0.2) -> AdaptBuffer:
    return AdaptBuffer(max_tokens, context, per_request, share)


def feed(buf: AdaptBuffer, rid: str, prompt: list[int], output: list[int], step: int = 3):
    """What the runner does: open, then the growing verified history, then close."""
    buf.open(rid, prompt)
    history = list(prompt)
    for i in range(0, len(output), step):
        history.extend(output[i:i + step])
        buf.observe(rid, history)
    buf.close(rid)


def test_an_example_is_the_prompt_tail_and_the_verified_output():
    buf = make(share=0.01)
    rid = next(f"r{i}" for i in range(100) if not is_heldout(f"r{i}", 0.01))
    buf.open(rid, list(range(20)))
    buf.observe(rid, list(range(20)) + [100, 101])
    buf.observe(rid, list(range(20)) + [100, 101])  # nothing new
    buf.observe(rid, list(range(20)) + [100, 101, 102])
    [ex] = buf.train_examples()
    assert ex.context == list(range(12, 20))  # the last max_context_tokens
    assert ex.continuation == [100, 101, 102]
    assert buf.tokens == ex.tokens == 11 and buf.heldout_tokens == 0


def test_bounds_hold_under_a_flood_of_distinct_requests():
    rng = random.Random(0)
    buf = make(max_tokens=500, context=8, per_request=40)
    for i in range(2000):
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
        output = [rng.randrange(1000) for _ in range(rng.randrange(0, 100))]
        feed(buf, f"req-{i}", prompt, output, step=rng.randrange(1, 6))
        assert buf.tokens <= 500
    examples = buf.train_examples() + buf.heldout_examples()
    assert sum(e.tokens for e in examples) == buf.tokens
    assert all(len(e.context) <= 8 and e.tokens <= 40 for e in examples)
    assert buf.evicted > 0
    # Oldest first: what is left is the newest requests.
    kept = sorted(int(e.request_id.split("-")[1]) for e in examples)
    assert kept[0] > 1900


def test_one_long_request_cannot_fill_the_buffer():
    buf = make(max_tokens=1000, context=8, per_request=40)
    feed(buf, "long", list(range(5)), list(range(10_000)))
    assert buf.tokens == 40
    feed(buf, "other", [1, 2], [3, 4])
    assert buf.tokens == 44


def test_open_requests_flooded_out_are_ignored_afterwards():
    buf = make(max_tokens=100, context=8, per_request=40)
    buf.open("first", list(range(8)))
    for i in range(20):
        buf.open(f"r{i}", list(range(8)))
    assert buf.tokens <= 100
    assert buf.observe("first", list(range(8)) + [1, 2, 3]) == 0  # evicted
    assert buf.tokens <= 100


def test_heldout_split_is_stable_disjoint_and_near_its_share():
    ids = [f"cmpl-{i}" for i in range(5000)]
    held = {r for r in ids if is_heldout(r, 0.2)}
    assert held == {r for r in ids if is_heldout(r, 0.2)}  # stable
    assert 0.17 < len(held) / len(ids) < 0.23
    # A larger share holds out a superset: raising it never trains on held-out text.
    assert held <= {r for r in ids if is_heldout(r, 0.3)}


def test_nothing_from_a_heldout_request_is_ever_trained_on():
    buf = make(max_tokens=100_000, context=8, per_request=40)
    for i in range(300):
        # Each request's tokens carry its number, so a leak would show.
        feed(buf, f"req-{i}", [10_000 + i] * 5, [10_000 + i] * 20)
    train, held = buf.train_examples(), buf.heldout_examples()
    assert train and held
    train_ids = {e.request_id for e in train}
    held_ids = {e.request_id for e in held}
    assert not train_ids & held_ids
    assert all(is_heldout(r, 0.2) for r in held_ids)
    assert not any(is_heldout(r, 0.2) for r in train_ids)
    held_tokens = {10_000 + int(r.split("-")[1]) for r in held_ids}
    assert not any(t in held_tokens for e in train for t in e.context + e.continuation)
    assert buf.heldout_tokens == sum(e.tokens for e in held)
    assert buf.heldout_positions == sum(len(e.continuation) for e in held)
    assert buf.train_tokens == sum(e.tokens for e in train)


def test_junk_input_is_ignored():
    buf = make()
    buf.open("", [1, 2])
    buf.open("empty", [])
    buf.open("none", None)
    buf.open("big", [1 << 40])
    buf.observe("never-opened", [1, 2, 3])
    buf.observe("empty", [])
    buf.close("never-opened")
    assert buf.tokens == 0 and buf.requests() == 0
    buf.open("r", [1, 2])
    buf.open("r", [9, 9, 9])  # already open: the first prompt stands
    buf.observe("r", [])
    buf.observe("r", [1])  # shorter than the prompt
    buf.observe("r", [1, 2, "x"])  # not a token id: the request is forgotten
    assert buf.tokens == 0 and buf.requests() == 0
    buf.open("s", [1, 2])
    buf.observe("s", [1, 2, 3])
    buf.close("s")
    buf.observe("s", [1, 2, 3, 4])  # closed: nothing more
    assert [e.continuation for e in buf.train_examples() + buf.heldout_examples()] == [[3]]


def test_a_request_that_verified_nothing_is_dropped_at_close():
    buf = make()
    buf.open("r", [1, 2, 3])
    assert buf.tokens == 3
    buf.close("r")
    assert buf.tokens == 0 and buf.requests() == 0


@pytest.mark.parametrize("args", [(100, 0, 40, 0.2), (100, 40, 40, 0.2), (30, 8, 40, 0.2),
                                  (100, 8, 40, 0.0), (100, 8, 40, 1.0)])
def test_bad_bounds_are_refused(args):
    with pytest.raises(ValueError):
        AdaptBuffer(*args)
