"""The draft book: drafts buffered at the target, and their matching to batch rows.

Owns, for every request a draft has opened at this target: the speculative
sequence S (prompt + verified tokens + drafted tokens not yet verified) and the
verified length V (how much of S the target has confirmed). It decides which
drafted tokens to propose for each row of the target's batch and which verified
tokens to report back to each draft.

Pure logic: no threads, no gRPC, no vLLM. The caller (the sink) serialises access.

Matching. Rows of the engine batch carry no request id, only their token history
H. A buffered sequence S applies to a row exactly when H is a prefix of S; we then
propose S[len(H):len(H)+k]. This is sound whatever S holds, because the target's
rejection sampler decides every token (drafts are hints). To find candidates fast,
requests are indexed by (len(V), last verified token): a row that advanced by g
tokens since the last step (0 <= g <= max_advance) is looked up under
(len(H) - g, H[len(H) - g - 1]) and confirmed by comparing the whole verified
prefix. Requests that were not matched at the last step (new, or lost track of)
are compared against the rows nobody claimed.

Bounds. Each request holds at most `max_pending` drafted tokens past its verified
position, a book holds at most `max_requests` requests, and token ids must lie in
[0, vocab_size). Breaking a bound raises BookError with a gRPC-style code; the
sink turns it into a per-request error or ends the stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np

# gRPC status code numbers (grpc.StatusCode values), kept here so this module
# does not import grpc.
INVALID_ARGUMENT = 3
NOT_FOUND = 5
ALREADY_EXISTS = 6
RESOURCE_EXHAUSTED = 8


class BookError(Exception):
    """A message was refused. `code` is a gRPC status code number."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclasses.dataclass
class VerifiedUpdate:
    """Tokens the target verified for a request: positions [position, position+len)."""

    key: Hashable  # (stream id, request id)
    position: int
    token_ids: list[int]


class _Entry:
    """One request's speculative sequence; tokens[:verified] are confirmed."""

    __slots__ = ("tokens", "length", "verified", "reported", "prompt_len", "k")

    def __init__(self, prompt: Sequence[int], k: int = 0):
        n = len(prompt)
        self.tokens = np.empty(max(16, 2 * n), dtype=np.int64)
        self.tokens[:n] = prompt
        self.length = n  # len(S)
        self.verified = n  # len(V): the prompt is verified by definition
        self.reported = n  # verified tokens already sent back to the draft
        self.prompt_len = n
        self.k = k  # at most this many proposed tokens per step; 0: the caller's k

    def seq(self) -> np.ndarray:
        return self.tokens[: self.length]

    def put(self, start: int, values: np.ndarray) -> None:
        """Overwrite from `start` on with `values`; S ends after them."""
        end = start + len(values)
        if end > len(self.tokens):
            grown = np.empty(max(end, 2 * len(self.tokens)), dtype=np.int64)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        self.tokens[start:end] = values
        self.length = end


@dataclasses.dataclass
class BookStats:
    """Counters of what the book did; cumulative, for metrics and tests."""

    opened: int = 0
    closed: int = 0
    draft_messages: int = 0
    draft_tokens_buffered: int = 0
    stale_messages: int = 0  # built on a history the target has left, or a gap
    rows_seen: int = 0
    rows_matched: int = 0  # rows bound to a request
    rows_with_proposals: int = 0  # rows that got at least one drafted token
    proposed_tokens: int = 0


