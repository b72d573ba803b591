"""Adaptive K for one target engine, from its own measured step costs and acceptance.

Pure: fed with numbers, returns decisions; no engine, no clock. `LocalSpec`
(with `adaptive_k=True`, as `specserve bench` runs its `specserve` system) asks
it for each new request's K and feeds it every engine step and every finished
request.

Owns the measurements: `StepCostFit`, the least-squares fit of the target's
decode step seconds = a + b · tokens over its recent steps (the Serve target
replica keeps one too and reports it to the router), and `DraftFigures`, α and
coverage from vLLM's per-request figures. The model that turns them into K
(predicted rate, speedup, choose_k with a margin) is `specserve.control.policy`'s, the
same one the Serve router decides with. On a GPU b is tiny at low batch
(verifying more tokens is nearly free); on these CPUs it is not.

Until the draft is measured, requests run at K_max; at K = 0 every
`probe_every`-th request runs at K_max so that a better draft (or lighter load)
is noticed. Draft quality that the draft does not show (it never drafts in
time) is coverage 0: speculation cannot pay, K = 0.
"""

from __future__ import annotations

import collections
import dataclasses

from specserve.control.policy import MARGIN, StepCost, choose_k, speedup

MIN_DRAFTED = 64  # drafted tokens before acceptance is trusted ...
MIN_REQUESTS = 4  # ... or this many speculative requests finished
MIN_STEPS = 16  # engine steps before the cost fit is trusted
PROBE_EVERY = 16


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


@dataclasses.dataclass
class DraftFigures:
    """Summed over finished speculative requests (vLLM's per-request figures)."""

    requests: int = 0
    steps: int = 0  # verify steps (= output tokens - accepted)
    steps_with_drafts: int = 0
    drafted: int = 0
    trials: int = 0  # drafted positions whose predecessors were all accepted
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    @property
    def coverage(self) -> float:
        return self.steps_with_drafts / self.steps if self.steps else 0.0

    @property
    def alpha(self) -> float:
        """Conditional acceptance, assuming full windows of each request's K (a
        short one only lowers it); the same figure as stats.Figures.alpha."""
        return sum(self.accepted_per_position) / self.trials if self.trials else 0.0


def accepted_positions(histogram: list[int]) -> list[int]:
    """vLLM's per-request histogram (steps with j accepted drafts, j = 0..K) ->
    accepted count per position (position i accepted in steps with j > i)."""
    k = len(histogram) - 1
    return [sum(histogram[i + 1:]) for i in range(k)]


class AdaptiveK:
    def __init__(self, k_max: int, probe_every: int = PROBE_EVERY):
        self.k_max = k_max
        self.probe_every = probe_every
        self.costs = StepCostFit()
        self.draft = DraftFigures()
        self.turn = 0
        self.last_reason = "not started"
        self.decisions: collections.Counter = collections.Counter()

    # ---- measurements -------------------------------------------------------------

    def observe_step(self, tokens: int, seconds: float) -> None:
        self.costs.add(tokens, seconds)

    def observe_request(self, output_tokens: int, histogram: list[int], drafted: int,
                        k: int | None = None) -> None:
        """A finished request that ran with K > 0 (histogram from vLLM; k: the
        request's K, default the histogram's)."""
        if not histogram:
            return
        k = len(histogram) - 1 if k is None else k
        d = self.draft
        acc = accepted_positions(histogram)
        if len(d.accepted_per_position) < len(acc):
            d.accepted_per_position.extend([0] * (len(acc) - len(d.accepted_per_position)))
        for i, v in enumerate(acc):
            d.accepted_per_position[i] += v
        d.requests += 1
        d.steps += max(output_tokens - sum(acc), 0)
        d.steps_with_drafts += sum(histogram)
        d.trials += sum(histogram) + sum(acc[:max(k, 1) - 1])
        d.drafted += drafted

    # ---- decision -------------------------------------------------------------------

    def choose(self, rows: int) -> int:
        """K for the next request, with `rows` requests running in the engine."""
        self.turn += 1
        k, self.last_reason = self._choose(max(rows, 1))
        self.decisions[k] += 1
        return k

    def _choose(self, rows: int) -> tuple[int, str]:
        if self.k_max <= 0:
            return 0, "no draft"
        d = self.draft
        if d.drafted < MIN_DRAFTED and d.requests < MIN_REQUESTS:
            return self.k_max, f"measuring the draft ({d.drafted} drafted tokens so far)"
        fit = self.costs.fit()
        if fit is None:
            return self.k_max, "measuring step costs"
        cost = StepCost(*fit)
        alpha, cov = d.alpha, d.coverage
        best_k = choose_k(alpha, self.k_max, cost=cost, rows=rows, coverage=cov, margin=MARGIN)
        why = (f"alpha {alpha:.2f}, coverage {cov:.2f}, step {cost.fixed * 1e3:.1f} ms + "
               f"{cost.per_token * 1e3:.2f} ms/token, {rows} rows")
        if best_k > 0:
            x = speedup(alpha, best_k, cost=cost, rows=rows, coverage=cov)
            return best_k, f"{why} -> K={best_k} (x{x:.2f})"
        if self.turn % self.probe_every == 0:
            return self.k_max, f"{why} -> probing K={self.k_max}"
        return 0, f"{why} -> K=0 (speculation does not pay)"
