"""The adapt buffer: what a draft replica keeps of the traffic it drafts for, to learn from.

Owns a bounded store of examples built from the verified tokens the draft
runner already receives (`DraftRunner._on_verified`). One example per request:
(context, continuation), the last `max_context_tokens` of its prompt and the
target's verified output after it, token by token as it is verified. The
continuation is what the target chose: the distillation target (hard labels),
and, on the held-out slice, what the draft's greedy agreement is measured on.

- Held-out slice: a request is held out when a stable hash of its id (BLAKE2b,
  the same in every process and replica) falls below `heldout_share`; its
  tokens are only ever returned by `heldout_examples`, never by
  `train_examples`.
- Bounds (tokens, context + continuation): `max_tokens` in all, the oldest
  requests evicted first; `per_request_tokens` per request, so one long
  request cannot fill the buffer (its tokens past the cap are not kept); a
  request's context is its prompt's last `max_context_tokens`.
- Cost: an append per verified update (the new tokens only) into int32
  arrays; no copy of the history, no lock, never blocks drafting.

Never does: I/O, training, or anything to the drafts. It holds user text
(token ids): nothing here sends it anywhere.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from array import array
from collections.abc import Sequence

_HASH_RANGE = 1 << 64


def is_heldout(request_id: str, share: float) -> bool:
    """Whether `request_id` belongs to the held-out slice (stable across processes)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < share * _HASH_RANGE


@dataclasses.dataclass(frozen=True)
class Example:
    """One request's context (prompt tail) and the target's verified continuation."""

    request_id: str
    context: list[int]
    continuation: list[int]

    @property
    def tokens(self) -> int:
        return len(self.context) + len(self.continuation)


class _Entry:
    __slots__ = ("heldout", "prompt_len", "context", "continuation", "open")

    def __init__(self, heldout: bool, prompt_len: int, context: array):
        self.heldout = heldout
        self.prompt_len = prompt_len  # where the verified output starts in the history
        self.context = context
        self.continuation = array("i")
        self.open = True  # still receiving verified tokens

    @property
    def tokens(self) -> int:
        return len(self.context) + len(self.continuation)


class AdaptBuffer:
    def __init__(self, max_tokens: int, max_context_tokens: int, per_request_tokens: int,
                 heldout_share: float):
        """max_tokens: tokens kept in all; max_context_tokens: of a prompt, per
        example; per_request_tokens: context + continuation of one request;
        heldout_share: share of requests held out (0 < share < 1)."""
        if not 0 < max_context_tokens < per_request_tokens <= max_tokens:
            raise ValueError(f"need 0 < max_context_tokens ({max_context_tokens}) < "
                             f"per_request_tokens ({per_request_tokens}) <= max_tokens "
                             f"({max_tokens}): a request must have room for its "
                             "continuation, and the buffer for a request")
        if not 0 < heldout_share < 1:
            raise ValueError(f"heldout_share must be between 0 and 1 (both excluded), "
                             f"got {heldout_share}")
        self.max_tokens = max_tokens
        self.max_context_tokens = max_context_tokens
        self.per_request_tokens = per_request_tokens
        self.heldout_share = heldout_share
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self.tokens = 0  # context + continuation, every request kept
        self.heldout_tokens = 0  # of those, the held-out requests'
        self.heldout_positions = 0  # held-out continuation tokens: where alpha is measured
        self.evicted = 0  # requests evicted to keep the bound

    @classmethod
    def from_config(cls, adapt) -> AdaptBuffer:
        """The buffer an AdaptConfig (`drafts[].adapt`) sets."""
        return cls(adapt.buffer_tokens, adapt.max_context_tokens, adapt.per_request_tokens,
                   adapt.heldout_share)

    # ---- from the draft runner -----------------------------------------------------

    def open(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        """Start collecting a request (the runner's `start`). An empty id or
        prompt, or an id already here, is ignored."""
        if not request_id or not prompt_ids or request_id in self._entries:
            return
        try:
            context = array("i", prompt_ids[-self.max_context_tokens:])
        except (OverflowError, TypeError):  # not token ids: nothing to learn from
            return
        entry = _Entry(is_heldout(request_id, self.heldout_share), len(prompt_ids), context)
        self._entries[request_id] = entry
        self._count(entry, len(context), 0)
        self._evict()

    def observe(self, request_id: str, history: Sequence[int]) -> int:
        """The request's verified history so far (prompt + verified output, as
        the runner holds it): keep its new verified tokens, up to the request's
        cap. Returns how many were kept. A request not open here (never
        opened, closed, or evicted) is ignored."""
        entry = self._entries.get(request_id)
        if entry is None or not entry.open or not history:
            return 0
        start = entry.prompt_len + len(entry.continuation)
        room = self.per_request_tokens - entry.tokens
        if room <= 0 or len(history) <= start:
            return 0
        new = history[start:start + room]
        try:
            entry.continuation.extend(new)
        except (OverflowError, TypeError):  # not token ids: forget the request
            del entry.continuation[start - entry.prompt_len:]  # what extend took
            self._drop(request_id)
            return 0
        self._count(entry, len(new), len(new))
        self._evict()
        return len(new)

    def close(self, request_id: str) -> None:
        """The request ended (or was released): keep what it gave, if anything."""
        entry = self._entries.get(request_id)
        if entry is None:
            return
        entry.open = False
        if not entry.continuation:  # nothing verified: nothing to learn from
            self._drop(request_id)

    # ---- for training and the guard ------------------------------------------------

    def train_examples(self) -> list[Example]:
        """The examples of requests not held out, oldest first."""
        return self._examples(heldout=False)

    def heldout_examples(self) -> list[Example]:
        """The held-out requests' examples, oldest first: never trained on."""
        return self._examples(heldout=True)

    @property
    def train_tokens(self) -> int:
        return self.tokens - self.heldout_tokens

    def requests(self) -> int:
        """Requests kept (open or closed)."""
        return len(self._entries)

    # ---- bookkeeping ---------------------------------------------------------------

    def _examples(self, heldout: bool) -> list[Example]:
        return [Example(rid, e.context.tolist(), e.continuation.tolist())
                for rid, e in self._entries.items()
                if e.heldout == heldout and e.continuation]

    def _count(self, entry: _Entry, tokens: int, positions: int) -> None:
        self.tokens += tokens
        if entry.heldout:
            self.heldout_tokens += tokens
            self.heldout_positions += positions

    def _drop(self, request_id: str) -> None:
        entry = self._entries.pop(request_id)
        self._count(entry, -entry.tokens, -len(entry.continuation))

    def _evict(self) -> None:
        # Oldest first. The newest request alone always fits
        # (per_request_tokens <= max_tokens), so this ends before reaching it.
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))
            self.evicted += 1
