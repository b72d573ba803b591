"""The synthetic draft: the target's own greedy continuation, corrupted at rate 1 − A.

`--draft synthetic:A` (or `synthetic:A@Dms`, `synthetic:A@Dms,hH`) stands in for a draft model of
known quality. It has no model: it replays the target's greedy continuation of
each prompt (recorded beforehand from a target-only run of the same prompts,
the *replay*) and replaces each token, independently with probability 1 − A, by
a different token. So at every drafted position the token is the target's
greedy choice with probability A, whatever came before:

    P(position i accepted | positions < i accepted) = A          (greedy)
    tokens per verify step with K drafts = (1 − A^(K+1)) / (1 − A)

(vLLM's plain acceptance rate, accepted / drafted, is *lower* than A: it counts
the drafts after a rejection too, which are never accepted.) The optional delay
D (milliseconds per token) stands in for a draft model's speed; without one,
tokens come at once. The synthetic draft streams through the same DraftRunner,
SinkLink and gRPC path as a real draft, so it measures the system's own
efficiency at any acceptance, model quality aside.

Corruption is a pure function of (seed, prompt, position): a re-sent or
re-drafted window carries the same tokens, and two runs with the same seed draft
the same. A corrupted token is never the target's greedy token.

Owns: parsing `synthetic:A[@Dms]`, the replay file (JSON lines
`{"prompt_token_ids": [...], "token_ids": [...]}`), the corruption rule, and
`SyntheticDraftModel` (the runner's DraftModel). Never decides output.

Where the replay comes from: `LocalSpec` records it with the target engine
itself before the first request (`specserve generate`), and `specserve bench`
uses its target-only run. A Ray Serve draft replica cannot know a request's
continuation in advance, so `specserve serve` does not offer synthetic drafts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import re
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

PREFIX = "synthetic:"
# Tokens per message when there is no delay: the runner sends the whole window
# after each chunk, so a few big chunks keep the sink's window full without
# flooding it (it holds at most 64 drafted tokens per request anyway).
CHUNK = 16

_SPEC_RE = re.compile(r"^synthetic:(?P<alpha>[0-9]*\.?[0-9]+)(@(?P<delay>[0-9]*\.?[0-9]+)ms)?"
                      r"(,h(?P<hit>[0-9]*\.?[0-9]+))?$")
DEFAULT_RECOVERY_HIT = 0.6
FAN_OUT = 3  # F: alternatives ranked at each position (SpeculationConfig.branch_fan_out)


@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
    alpha: float  # probability that a drafted token is the target's greedy token
    delay_ms: float = 0.0  # per draft forward step (main line and every branch: one step)
    recovery_hit: float = DEFAULT_RECOVERY_HIT  # H: the alternatives hold the target's token

    def __str__(self) -> str:
        return (f"{PREFIX}{self.alpha:g}" + (f"@{self.delay_ms:g}ms" if self.delay_ms else "")
                + (f",h{self.recovery_hit:g}" if self.recovery_hit != DEFAULT_RECOVERY_HIT
                   else ""))


def is_synthetic(draft: str | None) -> bool:
    return bool(draft) and draft.lower().startswith(PREFIX)


def parse(draft: str) -> SyntheticSpec:
    """'synthetic:0.8', 'synthetic:0.8@2ms' or 'synthetic:0.8@2ms,h0.6'; ValueError
    with the fix otherwise."""
    m = _SPEC_RE.match(draft.strip().lower())
    if m is None:
        raise ValueError(f"bad synthetic draft {draft!r}; write synthetic:A, synthetic:A@Dms or "
                         "synthetic:A@Dms,hH with 0 <= A, H <= 1 and a delay D in ms per draft "
                         "step, e.g. synthetic:0.8@20ms,h0.6")
    alpha = float(m["alpha"])
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"synthetic draft acceptance {alpha} is outside [0, 1]")
    hit = float(m["hit"]) if m["hit"] is not None else DEFAULT_RECOVERY_HIT
    if not 0.0 <= hit <= 1.0:
        raise ValueError(f"synthetic draft recovery hit rate {hit} is outside [0, 1]")
    return SyntheticSpec(alpha, float(m["delay"] or 0.0), hit)


# ---- the corruption rule (pure) ---------------------------------------------------


def prompt_digest(prompt: Sequence[int]) -> bytes:
    return hashlib.blake2b(struct.pack(f"<{len(prompt)}q", *prompt), digest_size=16).digest()


def _draw(seed: int, digest: bytes, position: int) -> tuple[float, int]:
    """(uniform in [0, 1), 64 random bits) for one (seed, prompt, position)."""
    h = hashlib.blake2b(struct.pack("<qq", seed, position) + digest, digest_size=16).digest()
    u, r = struct.unpack("<QQ", h)
    return u / 2.0**64, r


def drafted_token(true_token: int, alpha: float, seed: int, digest: bytes, position: int,
                  vocab_size: int) -> int:
    """The target's token with probability alpha, else another token of the vocabulary."""
    u, r = _draw(seed, digest, position)
    if u < alpha or vocab_size < 2:
        return true_token
    return (true_token + 1 + r % (vocab_size - 1)) % vocab_size


