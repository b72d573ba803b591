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
                                         RESOURCE_EXHAUSTED, BookError, Verified, VerifiedUpdate,
                                         _Entry)
from specserve.target.book_stats import ACCEPTED, DRAFTLESS, FIRST, REJECTED, BookStats  # noqa: F401

_OUTCOMES = ((st.ACCEPTED, ACCEPTED), (st.REJECTED, REJECTED), (st.DRAFTLESS, DRAFTLESS))


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

    def extend(self, key: Hashable, position: int, tokens: Sequence[int],
               branches: Sequence[tuple[int, Sequence[int]]] = (),
               stream: Hashable = None) -> int:
        """Drafted tokens for positions [position, position + len(tokens)), and
        branches (fork position, [alternative token, continuation...]): a batch
        of one (`extend_batch`). Raises its BookError; returns how many main
        tokens were added."""
        bcounts = [len(bt) for _, bt in branches]
        added, errors = self.extend_batch(
            stream, [key], [position], [len(tokens)], list(tokens),
            branch_of=[0] * len(branches), forks=[f for f, _ in branches], bcounts=bcounts,
            btokens=[t for _, bt in branches for t in bt])
        if errors:
            raise errors[0][1]
        return int(added[0])

    def extend_batch(self, stream: Hashable, keys: Sequence[Hashable], positions, counts, tokens,
                     branch_of=(), forks=(), bcounts=(), btokens=()) -> tuple[np.ndarray, list]:
        """Drafted windows for many requests at once (a DraftBatch), packed:
        entry i is keys[i]'s window at positions [positions[i], positions[i] +
        counts[i]), its tokens the next counts[i] of `tokens`; branch j belongs
        to entry branch_of[j], forks at forks[j], its tokens the next
        bcounts[j] of `btokens` ([alternative token, continuation...]).

        Each window overlapping what the book holds must agree with it: one
        built on another history (stale, or after a rejection the draft has not
        heard of yet) is dropped, its branches too. Past the verified
        positions the newer window wins where they differ. A branch must fork
        inside its window at a position not yet verified, with a token other
        than S's there. stream: the sender (None: any); a request attached to
        another stream (or to none) is unknown to it. Returns (main tokens
        added per entry, [(key, BookError)] for the entries refused).
        """
        n = len(keys)
        added = np.zeros(n, np.int64)
        positions = np.asarray(positions, np.int64).reshape(-1)
        counts = np.asarray(counts, np.int64).reshape(-1)
        tokens = np.asarray(tokens, np.int64).reshape(-1)
        branch_of = np.asarray(branch_of, np.int64).reshape(-1)
        forks = np.asarray(forks, np.int64).reshape(-1)
        bcounts = np.asarray(bcounts, np.int64).reshape(-1)
        btokens = np.asarray(btokens, np.int64).reshape(-1)
        if (len(positions) != n or len(counts) != n or (counts < 0).any()
                or counts.sum() != len(tokens) or len(forks) != len(branch_of)
                or len(bcounts) != len(branch_of) or (bcounts < 0).any()
                or bcounts.sum() != len(btokens) or (len(branch_of) and (
                    branch_of.min() < 0 or branch_of.max() >= n))
                or len(set(keys)) != n):
            raise BookError(INVALID_ARGUMENT, "malformed draft batch: its arrays do not add up "
                                              "(or it names a request twice)")
        errors: list = []
        store, W = self.store, self.store.W
        # Whose windows these are; bad token ids refuse the entry's whole window.
        bad = _bad_entries(tokens, counts, n, self.vocab_size)
        bad |= _bad_entries(btokens, bcounts, n, self.vocab_size, branch_of)
        slots = np.full(n, -1, np.int64)
        sidx = np.zeros(n, np.int64)
        prompt = np.zeros(n, np.int64)
        for i, key in enumerate(keys):
            entry = self._entries.get(key)
            if entry is None or (stream is not None and entry.stream != stream):
                if key not in self._released:  # else sent before it heard: dropped quietly
                    errors.append((key, BookError(NOT_FOUND,
                                                  f"unknown request {_name(key)!r}: open it first")))
                continue
            if bad[i]:
                errors.append((key, _vocab_error(tokens, counts, btokens, bcounts, branch_of, i,
                                                 self.vocab_size)))
                continue
            slots[i], sidx[i], prompt[i] = entry.slot, store.stream[entry.slot], entry.prompt_len
        live = slots >= 0
        nbr = np.bincount(branch_of, minlength=n) if len(branch_of) else np.zeros(n, np.int64)
        self.stats.draft_messages += int(live.sum())
        self._add("branch_messages", sidx[live], nbr[live])
        ei = np.flatnonzero(live)
        if not len(ei):
            return added, errors
        s, pos, cnt = slots[ei], positions[ei], counts[ei]
        V, L = store.V[s], store.L[s].copy()
        # Before the prompt's end is not a draft; past S's end is a gap; before
        # what the book holds, a window long overtaken.
        stale = (pos < np.maximum(prompt[ei], L - W)) | (pos > L)
        width = max(int(cnt.max()), 1)
        j = np.arange(width)
        start = (np.cumsum(counts) - counts)[ei]
        mine = j < cnt[:, None]
        win = tokens[np.minimum(start[:, None] + j, max(len(tokens) - 1, 0))] if len(tokens) \
            else np.zeros((len(ei), width), np.int64)
        held = store.ring[s[:, None], (np.maximum(pos, 0)[:, None] + j) & (W - 1)]
        differ = (win != held) & mine
        # Positions the target verified must agree: else the draft built on a
        # history the target has left.
        fixed = np.clip(V - pos, 0, cnt)
        stale |= (differ & (j < fixed[:, None])).any(1)
        self.stats.stale_messages += int(stale.sum())
        self._add("branches_dropped", sidx[ei], np.where(stale, nbr[ei], 0))
        # Past them, the message is a draft for the same verified history,
        # newer than what the book holds: where they differ (the book took a
        # branch the draft did not, say) the message wins.
        overlap = np.clip(L - pos, 0, cnt)
        newer = differ & (j >= fixed[:, None]) & (j < overlap[:, None]) & ~stale[:, None]
        cut = newer.any(1)
        if cut.any():
            at = pos[cut] + newer[cut].argmax(1)
            L[cut] = at
            overlap[cut] = at - pos[cut]
            self.branch_tokens -= store.drop_branches(s[cut], since=at)
            self.stats.rewritten_messages += int(cut.sum())
        room = np.clip(V + self.max_pending - L, 0, None)
        take = np.where(stale, 0, np.clip(np.minimum(cnt - overlap, room), 0, None))
        put = (j >= overlap[:, None]) & (j < (overlap + take)[:, None])
        store.ring[np.broadcast_to(s[:, None], put.shape)[put],
                   ((pos[:, None] + j) & (W - 1))[put]] = win[put]
        store.L[s] = np.where(stale, store.L[s], L + take)
        added[ei] = take
        self.stats.draft_tokens_buffered += int(take.sum())
        if len(branch_of):
            window_end = np.minimum(pos + cnt, store.L[s])
            entry_row = np.full(n, -1, np.int64)
            entry_row[ei] = np.arange(len(ei))
            row = entry_row[branch_of]
            keep = row >= 0
            keep[keep] = ~stale[row[keep]]
            self._add_branches(s, pos, window_end, sidx[ei], row[keep], forks[keep],
                               bcounts[keep], btokens, (np.cumsum(bcounts) - bcounts)[keep])
        return added, errors

    def _add_branches(self, s, pos, window_end, sidx, row, forks, bcounts, btokens, bstart) -> None:
        """Branches of the live windows (row: the window of each)."""
        if not len(row):
            return
        store, W = self.store, self.store.W
        mbl = self.max_branch_len
        bs = s[row]
        bl = np.minimum(bcounts, mbl)
        j = np.arange(mbl)
        bt = btokens[np.minimum(bstart[:, None] + j, max(len(btokens) - 1, 0))] \
            if len(btokens) else np.zeros((len(row), mbl), np.int64)
        first = bt[:, 0]
        ok = (bl > 0) & (np.maximum(pos[row], store.V[bs]) <= forks) & (forks < window_end[row])
        ok &= first != store.ring[bs, forks & (W - 1)]
        same = (store.fork[bs] == forks[:, None]) & (store.btok[bs, :, 0] == first[:, None])
        exists = same.any(1)
        col = same.argmax(1)
        grow = bl - np.where(exists, store.blen[bs, col], 0)
        # A new branch takes the next free column of its slot, in order; a
        # flood past max_branches per request is dropped (the first ones stay).
        new = ok & ~exists
        if new.any():
            ni = np.flatnonzero(new)
            order = ni[np.argsort(bs[ni], kind="stable")]
            group_start = np.r_[0, np.flatnonzero(np.diff(bs[order])) + 1]
            rank = np.arange(len(order)) - np.repeat(group_start, np.diff(np.r_[group_start,
                                                                                len(order)]))
            free = store.fork[bs[order]] < 0
            seen = np.cumsum(free, 1)
            fits = rank < np.minimum(self.max_branches - store.nbranch[bs[order]], seen[:, -1])
            col[order] = np.argmax(seen == (rank + 1)[:, None], 1)
            ok[order[~fits]] = False
        # ... and the book's branch tokens stay within max_branch_tokens.
        ok &= self.branch_tokens + np.cumsum(np.where(ok, grow, 0)) <= self.max_branch_tokens
        self._add("branches_buffered", sidx[row], ok)
        self._add("branches_dropped", sidx[row], ~ok)
        if not ok.any():
            return
        ws, wc = bs[ok], col[ok]
        touched = np.unique(ws)
        before = int(store.blen[touched].sum())
        store.fork[ws, wc] = forks[ok]
        store.blen[ws, wc] = bl[ok]
        store.btok[ws, wc] = np.where(j < bl[ok][:, None], bt[ok], 0)
        store.nbranch[touched] = (store.fork[touched] >= 0).sum(1)
        self.branch_tokens += int(store.blen[touched].sum()) - before

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

    # ---- the engine step ------------------------------------------------------

    def propose(
        self,
        histories: Sequence[np.ndarray],
        k: int,
        max_advance: int,
        active: Sequence[bool] | None = None,
        keys: Sequence[Hashable | None] | None = None,
    ) -> tuple[list[list[int]], list[VerifiedUpdate]]:
        """`propose_rows` for a list of histories (tests, tools): the verified
        updates as a list."""
        width = max((len(h) for h in histories), default=0)
        tok = np.zeros((len(histories), max(width, 1)), np.int64)
        for i, h in enumerate(histories):
            tok[i, : len(h)] = h
        lengths = np.array([len(h) for h in histories], np.int64)
        proposals, verified = self.propose_rows(tok, lengths, k, max_advance, active, keys)
        return proposals, verified.updates()

    def propose_rows(
        self,
        tok: np.ndarray,
        lengths: np.ndarray,
        k: int,
        max_advance: int,
        active: Sequence[bool] | None = None,
        keys: Sequence[Hashable | None] | None = None,
    ) -> tuple[list[list[int]], Verified]:
        """Drafts for each batch row, and the verified tokens to report.

        tok[i, :lengths[i]]: row i's token history (prompt + verified output),
        as vLLM's input batch holds it (`token_ids_cpu`, `num_tokens_no_spec`).
        keys[i]: the request row i serves, as registered (None: unknown, no
        drafts); the same list object step after step while the rows stay.
        k: at most this many drafted tokens per row.
        max_advance: the most tokens a row can gain in one step (k + 1).
        active[i]: False for rows that sampled nothing this step (partial
        prefill); they get no draft and update nothing.
        """
        nrows = len(lengths)
        proposals: list[list[int]] = [[] for _ in range(nrows)]
        self.misses = []
        self._uncovered = []
        act = np.ones(nrows, bool) if active is None else np.asarray(active, bool)[:nrows]
        self.stats.rows_seen += int(act.sum())
        if keys is None or not nrows:
            return proposals, Verified.none()
        slots = self._slots(keys)
        rows = np.flatnonzero(act & (slots >= 0))
        s = slots[rows]
        n = np.asarray(lengths, np.int64)[rows]
        here = n >= self.store.V[s]  # else not this request's row (a stale key)
        rows, s, n = rows[here], s[here], n[here]
        self.stats.rows_matched += len(rows)
        if not len(rows):
            return proposals, Verified.none()
        sidx = self.store.stream[s]
        self._judge_last(tok, rows, s, n, sidx)
        self._advance(tok, rows, s, n, sidx)
        return self._propose(proposals, tok, rows, s, n, sidx, k)

    def _slots(self, keys) -> np.ndarray:
        """Each row's slot (-1: unknown key); cached while the keys and the
        registrations stay the same."""
        last_keys, last_slots, epoch = self._rows_cache
        if keys is last_keys and epoch == self._epoch and last_slots is not None:
            return last_slots
        get = self._entries.get
        slots = np.fromiter(((e.slot if (e := get(key)) is not None else -1) if key is not None
                             else -1 for key in keys), np.int64, len(keys))
        self._rows_cache = (keys, slots, self._epoch)
        return slots

    def _judge_last(self, tok, rows, s, n, sidx) -> None:
        """How each request's last verify step ended, from its new history:
        every step emits the accepted tokens and one of the target's own, so
        the row gained accepted + 1 tokens; the token after the accepted ones
        differs from ours exactly when the target rejected it (vLLM may also
        have verified fewer than we proposed: then nothing was rejected)."""
        store = self.store
        start, plen = store.last_start[s], store.last_len[s]
        judged = (start >= 0) & (n > start)
        if not judged.any():
            return
        ji = np.flatnonzero(judged)
        js, jn, jstart, jlen = s[ji], n[ji], start[ji], plen[ji]
        store.outcome[js[jlen == 0]] = st.DRAFTLESS
        width = int(jlen.max())
        if width:
            j = np.arange(width)
            pos = jstart[:, None] + j
            got = tok[rows[ji][:, None], np.minimum(pos, (jn - 1)[:, None])]
            same = (store.last[js, :width] == got) & (pos < jn[:, None]) & (j < jlen[:, None])
            matched = np.argmin(np.concatenate([same, np.zeros((len(ji), 1), bool)], 1), 1)
            accepted = np.minimum(jn - jstart - 1, matched)
            tried = jlen > 0
            self._add("verified_steps", sidx[ji], tried)
            self._add("accepted_tokens", sidx[ji], np.where(tried, accepted, 0))
            self._add("alpha_trials", sidx[ji], np.where(tried, np.minimum(accepted + 1, jlen), 0))
            rejected = tried & (accepted < jlen) & (matched == accepted)
            store.outcome[js[tried & rejected]] = st.REJECTED
            store.outcome[js[tried & ~rejected]] = st.ACCEPTED
        store.last_start[js] = -1
        store.last_len[js] = 0

    def _advance(self, tok, rows, s, n, sidx) -> None:
        """Move each row's V to its length, reading only the tokens it gained.
        Where the row left S (a rejection), a branch forking there with the
        row's token becomes S (a hit); otherwise S restarts from the row."""
        store, W = self.store, self.store.W
        v = store.V[s]
        gain = n - v
        far = gain > store.max_gain
        for i in np.flatnonzero(far):  # the book lost sight of the row: S is its history
            take = min(int(n[i]), W)
            self.branch_tokens -= store.drop_branches(s[i])
            store.write(s[i], int(n[i]) - take, tok[rows[i], int(n[i]) - take : int(n[i])])
        ai = np.flatnonzero((gain > 0) & ~far)
        if len(ai):
            a_rows, a_s, a_n, a_v = rows[ai], s[ai], n[ai], v[ai]
            g = a_n - a_v
            j = np.arange(int(g.max()))
            pos = a_v[:, None] + j
            valid = j < g[:, None]
            got = tok[a_rows[:, None], np.minimum(pos, (a_n - 1)[:, None])]
            in_s = pos < store.L[a_s][:, None]
            diff = valid & in_s & (got != store.ring[a_s[:, None], pos & (W - 1)])
            rejected = diff.any(1)
            hit = np.zeros(len(ai), bool)
            if rejected.any():
                # The target decided a drafted position otherwise (a proposed
                # token, or the one after them: the bonus): a rejection.
                store.outcome[a_s[rejected]] = st.REJECTED
                hit = self._take_branches(tok, a_rows, a_s, a_n, a_v, got, diff, rejected, sidx[ai])
                # all forked at or before the rejection, or off the old S
                rs = a_s[rejected]
                self.branch_tokens -= int(store.blen[rs].sum())
                store.fork[rs], store.blen[rs], store.nbranch[rs] = -1, 0, 0
            # S is the row's history where it left S (no branch for it) or ran past S's end
            take = (rejected & ~hit) | (~rejected & (valid & ~in_s).any(1))
            if take.any():
                ti = np.flatnonzero(take)
                m = valid[ti]
                store.ring[np.broadcast_to(a_s[ti, None], m.shape)[m], (pos[ti] & (W - 1))[m]] = \
                    got[ti][m]
                store.L[a_s[ti]] = a_n[ti]
        store.V[s] = n
        b = np.flatnonzero(store.nbranch[s] > 0)
        if len(b):  # branches whose position is verified are dead
            self.branch_tokens -= store.drop_branches(s[b], before=n[b])

    def _take_branches(self, tok, rows, s, n, v, got, diff, rejected, sidx) -> np.ndarray:
        """Rows rejected where a branch with the row's token forks: that branch
        (cut to max_pending past the row) becomes S. Returns the hits."""
        store, W = self.store, self.store.W
        hit = np.zeros(len(rows), bool)
        ci = np.flatnonzero(rejected & (store.nbranch[s] > 0))
        if not len(ci):
            return hit
        cs = s[ci]
        first = diff[ci].argmax(1)
        p = v[ci] + first
        token = got[ci, first]
        need = n[ci] - p  # the branch must hold the row's tokens from p on
        cand = (store.fork[cs] == p[:, None]) & (store.btok[cs, :, 0] == token[:, None]) \
            & (store.blen[cs] >= need[:, None])
        b = cand.argmax(1)
        j = np.arange(got.shape[1])
        mbl = store.btok.shape[2]
        theirs = store.btok[cs[:, None], b[:, None], np.minimum(j, mbl - 1)]
        ours = tok[rows[ci][:, None], np.minimum(p[:, None] + j, (n[ci] - 1)[:, None])]
        good = cand.any(1) & ((theirs == ours) | (j >= need[:, None])).all(1)
        if not good.any():
            return hit
        gi = np.flatnonzero(good)
        hs, hb, hp = cs[gi], b[gi], p[gi]
        keep = np.minimum(store.blen[hs, hb], need[gi] + self.max_pending)
        jj = np.arange(mbl)
        m = jj < keep[:, None]
        store.ring[np.broadcast_to(hs[:, None], m.shape)[m], ((hp[:, None] + jj) & (W - 1))[m]] = \
            store.btok[hs, hb][m]
        store.L[hs] = hp + keep
        self._add("branch_hits", sidx[ci[gi]], np.ones(len(gi), np.int64))
        hit[ci[gi]] = True
        return hit

    def _propose(self, proposals, tok, rows, s, n, sidx, k):
        store, W = self.store, self.store.W
        own = store.own_k[s]
        want = np.where(own > 0, np.minimum(own, k), k)
        plen = np.clip(np.minimum(want, store.L[s] - n), 0, None)
        attached = sidx > 0
        # A row whose output is complete is finishing (vLLM proposes for it in
        # the step that ends it): not a step that drafts could help or that is
        # worth waiting for.
        finishing = (store.end[s] > 0) & (n >= store.end[s])
        plen[~attached | finishing] = 0
        width = int(plen.max())
        if width:
            drafted = store.ring[s[:, None], (n[:, None] + np.arange(width)) & (W - 1)]
            got = np.flatnonzero(plen)
            # (lists, not numpy scalars: this loop is the step's only one per row)
            for row, tokens, count in zip(rows[got].tolist(), drafted[got].tolist(),
                                          plen[got].tolist()):
                proposals[row] = tokens[:count] if count < width else tokens
        noted = attached & ~finishing
        outcome = store.outcome[s]
        covered = plen > 0
        for code, name in _OUTCOMES:
            m = noted & (outcome == code)
            self._add(f"steps_after_{name}", sidx, m)
            self._add(f"covered_after_{name}", sidx, m & covered)
        # The draft is drafting for these rows but nothing is here (it has not
        # heard of the rejection yet, or fell behind): the bounded wait may
        # hold the step for them.
        waiting = noted & ~covered & ((outcome == st.REJECTED) | (outcome == st.ACCEPTED))
        self._add("wait_rows", sidx, waiting)
        key_of = self._key_of
        self.misses = [(row, key_of[slot]) for row, slot in
                       zip(rows[waiting].tolist(), s[waiting].tolist())]
        self.stats.rows_with_proposals += int(covered.sum())
        self.stats.proposed_tokens += int(plen.sum())
        ns = s[noted]
        store.uncovered[ns] = np.where(covered[noted], 0, store.uncovered[ns] + 1)
        if self.release_after:
            late = ns[store.uncovered[ns] >= self.release_after]
            self._uncovered = [key_of[x] for x in late.tolist()]
        store.last_start[ns] = n[noted]
        store.last_len[ns] = plen[noted]
        if width:
            store.last[ns, :width] = drafted[noted]
        # Verified tokens the attached drafts have not heard yet.
        ui = np.flatnonzero(attached & (n > store.reported[s]))
        verified = Verified.none()
        if len(ui):
            start = store.reported[s[ui]]
            count = n[ui] - start
            j = np.arange(int(count.max()))
            m = j < count[:, None]
            flat = tok[rows[ui][:, None], np.minimum(start[:, None] + j, (n[ui] - 1)[:, None])][m]
            streams = self._streams
            verified = Verified([key_of[x] for x in s[ui].tolist()],
                                [streams[x] for x in sidx[ui].tolist()], start, count, flat)
            store.reported[s[ui]] = n[ui]
        return proposals, verified

    def refill(self, lengths: Sequence[int], k: int) -> dict[int, list[int]]:
        """Proposals for the rows of the last propose()'s misses whose drafts
        have arrived since (the bounded wait); {row: tokens}. lengths[i]: row
        i's history length, as at that propose(). Changes no verified
        position: it only reads what arrived for the same history."""
        out: dict[int, list[int]] = {}
        store = self.store
        for i, key in self.misses:
            entry = self._entries.get(key)
            n = int(lengths[i])
            if entry is None:
                continue
            s = entry.slot
            if store.V[s] != n or store.L[s] <= n:
                continue
            kk = min(k, entry.k) if entry.k else k
            tokens = store.read(s, n, min(int(store.L[s]), n + kk)).tolist()
            out[i] = tokens
            store.uncovered[s] = 0
            self.stats.rows_with_proposals += 1
            self.stats.proposed_tokens += len(tokens)
            self._count(entry, f"covered_after_{st.OUTCOME_NAMES[store.outcome[s]]}")
            self._count(entry, "wait_hits")
            store.last_start[s], store.last_len[s] = n, len(tokens)
            store.last[s, : len(tokens)] = tokens
        self.misses = []
        return out

    # ---- internals ------------------------------------------------------------

    def _add(self, name: str, sidx: np.ndarray, values: np.ndarray) -> None:
        """Add per-row counts to a counter, in all and per stream."""
        values = np.asarray(values, np.int64)
        total = int(values.sum())
        if not total:
            return
        setattr(self.stats, name, getattr(self.stats, name) + total)
        per = np.bincount(sidx, weights=values, minlength=len(self._streams))
        for i in np.flatnonzero(per):
            stream = self._streams[i]
            stats = self.stream_stats.get(stream)
            if stats is None:
                stats = self.stream_stats[stream] = BookStats()
            setattr(stats, name, getattr(stats, name) + int(per[i]))

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


