"""One request's entry in the draft book (its slot in the store, its prompt's
length, its stream) and what the book hands out: verified updates, packed
(`Verified`) or one by one, and its errors. Pure."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

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

    key: Hashable  # the request's key in the book
    position: int
    token_ids: list[int]
    stream: Hashable = None  # the draft stream it goes to
    held: int = 0  # where the book's drafted tokens for it end after the step


@dataclasses.dataclass
class Verified:
    """The verified tokens of one step for the drafts, packed: update i is
    request keys[i] (attached to streams[i]) at positions [positions[i],
    positions[i] + counts[i]), its tokens the next counts[i] of `tokens`;
    the book holds its drafted tokens up to held[i] after the step."""

    keys: list
    streams: list
    positions: np.ndarray
    counts: np.ndarray
    tokens: np.ndarray
    held: np.ndarray

    @classmethod
    def none(cls) -> "Verified":
        empty = np.zeros(0, np.int64)
        return cls([], [], empty, empty, empty, empty)

    def __len__(self) -> int:
        return len(self.keys)

    def by_stream(self) -> dict[Hashable, "Verified"]:
        """The same updates split by the stream each goes to."""
        if len(set(self.streams)) <= 1:  # the usual case: one draft replica (or none)
            return {self.streams[0]: self} if self.keys else {}
        ends = np.cumsum(self.counts)
        which: dict[Hashable, list[int]] = {}
        for i, sid in enumerate(self.streams):
            which.setdefault(sid, []).append(i)
        return {sid: Verified([self.keys[i] for i in rows], [sid] * len(rows),
                              self.positions[rows], self.counts[rows],
                              np.concatenate([self.tokens[ends[i] - self.counts[i]:ends[i]]
                                              for i in rows]), self.held[rows])
                for sid, rows in which.items()}

    def updates(self) -> list[VerifiedUpdate]:
        out, at = [], 0
        for key, stream, pos, n, held in zip(self.keys, self.streams, self.positions.tolist(),
                                             self.counts.tolist(), self.held.tolist()):
            out.append(VerifiedUpdate(key, pos, self.tokens[at : at + n].tolist(), stream, held))
            at += n
        return out


class _Entry:
    """One registered request: where its hot state lives in the store (its
    slot), and what the messages need: its prompt's length and its stream."""

    __slots__ = ("store", "slot", "prompt_len", "stream")

    def __init__(self, store, slot: int, prompt_len: int):
        self.store = store
        self.slot = slot
        self.prompt_len = prompt_len
        self.stream: Hashable = None  # the draft stream attached to it (None: none)

    @property
    def verified(self) -> int:
        return int(self.store.V[self.slot])

    @property
    def length(self) -> int:
        return int(self.store.L[self.slot])

    @property
    def k(self) -> int:
        return int(self.store.own_k[self.slot])

    @property
    def branches(self) -> dict:
        return self.store.branches(self.slot)

    @property
    def branch_tokens(self) -> int:
        return self.store.branch_tokens(self.slot)


def _name(key: Hashable) -> str:
    """A key's request id, for messages (keys may be (stream, request id))."""
    return str(key[-1] if isinstance(key, tuple) and key else key)
