"""A draft replica's adaptation figures, as `/v1/spec/stats` shows them per draft pool.

Owns one pure function, `adapt_figures`: the replica's buffer, its version
store's figures and the latest held-out alpha measurements into

    {version, heldout_alpha_serving, heldout_alpha_candidate,
     buffer_tokens, heldout_tokens, swaps, rollbacks}

(alphas null until measured; version null when the replica has no version
store). The draft replica answers it (`deployments/draft.py`
`DraftServer.adapt`), a target replica asks one replica of each pool
(`TargetServer.draft_adapt`), and the router puts it on the pool's row
(`specserve.control.pools.with_adapt`). Never does: I/O.
"""

from __future__ import annotations

from specserve.adapt.buffer import AdaptBuffer
from specserve.adapt.guard import HeldOutAlpha


def adapt_figures(buffer: AdaptBuffer, versions: dict | None = None,
                  serving: HeldOutAlpha | None = None,
                  candidate: HeldOutAlpha | None = None) -> dict:
    """versions: VersionStore.figures() ({version, swaps, rollbacks}) or None;
    serving / candidate: the latest held-out agreement of the serving weights
    and of the latest candidate, None until measured."""
    versions = versions or {}
    return {"version": versions.get("version"),
            "heldout_alpha_serving": serving.alpha if serving is not None else None,
            "heldout_alpha_candidate": candidate.alpha if candidate is not None else None,
            "buffer_tokens": buffer.tokens,
            "heldout_tokens": buffer.heldout_tokens,
            "swaps": versions.get("swaps", 0),
            "rollbacks": versions.get("rollbacks", 0)}
