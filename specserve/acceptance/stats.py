"""The acceptance picture: per-request spec-decode records, added up per draft
model, per draft replica and per target replica.

Owns the arithmetic only (pure: no Ray, no HTTP, no clock of its own). The
figures come from vLLM's own per-request spec-decode metrics (the accepted-count
histogram of every verify step), so they agree with vLLM's `vllm:spec_decode_*`
counters by construction.

Vocabulary, per request:
  steps              verify forward passes of the target for this request
                     (= output tokens - accepted tokens: every step emits one
                     target-sampled token plus the drafts it accepted)
  steps_with_drafts  steps that verified at least one drafted token
  coverage           steps_with_drafts / steps: how often drafts were waiting
  mean accepted length  1 + accepted / steps_with_drafts (tokens per verify step)
  alpha              conditional acceptance: accepted drafted tokens / drafted
                     positions whose predecessors were all accepted (position 0
                     of every step with drafts, position i of the steps that
                     accepted i, up to the request's K): the α of E(α, K) in
                     specserve/policy.py; acceptance_rate = accepted / drafted
                     is lower for K > 1 (positions after a rejection count)

PromQL over the exported counters (rates over 5 minutes):
  acceptance rate:  rate(specserve_accepted_tokens_total[5m])
                    / rate(specserve_draft_tokens_total[5m])
  coverage:         rate(specserve_steps_with_drafts_total[5m])
                    / rate(specserve_target_steps_total[5m])
"""

from __future__ import annotations

import dataclasses
from collections import deque


@dataclasses.dataclass
class RequestRecord:
    """One finished request, as the target saw it."""

    draft_model: str | None  # None: served by the target alone
    draft_replica: str | None
    target_replica: str
    k: int
    output_tokens: int
    draft_tokens: int
    accepted_histogram: list[int]  # [j] = verify steps that accepted j drafted tokens
    ttft_s: float
    duration_s: float  # first byte to last token
    finished_at: float
    # Live figures that came with the request (latest wins, per replica):
    target_running: int = 0  # the target engine's batch when the request finished
    target_waiting: int = 0  # ... and its queue
    draft_lag: float | None = None  # tokens the draft replica was recently behind

    @property
    def accepted_tokens(self) -> int:
        return sum(j * n for j, n in enumerate(self.accepted_histogram))

    @property
    def steps_with_drafts(self) -> int:
        return sum(self.accepted_histogram)

    @property
    def steps(self) -> int:
        return max(self.output_tokens - self.accepted_tokens, 0)

    def accepted_per_position(self, k: int) -> list[int]:
        """[i] = verify steps whose drafted token at position i was accepted."""
        h = self.accepted_histogram
        return [sum(h[j] for j in range(i + 1, len(h))) for i in range(k)]


@dataclasses.dataclass
class Figures:
    """Counters added up over requests."""

    requests: int = 0
    output_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0
    steps_with_drafts: int = 0
    alpha_trials: int = 0  # drafted positions whose predecessors were all accepted
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def add(self, r: RequestRecord, k: int) -> None:
        self.requests += 1
        self.output_tokens += r.output_tokens
        self.draft_tokens += r.draft_tokens
        self.accepted_tokens += r.accepted_tokens
        self.steps += r.steps
        self.steps_with_drafts += r.steps_with_drafts
        per = r.accepted_per_position(k)
        # full windows of the request's own K assumed (a short one only lowers alpha)
        self.alpha_trials += r.steps_with_drafts + sum(per[:max(r.k, 1) - 1])
        if len(self.accepted_per_position) < len(per):
            self.accepted_per_position += [0] * (len(per) - len(self.accepted_per_position))
        for i, v in enumerate(per):
            self.accepted_per_position[i] += v

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


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class SpecStats:
    """Totals since start plus a window of recent requests for latencies and rates."""

    def __init__(self, k: int, window: int = 512, slo_ttft_s: float = 2.0,
                 slo_tpot_s: float = 0.2):
        self.k = k
        self.slo_ttft_s = slo_ttft_s  # goodput counts requests that meet both
        self.slo_tpot_s = slo_tpot_s
        self.target_live: dict[str, dict] = {}
        self.draft_lag: dict[tuple[str, str], float] = {}
        self.by_model: dict[str, Figures] = {}
        self.by_replica: dict[tuple[str, str], Figures] = {}
        self.by_target: dict[str, Figures] = {}
        self.target_only = Figures()
        self.recent: deque[RequestRecord] = deque(maxlen=window)
        self.current_k: dict[str, int] = {}

    def record(self, r: RequestRecord) -> None:
        k = max(self.k, r.k)
        if r.draft_model is None:
            self.target_only.add(r, k)
        else:
            self.by_model.setdefault(r.draft_model, Figures()).add(r, k)
            self.by_replica.setdefault((r.draft_model, r.draft_replica or "?"),
                                       Figures()).add(r, k)
        self.by_target.setdefault(r.target_replica, Figures()).add(r, k)
        self.target_live[r.target_replica] = {"batch_size": r.target_running,
                                              "queue_length": r.target_waiting}
        if r.draft_model is not None and r.draft_lag is not None:
            self.draft_lag[(r.draft_model, r.draft_replica or "?")] = r.draft_lag
        self.recent.append(r)

    @staticmethod
    def tpot(r: RequestRecord) -> float | None:
        return (r.duration_s - r.ttft_s) / (r.output_tokens - 1) if r.output_tokens > 1 else None

    def end_to_end(self, now: float, horizon_s: float = 60.0) -> dict:
        """Latencies and rates over the requests finished in the last horizon_s.

        goodput: output tokens/s of the requests that met both latency
        objectives (TTFT <= slo_ttft_s and TPOT <= slo_tpot_s)."""
        recent = [r for r in self.recent if now - r.finished_at <= horizon_s]
        tpots = [t for t in (self.tpot(r) for r in recent) if t is not None]
        good = [r for r in recent if r.ttft_s <= self.slo_ttft_s
                and (self.tpot(r) or 0.0) <= self.slo_tpot_s]
        return {
            "requests": len(recent),
            "ttft_p50_s": _percentile([r.ttft_s for r in recent], 0.5),
            "tpot_p50_s": _percentile(tpots, 0.5),
            "output_tokens_per_s": sum(r.output_tokens for r in recent) / horizon_s,
            "goodput_tokens_per_s": sum(r.output_tokens for r in good) / horizon_s,
            "slo": {"ttft_s": self.slo_ttft_s, "tpot_s": self.slo_tpot_s},
        }

    def _target_rate(self, replica: str, now: float, horizon_s: float = 60.0) -> float:
        return sum(r.output_tokens for r in self.recent
                   if r.target_replica == replica and now - r.finished_at <= horizon_s) / horizon_s

    def snapshot(self, now: float) -> dict:
        drafts = [{"model": m, "replica": rep, "k": self.current_k.get(m, self.k),
                   "draft_lag": self.draft_lag.get((m, rep)), **f.as_dict()}
                  for (m, rep), f in sorted(self.by_replica.items())]
        models = [{"model": m, "replica": "*", "k": self.current_k.get(m, self.k),
                   **f.as_dict()} for m, f in sorted(self.by_model.items())]
        targets = [{"replica": t, **f.as_dict(), **self.target_live.get(t, {}),
                    "output_tokens_per_s": self._target_rate(t, now)}
                   for t, f in sorted(self.by_target.items())]
        return {"drafts": drafts, "draft_models": models, "targets": targets,
                "target_only": self.target_only.as_dict(),
                "end_to_end": self.end_to_end(now)}