def _bad_entries(tokens, counts, n: int, vocab: int, owner=None) -> np.ndarray:
    """Entries (of n) with a token id outside [0, vocab) among theirs."""
    if not len(tokens):
        return np.zeros(n, bool)
    bad = (tokens < 0) | (tokens >= vocab)
    if not bad.any():
        return np.zeros(n, bool)
    item = np.repeat(np.arange(len(counts)), counts)
    hit = np.zeros(n, bool)
    hit[(item if owner is None else owner[item])[bad]] = True
    return hit


def _vocab_error(tokens, counts, btokens, bcounts, branch_of, i: int, vocab: int) -> BookError:
    start = int(counts[:i].sum())
    mine = [tokens[start : start + counts[i]]]
    bstart = np.cumsum(bcounts) - bcounts
    mine += [btokens[bstart[b] : bstart[b] + bcounts[b]] for b in np.flatnonzero(branch_of == i)]
    arr = np.concatenate(mine)
    token = int(arr[(arr < 0) | (arr >= vocab)][0])
    return BookError(INVALID_ARGUMENT,
                     f"token id {token} is outside the target vocabulary [0, {vocab})")


def _name(key: Hashable) -> str:
    """A key's request id, for messages (keys may be (stream, request id))."""
    return str(key[-1] if isinstance(key, tuple) and key else key)
