"""The router's acceptance picture in Prometheus text format (part of /metrics).

Owns which figures of `SpecStats` fill which catalogued family
(`specserve.acceptance.catalogue` holds names, help and labels). PromQL over
the exported counters:
  acceptance rate:  rate(specserve_accepted_tokens_total[$__rate_interval])
                    / rate(specserve_draft_tokens_total[$__rate_interval])
  coverage:         rate(specserve_steps_with_drafts_total[$__rate_interval])
                    / rate(specserve_target_steps_total[$__rate_interval])
  TTFT p95:         histogram_quantile(0.95, sum by (le)
                      (rate(specserve_ttft_seconds_bucket[$__rate_interval])))
  tokens/s:         sum(rate(specserve_output_tokens_total[$__rate_interval]))
Label sets are bounded: draft models and replicas (pruned after
SpecStats.grace_s without requests), positions < K; `kind` is the pool's
(catalogue.kind_of), one per draft model.
"""

from __future__ import annotations

from specserve.acceptance.catalogue import NO_DRAFT, kind_of
from specserve.acceptance.exposition import family, histogram_family
from specserve.acceptance.stats import SpecStats

_COUNTERS = [
    ("draft_tokens", "specserve_draft_tokens_total"),
    ("accepted_tokens", "specserve_accepted_tokens_total"),
    ("steps", "specserve_target_steps_total"),
    ("steps_with_drafts", "specserve_steps_with_drafts_total"),
    ("output_tokens", "specserve_output_tokens_total"),
    ("requests", "specserve_requests_total"),
]


def prometheus_lines(stats: SpecStats, now: float, kinds: dict[str, str]) -> list[str]:
    """The same figures as /v1/spec/stats: counters and histograms since start
    (rates and quantiles are Prometheus' to compute); gauges of draft replicas
    with a request lately (`now`: the records' clock). kinds:
    AppConfig.draft_kinds()."""

    def _draft(m: str, rep: str) -> dict:
        return {"draft_model": m, "draft_replica": rep, "kind": kind_of(m, kinds)}

    rows = sorted(stats.by_replica.items())
    lines: list[str] = []
    for attr, name in _COUNTERS:
        lines += family(name, [*((_draft(m, rep), getattr(f, attr)) for (m, rep), f in rows),
                               (_draft(NO_DRAFT, "none"), getattr(stats.target_only, attr))])
    lines += family("specserve_accepted_per_position_total",
                    [({**_draft(m, rep), "position": i}, v) for (m, rep), f in rows
                     for i, v in enumerate(f.accepted_per_position)])
    lines += family("specserve_k", [({"draft_model": m, "kind": kind_of(m, kinds)},
                                     stats.current_k.get(m, stats.k))
                                    for m in sorted(stats.by_model)])
    lines += family("specserve_draft_lag_tokens",
                    [(_draft(m, rep), lag)
                     for (m, rep), lag in sorted(stats.live_draft_lag(now).items())])
    lines += histogram_family("specserve_ttft_seconds", [({}, stats.ttft)])
    lines += histogram_family("specserve_tpot_seconds", [({}, stats.tpot)])
    lines += family("specserve_goodput_tokens_total", [({}, stats.goodput_tokens)])
    return lines


def prometheus_text(stats: SpecStats, now: float, kinds: dict[str, str]) -> str:
    return "\n".join(prometheus_lines(stats, now, kinds)) + "\n"
