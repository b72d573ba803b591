"""Benchmark arithmetic: ratios, ideal speedups, tables.

Pure functions of measured numbers (no engines, no clock, no I/O), so every
figure `specserve bench` reports can be checked by hand and is unit-tested.
Acceptance figures and percentiles are `specserve.acceptance.record`'s (the one
place they are computed).
"""

from __future__ import annotations

from specserve.control.policy import expected_tokens


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
