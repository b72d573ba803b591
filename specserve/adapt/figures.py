"""A draft replica's adaptation figures, as `/v1/spec/stats` shows them per draft pool.

Owns `RoundFigures` (what the replica's adapter measured last) and one pure
function, `adapt_figures`: the replica's buffer, its version store's figures
and the adapter's figures into

    {version, heldout_alpha_serving, heldout_alpha_candidate,
     buffer_tokens, heldout_tokens, swaps, rollbacks,
     rounds, train_seconds, last_round}

(alphas null until measured; version: the one this replica's draft engine
serves, null when the replica has no version store; train_seconds: the latest round's; last_round: what it did, in words). The draft replica answers it (`deployments/draft.py`
`DraftServer.adapt`), a target replica asks one replica of each pool
(`TargetServer.draft_adapt`), and the router puts it on the pool's row
(`specserve.control.pools.with_adapt`). Never does: I/O.
"""

from __future__ import annotations

import dataclasses

from specserve.adapt.buffer import AdaptBuffer
from specserve.adapt.guard import HeldOutAlpha


@dataclasses.dataclass
class RoundFigures:
    """A replica's latest adaptation measurements (`specserve.adapt.adapter`)."""

    serving: HeldOutAlpha | None = None  # the serving weights, latest measure
    candidate: HeldOutAlpha | None = None  # the latest candidate
    started: HeldOutAlpha | None = None  # the serving weights when they started serving
    rounds: int = 0
    train_seconds: float = 0.0  # the latest round's
    last: str = ""  # what the latest round did, in words


def adapt_figures(buffer: AdaptBuffer, versions: dict | None = None,
                  rounds: RoundFigures | None = None, loaded: str | None = None) -> dict:
    """versions: VersionStore.figures() ({version, swaps, rollbacks}) or None;
    rounds: the adapter's figures (None: no adapter, nothing measured);
    loaded: the version the replica's draft engine serves (None: the store's
    current one), which lags the store's by at most one poll after a swap."""
    versions = versions or {}
    rounds = rounds or RoundFigures()
    serving, candidate = rounds.serving, rounds.candidate
    return {"version": loaded or versions.get("version"),
            "heldout_alpha_serving": serving.alpha if serving is not None else None,
            "heldout_alpha_candidate": candidate.alpha if candidate is not None else None,
            "buffer_tokens": buffer.tokens,
            "heldout_tokens": buffer.heldout_tokens,
            "swaps": versions.get("swaps", 0),
            "rollbacks": versions.get("rollbacks", 0),
            "rounds": rounds.rounds,
            "train_seconds": round(rounds.train_seconds, 1),
            "last_round": rounds.last or None}
