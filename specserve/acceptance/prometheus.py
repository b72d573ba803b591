"""The acceptance picture in Prometheus text exposition format (the router's /metrics).

Owns the metric names and labels; the figures are `SpecStats`'s. PromQL over
the exported counters:
  acceptance rate:  rate(specserve_accepted_tokens_total[$__rate_interval])
                    / rate(specserve_draft_tokens_total[$__rate_interval])
  coverage:         rate(specserve_steps_with_drafts_total[$__rate_interval])
                    / rate(specserve_target_steps_total[$__rate_interval])
  TTFT p95:         histogram_quantile(0.95, sum by (le)
                      (rate(specserve_ttft_seconds_bucket[$__rate_interval])))
  tokens/s:         sum(rate(specserve_output_tokens_total[$__rate_interval]))
Label sets are bounded: draft model and replica, target replica, position < K.
"""

from __future__ import annotations

from specserve.acceptance.stats import SpecStats

_COUNTERS = [
    ("draft_tokens", "draft_tokens_total", "Drafted tokens the target verified."),
    ("accepted_tokens", "accepted_tokens_total", "Drafted tokens the target accepted."),
    ("steps", "target_steps_total", "Target verify steps (one request, one forward pass)."),
    ("steps_with_drafts", "steps_with_drafts_total", "Target steps that found drafts waiting."),
    ("output_tokens", "output_tokens_total", "Tokens emitted to clients."),
    ("requests", "requests_total", "Finished requests."),
]


def prometheus_text(stats: SpecStats, now: float) -> str:
    """The same figures as /v1/spec/stats in Prometheus text exposition format:
    counters and histograms since start (`now` is unused: nothing here is a
    windowed figure; rates and quantiles are Prometheus' to compute)."""
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
    lines += ["# HELP specserve_draft_lag_tokens Tokens a draft replica was behind the "
              "verified position, recently.", "# TYPE specserve_draft_lag_tokens gauge"]
    for (m, rep), lag in sorted(stats.draft_lag.items()):
        lines.append(f'specserve_draft_lag_tokens{{draft_model="{m}",draft_replica="{rep}"}} {lag}')
    for key, help_text in (("batch_size", "Running requests"), ("queue_length", "Queued requests")):
        lines += [f"# HELP specserve_target_{key} {help_text} in the target engine.",
                  f"# TYPE specserve_target_{key} gauge"]
        for t, live in sorted(stats.target_live.items()):
            lines.append(f'specserve_target_{key}{{target_replica="{t}"}} {live[key]}')
    for name, hist, what in (("ttft_seconds", stats.ttft, "Time to first token"),
                             ("tpot_seconds", stats.tpot, "Time per output token")):
        lines += [f"# HELP specserve_{name} {what} of finished requests.",
                  f"# TYPE specserve_{name} histogram"]
        for bound, count in zip(hist.bounds, hist.counts):
            lines.append(f'specserve_{name}_bucket{{le="{bound:g}"}} {count}')
        lines += [f'specserve_{name}_bucket{{le="+Inf"}} {hist.total}',
                  f"specserve_{name}_sum {hist.sum_s}", f"specserve_{name}_count {hist.total}"]
    lines += ["# HELP specserve_goodput_tokens_total Output tokens of requests that met both "
              f"latency objectives (TTFT <= {stats.slo_ttft_s:g} s, TPOT <= "
              f"{stats.slo_tpot_s:g} s).", "# TYPE specserve_goodput_tokens_total counter",
              f"specserve_goodput_tokens_total {stats.goodput_tokens}"]
    return "\n".join(lines) + "\n"
