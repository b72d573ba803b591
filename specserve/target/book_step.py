"""The engine step of the draft book (part of `DraftBook`): one function per
stage, over all rows at once.

`propose_rows` tells the step's story: find each row's request by key
(`_slots`), judge how its last proposal fared (`_judge_last`: accepted,
rejected or draftless, counted exactly), move its verified position over the
tokens it gained (`_advance`; a rejection takes a matching branch,
`_take_branches`, or restarts S from the row), then propose the next drafted
tokens (with a price, only as many as the request's own recent acceptance
says pay: `_worth`) and hand out the verified ones (`_propose`). `refill` serves the
bounded wait. Pure: numpy over the store's arrays
(`specserve.target.book_store`), no Python loop per row but building the
proposal lists vLLM wants.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from specserve.control import policy
from specserve.target import book_store as st
from specserve.target.book_entry import Verified, VerifiedUpdate
from specserve.target.book_stats import ACCEPTED, DRAFTLESS, REJECTED

# A request's α starts as its draft stream's, worth this many trials of its own.
PRIOR_TRIALS = 4
# A row whose α says no drafts pay still tries one token this often (steps).
PROBE_EVERY = 4
# A request's α weighs each verify step's outcome this much less per later step.
RECENT = 0.7

_OUTCOMES = ((st.ACCEPTED, ACCEPTED), (st.REJECTED, REJECTED), (st.DRAFTLESS, DRAFTLESS))


class EngineStep:
    def propose(
        self,
        histories: Sequence[np.ndarray],
        k: int,
        max_advance: int,
        active: Sequence[bool] | None = None,
        keys: Sequence[Hashable | None] | None = None,
        price: float = 0.0,
    ) -> tuple[list[list[int]], list[VerifiedUpdate]]:
        """`propose_rows` for a list of histories (tests, tools): the verified
        updates as a list."""
        width = max((len(h) for h in histories), default=0)
        tok = np.zeros((len(histories), max(width, 1)), np.int64)
        for i, h in enumerate(histories):
            tok[i, : len(h)] = h
        lengths = np.array([len(h) for h in histories], np.int64)
        proposals, verified = self.propose_rows(tok, lengths, k, max_advance, active, keys, price)
        return proposals, verified.updates()

    def propose_rows(
        self,
        tok: np.ndarray,
        lengths: np.ndarray,
        k: int,
        max_advance: int,
        active: Sequence[bool] | None = None,
        keys: Sequence[Hashable | None] | None = None,
        price: float = 0.0,
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
        price: a drafted token is proposed only where its row's chance of
        having it accepted beats this (`policy.row_k`; 0: every row gets its K).
        Sets `emitted`: the tokens the rows gained in the step that just ran.
        """
        nrows = len(lengths)
        proposals: list[list[int]] = [[] for _ in range(nrows)]
        self.misses = []
        self._uncovered = []
        act = np.ones(nrows, bool) if active is None else np.asarray(active, bool)[:nrows]
        self.stats.rows_seen += int(act.sum())
        self.emitted = int(act.sum())  # a row the book does not know: one token
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
        self.emitted += int(np.minimum(n - self.store.V[s], max_advance).sum()) - len(rows)
        self._judge_last(tok, rows, s, n, sidx)
        self._advance(tok, rows, s, n, sidx)
        return self._propose(proposals, tok, rows, s, n, sidx, k, price)

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
            trials = np.where(tried, np.minimum(accepted + 1, jlen), 0)
            self._add("alpha_trials", sidx[ji], trials)
            t = js[tried]  # recent outcomes weigh more: text turns repetitive and back
            store.accepted[t] = RECENT * store.accepted[t] + accepted[tried]
            store.trials[t] = RECENT * store.trials[t] + trials[tried]
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
                store.done[a_s[ti]] = -1  # the draft has not heard of it yet
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
        store.done[hs] = -1
        self._add("branch_hits", sidx[ci[gi]], np.ones(len(gi), np.int64))
        hit[ci[gi]] = True
        return hit

    def _propose(self, proposals, tok, rows, s, n, sidx, k, price=0.0):
        store, W = self.store, self.store.W
        own = store.own_k[s]
        want = np.where(own > 0, np.minimum(own, k), k)
        attached = sidx > 0
        # What the draft has for each row (its coverage), and what is worth
        # verifying of it (`cap`): the proposal is the shorter.
        have = np.clip(np.minimum(want, store.L[s] - n), 0, None)
        # A row whose output is complete is finishing (vLLM proposes for it in
        # the step that ends it): not a step that drafts could help or that is
        # worth waiting for.
        finishing = (store.end[s] > 0) & (n >= store.end[s])
        have[~attached | finishing] = 0
        cap = self._worth(s, sidx, want, price) if price > 0.0 else want
        store.cap[s] = cap
        plen = np.minimum(have, cap)
        width = int(plen.max())
        if width:
            drafted = store.ring[s[:, None], (n[:, None] + np.arange(width)) & (W - 1)]
            got = np.flatnonzero(plen)
            # (lists, not numpy scalars: this loop is the step's only one per row)
            for row, tokens, count in zip(rows[got].tolist(), drafted[got].tolist(),
                                          plen[got].tolist()):
                proposals[row] = tokens[:count] if count < width else tokens
        noted = attached & ~finishing
        store.steps[s[noted]] += 1
        outcome = store.outcome[s]
        covered = have > 0
        for code, name in _OUTCOMES:
            m = noted & (outcome == code)
            self._add(f"steps_after_{name}", sidx, m)
            self._add(f"covered_after_{name}", sidx, m & covered)
        # The draft is drafting for these rows but nothing is here (it has not
        # heard of the rejection yet, or fell behind): the bounded wait may
        # hold the step for them.
        waiting = noted & ~covered & (cap > 0) & ((outcome == st.REJECTED)
                                                   | (outcome == st.ACCEPTED))
        self._add("wait_rows", sidx, waiting)
        key_of = self._key_of
        self.misses = [(row, key_of[slot]) for row, slot in
                       zip(rows[waiting].tolist(), s[waiting].tolist())]
        self.stats.rows_with_proposals += int(np.count_nonzero(plen))
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
                                [streams[x] for x in sidx[ui].tolist()], start, count, flat,
                                store.L[s[ui]].copy())
            store.reported[s[ui]] = n[ui]
        return proposals, verified

    def _worth(self, s, sidx, want, price) -> np.ndarray:
        """The drafted tokens worth verifying per row at this `price`
        (`policy.row_k`), by each request's own recent acceptance (RECENT),
        its draft stream's over its first PRIOR_TRIALS trials. A row held at 0
        tries one token every PROBE_EVERY steps, so its α keeps being measured."""
        prior = np.ones(len(self._streams))  # nothing measured: propose (and measure)
        for i, stream in enumerate(self._streams):
            stats = self.stream_stats.get(stream)
            if stats is not None and stats.alpha is not None:
                prior[i] = stats.alpha
        store = self.store
        alpha = (store.accepted[s] + PRIOR_TRIALS * prior[sidx]) / (store.trials[s] + PRIOR_TRIALS)
        cap = policy.row_k(alpha, want, price)
        probe = (cap == 0) & (store.steps[s] % PROBE_EVERY == 0)
        return np.where(probe, np.minimum(want, 1), cap)

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
            kk = min(k, int(store.cap[s]))
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
