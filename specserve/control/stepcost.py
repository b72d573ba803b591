"""The target's measured decode step cost: step seconds = a + b · tokens.

Owns `StepCostFit`, a least-squares fit over the target's recent decode steps
(fed by `specserve.target.engine`'s stat logger with vLLM's step timing), which
the K controller turns into a `specserve.control.policy.StepCost`. Pure: fed
with numbers, no clock of its own.
"""

from __future__ import annotations

import collections

from specserve.control.policy import StepCost

MIN_STEPS = 16  # engine steps before the fit is trusted


class StepCostFit:
    """Least-squares fit of step seconds = a + b · tokens over recent steps."""

    def __init__(self, window: int = 512):
        self.points: collections.deque = collections.deque(maxlen=window)

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.points.append((float(tokens), float(seconds)))

    def __len__(self) -> int:
        return len(self.points)

    def fit(self) -> tuple[float, float] | None:
        """(a, b) in seconds and seconds per token; None with too few points.
        With no spread in tokens, all cost is fixed (b = 0). Both are >= 0."""
        points = list(self.points)  # one copy: the engine's thread may append meanwhile
        n = len(points)
        if n < MIN_STEPS:
            return None
        mx = sum(x for x, _ in points) / n
        my = sum(y for _, y in points) / n
        sxx = sum((x - mx) ** 2 for x, _ in points)
        if sxx <= 1e-12:
            return my, 0.0
        b = sum((x - mx) * (y - my) for x, y in points) / sxx
        b = max(b, 0.0)
        a = max(my - b * mx, 0.0)
        return a, b

    def cost(self) -> StepCost | None:
        fit = self.fit()
        return StepCost(*fit) if fit is not None else None

    def as_dict(self) -> dict | None:
        """The fit as reported (None until MIN_STEPS steps were measured)."""
        fit = self.fit()
        if fit is None:
            return None
        return {"fixed_s": fit[0], "per_token_s": fit[1], "steps": len(self.points)}
