"""The suffix draft: drafts from a suffix memory, no model (`kind: suffix`, `--draft suffix`).

Owns `SuffixDraftModel`, the runner's DraftModel for a pool with no model: per
request a memory of its own prompt and verified output, and one memory across
requests (the fleet memory: every request this replica drafts for, whichever
target replica runs it), both `specserve.draft.suffix_tree.SuffixIndex`,
bounded by `SuffixConfig`. A lookup drafts from whichever memory scores higher
(SuffixDecoding); the other continuations seen at each drafted position are the
branches. The memories learn only the target's verified tokens (the runner's
`observe` hook), never this draft's own guesses.

Never decides output: the target's rejection sampler does. A suffix draft that
finds nothing drafts nothing (the target steps alone), and a wrong one costs a
rejected draft, never a token of output.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence

from specserve.config.suffix import SuffixConfig
from specserve.draft.suffix_tree import DraftRule, SuffixIndex, best_draft

NAME = "suffix"  # the draft spec: `--draft suffix`, DraftConfig.draft_spec of kind suffix


def is_suffix(draft: str | None) -> bool:
    return bool(draft) and draft.strip().lower() == NAME


class SuffixDraftModel:
    """DraftModel for the DraftRunner over suffix memories."""

    def __init__(self, config: SuffixConfig | None = None, max_model_len: int = 1 << 30,
                 vocab_size: int | None = None, fan_out: int = 3, max_live: int = 4096):
        self.config = c = config or SuffixConfig()
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.rule = DraftRule(c.max_draft_tokens, c.factor, c.offset, c.min_prob,
                              max(fan_out, 0))
        self.fleet = SuffixIndex(c.max_depth, c.max_tokens, c.max_requests,
                                 c.max_request_tokens, vocab_size) if c.share else None
        # request -> its own memory; at most max_live (a runner's live requests)
        self._own: collections.OrderedDict[str, SuffixIndex] = collections.OrderedDict()
        self.max_live = max_live
        # request -> position -> alternatives there (from the last lookup)
        self._alts: dict[str, dict[int, list[int]]] = {}
        self.lookups = 0
        self.hits = 0

    def _own_index(self, rid: str) -> SuffixIndex:
        ix = self._own.get(rid)
        if ix is None:
            c = self.config
            ix = self._own[rid] = SuffixIndex(c.max_depth, c.max_request_tokens, 1,
                                              c.max_request_tokens, self.vocab_size)
            while len(self._own) > self.max_live:
                self._own.popitem(last=False)
        return ix

    def _indexes(self, rid: str) -> list[SuffixIndex]:
        return [self._own_index(rid)] + ([self.fleet] if self.fleet is not None else [])

    # ---- learning -----------------------------------------------------------------

    def observe(self, request_id: str, verified: Sequence[int]) -> None:
        """The target's history of a request (prompt + verified output) grew."""
        own = self._own_index(request_id)
        n = own.length(request_id)
        if len(verified) > n:
            own.extend(request_id, verified[n:])
        if self.fleet is not None:
            n = self.fleet.length(request_id)
            if len(verified) > n:  # (0 again if evicted: it comes back, within bounds)
                self.fleet.extend(request_id, verified[n:])

    # ---- drafting -----------------------------------------------------------------

    def draft(self, request_id: str, tokens: Sequence[int], max_tokens: int):
        """One lookup (a suffix_tree.Draft) after `tokens`."""
        self.lookups += 1
        d = best_draft(tokens, self._indexes(request_id), self.rule, max_tokens)
        if d.tokens:
            self.hits += 1
        return d

    def start(self, request_id: str, tokens: Sequence[int]) -> None:
        """Learn a request's prompt before its first draft (a first segment
        starts from the prompt: the request's first history)."""
        if request_id not in self._own:
            self.observe(request_id, tokens)

    def keep_alternatives(self, request_id: str, at: int, d) -> None:
        """Remember the alternatives of draft `d` (drafted from position `at`),
        for branches()."""
        alts = self._alts.setdefault(request_id, {})
        for i, a in enumerate(d.alternatives):
            if a:
                alts[at + i] = a

    async def continue_tokens(self, segment_id, request_id, tokens, max_tokens):
        self.start(request_id, tokens)
        d = self.draft(request_id, tokens, max_tokens)
        if not d.tokens:
            return
        self.keep_alternatives(request_id, len(tokens), d)
        await asyncio.sleep(0)  # the event loop's (gRPC's) turn
        yield list(d.tokens)

    def branches(self, request_id: str, tokens: Sequence[int], fork: int, count: int,
                 length: int) -> list[list[int]]:
        """Up to `count` branches at `fork`: an alternative seen there, then the
        memory's continuation after it (at most `length` tokens)."""
        out = []
        for alt in self._alts.get(request_id, {}).get(fork, [])[:count]:
            prefix = list(tokens[:fork]) + [alt]
            cont = best_draft(prefix, self._indexes(request_id), self.rule, length).tokens
            out.append([alt, *cont])
        return out

    def forget(self, request_id: str, before: int | None = None) -> None:
        """Drop a request's alternatives (those before `before` only, when given);
        at its end (before None) its own memory too. The fleet memory keeps it."""
        alts = self._alts.get(request_id)
        if before is None:
            self._alts.pop(request_id, None)
            self._own.pop(request_id, None)
        elif alts:
            for p in [p for p in alts if p < before]:
                del alts[p]