def alternatives(true_token: int, alpha: float, hit: float, seed: int, digest: bytes,
                 position: int, vocab_size: int, fan_out: int = FAN_OUT) -> list[int]:
    """The draft's `fan_out` next-best tokens at a position, best first: never
    its own drafted token; where that one is corrupted, the target's token is
    among them with probability `hit`, at rank i with probability ∝ 1/(i + 1)."""
    main = drafted_token(true_token, alpha, seed, digest, position, vocab_size)
    h = hashlib.blake2b(struct.pack("<qqq", seed, position, 0x6272616e6368) + digest,
                        digest_size=16).digest()
    u, r = struct.unpack("<QQ", h)
    out: list[int] = []
    if main != true_token and u / 2.0**64 < hit:
        # Rank i with probability ∝ 1/(i + 1): a draft's next-best token is
        # likelier the better it ranks, so fewer alternatives find it less often.
        weights = [1.0 / (i + 1) for i in range(fan_out)]
        x = (r & 0xFFFFFFFF) / 2.0**32 * sum(weights)
        rank = 0
        while rank < fan_out - 1 and x >= weights[rank]:
            x -= weights[rank]
            rank += 1
    else:
        rank = -1
    step = 0
    while len(out) < fan_out and vocab_size > 2:
        if len(out) == rank:
            out.append(true_token)
            continue
        step += 1
        t = (true_token + 7919 * step + (r >> 16) % max(vocab_size - 1, 1)) % vocab_size
        if t != true_token and t != main and t not in out:
            out.append(t)
        if step > 8 * fan_out + 64:
            break
    return out


# ---- the replay --------------------------------------------------------------------


def write_replay(path: Path | str, records: Iterable[tuple[Sequence[int], Sequence[int]]]) -> None:
    """(prompt ids, target's greedy output ids) per prompt, as JSON lines."""
    with open(path, "w") as f:
        for prompt, output in records:
            f.write(json.dumps({"prompt_token_ids": list(prompt), "token_ids": list(output)}))
            f.write("\n")


