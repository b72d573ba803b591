"""The acceptance picture: finished requests' acceptance records added up per
draft model, per draft replica, per draft weights' version (adapting pools)
and per target replica, and the end-to-end latencies of recent requests.

Owns the aggregation only (pure: no Ray, no HTTP, no clock of its own); every
figure is `specserve.acceptance.record`'s. The records come from vLLM's own
per-request spec-decode metrics, so the sums agree with vLLM's
`vllm:spec_decode_*` counters by construction. `specserve.acceptance.prometheus`
exports the same picture.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from specserve.acceptance.catalogue import ITL_BUCKETS_S, TTFT_BUCKETS_S, kind_of
from specserve.acceptance.record import Acceptance, Figures, TargetReport, percentile
from specserve.acceptance.replicas import GRACE_S, LIVE_S


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """One finished request: the target's report and the router's timing."""

    report: TargetReport
    ttft_s: float
    duration_s: float  # first byte to last token
    finished_at: float

    @property
    def acceptance(self) -> Acceptance:
        return self.report.acceptance

    @property
    def output_tokens(self) -> int:
        return self.report.acceptance.output_tokens

    @property
    def tpot_s(self) -> float | None:
        n = self.output_tokens
        return (self.duration_s - self.ttft_s) / (n - 1) if n > 1 else None




@dataclasses.dataclass
class LatencyHistogram:
    """Cumulative counts of observations <= each bound (Prometheus' le buckets)."""

    bounds: tuple[float, ...]
    counts: list[int] = dataclasses.field(default_factory=list)
    total: int = 0
    sum_s: float = 0.0

    def __post_init__(self):
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.bounds):
            if value <= b:
                self.counts[i] += 1
        self.total += 1
        self.sum_s += value