class DraftBook:
    def __init__(
        self,
        vocab_size: int,
        max_requests: int = 4096,
        max_pending: int = 64,
        max_prompt_len: int = 1 << 20,
    ):
        if vocab_size < 1 or max_requests < 1 or max_pending < 1:
            raise ValueError("vocab_size, max_requests and max_pending must be >= 1")
        self.vocab_size = vocab_size
        self.max_requests = max_requests
        self.max_pending = max_pending
        self.max_prompt_len = max_prompt_len
        self.stats = BookStats()
        self._entries: dict[Hashable, _Entry] = {}
        # (len(V), last verified token) -> keys. Every entry is in exactly one bucket.
        self._index: dict[tuple[int, int], set[Hashable]] = {}
        # Keys not matched to any row at the last propose(): searched the slow way.
        self._unmatched: set[Hashable] = set()

    # ---- messages from drafts -------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def open(self, key: Hashable, prompt: Sequence[int], k: int = 0) -> None:
        if key in self._entries:
            raise BookError(ALREADY_EXISTS, f"request {key[-1]!r} is already open on this stream")
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
        self._entries[key] = entry
        self._index_add(key, entry)
        self._unmatched.add(key)
        self.stats.opened += 1

    def extend(self, key: Hashable, position: int, tokens: Sequence[int]) -> int:
        """Drafted tokens for positions [position, position + len(tokens)).

        The part that overlaps what the book already holds must agree with it:
        a draft built on another history (stale, or after a rejection the draft
        has not heard of yet) is dropped. Returns how many tokens were added.
        """
        entry = self._entries.get(key)
        if entry is None:
            raise BookError(NOT_FOUND, f"unknown request {key[-1]!r}: open it first")
        arr = self._checked_tokens(tokens)
        self.stats.draft_messages += 1
        if position < entry.prompt_len or position > entry.length:
            # Before the prompt's end is not a draft; past S's end is a gap.
            self.stats.stale_messages += 1
            return 0
        overlap = min(entry.length - position, len(arr))
        if not np.array_equal(entry.tokens[position : position + overlap], arr[:overlap]):
            self.stats.stale_messages += 1
            return 0
        room = entry.verified + self.max_pending - entry.length
        new = arr[overlap : overlap + max(room, 0)]
        if len(new):
            entry.put(entry.length, new)
            self.stats.draft_tokens_buffered += len(new)
        return len(new)

    def close(self, key: Hashable) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._index_remove(key, entry)
        self._unmatched.discard(key)
        self.stats.closed += 1
        return True

    def close_all(self, stream_id: Hashable) -> int:
        """Drop every request of a stream (keys are (stream_id, request_id))."""
        keys = [k for k in self._entries if k[0] == stream_id]
        for k in keys:
            self.close(k)
        return len(keys)

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
    ) -> tuple[list[list[int]], list[VerifiedUpdate]]:
        """Drafts for each batch row, and the verified tokens to report.

        histories[i]: row i's token history (prompt + verified output), 1-D ints.
        k: at most this many drafted tokens per row.
        max_advance: the most tokens a row can gain in one step (k + 1).
        active[i]: False for rows that sampled nothing this step (partial
        prefill); they get no draft and update nothing.
        """
        proposals: list[list[int]] = [[] for _ in histories]
        claimed: dict[Hashable, int] = {}
        loose_rows: list[int] = []
        for i, h in enumerate(histories):
            if active is not None and not active[i]:
                continue
            self.stats.rows_seen += 1
            key = self._find_indexed(h, max_advance, claimed)
            if key is None:
                loose_rows.append(i)
            else:
                claimed[key] = i
        if loose_rows and self._unmatched:
            for key in list(self._unmatched):
                if key in claimed:
                    continue
                entry = self._entries[key]
                for j, i in enumerate(loose_rows):
                    h = histories[i]
                    if len(h) >= entry.verified and np.array_equal(
                        h[: entry.verified], entry.tokens[: entry.verified]
                    ):
                        claimed[key] = i
                        del loose_rows[j]
                        break
                if not loose_rows:
                    break

        updates: list[VerifiedUpdate] = []
        for key, i in claimed.items():
            self.stats.rows_matched += 1
            entry = self._entries[key]
            proposals[i] = self._advance(key, entry, histories[i], k)
            if proposals[i]:
                self.stats.rows_with_proposals += 1
                self.stats.proposed_tokens += len(proposals[i])
            if entry.verified > entry.reported:
                start = entry.reported
                updates.append(
                    VerifiedUpdate(key, start, entry.tokens[start : entry.verified].tolist())
                )
                entry.reported = entry.verified
        self._unmatched = set(self._entries) - set(claimed)
        return proposals, updates

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

    def _find_indexed(self, h: np.ndarray, max_advance: int, claimed) -> Hashable | None:
        """The request whose verified prefix h extends; among several (same
        prompt, say) the one whose drafts agree with h the longest."""
        n = len(h)
        for gain in range(0, max_advance + 1):
            m = n - gain
            if m < 1:
                break
            bucket = self._index.get((m, int(h[m - 1])))
            if not bucket:
                continue
            best, best_agree = None, -1
            for key in bucket:
                if key in claimed:
                    continue
                entry = self._entries[key]
                if not np.array_equal(h[:m], entry.tokens[:m]):
                    continue
                end = min(entry.length, n)
                agree = int(np.argmin(np.append(entry.tokens[m:end] == h[m:end], False)))
                if agree > best_agree:
                    best, best_agree = key, agree
            if best is not None:
                return best
        return None

    def _advance(self, key: Hashable, entry: _Entry, h: np.ndarray, k: int) -> list[int]:
        """Row history h extends entry's verified prefix: move V to len(h)."""
        n = len(h)
        self._index_remove(key, entry)
        v = entry.verified
        if n > v:
            have = min(entry.length, n)
            same = np.array_equal(entry.tokens[v:have], h[v:have])
            if not same or entry.length < n:
                # Rejection (or the target ran past the drafts): S restarts from H.
                entry.put(v, np.asarray(h[v:n], dtype=np.int64))
            entry.verified = n
        self._index_add(key, entry)
        if entry.k:
            k = min(k, entry.k)
        return entry.tokens[n : min(entry.length, n + k)].tolist()

    def _index_add(self, key: Hashable, entry: _Entry) -> None:
        v = entry.verified
        self._index.setdefault((v, int(entry.tokens[v - 1])), set()).add(key)

    def _index_remove(self, key: Hashable, entry: _Entry) -> None:
        v = entry.verified
        bucket_key = (v, int(entry.tokens[v - 1]))
        bucket = self._index.get(bucket_key)
        if bucket is not None:
            bucket.discard(key)
            if not bucket:
                del self._index[bucket_key]