class Replay:
    """The target's greedy continuations, looked up by a sequence they prefix."""

    def __init__(self, records: Iterable[tuple[Sequence[int], Sequence[int]]] = ()):
        # prompt length -> {prompt tuple: full sequence (prompt + output)}
        self._by_len: dict[int, dict[tuple[int, ...], tuple[list[int], bytes]]] = {}
        for prompt, output in records:
            self.add(prompt, output)

    def add(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        p = tuple(prompt)
        self._by_len.setdefault(len(p), {})[p] = (list(p) + list(output), prompt_digest(p))

    def __len__(self) -> int:
        return sum(len(d) for d in self._by_len.values())

    @classmethod
    def load(cls, path: Path | str) -> "Replay":
        replay = cls()
        for line in Path(path).read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                replay.add(r["prompt_token_ids"], r["token_ids"])
        return replay

    def find(self, tokens: Sequence[int]) -> tuple[list[int], int, bytes] | None:
        """(recorded sequence, prompt length, prompt digest) of the longest
        recorded prompt that `tokens` starts with; None if there is none."""
        best = None
        for n, prompts in self._by_len.items():
            if n <= len(tokens) and (best is None or n > best[1]):
                hit = prompts.get(tuple(tokens[:n]))
                if hit is not None:
                    best = (hit[0], n, hit[1])
        return best


def explains(tokens: Sequence[int], seq: Sequence[int], start: int, spec_alpha: float, seed: int,
             digest: bytes, vocab_size: int) -> bool:
    """Every token of `tokens` from `start` on is either the recorded one or this
    draft's own corruption of it: the target has not left the recorded path."""
    if len(tokens) > len(seq):
        return False
    for p in range(start, len(tokens)):
        t = tokens[p]
        if t != seq[p] and t != drafted_token(seq[p], spec_alpha, seed, digest, p, vocab_size):
            return False
    return True


class SyntheticDraftModel:
    """DraftModel for the DraftRunner: replays and corrupts, no model at all.

    For a sequence S (prompt, verified tokens, own drafts) it drafts positions
    len(S), len(S)+1, ... from the recorded sequence, each corrupted by the rule.
    It drafts nothing for a prompt it has no record of, past the end of the
    record, or once the target has left the recorded path (sampling, or an
    engine whose greedy choice differs): then it is no help, and says so by
    silence rather than by guessing.
    """

    def __init__(self, spec: SyntheticSpec, replay: Replay, vocab_size: int, seed: int = 0,
                 max_model_len: int = 1 << 30, fan_out: int = FAN_OUT):
        self.spec = spec
        self.replay = replay
        self.vocab_size = vocab_size
        self.seed = seed
        self.max_model_len = max_model_len
        self.unknown_prompts = 0
        self.fan_out = max(fan_out, 1)  # F: H is the chance the top F hold the target's token
        # request id -> its record. `Replay.find` hashes a prefix of the tokens
        # per recorded prompt length: with 64 prompts of 4 000 tokens, ~5 ms of
        # the draft process's CPU at every segment and branch, taken from a
        # target that shares the machine.
        self._found: dict[str, tuple[list[int], int, bytes] | None] = {}

    def _record(self, request_id: str, tokens: Sequence[int]):
        """`Replay.find(tokens)`, remembered for the request while its tokens
        still start with the found prompt (a list comparison, no hashing)."""
        found = self._found.get(request_id)
        if found is None or list(tokens[:found[1]]) != found[0][:found[1]]:
            found = self._found[request_id] = self.replay.find(tokens)
        return found

    def forget(self, request_id: str, before: int | None = None) -> None:
        """The runner is done with the request (before=None), or with its
        positions before `before` (nothing to drop here)."""
        if before is None:
            self._found.pop(request_id, None)

    async def continue_tokens(self, segment_id, request_id, tokens, max_tokens):
        found = self._record(request_id, tokens)
        if found is None:
            self.unknown_prompts += 1
            return
        seq, n_prompt, digest = found
        a = self.spec.alpha
        if not explains(tokens, seq, n_prompt, a, self.seed, digest, self.vocab_size):
            return
        end = min(len(tokens) + max_tokens, len(seq))
        p = len(tokens)
        delay = self.spec.delay_ms / 1000.0
        while p < end:
            n = 1 if delay > 0 else min(CHUNK, end - p)
            # Sleep even without a delay: give the event loop (gRPC) its turn.
            await asyncio.sleep(delay * n)
            yield [drafted_token(seq[q], a, self.seed, digest, q, self.vocab_size)
                   for q in range(p, p + n)]
            p += n

    def branches(self, request_id: str, tokens: Sequence[int], fork: int, count: int,
                 length: int) -> list[list[int]]:
        """`count` branches forking at `fork` of the main line `tokens`: an
        alternative, then the main line's own draws for the positions after it,
        as far as the main line has been drafted (a batched engine drafts one
        more token of every branch per step) and at most `length` of them."""
        found = self._record(request_id, tokens)
        if found is None or count <= 0 or not 0 <= fork < len(tokens):
            return []
        seq, n_prompt, digest = found
        if fork < n_prompt or fork >= len(seq):
            return []
        a = self.spec.alpha
        alts = alternatives(seq[fork], a, self.spec.recovery_hit, self.seed, digest, fork,
                            self.vocab_size, self.fan_out)[:count]
        end = min(fork + 1 + length, len(tokens), len(seq))
        cont = [drafted_token(seq[q], a, self.seed, digest, q, self.vocab_size)
                for q in range(fork + 1, end)]
        return [[t, *cont] for t in alts]
