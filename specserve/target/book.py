"""The draft book: drafts buffered at the target, and their matching to batch rows.

Owns, for every request a draft has opened at this target: the speculative
sequence S (prompt + verified tokens + drafted tokens not yet verified) and the
verified length V (how much of S the target has confirmed). It decides which
drafted tokens to propose for each row of the target's batch and which verified
tokens to report back to each draft.

Pure logic: no threads, no gRPC, no vLLM. The caller (the sink) serialises access.

Matching. Every row of the engine batch names its request (vLLM's input batch
knows each row's request id; the proposer hands the book that key, or None for
a row it does not know). The target registers each request before its first
step (`register`: prompt, K, end), so the entry is the target's; a draft can
only `attach` to a registered entry and extend it. A step finds each row's
entry by key (a dictionary lookup, redone only when the batch's rows change)
and compares only the tokens the row gained since the last step (at most K + 1
in a verify step), so its cost is flat in the context length; the step works on
all rows at once over the store's arrays (specserve/target/book_store.py), with
no Python loop per row. Token history confirms positions; it never finds
requests: a row whose key is unknown gets no drafts, and a draft learns the
verified tokens only of the entries it attached to. The book holds the last W
positions of each S (the store's ring), not the whole history: a draft window
that starts before them is stale.

Branches (the speculation cache). Besides S, a draft may send branches: a
branch forks at a drafted position p of S with an alternative token there, then
its continuation; it stands for the outcome "the target rejects S[p] and samples
that token". A row whose history left S at p with the token of a branch takes
the branch as its S (a hit) and is proposed the branch's continuation at once,
instead of waiting a step for the draft to hear of the rejection. A branch is a
hint like everything else: at worst its tokens are rejected. Branches fork from
S only (no branch of a branch); they are dropped as soon as their position is
verified or S changes before them.

Acceptance, exactly. The book remembers what it proposed to each request at the
last step; the next history says how many of those tokens the target accepted.
So it counts the conditional acceptance without assuming full windows (vLLM's
per-position counters cannot tell a short window from a rejection), and, per
step, whether the step before was a rejection, an accepted window or draftless:
coverage after each, and the branch hit rate.

Bounds. Each request holds at most `max_pending` drafted tokens past its verified
position and at most `max_branches` branches of at most `max_branch_len` tokens;
the book holds at most `max_requests` requests and `max_branch_tokens` branch
tokens in all (branches past a bound are dropped and counted); token ids must
lie in [0, vocab_size). Breaking a bound raises BookError with a gRPC-style code; the
sink turns it into a per-request error or ends the stream.

Release. A request whose last `release_after` steps in a row found no drafts
(after the bounded wait) is given up: detached from its draft (it stays the
target's), and named to the caller to tell the draft, whose messages for it in
flight are then dropped quietly.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from specserve.target import book_store as st
# the book's error and updates live with its entry (re-exported here)
from specserve.target.book_entry import (ALREADY_EXISTS, INVALID_ARGUMENT, NOT_FOUND,  # noqa: F401
                                         RESOURCE_EXHAUSTED, BookError, Verified,  # noqa: F401
                                         VerifiedUpdate, _Entry, _name)  # noqa: F401
from specserve.target.book_ingest import WindowIngest
from specserve.target.book_stats import ACCEPTED, DRAFTLESS, FIRST, REJECTED, BookStats  # noqa: F401
from specserve.target.book_step import EngineStep


class DraftBook(WindowIngest, EngineStep):
    def __init__(
        self,
        vocab_size: int,
        max_requests: int = 4096,
        max_pending: int = 64,
        max_prompt_len: int = 1 << 20,
        max_branches: int = 32,
        max_branch_len: int = 16,
        max_branch_tokens: int = 1 << 18,
        release_after: int = 0,
        max_gain: int = 17,
    ):
        """release_after: give a request up once this many of its steps in a row
        found no drafts (SpeculationConfig.release_after_steps; 0: never).
        max_gain: the most tokens a row gains in a step on the fast path (K + 1
        for any K up to 16); a bigger gain (a row the book lost sight of) takes
        the row's history as S."""
        if vocab_size < 1 or max_requests < 1 or max_pending < 1:
            raise ValueError("vocab_size, max_requests and max_pending must be >= 1")
        if max_branches < 0 or max_branch_len < 1 or max_branch_tokens < 0:
            raise ValueError("max_branches, max_branch_tokens must be >= 0, max_branch_len >= 1")
        self.vocab_size = vocab_size
        self.max_requests = max_requests
        self.max_pending = max_pending
        self.max_prompt_len = max_prompt_len
        self.max_branches = max_branches
        self.max_branch_len = max_branch_len
        self.max_branch_tokens = max_branch_tokens
        self.release_after = release_after
        self.store = st.SlotStore(max_requests, max_pending, max_gain, max_branches,
                                  max_branch_len)
        self.branch_tokens = 0  # in all entries
        self.stats = BookStats()
        # The same counters per stream (one stream: one draft replica).
        self.stream_stats: dict[Hashable, BookStats] = {}
        # Rows of the last propose() whose draft is drafting for them (their
        # last step verified drafts) but that got nothing: (row, key), for the
        # caller's bounded wait (see refill).
        self.misses: list[tuple[int, Hashable]] = []
        self._entries: dict[Hashable, _Entry] = {}
        self._key_of: list[Hashable] = [None] * max_requests  # slot -> key
        # Given up (release_uncovered) and not yet closed by their draft: its
        # messages for them in flight are dropped quietly. Insertion-ordered, bounded.
        self._released: dict[Hashable, Hashable] = {}  # key -> the stream it had
        self._uncovered: list[Hashable] = []  # at release_after uncovered steps now
        self._stream_index: dict[Hashable, int] = {None: 0}  # stream -> its store index
        self._streams: list[Hashable] = [None]
        self._rows_cache: tuple = (None, None, -1)  # (keys, their slots, epoch)
        self._epoch = 0  # bumped when a key's slot changes

    # ---- messages from the target and from drafts --------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def register(self, key: Hashable, prompt: Sequence[int], k: int = 0, end: int = 0) -> None:
        """The target's registration of a request (before its first step): its
        prompt, its own K (0: the caller's) and where its output ends (prompt +
        max_tokens; 0: unknown). The entry is the target's until `unregister`."""
        self._released.pop(key, None)
        if key in self._entries:
            raise BookError(ALREADY_EXISTS, f"request {_name(key)!r} is already registered")
        if len(self._entries) >= self.max_requests:
            raise BookError(
                RESOURCE_EXHAUSTED,
                f"too many open requests ({self.max_requests}); close finished requests first",
            )
        if not 0 < len(prompt) <= self.max_prompt_len:
            raise BookError(
                INVALID_ARGUMENT,
                f"prompt must have 1..{self.max_prompt_len} tokens, got {len(prompt)}",
            )
        arr = self._checked_tokens(prompt)
        slot = self.store.take(arr, k, end if end > len(arr) else 0)
        self._entries[key] = _Entry(self.store, slot, len(arr))
        self._key_of[slot] = key
        self._epoch += 1
        self.stats.opened += 1

    def attach(self, key: Hashable, stream: Hashable, known: int = 0) -> None:
        """A draft stream takes up a registered request (the caller checked that
        it may). known: how much of the request's history the draft has (its
        verified position; 0: the prompt): verified updates resume from there."""
        entry = self._entries.get(key)
        if entry is None:
            raise BookError(NOT_FOUND, f"unknown request {_name(key)!r}")
        if entry.stream is not None and entry.stream != stream:
            raise BookError(ALREADY_EXISTS, f"request {_name(key)!r} has a draft already")
        self._released.pop(key, None)
        entry.stream = stream
        s = entry.slot
        self.store.stream[s] = self._index_of(stream)
        self.stream_stats.setdefault(stream, BookStats())
        self.store.reported[s] = min(max(known, entry.prompt_len), int(self.store.V[s]))

    def open(self, key: Hashable, prompt: Sequence[int], k: int = 0, end: int = 0) -> None:
        """register and attach in one (tests, tools): keys (stream, request id)
        attach to their stream."""
        self.register(key, prompt, k, end)
        self.attach(key, key[0] if isinstance(key, tuple) and key else None)

    def _count(self, entry: _Entry, name: str, n: int = 1) -> None:
        setattr(self.stats, name, getattr(self.stats, name) + n)
        per = self.stream_stats.get(entry.stream)
        if per is None:
            per = self.stream_stats[entry.stream] = BookStats()
        setattr(per, name, getattr(per, name) + n)

    def attached(self) -> int:
        """Registered requests a draft stream is attached to."""
        return int(np.count_nonzero(self.store.stream))

    def stream_of(self, key: Hashable) -> Hashable:
        """The draft stream attached to a request (None: none, or unknown)."""
        entry = self._entries.get(key)
        return None if entry is None else entry.stream

    def pending(self, key: Hashable) -> int:
        """Drafted tokens past the verified position of a request (0 if unknown)."""
        entry = self._entries.get(key)
        return 0 if entry is None else entry.length - entry.verified

    def answered(self, key: Hashable, k: int) -> bool:
        """Nothing to wait for: the request has the most tokens a step can
        propose it (`want`), its draft said it has nothing more for now (a
        DraftBatch's done, for the history the book holds), or it is unknown."""
        entry = self._entries.get(key)
        if entry is None:
            return True
        s = entry.slot
        return (entry.length - entry.verified >= self.want(key, k)
                or self.store.done[s] == self.store.L[s])

    def want(self, key: Hashable, k: int) -> int:
        """The most tokens a request can be proposed per step: k, or its own K."""
        entry = self._entries.get(key)
        return 0 if entry is None else (min(k, entry.k) if entry.k else k)

    def unregister(self, key: Hashable) -> bool:
        """The target is done with a request (finished, aborted): forget it."""
        self._released.pop(key, None)
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.branch_tokens -= self.store.drop_branches(entry.slot)
        self.store.give_back(entry.slot)
        self._key_of[entry.slot] = None
        self._epoch += 1
        self.stats.closed += 1
        return True

    close = unregister

    def detach(self, key: Hashable, stream: Hashable = None) -> bool:
        """A draft stops drafting a request (its close, its stream gone, a
        release): its drafts and branches go; the verified history stays, for
        a draft that attaches again."""
        entry = self._entries.get(key)
        if entry is None or entry.stream is None or (stream is not None and entry.stream != stream):
            return False
        s = entry.slot
        self.branch_tokens -= self.store.drop_branches(s)
        self.store.L[s] = self.store.V[s]
        self.store.done[s] = -1
        self.store.stream[s] = 0
        entry.stream = None
        return True

    def close_all(self, stream_id: Hashable) -> int:
        """Detach every request of a stream (it broke or closed)."""
        keys = [k for k, e in self._entries.items() if e.stream == stream_id]
        for k in keys:
            self.detach(k)
        for k in [k for k in self._released if self._released[k] == stream_id]:
            del self._released[k]
        return len(keys)

    def release_uncovered(self) -> list[tuple[Hashable, int, Hashable]]:
        """Detach the requests whose last release_after steps found no drafts
        (after the wait): drafts too late to verify only take the draft's time
        from the requests it keeps up with. They stay registered (the
        target's). Returns (key, steps, stream) for the caller to tell."""
        out = []
        for key in self._uncovered:
            entry = self._entries.get(key)
            if entry is None or entry.stream is None \
                    or self.store.uncovered[entry.slot] < self.release_after:
                continue  # closed meanwhile, or the wait brought drafts
            out.append((key, int(self.store.uncovered[entry.slot]), entry.stream))
            self._count(entry, "released")
            self._released[key] = entry.stream
            self.detach(key)
            if len(self._released) > self.max_requests:
                del self._released[next(iter(self._released))]
        self._uncovered = []
        return out

    def sequence(self, key: Hashable) -> tuple[list[int], int]:
        """(S, len(V)) of a request, for tests and debugging: S as far as the
        ring holds it (all of it while it is shorter than the ring)."""
        entry = self._entries[key]
        return self.store.sequence(entry.slot).tolist(), entry.verified
    # ---- internals ------------------------------------------------------------

    def _add(self, name: str, sidx: np.ndarray, values: np.ndarray) -> None:
        """Add per-row counts (bools or non-negative ints) to a counter, in all
        and per stream. (Called a dozen times a step: numpy's bincount with
        weights costs tens of microseconds, so it is avoided.)"""
        values = np.asarray(values)
        flags = values.dtype == bool
        total = int(np.count_nonzero(values)) if flags else int(values.sum())
        if not total:
            return
        setattr(self.stats, name, getattr(self.stats, name) + total)
        first = int(sidx[0])
        if (sidx == first).all():  # one stream: the usual case
            per = [(first, total)]
        else:
            counts = np.bincount(sidx[values] if flags else np.repeat(sidx, values))
            per = [(i, int(counts[i])) for i in np.flatnonzero(counts).tolist()]
        for i, count in per:
            stream = self._streams[i]
            stats = self.stream_stats.get(stream)
            if stats is None:
                stats = self.stream_stats[stream] = BookStats()
            setattr(stats, name, getattr(stats, name) + count)

    def _index_of(self, stream: Hashable) -> int:
        i = self._stream_index.get(stream)
        if i is None:
            i = self._stream_index[stream] = len(self._streams)
            self._streams.append(stream)
        return i

    def _checked_tokens(self, tokens: Sequence[int]) -> np.ndarray:
        arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if len(arr) and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = int(arr[(arr < 0) | (arr >= self.vocab_size)][0])
            raise BookError(
                INVALID_ARGUMENT,
                f"token id {bad} is outside the target vocabulary [0, {self.vocab_size})",
            )
        return arr