class SpecStats:
    """Totals since start plus a window of recent requests for latencies and rates."""

    def __init__(self, k: int, window: int = 512, slo_ttft_s: float = 2.0,
                 slo_tpot_s: float = 0.2, grace_s: float = GRACE_S):
        self.k = k
        self.grace_s = grace_s
        # When each replica's rows last had a request: ("draft", model,
        # replica) or ("target", replica) -> finished_at.
        self.last_seen: dict[tuple, float] = {}
        self.slo_ttft_s = slo_ttft_s  # goodput counts requests that meet both
        self.slo_tpot_s = slo_tpot_s
        self.target_live: dict[str, dict] = {}
        self.draft_lag: dict[tuple[str, str], float] = {}
        self.by_model: dict[str, Figures] = {}
        self.by_replica: dict[tuple[str, str], Figures] = {}
        self.by_target: dict[str, Figures] = {}
        self.by_version: dict[tuple[str, str], Figures] = {}  # (model, version)
        self.target_only = Figures()
        self.recent: deque[RequestRecord] = deque(maxlen=window)
        self.current_k: dict[str, int] = {}
        # Since start, for Prometheus (quantiles and rates are computed there).
        self.ttft = LatencyHistogram(TTFT_BUCKETS_S)
        self.tpot = LatencyHistogram(ITL_BUCKETS_S)
        self.goodput_tokens = 0  # output tokens of requests that met both SLOs

    def record(self, r: RequestRecord) -> None:
        rep, acc = r.report, r.acceptance
        if rep.draft_model is None:
            self.target_only.add(acc)
        else:
            self.by_model.setdefault(rep.draft_model, Figures()).add(acc)
            self.by_replica.setdefault((rep.draft_model, rep.draft_replica or "?"),
                                       Figures()).add(acc)
            self.last_seen[("draft", rep.draft_model, rep.draft_replica or "?")] = r.finished_at
            if rep.draft_version is not None:
                self.by_version.setdefault((rep.draft_model, rep.draft_version),
                                           Figures()).add(acc)
        self.last_seen[("target", rep.target_replica)] = r.finished_at
        self.by_target.setdefault(rep.target_replica, Figures()).add(acc)
        self.target_live[rep.target_replica] = {"batch_size": rep.target_running,
                                                "queue_length": rep.target_waiting}
        if rep.draft_model is not None and rep.draft_lag is not None:
            self.draft_lag[(rep.draft_model, rep.draft_replica or "?")] = rep.draft_lag
        self.recent.append(r)
        self.ttft.observe(r.ttft_s)
        if r.tpot_s is not None:
            self.tpot.observe(r.tpot_s)
        if self.meets_slo(r):
            self.goodput_tokens += r.output_tokens

    def prune(self, now: float) -> None:
        """Drop the rows of replicas without a request for grace_s (their
        counters leave /metrics; the per-model and target-only sums stay)."""
        for key, at in list(self.last_seen.items()):
            if now - at <= self.grace_s:
                continue
            del self.last_seen[key]
            if key[0] == "draft":
                self.by_replica.pop(key[1:], None)
                self.draft_lag.pop(key[1:], None)
            else:
                self.by_target.pop(key[1], None)
                self.target_live.pop(key[1], None)

    def live_draft_lag(self, now: float) -> dict[tuple[str, str], float]:
        """The lag gauges of draft replicas with a request in the last LIVE_S
        (a dead replica's last lag is not shown)."""
        return {key: lag for key, lag in self.draft_lag.items()
                if now - self.last_seen.get(("draft", *key), float("-inf")) <= LIVE_S}

    def meets_slo(self, r: RequestRecord) -> bool:
        return r.ttft_s <= self.slo_ttft_s and (r.tpot_s or 0.0) <= self.slo_tpot_s

    def end_to_end(self, now: float, horizon_s: float = 60.0) -> dict:
        """Latencies and rates over the requests finished in the last horizon_s.

        goodput: output tokens/s of the requests that met both latency
        objectives (TTFT <= slo_ttft_s and TPOT <= slo_tpot_s)."""
        recent = [r for r in self.recent if now - r.finished_at <= horizon_s]
        tpots = [t for t in (r.tpot_s for r in recent) if t is not None]
        good = [r for r in recent if self.meets_slo(r)]
        return {
            "requests": len(recent),
            "ttft_p50_s": percentile([r.ttft_s for r in recent], 50),
            "tpot_p50_s": percentile(tpots, 50),
            "output_tokens_per_s": sum(r.output_tokens for r in recent) / horizon_s,
            "goodput_tokens_per_s": sum(r.output_tokens for r in good) / horizon_s,
            "slo": {"ttft_s": self.slo_ttft_s, "tpot_s": self.slo_tpot_s},
        }

    def _target_rate(self, replica: str, now: float, horizon_s: float = 60.0) -> float:
        return sum(r.output_tokens for r in self.recent
                   if r.report.target_replica == replica and now - r.finished_at <= horizon_s) / horizon_s

    def snapshot(self, now: float, kinds: dict[str, str]) -> dict:
        """/v1/spec/stats' acceptance part; kinds: AppConfig.draft_kinds() (each
        row's `kind`, catalogue.kind_of)."""
        drafts = [{"model": m, "replica": rep, "kind": kind_of(m, kinds),
                   "k": self.current_k.get(m, self.k),
                   "draft_lag": self.draft_lag.get((m, rep)), **f.as_dict()}
                  for (m, rep), f in sorted(self.by_replica.items())]
        models = [{"model": m, "replica": "*", "kind": kind_of(m, kinds),
                   "k": self.current_k.get(m, self.k),
                   **f.as_dict()} for m, f in sorted(self.by_model.items())]
        versions = [{"model": m, "version": v, **f.as_dict()}
                    for (m, v), f in sorted(self.by_version.items())]
        targets = [{"replica": t, **f.as_dict(), **self.target_live.get(t, {}),
                    "output_tokens_per_s": self._target_rate(t, now)}
                   for t, f in sorted(self.by_target.items())]
        return {"drafts": drafts, "draft_models": models, "draft_versions": versions,
                "targets": targets,
                "target_only": self.target_only.as_dict(),
                "end_to_end": self.end_to_end(now)}
