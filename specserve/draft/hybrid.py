"""The hybrid draft: a draft model that consults a suffix memory position by position (`kind: hybrid`).

Owns `HybridDraftModel`, the runner's DraftModel for a pool whose replicas run a
draft model and keep a suffix memory beside it (the same memory a suffix pool
keeps: each request's own prompt and output, and one across every request this
replica drafts for, whichever target replica runs it). Before each drafted
position it looks the context up in the memory; where the memory's draft scores
at least what the model is expected to have accepted over as many tokens, the
memory's tokens are sent (no model step spent), else the model drafts on, and
the memory is asked again after each of the model's tokens (SuffixDecoding's
combination with a model speculator, Oliaro et al. 2025). Where the
model's token won and the memory had another, the memory's continuation is a
branch at that position, beside the memory's own alternatives.

The choice (`memory_wins`) and the per-source acceptance (`SourceTally`) are
pure and tested alone (tests/draft/test_hybrid.py). The model's acceptance is
measured from the target's verified tokens on the positions the model drafted,
never assumed.

Never decides output: the target's rejection sampler does; a wrong memory
draft costs a rejected draft, like a wrong model draft.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from specserve.draft.suffix import SuffixDraftModel

PREFIX = "hybrid:"  # the draft spec: `--draft hybrid:FOLDER`, DraftConfig.draft_spec of kind hybrid
MEMORY, MODEL = "memory", "model"


def is_hybrid(draft: str | None) -> bool:
    return bool(draft) and draft.strip().lower().startswith(PREFIX)


def model_of(draft: str) -> str:
    """The draft model folder (or 'default') of a `hybrid:FOLDER` spec."""
    folder = draft.strip()[len(PREFIX):]
    if not folder:
        raise ValueError(f"{draft!r}: a hybrid draft names its model, as hybrid:FOLDER "
                         "(or hybrid:default)")
    return folder


def model_expected_tokens(alpha: float, n: int) -> float:
    """Tokens the target is expected to accept of n model tokens, each taken
    with probability alpha after the one before it: alpha + alpha^2 + ... + alpha^n."""
    a = min(max(alpha, 0.0), 1.0)
    if a >= 1.0:
        return float(n)
    return a * (1.0 - a ** n) / (1.0 - a)


def memory_wins(memory_tokens: int, memory_score: float, model_alpha: float) -> bool:
    """Send the memory's draft instead of the model's: it has tokens and its
    score (the sum of its prefix probabilities: expected accepted tokens) is at
    least the model's expected accepted tokens over the same length. A tie goes
    to the memory, whose tokens cost no model step."""
    return memory_tokens > 0 and memory_score >= model_expected_tokens(model_alpha, memory_tokens)


@dataclasses.dataclass
class SourceTally:
    """Per source (memory, model): drafted tokens the target agreed with and
    rejections, from the positions each drafted. alpha(source) is that
    source's per-token acceptance; a prior of one agreed and one rejected
    keeps the first estimates at 0.5."""

    agreed: dict = dataclasses.field(default_factory=lambda: {MEMORY: 1, MODEL: 1})
    rejected: dict = dataclasses.field(default_factory=lambda: {MEMORY: 1, MODEL: 1})
    drafted: dict = dataclasses.field(default_factory=lambda: {MEMORY: 0, MODEL: 0})
    # request -> position -> (token, source): the current line's unverified tokens
    _line: dict = dataclasses.field(default_factory=dict)

    def alpha(self, source: str) -> float:
        return self.agreed[source] / (self.agreed[source] + self.rejected[source])

    def restart(self, rid: str, at: int) -> None:
        """A new line from position `at`: what was drafted from there on is void."""
        line = self._line.get(rid)
        if line:
            for p in [p for p in line if p >= at]:
                del line[p]

    def drafted_tokens(self, rid: str, at: int, tokens: Sequence[int], source: str) -> None:
        line = self._line.setdefault(rid, {})
        for i, t in enumerate(tokens):
            line[at + i] = (t, source)
        self.drafted[source] += len(tokens)

    def verified(self, rid: str, verified: Sequence[int]) -> None:
        """The target's history grew: score the drafted positions it now covers."""
        line = self._line.get(rid)
        if not line:
            return
        for p in sorted(p for p in line if p < len(verified)):
            if p not in line:
                continue  # voided by a rejection before it
            token, source = line.pop(p)
            if token == verified[p]:
                self.agreed[source] += 1
            else:
                self.rejected[source] += 1
                for q in [q for q in line if q > p]:
                    del line[q]  # drafted after a rejected token: never verified

    def forget(self, rid: str) -> None:
        self._line.pop(rid, None)


