"""The draft book's store: every registered request's hot state in slot arrays.

Owns the arrays one engine step reads and writes for all its rows at once
(numpy, no Python loop per row): per slot (one registered request) its
verified length V, the length L of its speculative sequence S, where its
verified updates resume, its last proposal, how its last verify step ended,
its own K and end, its own recent acceptance, the stream it is attached to;
the tail of S in a ring of W positions (position p lives at column p mod W,
so S[L - W : L] is held: the drafts past V and the verified tokens just
before them); and its branches (fork position, tokens) in fixed-size tables.

Pure: no threads, no gRPC, no vLLM; the book (specserve/target/book.py) decides
what to write. Memory is fixed at construction: slots x (W + branches x
branch length) token ids.
"""

from __future__ import annotations

import numpy as np

# How a request's last verify step ended (codes of specserve.target.book_stats' names).
FIRST, ACCEPTED, REJECTED, DRAFTLESS = 0, 1, 2, 3
OUTCOME_NAMES = ("first", "accepted", "rejected", "draftless")


def ring_width(max_pending: int, max_gain: int) -> int:
    """The smallest power of two holding max_pending drafts past V and a
    step's gain before V moves."""
    w = 64
    while w < max_pending + max_gain + 2:
        w *= 2
    return w


class SlotStore:
    def __init__(self, slots: int, max_pending: int, max_gain: int, max_branches: int,
                 max_branch_len: int):
        self.W = ring_width(max_pending, max_gain)
        self.max_gain = max_gain  # a step's gain past this goes the slow way
        c = slots
        self.V = np.zeros(c, np.int64)  # verified length (prompt + verified output)
        self.L = np.zeros(c, np.int64)  # len(S)
        self.reported = np.zeros(c, np.int64)  # verified updates resume here
        self.last_start = np.full(c, -1, np.int64)  # len(H) when it was last proposed to
        self.last_len = np.zeros(c, np.int64)  # ... how many tokens ...
        self.last = np.zeros((c, max_pending), np.int32)  # ... and which
        self.outcome = np.zeros(c, np.int8)  # FIRST ...
        self.uncovered = np.zeros(c, np.int64)  # steps in a row without drafts
        # len(S) when the draft said it had nothing more (-1: it did not); the
        # draft is done only while this equals L
        self.done = np.full(c, -1, np.int64)
        self.own_k = np.zeros(c, np.int64)  # its own K (0: the step's)
        # its proposals' recent verify outcomes (its own α: accepted / trials,
        # each step's weighing RECENT of the one before), the steps that
        # verified or skipped one, and the K it got last step
        self.accepted = np.zeros(c, np.float64)
        self.trials = np.zeros(c, np.float64)
        self.steps = np.zeros(c, np.int64)
        self.cap = np.zeros(c, np.int64)
        self.end = np.zeros(c, np.int64)  # where its output ends (0: unknown)
        self.stream = np.zeros(c, np.int32)  # the attached stream's index (0: none)
        self.ring = np.zeros((c, self.W), np.int32)  # S[p] at column p % W
        mb = max(max_branches, 1)
        self.fork = np.full((c, mb), -1, np.int64)  # a branch's fork position (-1: none)
        self.blen = np.zeros((c, mb), np.int64)  # ... its length
        self.btok = np.zeros((c, mb, max_branch_len), np.int32)  # ... its tokens
        self.nbranch = np.zeros(c, np.int64)
        self._free = list(range(c - 1, -1, -1))

    # ---- slots --------------------------------------------------------------------

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, prompt: np.ndarray, k: int, end: int) -> int:
        s = self._free.pop()
        n = len(prompt)
        self.V[s] = self.L[s] = self.reported[s] = n
        self.last_start[s], self.last_len[s] = -1, 0
        self.outcome[s], self.uncovered[s], self.done[s] = FIRST, 0, -1
        self.own_k[s], self.end[s], self.stream[s] = k, end, 0
        self.accepted[s] = self.trials[s] = self.steps[s] = self.cap[s] = 0
        self.write(s, max(0, n - self.W), prompt[max(0, n - self.W):])
        self.drop_branches(s)
        return s

    def give_back(self, s: int) -> None:
        self.drop_branches(s)
        self.stream[s] = 0
        self._free.append(s)

    # ---- S, in the ring -----------------------------------------------------------

    def held_from(self, s: int) -> int:
        """The first position of S the ring still holds."""
        return max(0, int(self.L[s]) - self.W)

    def read(self, s: int, start: int, end: int) -> np.ndarray:
        """S[start:end]; the caller keeps start >= held_from(s)."""
        return self.ring[s, np.arange(start, end) % self.W]

    def write(self, s: int, start: int, values) -> None:
        """S[start:] = values (S ends after them)."""
        values = np.asarray(values)
        if len(values) > self.W:
            start, values = start + len(values) - self.W, values[-self.W:]
        self.ring[s, np.arange(start, start + len(values)) % self.W] = values
        self.L[s] = start + len(values)

    def sequence(self, s: int) -> np.ndarray:
        return self.read(s, self.held_from(s), int(self.L[s]))

    # ---- branches -----------------------------------------------------------------

    def branch_tokens(self, s: int | None = None) -> int:
        lens = self.blen if s is None else self.blen[s]
        return int(lens.sum())

    def branches(self, s: int) -> dict[tuple[int, int], np.ndarray]:
        """{(fork, alternative token): tokens} of one slot (tests, messages)."""
        out = {}
        for b in np.flatnonzero(self.fork[s] >= 0):
            n = int(self.blen[s, b])
            out[(int(self.fork[s, b]), int(self.btok[s, b, 0]))] = self.btok[s, b, :n].copy()
        return out

    def find_branch(self, s: int, fork: int, token: int) -> int:
        hit = np.flatnonzero((self.fork[s] == fork) & (self.btok[s, :, 0] == token))
        return int(hit[0]) if len(hit) else -1

    def put_branch(self, s: int, b: int, fork: int, tokens: np.ndarray) -> None:
        """Store a branch in column b (-1: a free one; the caller checked there is)."""
        if b < 0:
            b = int(np.flatnonzero(self.fork[s] < 0)[0])
            self.nbranch[s] += 1
        self.fork[s, b] = fork
        self.blen[s, b] = len(tokens)
        self.btok[s, b, : len(tokens)] = tokens

    def drop_branches(self, s, before=None, since=None) -> int:
        """Drop a slot's branches (or those forking before `before`, or at or
        after `since`); the tokens they held. s, before: a slot and a position,
        or arrays of them."""
        if np.ndim(s) == 0 and self.nbranch[s] == 0:
            return 0  # the usual case
        forks = self.fork[s]
        gone = forks >= 0
        if before is not None:
            gone &= forks < (np.asarray(before)[:, None] if np.ndim(s) else before)
        if since is not None:
            gone &= forks >= (np.asarray(since)[:, None] if np.ndim(s) else since)
        n = int(self.blen[s][gone].sum())
        if gone.any():
            self.fork[s] = np.where(gone, -1, forks)
            self.blen[s] = np.where(gone, 0, self.blen[s])
            self.nbranch[s] = (self.fork[s] >= 0).sum(axis=-1)
        return n
