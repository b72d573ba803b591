"""The acceptance record: what vLLM says about one request's speculation, and
every figure derived from it.

Owns the arithmetic of acceptance and latency summaries (pure: no Ray, no HTTP,
no clock): `Acceptance` is one request's record, built from vLLM's per-request
spec-decode metrics (the histogram of accepted counts over its verify steps);
`Figures` adds records up (or takes vLLM's engine-wide counters) and derives
every figure the router, the bench, the K controller and the simulator's
calibration report; `percentile` is the one percentile definition. Nothing else
computes these.

Vocabulary (gpt-fast's and vLLM's):
  steps              verify forward passes of the target for a request
                     (= output tokens − accepted tokens: every step emits one
                     target-sampled token, recovered or bonus, plus the drafted
                     tokens it accepted)
  steps_with_drafts  steps that verified at least one drafted token
  coverage           steps_with_drafts / steps: how often drafts were waiting
  mean accepted length  1 + accepted / steps_with_drafts (tokens per verify step
                     that had drafts)
  acceptance_rate    accepted / drafted: vLLM's own figure; it counts the drafts
                     after a rejection too, which can never be accepted, so with
                     per-token acceptance α and K drafts it is
                     (α − α^(K+1)) / (K (1 − α)), well below α
  alpha              conditional acceptance: accepted / trials, trials[i] the
                     drafted positions i whose predecessors were all accepted
                     (trials[0] = drafted[0], trials[i] = min(accepted[i−1],
                     drafted[i])): the α of E(α, K) = (1 − α^(K+1)) / (1 − α)
                     (specserve/control/policy.py). From per-request histograms
                     drafted[i] is taken as full windows of the request's K (a
                     short window can only make alpha lower).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


def accepted_per_position(histogram: Sequence[int], k: int) -> list[int]:
    """vLLM's histogram ([j] = steps that accepted j drafted tokens) -> [i] =
    steps whose drafted token at position i was accepted (those with j > i)."""
    return [sum(histogram[j] for j in range(i + 1, len(histogram))) for i in range(k)]


def position_trials(accepted: Sequence[int], drafted: Sequence[int]) -> list[int]:
    """[i] = drafted positions i whose predecessors were all accepted."""
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
    from specserve.control.policy import expected_tokens

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


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """One finished request's speculation, as its target engine counted it."""

    k: int  # the request's K: at most this many drafted tokens per step (0: none)
    output_tokens: int
    draft_tokens: int = 0  # drafted tokens the target verified
    # [j] = verify steps that accepted j drafted tokens (vLLM's per-request
    # histogram; empty when the request ran without drafts)
    accepted_histogram: tuple[int, ...] = ()

    @classmethod
    def of_output(cls, output, k: int, output_tokens: int | None = None) -> "Acceptance":
        """From vLLM's final CompletionOutput (spec_decode_metrics, or none);
        output_tokens: the request's total where the output holds a delta."""
        m = getattr(output, "spec_decode_metrics", None)
        n = len(output.token_ids) if output_tokens is None else output_tokens
        return cls(k=k, output_tokens=n,
                   draft_tokens=m.num_draft_tokens if m is not None else 0,
                   accepted_histogram=tuple(m.histogram) if m is not None else ())

    @property
    def accepted_tokens(self) -> int:
        return sum(j * n for j, n in enumerate(self.accepted_histogram))

    @property
    def steps_with_drafts(self) -> int:
        return sum(self.accepted_histogram)

    @property
    def steps(self) -> int:
        return max(self.output_tokens - self.accepted_tokens, 0)

    def accepted_per_position(self, k: int | None = None) -> list[int]:
        """[i] = verify steps whose drafted token at position i was accepted."""
        n = max(len(self.accepted_histogram) - 1, self.k) if k is None else k
        return accepted_per_position(self.accepted_histogram, n)

    @property
    def alpha_trials(self) -> int:
        # full windows of the request's own K: drafted[i] = steps_with_drafts
        k = max(self.k, 1)
        return sum(position_trials(self.accepted_per_position(k),
                                   [self.steps_with_drafts] * k))


@dataclasses.dataclass
class Figures:
    """Acceptance added up over requests (or read off an engine's counters)."""

    requests: int = 0
    output_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0
    steps_with_drafts: int = 0
    alpha_trials: int = 0  # drafted positions whose predecessors were all accepted
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def add(self, a: Acceptance) -> None:
        self.requests += 1
        self.output_tokens += a.output_tokens
        self.draft_tokens += a.draft_tokens
        self.accepted_tokens += a.accepted_tokens
        self.steps += a.steps
        self.steps_with_drafts += a.steps_with_drafts
        self.alpha_trials += a.alpha_trials
        per = a.accepted_per_position()
        if len(self.accepted_per_position) < len(per):
            self.accepted_per_position += [0] * (len(per) - len(self.accepted_per_position))
        for i, v in enumerate(per):
            self.accepted_per_position[i] += v

    @classmethod
    def of(cls, records) -> "Figures":
        f = cls()
        for a in records:
            f.add(a)
        return f

    @classmethod
    def of_engine(cls, output_tokens: int, num_drafts: int, draft_tokens: int,
                  accepted_per_position: Sequence[int],
                  draft_per_position: Sequence[int] | None) -> "Figures":
        """From vLLM's engine-wide spec-decode counters over a run (num_drafts:
        steps that verified drafts; per position: accepted and drafted tokens).
        Without drafted counts per position, full windows are assumed."""
        accepted = list(accepted_per_position)
        drafted = (list(draft_per_position) if draft_per_position is not None
                   else [num_drafts] * len(accepted))
        total = sum(accepted)
        return cls(requests=0, output_tokens=output_tokens, draft_tokens=draft_tokens,
                   accepted_tokens=total, steps=max(output_tokens - total, 0),
                   steps_with_drafts=num_drafts,
                   alpha_trials=sum(position_trials(accepted, drafted)),
                   accepted_per_position=accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def coverage(self) -> float:
        return self.steps_with_drafts / self.steps if self.steps else 0.0

    @property
    def alpha(self) -> float:
        return self.accepted_tokens / self.alpha_trials if self.alpha_trials else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + (self.accepted_tokens / self.steps_with_drafts
                      if self.steps_with_drafts else 0.0)

    @property
    def tokens_per_step(self) -> float:
        return self.output_tokens / self.steps if self.steps else 1.0

    def as_dict(self) -> dict:
        return {
            "requests": self.requests, "output_tokens": self.output_tokens,
            "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate, "alpha": self.alpha,
            "accepted_per_position": list(self.accepted_per_position),
            "mean_accepted_length": self.mean_accepted_length,
            "target_steps": self.steps, "steps_with_drafts": self.steps_with_drafts,
            "coverage": self.coverage,
        }


@dataclasses.dataclass(frozen=True)
class TargetReport:
    """What a target replica reports with a finished request: who drafted, the
    request's acceptance, and live figures of its engine."""

    target_replica: str
    draft_model: str | None  # None: the target alone
    draft_replica: str | None
    acceptance: Acceptance
    target_running: int = 0  # the target engine's batch when the request finished
    target_waiting: int = 0  # ... and its queue
    draft_lag: float | None = None  # tokens the draft replica was recently behind
    draft_version: str | None = None  # the draft weights' version (adapting pools: v0, v1, ...)