class HybridDraftModel:
    """DraftModel for the DraftRunner: `model` (a VllmDraftModel, or any
    DraftModel) with `memory` (a SuffixDraftModel) consulted before each position."""

    def __init__(self, model, memory: SuffixDraftModel):
        self.model = model
        self.memory = memory
        self.max_model_len = model.max_model_len
        self.tally = SourceTally()
        # request -> position -> the memory's draft there where the model's token won
        self._memory_alts: dict[str, dict[int, list[int]]] = {}

    # ---- learning -----------------------------------------------------------------

    def observe(self, request_id: str, verified: Sequence[int]) -> None:
        self.memory.observe(request_id, verified)
        self.tally.verified(request_id, verified)

    # ---- drafting -----------------------------------------------------------------

    def _memory_draft(self, request_id: str, tokens: list[int], left: int):
        d = self.memory.draft(request_id, tokens, left)
        return d if memory_wins(len(d.tokens), d.score, self.tally.alpha(MODEL)) else None, d

    async def continue_tokens(self, segment_id, request_id, tokens, max_tokens):
        tokens = list(tokens)
        self.memory.start(request_id, tokens)
        self.tally.restart(request_id, len(tokens))
        left, part = max_tokens, 0
        win, d = self._memory_draft(request_id, tokens, left)
        while left > 0:
            if win is not None:
                new = list(win.tokens[:left])
                self.memory.keep_alternatives(request_id, len(tokens), win)
                self.tally.drafted_tokens(request_id, len(tokens), new, MEMORY)
                tokens += new
                left -= len(new)
                yield new
                if left > 0:
                    win, d = self._memory_draft(request_id, tokens, left)
                continue
            # The model drafts on, until the memory scores higher at the end of its line.
            part += 1
            gen = self.model.continue_tokens(f"{segment_id}.{part}", request_id, tokens, left)
            try:
                async for new in gen:
                    if not new:
                        continue
                    if d.tokens and d.tokens[0] != new[0]:
                        # The memory had another token here: its draft is a branch.
                        self._memory_alts.setdefault(request_id, {})[len(tokens)] = list(d.tokens)
                    self.tally.drafted_tokens(request_id, len(tokens), new, MODEL)
                    tokens += new
                    left -= len(new)
                    yield new
                    if left <= 0:
                        break
                    win, d = self._memory_draft(request_id, tokens, left)
                    if win is not None:
                        break
            finally:
                await gen.aclose()  # aborts the model's request when the memory takes over
            if win is None:
                return  # the model has nothing more (or the limit is reached)

    def branches(self, request_id: str, tokens: Sequence[int], fork: int, count: int,
                 length: int) -> list[list[int]]:
        """Up to `count` branches at `fork`: the memory's draft where the model's
        token won there, the memory's alternatives, then the model's (first
        token distinct from each other and from the line's own)."""
        out: list[list[int]] = []
        seen = {tokens[fork]} if fork < len(tokens) else set()
        mine = self._memory_alts.get(request_id, {}).get(fork)
        candidates = [mine[:length + 1]] if mine else []
        candidates += self.memory.branches(request_id, tokens, fork, count, length)
        if hasattr(self.model, "branches"):
            candidates += self.model.branches(request_id, tokens, fork, count, length)
        for b in candidates:
            if len(out) >= count:
                break
            if b and b[0] not in seen:
                seen.add(b[0])
                out.append(b)
        return out

    def forget(self, request_id: str, before: int | None = None) -> None:
        self.memory.forget(request_id, before)
        forget = getattr(self.model, "forget", None)
        if forget is not None:
            forget(request_id, before)
        alts = self._memory_alts.get(request_id)
        if before is None:
            self._memory_alts.pop(request_id, None)
            self.tally.forget(request_id)
        elif alts:
            for p in [p for p in alts if p < before]:
                del alts[p]

    def figures(self) -> dict:
        """Tokens each source drafted and its measured acceptance."""
        t = self.tally
        return {f"{s}_{what}": v for s in (MEMORY, MODEL)
                for what, v in (("drafted", t.drafted[s]), ("alpha", round(t.alpha(s), 3)))}
