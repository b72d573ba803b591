"""The guard: new draft weights serve only if they beat the serving ones on the held-out slice.

Owns one pure decision, `judge`: given the greedy agreement of the serving
weights and of a candidate on the same held-out positions (the held-out
requests of `specserve.adapt.buffer`, never trained on; counted as
`specserve.tools.distill.recipe.greedy_agreement` counts them), swap only when

    alpha_candidate > alpha_serving + margin     (margin in alpha points)

and there are at least `min_positions` positions. Anything else is a refusal,
with the reason an operator reads in the figures. A refused candidate costs
nothing: drafts are hints, and the serving weights keep serving.

Never does: measure alpha, load weights, or swap.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class HeldOutAlpha:
    """Greedy agreement on the held-out slice: `agreed` of `positions` positions."""

    agreed: int
    positions: int

    @classmethod
    def of(cls, agreement: tuple[int, int]) -> HeldOutAlpha:
        """From greedy_agreement's (agreeing positions, positions)."""
        agreed, positions = agreement
        return cls(int(agreed), int(positions))

    @property
    def alpha(self) -> float | None:
        """agreed / positions; None with no positions."""
        return self.agreed / self.positions if self.positions > 0 else None


@dataclasses.dataclass(frozen=True)
class GuardDecision:
    swap: bool
    reason: str


def judge(serving: HeldOutAlpha, candidate: HeldOutAlpha, margin: float,
          min_positions: int) -> GuardDecision:
    """Whether `candidate` may replace `serving`, and why (AdaptConfig.margin,
    AdaptConfig.min_heldout_positions)."""
    if serving.positions != candidate.positions:
        return GuardDecision(False, f"refused: measured on different held-out positions "
                                    f"(serving {serving.positions}, candidate "
                                    f"{candidate.positions}); measure both on one slice")
    if serving.positions < max(min_positions, 1):
        return GuardDecision(False, f"refused: too few held-out positions "
                                    f"({serving.positions} < {min_positions})")
    if not (0 <= serving.agreed <= serving.positions
            and 0 <= candidate.agreed <= candidate.positions):
        return GuardDecision(False, f"refused: agreement out of range (serving "
                                    f"{serving.agreed}/{serving.positions}, candidate "
                                    f"{candidate.agreed}/{candidate.positions})")
    a_serving, a_candidate = serving.alpha, candidate.alpha
    if a_candidate > a_serving + margin:
        return GuardDecision(True, f"swap: candidate α {a_candidate:.3f} > serving α "
                                   f"{a_serving:.3f} + margin {margin:g} "
                                   f"({serving.positions} held-out positions)")
    return GuardDecision(False, f"refused: candidate α {a_candidate:.3f} ≤ serving α "
                                f"{a_serving:.3f} + margin {margin:g} "
                                f"({serving.positions} held-out positions)")
