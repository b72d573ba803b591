"""What the draft book counts: its messages, its rows and the verify outcomes of
its proposals (exact, per step), cumulative, for /v1/spec/stats, /metrics and
tests (`specserve.acceptance.branches` turns them into figures). Pure."""

from __future__ import annotations

import dataclasses


# How a request's previous verify step ended (for coverage after each outcome).
FIRST = "first"  # no step yet, or the row was not tracked
ACCEPTED = "accepted"  # every proposed token accepted
REJECTED = "rejected"  # a proposed token rejected
DRAFTLESS = "draftless"  # nothing was proposed


@dataclasses.dataclass
class BookStats:
    """Counters of what the book did; cumulative, for metrics and tests."""

    opened: int = 0
    closed: int = 0
    draft_messages: int = 0
    draft_tokens_buffered: int = 0
    stale_messages: int = 0  # built on a history the target has left, or a gap
    rewritten_messages: int = 0  # replaced drafted (unverified) tokens with newer ones
    rows_seen: int = 0
    rows_matched: int = 0  # rows bound to a request
    rows_with_proposals: int = 0  # rows that got at least one drafted token
    proposed_tokens: int = 0
    branch_messages: int = 0  # branches received
    branches_buffered: int = 0  # ... and kept
    branches_dropped: int = 0  # stale, not an alternative, or past a bound
    # Verify outcomes of proposals, from the next history (exact, per step):
    verified_steps: int = 0  # steps that verified a proposal of ours
    accepted_tokens: int = 0  # proposed tokens the target accepted
    alpha_trials: int = 0  # proposed tokens whose predecessors were all accepted
    # Steps by how the request's previous step ended, and those that got drafts:
    steps_after_accepted: int = 0
    covered_after_accepted: int = 0
    steps_after_rejected: int = 0
    covered_after_rejected: int = 0
    steps_after_draftless: int = 0
    covered_after_draftless: int = 0
    branch_hits: int = 0  # steps after a rejection that found a matching branch
    wait_rows: int = 0  # steps after a step with drafts that found none (could wait)
    wait_hits: int = 0  # ... that got drafts within the bounded wait (refill)
    released: int = 0  # requests given up: release_after steps in a row without drafts
    stream_cuts: int = 0  # the draft's streams the sink cut off (flood, not reading, error)

    @property
    def alpha(self) -> float | None:
        """Conditional acceptance of what was proposed, exactly."""
        return self.accepted_tokens / self.alpha_trials if self.alpha_trials else None

    @property
    def branch_hit_rate(self) -> float | None:
        return self.branch_hits / self.steps_after_rejected if self.steps_after_rejected else None

    def coverage_after(self, outcome: str) -> float | None:
        steps = getattr(self, f"steps_after_{outcome}")
        return getattr(self, f"covered_after_{outcome}") / steps if steps else None

    def add(self, other: "BookStats") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
