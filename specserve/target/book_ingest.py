"""Taking drafted windows into the draft book (part of `DraftBook`).

Owns `extend` and `extend_batch`: a DraftBatch's windows for many requests
checked against what the book holds (verified positions must agree, newer
drafts win past them, gaps and overtaken windows are stale) and written into
the store's ring, and their branches into the branch tables, with numpy over
all entries at once; a single draft message is a batch of one. Pure: the sink
serialises access. The state it works on is `DraftBook`'s
(specserve/target/book.py); the arrays are `specserve.target.book_store`'s.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from specserve.target.book_entry import INVALID_ARGUMENT, NOT_FOUND, BookError, _name


class WindowIngest:
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
                     branch_of=(), forks=(), bcounts=(), btokens=(),
                     done=()) -> tuple[np.ndarray, list]:
        """Drafted windows for many requests at once (a DraftBatch), packed:
        entry i is keys[i]'s window at positions [positions[i], positions[i] +
        counts[i]), its tokens the next counts[i] of `tokens`; branch j belongs
        to entry branch_of[j], forks at forks[j], its tokens the next
        bcounts[j] of `btokens` ([alternative token, continuation...]).

        Each window overlapping what the book holds must agree with it: one
        built on another history (stale, or after a rejection the draft has not
        heard of yet) is dropped, its branches too; so is one that leaves a gap
        after what the book holds. Past the verified positions the newer window
        wins where they differ. Windows are usually deltas (what the draft has
        not sent yet). A branch must fork at a position not yet verified that
        the book holds a drafted token for (from this window or an earlier
        one), with a token other than that one. done: the entries whose window
        is all their draft has for now, sent whole from the verified position
        it knew; the book notes it (a wait for the request can stop) where that
        is the book's verified position and the window ends where the book's
        drafts now end. stream: the sender (None: any); a request attached to
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
        done = np.asarray(done, np.int64).reshape(-1)
        if (len(positions) != n or len(counts) != n or (counts < 0).any()
                or (len(done) and (done.min() < 0 or done.max() >= n))
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
        changed = s[~stale & ((take > 0) | cut)]
        store.done[changed] = -1  # (a done of this message is noted below)
        if len(done):
            said = np.zeros(n, bool)
            said[done] = True
            fin = said[ei] & ~stale & (pos == V) & (pos + cnt == store.L[s])
            store.done[s[fin]] = store.L[s[fin]]
        self.stats.draft_tokens_buffered += int(take.sum())
        if len(branch_of):
            entry_row = np.full(n, -1, np.int64)
            entry_row[ei] = np.arange(len(ei))
            row = entry_row[branch_of]
            keep = row >= 0
            keep[keep] = ~stale[row[keep]]
            self._add_branches(s, sidx[ei], row[keep], forks[keep],
                               bcounts[keep], btokens, (np.cumsum(bcounts) - bcounts)[keep])
        return added, errors

    def _add_branches(self, s, sidx, row, forks, bcounts, btokens, bstart) -> None:
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
        ok = (bl > 0) & (store.V[bs] <= forks) & (forks < store.L[bs])
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
