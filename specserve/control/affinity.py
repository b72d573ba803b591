"""Prefix affinity within a load bound: which replica a request should go to.

Owns the pure part of routing by prefix and load, for target replicas (keyed
by the request's text: the chat messages or the prompt) and draft replicas
(keyed by the prompt's token ids):

- `prefix_keys`: a request's prefix as chained hashes of fixed-size chunks
  (as vLLM's block hashes: chunk i's key covers chunks 0..i), so that two
  requests share their first n keys exactly when they share their first n
  chunks;
- `PrefixIndex`: which replica was sent which keys, bounded (least recently
  used keys go first), an approximate radix tree per replica as sgl-router's
  cache-aware policy keeps;
- `choose`: the replica order for one request: among the replicas whose load
  is within the bound of the least loaded one, the longest prefix match; ties
  by load, then by a hash of the request's first key (rendezvous hashing, so
  that routers with no shared state agree on a new conversation's replica),
  and why (`REASONS`);
- `conversation_text`: the text of an OpenAI request body that prefixes the
  next turn's (messages or prompt), nothing else of it.

Never does: I/O, Ray, or know what a replica is beyond its id string.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence

# Why a replica was chosen: "prefix": it holds a longer prefix of the request
# than the other replicas within the load bound; "load": no replica within the
# bound held more of it than another (a new conversation, or no key), so the
# least loaded one; "balance": a replica holding more of the prefix was over
# the load bound, so the prefix gave way to the load.
REASONS = ("prefix", "load", "balance")

# At most this many chunks of a request count (longer prefixes match as
# equal): bounds the work per request and the index per conversation.
MAX_CHUNKS = 512


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prefix_keys(seq: str | Sequence[int] | None, chunk: int) -> list[int]:
    """Chained hashes of seq's whole chunks of `chunk` characters (a str) or
    token ids (a sequence of ints), at most MAX_CHUNKS; a partial last chunk
    has no key. Stable across processes (blake2b, not Python's hash)."""
    if not seq or chunk < 1:
        return []
    keys: list[int] = []
    prev = b""
    for i in range(0, min(len(seq) // chunk, MAX_CHUNKS) * chunk, chunk):
        part = seq[i:i + chunk]
        data = (part.encode("utf-8", "surrogatepass") if isinstance(part, str)
                else ",".join(map(str, part)).encode())
        key = _digest(prev + data)
        keys.append(key)
        prev = key.to_bytes(8, "little")
    return keys


class PrefixIndex:
    """The prefix keys each replica was sent, at most `capacity` keys (the
    least recently used are forgotten first)."""

    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self._keys: OrderedDict[int, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, keys: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        """For each replica, how many of the leading keys it was sent."""
        matched = {r: 0 for r in replicas}
        alive = set(matched)
        for n, key in enumerate(keys, 1):
            alive &= self._keys.get(key, set())
            if not alive:
                break
            for r in alive:
                matched[r] = n
        return matched

    def insert(self, keys: Sequence[int], replica: str) -> None:
        """The request with these keys was sent to `replica`."""
        for key in keys:
            holders = self._keys.get(key)
            if holders is None:
                self._keys[key] = {replica}
            else:
                holders.add(replica)
                self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def drop(self, replica: str) -> None:
        """Forget a replica (it died or was scaled down)."""
        for key in [k for k, h in self._keys.items() if replica in h]:
            holders = self._keys[key]
            holders.discard(replica)
            if not holders:
                del self._keys[key]


@dataclasses.dataclass(frozen=True)
class Choice:
    order: list[str]  # the replicas, preferred first
    reason: str  # one of REASONS
    matched: int  # keys the first replica holds


def _rendezvous(first_key: int, replica: str) -> int:
    return _digest(first_key.to_bytes(8, "little") + replica.encode())


def choose(replicas: Sequence[str], loads: dict[str, int], matched: dict[str, int],
           first_key: int | None, max_extra: int) -> Choice:
    """The order to try `replicas` in for one request, and why.

    loads: requests each replica has in flight (missing: 0); matched: keys of
    the request each replica holds (`PrefixIndex.match`); first_key: the
    request's first prefix key (None: it has none); max_extra: the load bound,
    how many more requests than the least loaded replica a replica may have
    and still be chosen for its prefix."""
    if not replicas:
        return Choice([], "load", 0)
    load = {r: max(loads.get(r, 0), 0) for r in replicas}
    least = min(load.values())
    within = [r for r in replicas if load[r] <= least + max_extra]

    def rank(r: str):
        tie = _rendezvous(first_key, r) if first_key is not None else 0
        return (-matched.get(r, 0), load[r], tie, r)

    best = min(within, key=rank)
    rest = sorted((r for r in replicas if r != best),
                  key=lambda r: (load[r], -matched.get(r, 0), r))
    m = matched.get(best, 0)
    if any(matched.get(r, 0) > m for r in replicas):
        reason = "balance"
    elif m > 0 and any(matched.get(r, 0) < m for r in within):
        reason = "prefix"
    else:
        reason = "load"
    return Choice([best, *rest], reason, m)


def _text(value) -> str:
    """The text of a message's content (a string, or OpenAI's list of parts)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text(p.get("text") if isinstance(p, dict) else p) for p in value)
    return ""


def conversation_text(body: bytes) -> str | Sequence[int] | None:
    """What of an OpenAI request body the next turn of its conversation starts
    with: the chat messages (role and text of each, in order) or the
    completion prompt (a string, or token ids); None when the body has none
    (not JSON, a batch of prompts, other routes)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    messages = data.get("messages")
    if isinstance(messages, list):
        # Each message ends with a separator no text holds, so that one
        # turn's text is a prefix of the next turn's exactly when its messages are.
        return "".join(f"{m.get('role', '')}\x1f{_text(m.get('content'))}\x1e"
                       for m in messages if isinstance(m, dict))
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    return None


@dataclasses.dataclass
class Tally:
    """Choices made, by reason; `full`: the preferred replica was at its
    max_ongoing_requests and Serve sent the request to the next one."""

    counts: dict[str, int] = dataclasses.field(
        default_factory=lambda: {r: 0 for r in (*REASONS, "full")})
    matched_keys: int = 0  # prefix keys the chosen replicas held, summed
    keys: int = 0  # prefix keys of the routed requests, summed

    def count(self, reason: str, matched: int, keys: int) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.matched_keys += matched
        self.keys += keys

    def add(self, other: "Tally") -> None:
        """Add another router's choices (the app's figures, specserve.acceptance.ledger)."""
        for reason, n in other.counts.items():
            self.counts[reason] = self.counts.get(reason, 0) + n
        self.matched_keys += other.matched_keys
        self.keys += other.keys

    def snapshot(self) -> dict:
        return {"choices": dict(self.counts),
                "prefix_match_rate": (self.matched_keys / self.keys) if self.keys else None}
