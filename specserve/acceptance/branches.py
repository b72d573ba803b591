"""The step after a rejection: figures from the target's draft book, per draft.

Owns the arithmetic over the counters a target's sink keeps per draft
("model/replica"; specserve.target.book.BookStats by name, plus the bounded
wait; the DraftSink.Stats rpc). Pure: no gRPC, no clock.

Vocabulary (per draft, over a span of counters):
  branch_hit_rate         steps after a rejection that found a matching branch
                          (a pre-drafted outcome) / steps after a rejection
  coverage_after_accepted share of steps after a fully accepted window that
                          found drafts (the run-ahead keeps up)
  coverage_after_rejected share of steps after a rejection that found drafts
                          (a branch hit, or drafts within the bounded wait)
  wait_hit_rate           rows that got drafts within the bounded wait / rows
                          that could wait (drafts at their last step, none now)
  wait_ms_per_step        milliseconds the proposer held steps for this draft,
                          over all steps with its rows
  book_alpha              conditional acceptance of what the book proposed,
                          counted exactly per step (the proposer knows each
                          window's length; vLLM's per-position counters do not,
                          so their estimate is low when windows are short)

PromQL over the exported counters (one series per target replica and draft):
  branch hit rate: sum by (draft_model) (rate(specserve_branch_hits_total[5m]))
                   / sum by (draft_model) (rate(specserve_steps_after_rejection_total[5m]))
  wait per step:   sum(rate(specserve_wait_seconds_total[5m]))
                   / sum(rate(specserve_proposer_steps_total[5m]))
"""

from __future__ import annotations

COUNTERS = (
    "steps_after_accepted", "covered_after_accepted", "steps_after_rejected",
    "covered_after_rejected", "steps_after_draftless", "covered_after_draftless",
    "branch_hits", "branches_buffered", "branches_dropped", "wait_rows", "wait_hits",
    "accepted_tokens", "alpha_trials", "verified_steps", "released", "stream_cuts",
)
WAIT = ("waits", "wait_seconds", "steps")


def split(draft: str) -> tuple[str, str]:
    """(pool, replica) of a draft's key "model/replica"; ("name", "?") for a
    key without a replica."""
    model, _, replica = draft.rpartition("/")
    return (model, replica) if model else (draft, "?")


def pool_waits(per_draft: dict[str, dict]) -> dict[str, float]:
    """Seconds per step the proposer held the target's steps for each pool's
    drafts (the bounded wait): wait_seconds / steps, both added up over the
    pool's replicas. The step cost a pool adds on top of a + b · tokens
    (specserve.control.policy); pools with no steps counted are left out."""
    seconds: dict[str, float] = {}
    steps: dict[str, int] = {}
    for draft, c in per_draft.items():
        pool = split(draft)[0]
        seconds[pool] = seconds.get(pool, 0.0) + c.get("wait_seconds", 0.0)
        steps[pool] = steps.get(pool, 0) + c.get("steps", 0)
    return {pool: seconds[pool] / n for pool, n in steps.items() if n > 0}


def minus(after: dict, before: dict) -> dict:
    """Counters over a span: after - before, per key (missing before: 0)."""
    return {k: v - before.get(k, 0) for k, v in after.items()}


def total(per_draft: dict[str, dict]) -> dict:
    """Counters added up over drafts."""
    out: dict = {}
    for c in per_draft.values():
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out


def _ratio(a, b):
    return a / b if b else None


def figures(c: dict) -> dict:
    """The figures of one draft's (or a total's) counters; None where nothing was seen."""
    g = lambda k: c.get(k, 0)  # noqa: E731
    return {
        "branch_hit_rate": _ratio(g("branch_hits"), g("steps_after_rejected")),
        "coverage_after_accepted": _ratio(g("covered_after_accepted"), g("steps_after_accepted")),
        "coverage_after_rejected": _ratio(g("covered_after_rejected"), g("steps_after_rejected")),
        "wait_hit_rate": _ratio(g("wait_hits"), g("wait_rows")),
        "wait_ms_per_step": (_ratio(g("wait_seconds"), g("steps")) or 0.0) * 1e3
        if g("steps") else None,
        "book_alpha": _ratio(g("accepted_tokens"), g("alpha_trials")),
        "steps_after_rejected": g("steps_after_rejected"),
        "released": g("released"),
    }


# The counters' /metrics families (catalogued in specserve.acceptance.catalogue;
# written per target replica by specserve.acceptance.replicas).
PROMETHEUS = (
    ("branch_hits", "specserve_branch_hits_total"),
    ("steps_after_rejected", "specserve_steps_after_rejection_total"),
    ("covered_after_rejected", "specserve_covered_after_rejection_total"),
    ("steps_after_accepted", "specserve_steps_after_accepted_total"),
    ("covered_after_accepted", "specserve_covered_after_accepted_total"),
    ("wait_seconds", "specserve_wait_seconds_total"),
    ("steps", "specserve_proposer_steps_total"),
    ("released", "specserve_released_requests_total"),
    ("stream_cuts", "specserve_draft_stream_cuts_total"),
)
