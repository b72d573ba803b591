"""What a draft has sent a sink, per request: the wire's deltas.

Owns the draft side's record of each request's window as the sink should hold
it (the drafted tokens from the verified position the draft knew when it
sent, and the branches sent with them), so that a draft sends only what the
sink does not hold yet: the tokens past where the new window stops agreeing
with the record, and each branch once. The sink's verified updates keep the
record honest: a verified token that differs from the record cuts it there
(the sink cut its drafts there too), and a record that runs past what the sink
says it holds (`VerifiedBatch.held`: it refused or dropped the rest) is sent
again from there.

Pure: no I/O. `SinkLink` (specserve/draft/link.py) calls it for every window
its caller hands it; the caller keeps sending whole windows.
"""

from __future__ import annotations

Branch = tuple[int, list[int]]  # (fork position, [alternative, continuation...])
# A branch is sent once per (fork position, alternative): its continuation may
# grow while the window does, but the sink takes the rest from the window
# the draft sends after it took the branch itself.


class _Record:
    __slots__ = ("start", "tokens", "branches")

    def __init__(self, start: int, tokens: list[int], branches: dict[tuple[int, int], list]):
        self.start = start  # the verified position the window was drafted from
        self.tokens = tokens  # drafted tokens for positions start, start + 1, ...
        self.branches = branches  # (fork, alternative) -> the branch's tokens as sent

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class SentWindows:
    def __init__(self):
        self._records: dict[str, _Record] = {}

    def delta(self, rid: str, position: int, tokens: list[int],
              branches=()) -> tuple[int, list[Branch]] | None:
        """The window (position, tokens, branches) against what was sent:
        (where the sink's copy stops agreeing with it, the branches it lacks),
        or None when the sink holds it all. Records the window as sent."""
        rec = self._records.get(rid)
        start = position
        kept: dict[tuple[int, int], list] = {}
        if rec is not None and rec.start <= position <= rec.end:
            held = rec.tokens[position - rec.start:]
            n = min(len(held), len(tokens))
            i = 0
            while i < n and held[i] == tokens[i]:
                i += 1
            start = position + i
            # A rewrite (the window differs where the sink holds a token) makes
            # the sink drop the branches forking from there: they go again.
            rewrite = i < n
            kept = {b: bt for b, bt in rec.branches.items()
                    if b[0] >= position and not (rewrite and b[0] >= start)}
        new = []
        for fork, bt in branches:
            if bt and (fork, bt[0]) not in kept:
                new.append((fork, bt))
                kept[(fork, bt[0])] = bt
        self._records[rid] = _Record(position, list(tokens), kept)
        if start == position + len(tokens) and not new:
            return None
        return start, new

    def tokens_from(self, rid: str, start: int) -> tuple[int, list[int]]:
        """(position, the recorded tokens from there): a delta's tokens, from
        `start` or the record's own start if that is later."""
        rec = self._records[rid]
        start = min(max(start, rec.start), rec.end)
        return start, rec.tokens[start - rec.start:]

    def heard(self, rid: str, position: int, tokens: list[int],
              held: int) -> tuple[int, list[Branch]] | None:
        """A verified update (the target's tokens at [position, position +
        len(tokens)), and `held`: where the sink's drafts end, 0 unknown).
        Returns (from where, branches) to send again when the sink holds less
        than the record, else None."""
        rec = self._records.get(rid)
        if rec is None:
            return None
        lo, hi = max(position, rec.start), min(position + len(tokens), rec.end)
        for q in range(lo, hi):
            if rec.tokens[q - rec.start] != tokens[q - position]:
                # The target decided q otherwise: the sink dropped our tokens
                # from q on, and every branch.
                del rec.tokens[q - rec.start:]
                rec.branches = {}
                return None
        verified = position + len(tokens)
        rec.branches = {b: bt for b, bt in rec.branches.items() if b[0] >= verified}
        if rec.start <= held < rec.end:
            return held, [(b[0], bt) for b, bt in rec.branches.items() if b[0] >= held]
        return None

    def forget(self, rid: str) -> None:
        self._records.pop(rid, None)

    def clear(self) -> None:
        """A new stream: the sink holds nothing of ours."""
        self._records.clear()