_COUNTERS = [
    ("draft_tokens", "draft_tokens_total", "Drafted tokens the target verified."),
    ("accepted_tokens", "accepted_tokens_total", "Drafted tokens the target accepted."),
    ("steps", "target_steps_total", "Target verify steps (one request, one forward pass)."),
    ("steps_with_drafts", "steps_with_drafts_total", "Target steps that found drafts waiting."),
    ("output_tokens", "output_tokens_total", "Tokens emitted to clients."),
    ("requests", "requests_total", "Finished requests."),
]


def prometheus_text(stats: SpecStats, now: float) -> str:
    """The same figures as /v1/spec/stats in Prometheus text exposition format."""
    lines = []
    for attr, name, help_text in _COUNTERS:
        lines += [f"# HELP specserve_{name} {help_text}", f"# TYPE specserve_{name} counter"]
        for (m, rep), f in sorted(stats.by_replica.items()):
            lines.append(f'specserve_{name}{{draft_model="{m}",draft_replica="{rep}"}} '
                         f"{getattr(f, attr)}")
        lines.append(f'specserve_{name}{{draft_model="none",draft_replica="none"}} '
                     f"{getattr(stats.target_only, attr)}")
    lines += ["# HELP specserve_accepted_per_position_total Accepted drafted tokens by "
              "position in the draft.", "# TYPE specserve_accepted_per_position_total counter"]
    for (m, rep), f in sorted(stats.by_replica.items()):
        for i, v in enumerate(f.accepted_per_position):
            lines.append(f'specserve_accepted_per_position_total{{draft_model="{m}",'
                         f'draft_replica="{rep}",position="{i}"}} {v}')
    lines += ["# HELP specserve_k Current number of speculative tokens per draft model.",
              "# TYPE specserve_k gauge"]
    for m in sorted(stats.by_model):
        lines.append(f'specserve_k{{draft_model="{m}"}} {stats.current_k.get(m, stats.k)}')
    e2e = stats.end_to_end(now)
    lines += ["# HELP specserve_draft_lag_tokens Tokens a draft replica was behind the "
              "verified position, recently.", "# TYPE specserve_draft_lag_tokens gauge"]
    for (m, rep), lag in sorted(stats.draft_lag.items()):
        lines.append(f'specserve_draft_lag_tokens{{draft_model="{m}",draft_replica="{rep}"}} {lag}')
    for key, help_text in (("batch_size", "Running requests"), ("queue_length", "Queued requests")):
        lines += [f"# HELP specserve_target_{key} {help_text} in the target engine.",
                  f"# TYPE specserve_target_{key} gauge"]
        for t, live in sorted(stats.target_live.items()):
            lines.append(f'specserve_target_{key}{{target_replica="{t}"}} {live[key]}')
    for key, name in (("ttft_p50_s", "ttft_p50_seconds"), ("tpot_p50_s", "tpot_p50_seconds"),
                      ("output_tokens_per_s", "output_tokens_per_second"),
                      ("goodput_tokens_per_s", "goodput_tokens_per_second")):
        lines += [f"# HELP specserve_{name} Over the last 60 s of finished requests.",
                  f"# TYPE specserve_{name} gauge",
                  f"specserve_{name} {e2e[key] if e2e[key] is not None else 'NaN'}"]
    return "\n".join(lines) + "\n"
