"""The suffix memory alone (specserve/draft/suffix_tree.py): matching, the
drafting rule, alternatives, bounds and eviction, hostile input."""

import random

import pytest

from specserve.draft.suffix_tree import DraftRule, SuffixIndex, best_draft


def test_drafts_the_continuation_of_the_longest_match():
    ix = SuffixIndex(max_depth=8)
    ix.extend("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    d = ix.propose([50, 3, 4, 5], max_tokens=4, factor=2.0)
    assert d.tokens == [6, 7, 8, 9][: 4] and d.match == 3
    # Length follows the match: factor 1, match 1 -> one token.
    assert ix.propose([99, 5], max_tokens=8, factor=1.0).tokens == [6]
    assert ix.propose([42, 43], max_tokens=8).tokens == []


def test_copies_past_the_trie_depth_and_skips_the_live_end():
    ix = SuffixIndex(max_depth=4)
    seq = list(range(100, 140))
    ix.extend("r", seq + [7, 7] + seq[:10])  # the sequence repeats its own start
    # The context is the live sequence itself: its last 4 tokens end the sequence
    # (nothing after them yet), so the draft copies from their earlier occurrence.
    d = ix.propose(seq + [7, 7] + seq[:10], max_tokens=12, factor=4.0)
    assert d.tokens == seq[10:22]


def test_most_frequent_continuation_wins_and_the_others_are_alternatives():
    ix = SuffixIndex(max_depth=6)
    for i in range(3):
        ix.extend(f"x{i}", [1, 2, 3, 10, 11])
    ix.extend("y", [1, 2, 3, 20, 21])
    d = ix.propose([1, 2, 3], max_tokens=2, factor=2.0, min_prob=0.1, fan_out=2)
    assert d.tokens == [10, 11]
    assert d.alternatives[0] == [20]
    assert d.prob == pytest.approx(0.75)
    # A minimum probability above 3/4 drafts nothing.
    assert ix.propose([1, 2, 3], max_tokens=2, factor=2.0, min_prob=0.8).tokens == []


def test_best_draft_picks_the_higher_score():
    own, fleet = SuffixIndex(), SuffixIndex()
    own.extend("r", [5, 6, 7, 1])
    for i in range(4):
        fleet.extend(i, [5, 6, 7, 8, 9, 10])
    d = best_draft([0, 5, 6, 7], [own, fleet], DraftRule(max_tokens=3, factor=1.0))
    assert d.tokens == [8, 9, 10]


def test_flood_of_distinct_sequences_stays_within_the_bounds():
    rng = random.Random(0)
    ix = SuffixIndex(max_depth=8, max_tokens=2000, max_sequences=50, max_sequence_tokens=300)
    peak_nodes = 0
    for i in range(400):
        ix.extend(i, [rng.randrange(50_000) for _ in range(rng.randrange(1, 600))])
        assert ix.tokens <= 2000 and len(ix) <= 50
        peak_nodes = max(peak_nodes, ix.nodes)
    assert peak_nodes <= 2000 * 8
    assert ix.evicted > 0
    # Counting stays exact: rebuilding the kept sequences gives the same trie size.
    kept = [ix._seqs[n][0] for n in ix._ids.values()]
    again = SuffixIndex(max_depth=8, max_tokens=10**6, max_sequences=10**6,
                        max_sequence_tokens=10**6)
    for j, s in enumerate(kept):
        again.extend(j, s)
    assert again.nodes == ix.nodes


def test_removing_everything_empties_the_trie():
    ix = SuffixIndex(max_depth=5)
    ix.extend("a", [1, 2, 1, 2, 1, 2, 3])
    ix.extend("b", [2, 1, 2, 9])
    ix.remove("a")
    ix.remove("b")
    assert ix.nodes == 0 and ix.tokens == 0 and not ix.root.children


def test_huge_sequence_and_junk_ids_are_cut_not_stored():
    ix = SuffixIndex(max_depth=4, max_tokens=1000, max_sequence_tokens=100, vocab_size=1000)
    ix.extend("huge", list(range(500)) * 100)
    assert ix.tokens == 100 and ix.nodes <= 100 * 4
    ix.extend("junk", [5, 6, -3, 10**12, 7.5, "x", None, 5, 6, 999, 1000])
    d = ix.propose([5, 6], 4, factor=1.0, min_prob=0.0)
    assert d.tokens and all(0 <= t < 1000 and isinstance(t, int) for t in d.tokens)
    for node in _walk(ix.root):
        for t in node.children:
            assert isinstance(t, int) and 0 <= t < 1000
    # Junk breaks the sequence: 6 was followed by junk, so [-3...] is not a path.
    assert ix.match([6, 10**12])[0] is None


def _walk(node):
    yield node
    for c in node.children.values():
        yield from _walk(c)
