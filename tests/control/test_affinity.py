"""Routing by prefix and load alone: prefix keys, the index, the choice and why."""

import json
import random

from specserve.control.affinity import (
    MAX_CHUNKS, PrefixIndex, Tally, choose, conversation_text, prefix_keys,
)


def test_prefix_keys_share_exactly_the_shared_chunks():
    a = prefix_keys("abcdefgh" + "ijkl", 4)
    b = prefix_keys("abcdefgh" + "ijkX", 4)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    # chained: the same chunk after a different prefix is another key
    assert prefix_keys("XXXXijkl", 4)[1] != a[2]
    assert prefix_keys("abc", 4) == [] and prefix_keys(None, 4) == [] == prefix_keys("", 4)
    assert prefix_keys("abcdefg", 4) == a[:1]  # a partial last chunk has no key
    assert prefix_keys([1, 2, 3, 4, 5, 6], 3) == prefix_keys((1, 2, 3, 4, 5, 6), 3)
    assert prefix_keys([1, 23, 4], 3) != prefix_keys([12, 3, 4], 3)
    assert len(prefix_keys("a" * (4 * MAX_CHUNKS + 40), 4)) == MAX_CHUNKS
    # stable across processes: a fixed value, not Python's salted hash
    assert prefix_keys("abcd", 4) == prefix_keys("abcd", 4)


def test_index_matches_leading_keys_per_replica_and_forgets():
    idx = PrefixIndex(capacity=100)
    conv = prefix_keys("system prompt. user: hello there; assistant: hi", 4)
    idx.insert(conv[:5], "r1")
    idx.insert(conv, "r2")
    assert idx.match(conv, ["r1", "r2", "r3"]) == {"r1": 5, "r2": len(conv), "r3": 0}
    other = prefix_keys("system prompt. user: something else entirely", 4)
    shared = sum(1 for x, y in zip(conv, other) if x == y)
    assert 0 < shared < len(other)
    assert idx.match(other, ["r1", "r2"]) == {"r1": min(5, shared), "r2": shared}
    idx.drop("r2")
    assert idx.match(conv, ["r1", "r2"]) == {"r1": 5, "r2": 0}
    assert len(idx) == 5
    small = PrefixIndex(capacity=3)
    small.insert(conv[:3], "r1")
    small.insert(other[-2:], "r1")  # the oldest keys go first
    assert len(small) == 3 and small.match(conv, ["r1"]) == {"r1": 0}


def test_choose_prefers_the_prefix_within_the_load_bound():
    # the replica holding the prefix wins while its load is within the bound
    c = choose(["a", "b"], {"a": 3, "b": 1}, {"a": 7, "b": 2}, 11, max_extra=2)
    assert c.order == ["a", "b"] and c.reason == "prefix" and c.matched == 7
    # past the bound the load wins, and says that the prefix gave way
    c = choose(["a", "b"], {"a": 4, "b": 1}, {"a": 7, "b": 2}, 11, max_extra=2)
    assert c.order == ["b", "a"] and c.reason == "balance" and c.matched == 2
    # equal prefixes (a shared system prompt): the least loaded
    c = choose(["a", "b", "c"], {"a": 2, "b": 0, "c": 1}, {"a": 3, "b": 3, "c": 3}, 11, 5)
    assert c.order == ["b", "c", "a"] and c.reason == "load"
    # no replica and no key
    assert choose([], {}, {}, None, 1).order == []
    c = choose(["a", "b"], {"b": 1}, {}, None, 1)
    assert c.order == ["a", "b"] and c.reason == "load"


def test_new_conversations_spread_the_same_way_in_every_router():
    # Ties (equal load, nothing matched) go by a hash of the first key, so two
    # routers with no shared state pick the same replica, and conversations spread.
    replicas = ["r1", "r2", "r3"]
    rng = random.Random(0)
    firsts = [rng.getrandbits(64) for _ in range(300)]
    picks = [choose(replicas, {}, {}, f, 0).order[0] for f in firsts]
    assert picks == [choose(list(reversed(replicas)), {}, {}, f, 0).order[0] for f in firsts]
    counts = {r: picks.count(r) for r in replicas}
    assert max(counts.values()) / (len(picks) / 3) < 1.3, counts


def test_a_conversation_stays_with_its_replica_and_load_spreads_conversations():
    # Closed loop over the index and the choice, as the router runs them:
    # 8 clients, one conversation of 6 turns each, a shared system prompt, 2
    # replicas; while one client's turn is routed the others are in flight.
    idx, tally = PrefixIndex(), Tally()
    replicas = ["r1", "r2"]
    at: dict[int, str] = {}  # where each client's last turn went
    system = "You are a helpful assistant. " * 8
    served: dict[int, set[str]] = {}
    convs = {i: [{"role": "system", "content": system}] for i in range(8)}
    for turn in range(6):
        for i, msgs in convs.items():
            msgs.append({"role": "user", "content": f"question {turn} of conversation {i}"})
            keys = prefix_keys(conversation_text(json.dumps({"messages": msgs}).encode()), 16)
            inflight = {r: sum(1 for j, q in at.items() if q == r and j != i) for r in replicas}
            c = choose(replicas, inflight, idx.match(keys, replicas), keys[0], 2)
            r = at[i] = c.order[0]
            tally.count(c.reason, c.matched, len(keys))
            idx.insert(keys, r)
            served.setdefault(i, set()).add(r)
            msgs.append({"role": "assistant", "content": f"answer {turn} to {i}, " * 3})
    assert all(len(s) == 1 for s in served.values()), served
    per_replica = [sum(1 for s in served.values() if r in s) for r in replicas]
    assert per_replica == [4, 4]
    snap = tally.snapshot()
    # (a turn whose distinct text ends inside a partial chunk matches both
    # replicas equally: then the load decides, and the client's own replica is
    # the less loaded one)
    # In the first turn the shared system prompt draws the new conversations to
    # the replica that holds it, until the load bound sends one elsewhere.
    assert snap["choices"]["balance"] == 1 and snap["choices"]["prefix"] >= 8 * 4
    assert snap["prefix_match_rate"] > 0.5


def test_conversation_text_reads_messages_or_prompt_only():
    def text(body):
        return conversation_text(json.dumps(body).encode())

    one = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    two = one + [{"role": "assistant", "content": "hello"},
                 {"role": "user", "content": [{"type": "text", "text": "more"}]}]
    assert text({"messages": two, "max_tokens": 5}).startswith(text({"messages": one}))
    # a turn that differs is not a prefix, even where the texts would join up
    assert not text({"messages": [{"role": "user", "content": "hi!"}]}).startswith(
        text({"messages": [{"role": "user", "content": "hi"}]}))
    assert text({"prompt": "once upon", "temperature": 0}) == "once upon"
    assert text({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert text({"prompt": ["a", "b"]}) is None  # a batch: no one prefix
    assert conversation_text(b"not json") is None
    assert conversation_text(b"\xff\xfe") is None
    assert text([1, 2]) is None and text({"model": "m"}) is None
