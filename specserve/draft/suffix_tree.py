"""Suffix memory: token sequences indexed for drafting without a model (SuffixDecoding).

Owns a bounded, frequency-counting index of token sequences and the drafting
rule over it; pure (no I/O, no asyncio), tested alone (tests/draft/test_suffix_tree.py).
The suffix draft (specserve/draft/suffix.py) keeps one `SuffixIndex` per request
(its prompt and output so far) and one across requests (the fleet memory).

Structure. A truncated suffix trie of depth D: every suffix of every kept
sequence, cut at D tokens, is a path from the root; a node counts the
occurrences of its path (over all kept sequences) and remembers where its path
last ended (sequence, position), so a draft can be copied on from there once the
trie's depth runs out. Appending a token to a sequence touches at most D + 1
nodes (the "active" path ends), so a sequence of L tokens costs O(L·D) and holds
at most L·D nodes.

Drafting (Oliaro et al., SuffixDecoding, NeurIPS 2025; the rule vLLM's
`suffix` method takes from Arctic Inference):
  1. match: the longest suffix of the context (m ≤ D tokens) that is a path;
  2. length: at most min(max_tokens, ceil(factor · m) + offset): a long match
     earns a long draft;
  3. walk: repeatedly take the most frequent child; the draft's probability is
     the product of count(child) / count(parent); stop below `min_prob`;
  4. past depth D: copy the tokens that followed the path's last occurrence.
The alternatives at each drafted position (the other children, most frequent
first) are the draft's branches.

Bounds (the caller's config): tokens and sequences kept (oldest evicted first:
its counts are taken back out of the trie, emptied nodes deleted), and tokens
per sequence (a longer sequence is indexed up to the cap, the rest ignored).
Ids outside [0, vocab_size) are never stored: they break the sequence there
(as a separator would), so junk ids cannot be drafted back.

Why our own and not Arctic Inference's (which vLLM's `suffix` method imports):
`arctic-inference` comes from PyPI here only as a source package (a C++ /
nanobind build, and a vLLM plugin that patches vLLM where its version matches),
which `make install` would have to build on every machine; this one is plain
Python, bounded by the config, and tested alone.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable, Sequence


class _Node:
    __slots__ = ("count", "children", "ref", "prev")

    def __init__(self):
        self.count = 0
        self.children: dict[int, _Node] = {}
        # (sequence number, end position) where this path last ended, and the
        # occurrence before that one: a live sequence's own end has nothing after
        # it yet, so the copy past depth D reads the one before.
        self.ref: tuple[int, int] | None = None
        self.prev: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class Draft:
    """A proposal: tokens, its probability estimate (product of the walk's
    ratios), the match length it came from, per token the alternatives (other
    continuations seen there, most frequent first), and its score: the sum of
    the prefix probabilities, roughly the expected accepted tokens (how
    SuffixDecoding ranks the candidates of several trees)."""

    tokens: list[int]
    prob: float = 0.0
    match: int = 0
    alternatives: list[list[int]] = dataclasses.field(default_factory=list)
    score: float = 0.0


class SuffixIndex:
    """Bounded suffix trie over sequences keyed by id (any hashable)."""

    def __init__(self, max_depth: int = 24, max_tokens: int = 1 << 16, max_sequences: int = 1024,
                 max_sequence_tokens: int = 8192, vocab_size: int | None = None):
        if max_depth < 1 or max_tokens < 1 or max_sequences < 1 or max_sequence_tokens < 1:
            raise ValueError("suffix index bounds must be >= 1")
        self.max_depth = max_depth
        self.max_tokens = max_tokens
        self.max_sequences = max_sequences
        self.max_sequence_tokens = min(max_sequence_tokens, max_tokens)
        self.vocab_size = vocab_size
        self.root = _Node()
        self.tokens = 0  # tokens kept, over all sequences
        self.nodes = 0
        self.evicted = 0  # sequences evicted for the bounds
        # key -> internal sequence number; number -> (tokens, active path ends)
        self._ids: collections.OrderedDict = collections.OrderedDict()
        self._seqs: dict[int, tuple[list[int], list[_Node]]] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, key) -> bool:
        return key in self._ids

    def length(self, key) -> int:
        """Tokens kept of sequence `key` (0 if unknown)."""
        n = self._ids.get(key)
        return 0 if n is None else len(self._seqs[n][0])

    # ---- writing ---------------------------------------------------------------

    def extend(self, key, tokens: Iterable[int]) -> None:
        """Append tokens to sequence `key` (created if new; the newest for eviction)."""
        n = self._ids.get(key)
        if n is None:
            n = self._next
            self._next += 1
            self._ids[key] = n
            self._seqs[n] = ([], [])
        else:
            self._ids.move_to_end(key)
        seq, active = self._seqs[n]
        vocab = self.vocab_size
        for t in tokens:
            if len(seq) >= self.max_sequence_tokens:
                break
            if type(t) is not int or t < 0 or (vocab is not None and t >= vocab):
                t = -1  # a break: kept in the sequence (positions stay), never in the trie
            seq.append(t)
            self.tokens += 1
            if t < 0:
                active.clear()
            else:
                self._append(n, seq, active, t)
            if self.tokens > self.max_tokens:
                self._evict(keep=n)
        while len(self._ids) > self.max_sequences:
            self._evict(keep=n)

    def _append(self, n: int, seq: list[int], active: list[_Node], t: int) -> None:
        # active[i]: the node of the suffix that started i + 1 tokens before the end
        end = len(seq)
        nxt = []
        for node in [self.root, *active]:
            if len(nxt) >= self.max_depth:
                break
            child = node.children.get(t)
            if child is None:
                child = node.children[t] = _Node()
                self.nodes += 1
            child.count += 1
            if child.ref != (n, end):
                child.prev, child.ref = child.ref, (n, end)
            nxt.append(child)
        active[:] = nxt[: self.max_depth - 1]

    def remove(self, key) -> None:
        n = self._ids.pop(key, None)
        if n is None:
            return
        seq, _ = self._seqs.pop(n)
        self.tokens -= len(seq)
        d = self.max_depth
        for start in range(len(seq)):
            node, path = self.root, []
            for t in seq[start:start + d]:
                if t < 0:
                    break
                child = node.children[t]
                path.append((node, t, child))
                node = child
            for parent, t, child in path:
                child.count -= 1
            for parent, t, child in reversed(path):
                if child.count == 0:
                    del parent.children[t]
                    self.nodes -= 1

    def _evict(self, keep: int) -> None:
        """Drop the oldest sequence other than `keep` (the one being written);
        if it is the only one, truncate nothing: its own cap bounds it."""
        for key, n in self._ids.items():
            if n != keep:
                self.remove(key)
                self.evicted += 1
                return
        # Only `keep` is left and it alone exceeds max_tokens: impossible, since
        # max_sequence_tokens <= max_tokens.

    # ---- reading ---------------------------------------------------------------

    def _copy_from(self, node: _Node) -> tuple[list[int], int] | None:
        """(sequence, position) where the tokens after the path's most recent
        continued occurrence are; None if no kept occurrence has a next token."""
        for ref in (node.ref, node.prev):
            if ref is not None and ref[0] in self._seqs:
                seq = self._seqs[ref[0]][0]
                if ref[1] < len(seq) and seq[ref[1]] >= 0:
                    return seq, ref[1]
        return None

    def match(self, context: Sequence[int]) -> tuple[_Node | None, int]:
        """(node, m): the longest suffix of `context` (m ≤ D tokens) that is a
        path with something after it (a child, or a kept occurrence to copy on from)."""
        for m in range(min(self.max_depth, len(context)), 0, -1):
            node = self.root
            for t in context[len(context) - m:]:
                node = node.children.get(t)
                if node is None:
                    break
            else:
                if node.children or self._copy_from(node) is not None:
                    return node, m
        return None, 0

    def propose(self, context: Sequence[int], max_tokens: int, factor: float = 1.0,
                offset: float = 0.0, min_prob: float = 0.1, fan_out: int = 0) -> Draft:
        """The draft after `context` (see the module docstring); empty if nothing matches."""
        node, m = self.match(context)
        if node is None or max_tokens < 1:
            return Draft([], 0.0, 0)
        limit = min(max_tokens, math.ceil(factor * m + offset))
        out: list[int] = []
        alts: list[list[int]] = []
        prob, score = 1.0, 0.0
        while len(out) < limit and node.children:
            ranked = sorted(node.children.items(), key=lambda kv: -kv[1].count)
            t, child = ranked[0]
            p = prob * child.count / max(node.count, child.count)
            if p < min_prob:
                break
            prob = p
            score += p
            out.append(t)
            alts.append([a for a, _ in ranked[1:1 + fan_out]] if fan_out else [])
            node = child
        src = self._copy_from(node) if len(out) < limit and prob >= min_prob \
            and not node.children else None
        if src is not None:
            # Past the trie's depth: copy what followed the path's last occurrence.
            seq, at = src
            for t in seq[at:at + limit - len(out)]:
                if t < 0:
                    break
                out.append(t)
                alts.append([])
                score += prob
        return Draft(out, prob if out else 0.0, m, alts, score)


@dataclasses.dataclass(frozen=True)
class DraftRule:
    """SuffixDecoding's knobs (SuffixConfig)."""

    max_tokens: int = 16  # longest draft
    factor: float = 1.0  # draft length ≤ factor · match length + offset
    offset: float = 0.0
    min_prob: float = 0.1  # stop the walk below this estimated probability
    fan_out: int = 0  # alternatives kept per drafted position


def best_draft(context: Sequence[int], indexes: Iterable[SuffixIndex], rule: DraftRule,
               max_tokens: int | None = None) -> Draft:
    """The highest-scoring draft over several indexes (a request's own, the fleet's)."""
    cap = rule.max_tokens if max_tokens is None else min(max_tokens, rule.max_tokens)
    best = Draft([], 0.0, 0)
    for ix in indexes:
        d = ix.propose(context, cap, rule.factor, rule.offset, rule.min_prob, rule.fan_out)
        if d.score > best.score:
            best = d
    return best
