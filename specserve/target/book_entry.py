"""One request's entry in the draft book: its speculative sequence S (prompt +
verified + drafted tokens), how much of S is verified and reported, and its
branches (alternatives at fork positions, each with its continuation); and
what the book hands out: its verified updates and its errors. Pure."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from specserve.target.book_stats import FIRST

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


class _Entry:
    """One request's speculative sequence; tokens[:verified] are confirmed."""

    __slots__ = ("tokens", "length", "verified", "reported", "prompt_len", "k", "branches",
                 "branch_tokens", "last_start", "last_proposal", "last_outcome", "stream", "end",
                 "uncovered")

    def __init__(self, prompt: Sequence[int], k: int = 0):
        n = len(prompt)
        self.tokens = np.empty(max(16, 2 * n), dtype=np.int64)
        self.tokens[:n] = prompt
        self.length = n  # len(S)
        self.verified = n  # len(V): the prompt is verified by definition
        self.reported = n  # verified tokens already sent back to the draft
        self.prompt_len = n
        self.k = k  # at most this many proposed tokens per step; 0: the caller's k
        # (fork position, alternative token) -> tokens from the fork on.
        self.branches: dict[tuple[int, int], np.ndarray] = {}
        self.branch_tokens = 0
        self.last_start = -1  # where the last proposal started (len(H) then)
        self.last_proposal: list[int] = []
        self.last_outcome = FIRST  # how this request's last verify step ended
        self.stream: Hashable = None  # the draft stream attached to it (None: none)
        self.end: int | None = None  # where the output ends (history length); None: unknown
        self.uncovered = 0  # this request's steps in a row without drafts

    def drop_branches(self, which: Callable[[int], bool] | None = None) -> int:
        """Drop the branches whose fork position `which` holds (all: None);
        returns how many tokens they held."""
        if not self.branches:
            return 0  # the usual case, on the engine step's path
        gone = [b for b in self.branches if which is None or which(b[0])]
        n = sum(len(self.branches.pop(b)) for b in gone)
        self.branch_tokens -= n
        return n

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
