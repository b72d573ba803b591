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
entry by key (a dictionary lookup) and compares only the tokens the row gained
since the last step (at most K + 1 in a verify step), so its cost is flat in
the context length. Token history confirms positions; it never finds requests:
a row whose key is unknown gets no drafts, and a draft learns the verified
tokens only of the entries it attached to.

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
(after the bounded wait) is given up: closed, and named to the caller to tell
its draft, whose messages for it in flight are then dropped quietly.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

# the book's error and update live with its entry (re-exported here)
from specserve.target.book_entry import (ALREADY_EXISTS, INVALID_ARGUMENT, NOT_FOUND,  # noqa: F401
                                         RESOURCE_EXHAUSTED, BookError, VerifiedUpdate, _Entry)
from specserve.target.book_stats import ACCEPTED, DRAFTLESS, FIRST, REJECTED, BookStats  # noqa: F401


class DraftBook:
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
    ):
        """release_after: give a request up once this many of its steps in a row
        found no drafts (SpeculationConfig.release_after_steps; 0: never)."""
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
        self.branch_tokens = 0  # in all entries
        self.stats = BookStats()
        # The same counters per stream (one stream: one draft replica).
        self.stream_stats: dict[Hashable, BookStats] = {}
        # Rows of the last propose() whose draft is drafting for them (their
        # last step verified drafts) but that got nothing: (row, key), for the
        # caller's bounded wait (see refill).
        self.misses: list[tuple[int, Hashable]] = []
        self._entries: dict[Hashable, _Entry] = {}
        # Given up (release_uncovered) and not yet closed by their draft: its
        # messages for them in flight are dropped quietly. Insertion-ordered, bounded.
        self._released: dict[Hashable, Hashable] = {}  # key -> the stream it had
        self._uncovered: list[Hashable] = []  # at release_after uncovered steps now

    # ---- messages from drafts -------------------------------------------------

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
        entry = _Entry(arr, k)
        entry.end = end if end > len(prompt) else None
        self._entries[key] = entry
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
        self.stream_stats.setdefault(stream, BookStats())
        entry.reported = min(max(known, entry.prompt_len), entry.verified)

    def open(self, key: Hashable, prompt: Sequence[int], k: int = 0, end: int = 0) -> None:
        """register and attach in one (tests, tools): keys (stream, request id)
        attach to their stream."""
        self.register(key, prompt, k, end)
        self.attach(key, key[0] if isinstance(key, tuple) and key else None)

    def extend(self, key: Hashable, position: int, tokens: Sequence[int],
               branches: Sequence[tuple[int, Sequence[int]]] = (),
               stream: Hashable = None) -> int:
        """Drafted tokens for positions [position, position + len(tokens)), and
        branches (fork position, [alternative token, continuation...]).

        The part that overlaps what the book already holds must agree with it:
        a draft built on another history (stale, or after a rejection the draft
        has not heard of yet) is dropped, its branches too. A branch must fork
        inside this message's window at a position not yet verified, with a
        token other than S's there. stream: the sender; a request attached to
        another stream (or to none) is unknown to it. Returns how many main
        tokens were added.
        """
        entry = self._entries.get(key)
        if entry is None or (stream is not None and entry.stream != stream):
            if key in self._released:
                return 0  # sent before the draft heard it was released
            raise BookError(NOT_FOUND, f"unknown request {_name(key)!r}: open it first")
        arr = self._checked_tokens(tokens)
        checked = [(int(fork), self._checked_tokens(bt)) for fork, bt in branches]
        self.stats.draft_messages += 1
        if checked:
            self._count(entry, "branch_messages", len(checked))
        if position < entry.prompt_len or position > entry.length:
            # Before the prompt's end is not a draft; past S's end is a gap.
            self.stats.stale_messages += 1
            self._count(entry, "branches_dropped", len(checked))
            return 0
        # Positions the target verified must agree: else the draft built on a
        # history the target has left.
        fixed = max(min(entry.verified - position, len(arr)), 0)
        if not np.array_equal(entry.tokens[position : position + fixed], arr[:fixed]):
            self.stats.stale_messages += 1
            self._count(entry, "branches_dropped", len(checked))
            return 0
        # Past them, the message is a draft for the same verified history, newer
        # than what the book holds: where they differ (the book took a branch
        # the draft did not, say) the message wins.
        overlap = min(entry.length - position, len(arr))
        differ = np.flatnonzero(entry.tokens[position + fixed : position + overlap]
                                != arr[fixed:overlap])
        if len(differ):
            cut = position + fixed + int(differ[0])
            entry.length = cut
            self.branch_tokens -= entry.drop_branches(lambda fork: fork >= cut)
            self.stats.rewritten_messages += 1
            overlap = cut - position
        room = entry.verified + self.max_pending - entry.length
        new = arr[overlap : overlap + max(room, 0)]
        if len(new):
            entry.put(entry.length, new)
            self.stats.draft_tokens_buffered += len(new)
        window_end = min(position + len(arr), entry.length)
        for fork, bt in checked:
            self._add_branch(entry, position, window_end, fork, bt)
        return len(new)

    def _add_branch(self, entry: _Entry, start: int, end: int, fork: int, bt: np.ndarray) -> None:
        bt = bt[: self.max_branch_len]
        ok = (len(bt) > 0 and max(start, entry.verified) <= fork < end
              and int(bt[0]) != int(entry.tokens[fork]))
        bkey = (fork, int(bt[0])) if len(bt) else None
        old = entry.branches.get(bkey) if ok else None
        grow = len(bt) - (len(old) if old is not None else 0)
        if ok and old is None and len(entry.branches) >= self.max_branches:
            ok = False  # a flood: the first max_branches stay
        if ok and self.branch_tokens + grow > self.max_branch_tokens:
            ok = False
        if not ok:
            self._count(entry, "branches_dropped")
            return
        entry.branches[bkey] = bt.copy()
        entry.branch_tokens += grow
        self.branch_tokens += grow
        self._count(entry, "branches_buffered")

    def _count(self, entry: _Entry, name: str, n: int = 1) -> None:
        setattr(self.stats, name, getattr(self.stats, name) + n)
        per = self.stream_stats.get(entry.stream)
        if per is None:
            per = self.stream_stats[entry.stream] = BookStats()
        setattr(per, name, getattr(per, name) + n)

    def stream_of(self, key: Hashable) -> Hashable:
        """The draft stream attached to a request (None: none, or unknown)."""
        entry = self._entries.get(key)
        return None if entry is None else entry.stream

    def pending(self, key: Hashable) -> int:
        """Drafted tokens past the verified position of a request (0 if unknown)."""
        entry = self._entries.get(key)
        return 0 if entry is None else entry.length - entry.verified

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
        self.branch_tokens -= entry.drop_branches()
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
        self.branch_tokens -= entry.drop_branches()
        entry.length = entry.verified
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

    def release_uncovered(self) -> list[tuple[Hashable, int]]:
        """Close the requests whose last release_after steps found no drafts (after
        the wait): drafts too late to verify only take the draft's time from the
        requests it keeps up with. They stay registered (the target's), detached
        from their draft. Returns (key, steps, stream) for the caller to tell."""
        out = []
        for key in self._uncovered:
            entry = self._entries.get(key)
            if entry is None or entry.uncovered < self.release_after:
                continue  # closed meanwhile, or the wait brought drafts
            out.append((key, entry.uncovered, entry.stream))
            self._count(entry, "released")
            self._released[key] = entry.stream
            self.detach(key)
            if len(self._released) > self.max_requests:
                del self._released[next(iter(self._released))]
        self._uncovered = []
        return out

    def sequence(self, key: Hashable) -> tuple[list[int], int]:
        """(S, len(V)) of a request, for tests and debugging."""
        entry = self._entries[key]
        return entry.seq().tolist(), entry.verified

    # ---- the engine step ------------------------------------------------------

    def propose(
        self,
        histories: Sequence[np.ndarray],
        k: int,
        max_advance: int,
        active: Sequence[bool] | None = None,
        keys: Sequence[Hashable | None] | None = None,
    ) -> tuple[list[list[int]], list[VerifiedUpdate]]:
        """Drafts for each batch row, and the verified tokens to report.

        histories[i]: row i's token history (prompt + verified output), 1-D ints.
        keys[i]: the request row i serves, as registered (None: unknown, no drafts).
        k: at most this many drafted tokens per row.
        max_advance: the most tokens a row can gain in one step (k + 1); a row
        that gained more (the target ran on without this book) is taken as is.
        active[i]: False for rows that sampled nothing this step (partial
        prefill); they get no draft and update nothing.
        """
        proposals: list[list[int]] = [[] for _ in histories]
        updates: list[VerifiedUpdate] = []
        self.misses = []
        self._uncovered = []
        entries = self._entries
        for i, h in enumerate(histories):
            if (active is not None and not active[i]) or keys is None:
                continue
            self.stats.rows_seen += 1
            key = keys[i]
            entry = entries.get(key) if key is not None else None
            if entry is None or len(h) < entry.verified:
                continue  # unknown, or not this request's row (a stale key)
            self.stats.rows_matched += 1
            proposals[i] = self._advance(entry, h, k)
            if entry.stream is None:
                proposals[i] = []  # no draft attached: nothing to propose or report
                continue
            if entry.end is not None and len(h) >= entry.end:
                # The request's output is complete: the row is finishing (vLLM
                # proposes for it in the step that ends it), not a step that
                # drafts could help or that is worth waiting for.
                proposals[i] = []
            else:
                self._note_proposal(key, entry, len(h), proposals[i])
                if not proposals[i] and entry.last_outcome in (REJECTED, ACCEPTED):
                    # The draft is drafting for this row but nothing is here (it
                    # has not heard of the rejection yet, or fell behind): the
                    # bounded wait may hold the step for it.
                    self.misses.append((i, key))
            if entry.verified > entry.reported:
                start = entry.reported
                updates.append(VerifiedUpdate(key, start, entry.tokens[start : entry.verified].tolist(),
                                              entry.stream))
                entry.reported = entry.verified
        return proposals, updates

    def refill(self, histories: Sequence[np.ndarray], k: int) -> dict[int, list[int]]:
        """Proposals for the rows of the last propose()'s misses whose drafts
        have arrived since (the bounded wait); {row: tokens}. Changes no
        verified position: it only reads what arrived for the same history."""
        out: dict[int, list[int]] = {}
        for i, key in self.misses:
            entry = self._entries.get(key)
            h = histories[i]
            n = len(h)
            if entry is None or entry.verified != n or entry.length <= n:
                continue
            kk = min(k, entry.k) if entry.k else k
            tokens = entry.tokens[n : min(entry.length, n + kk)].tolist()
            if not tokens:
                continue
            out[i] = tokens
            entry.uncovered = 0
            self.stats.rows_with_proposals += 1
            self.stats.proposed_tokens += len(tokens)
            self._count(entry, f"covered_after_{entry.last_outcome}")
            self._count(entry, "wait_hits")
            entry.last_start, entry.last_proposal = n, tokens
        self.misses = []
        return out

    def _note_proposal(self, key: Hashable, entry: _Entry, n: int, proposal: list[int]) -> None:
        """Count this step's proposal against how the request's last step ended."""
        outcome = entry.last_outcome
        if outcome != FIRST:
            self._count(entry, f"steps_after_{outcome}")
            if proposal:
                self._count(entry, f"covered_after_{outcome}")
        if not proposal and outcome in (REJECTED, ACCEPTED):
            self._count(entry, "wait_rows")
        if proposal:
            self.stats.rows_with_proposals += 1
            self.stats.proposed_tokens += len(proposal)
        entry.uncovered = 0 if proposal else entry.uncovered + 1
        if self.release_after and entry.uncovered >= self.release_after:
            self._uncovered.append(key)
        entry.last_start, entry.last_proposal = n, proposal

    # ---- internals ------------------------------------------------------------

    def _checked_tokens(self, tokens: Sequence[int]) -> np.ndarray:
        arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if len(arr) and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = int(arr[(arr < 0) | (arr >= self.vocab_size)][0])
            raise BookError(
                INVALID_ARGUMENT,
                f"token id {bad} is outside the target vocabulary [0, {self.vocab_size})",
            )
        return arr

    def _advance(self, entry: _Entry, h: np.ndarray, k: int) -> list[int]:
        """Row h is entry's request, its history at least V long: move V to len(h).
        Only the tokens past V are read (at most K + 1 in a verify step).

        Where h leaves S (a rejection), a branch forking there with h's token
        becomes S (a hit); otherwise S restarts from h."""
        n = len(h)
        self._judge_last(entry, h)
        v = entry.verified
        if n > v:
            have = min(entry.length, n)
            diff = np.flatnonzero(entry.tokens[v:have] != h[v:have])
            if len(diff):
                p = v + int(diff[0])
                # The target decided a drafted position otherwise (a proposed
                # token, or the one after them: the bonus): a rejection.
                entry.last_outcome = REJECTED
                branch = entry.branches.get((p, int(h[p])))
                # all forked at or before p, or off the old S
                self.branch_tokens -= entry.drop_branches()
                hit = branch is not None and len(branch) >= n - p and np.array_equal(
                    branch[: n - p], h[p:n])
                if hit:
                    entry.put(p, branch[: n - p + self.max_pending])
                    self._count(entry, "branch_hits")
                else:
                    entry.put(v, np.asarray(h[v:n], dtype=np.int64))
            elif entry.length < n:
                # The target ran past the drafts: S is h.
                entry.put(v, np.asarray(h[v:n], dtype=np.int64))
            entry.verified = n
            self.branch_tokens -= entry.drop_branches(lambda fork: fork < n)
        if entry.k:
            k = min(k, entry.k)
        return entry.tokens[n : min(entry.length, n + k)].tolist()

    def _judge_last(self, entry: _Entry, h: np.ndarray) -> None:
        """How the request's last verify step ended, from its new history."""
        start, prop = entry.last_start, entry.last_proposal
        n = len(h)
        if start < 0 or n <= start:
            return  # first step, or the row did not advance (outcome unchanged)
        if not prop:
            entry.last_outcome = DRAFTLESS
            return
        # Every step emits the accepted tokens and one of the target's own, so
        # the row gained accepted + 1 tokens; the token after the accepted ones
        # differs from ours exactly when the target rejected it (vLLM may also
        # have verified fewer than we proposed: then nothing was rejected).
        got = h[start : min(n, start + len(prop))]
        same = np.asarray(prop[: len(got)]) == got
        matched = int(np.argmin(np.append(same, False)))
        accepted = min(n - start - 1, matched)
        self._count(entry, "verified_steps")
        self._count(entry, "accepted_tokens", accepted)
        self._count(entry, "alpha_trials", min(accepted + 1, len(prop)))
        rejected = accepted < len(prop) and matched == accepted
        entry.last_outcome = REJECTED if rejected else ACCEPTED
        entry.last_start, entry.last_proposal = -1, []


def _name(key: Hashable) -> str:
    """A key's request id, for messages (keys may be (stream, request id))."""
    return str(key[-1] if isinstance(key, tuple) and key else key)
