"""Benchmark arithmetic: acceptance figures, latency summaries, ideal speedups, tables.

Pure functions of measured numbers (no engines, no clock, no I/O), so every
figure `specserve bench` reports can be checked by hand and is unit-tested.

Acceptance, from vLLM's spec-decode counters (per verify step and position i:
drafted[i] = steps that verified a drafted token at position i, accepted[i] =
steps whose drafted token at i was accepted, which needs positions < i accepted):

- acceptance_rate = Σ accepted / Σ drafted: vLLM's own figure. It counts the
  drafts after a rejection too, which can never be accepted, so with a per-token
  acceptance α and K drafts it is (α − α^(K+1)) / (K (1 − α)), well below α.
- conditional acceptance α̂ = Σ_i accepted[i] / Σ_i trials[i], with trials[0] =
  drafted[0] and trials[i] = min(accepted[i−1], drafted[i]): the share of
  drafted tokens accepted among those whose predecessors were all accepted, the
  α of the model E(α, K) = (1 − α^(K+1)) / (1 − α) tokens per verify step. For
  the synthetic draft `synthetic:A` it is A by construction. (The min is exact
  when every step's window is full, as it is when drafts keep ahead; a step with
  a short window can only make α̂ lower.)
- mean_accepted_length = 1 + accepted / steps with drafts: tokens a verify step
  that had drafts emitted.
- coverage = steps with drafts / all verify steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from specserve.control.policy import expected_tokens


def conditional_acceptance(accepted: Sequence[int], drafted: Sequence[int]) -> float | None:
    """α̂ over all positions; None with no drafted tokens."""
    trials = position_trials(accepted, drafted)
    total = sum(trials)
    return sum(accepted[: len(trials)]) / total if total else None


def position_trials(accepted: Sequence[int], drafted: Sequence[int]) -> list[int]:
    trials = []
    for i, d in enumerate(drafted):
        trials.append(d if i == 0 else min(accepted[i - 1] if i - 1 < len(accepted) else 0, d))
    return trials


def per_position_acceptance(accepted: Sequence[int], drafted: Sequence[int]) -> list[float | None]:
    """accepted[i] / trials[i] per position (None where nothing was tried)."""
    return [(accepted[i] / t if t else None)
            for i, t in enumerate(position_trials(accepted, drafted))]


def plain_acceptance_for(alpha: float, k: int) -> float:
    """vLLM's accepted/drafted for independent per-token acceptance alpha, full windows."""
    if k <= 0:
        return 0.0
    return (expected_tokens(alpha, k) - 1.0) / k


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ideal_speedup(alpha: float, k: int, verify_step_cost: float) -> float:
    """Speedup over target-only that a draft of acceptance alpha, K drafts per
    step and free, always-waiting drafts would give, when a verify step with K
    drafts costs `verify_step_cost` target-only steps (measured)."""
    return expected_tokens(alpha, k) / verify_step_cost


def colocated_bound(alpha: float, k: int, verify_step_cost: float, draft_step: float) -> float:
    """The most a co-located draft of the same speed could reach, as a speedup
    over target-only: it drafts K tokens one draft step each (`draft_step`, in
    target-only steps) before every verify step, in series with it:
    E(α, K) / (verify_step_cost + K · draft_step)."""
    return expected_tokens(alpha, k) / (verify_step_cost + k * draft_step)


def fmt(x, digits: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """rows of dicts -> a Markdown table with (key, header) columns."""
    head = "| " + " | ".join(h for _, h in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])
