"""The acceptance picture in Prometheus text exposition format (the router's /metrics).

Owns the metric names and labels; the figures are `SpecStats`'s. PromQL over
the exported counters:
  acceptance rate:  rate(specserve_accepted_tokens_total[$__rate_interval])
                    / rate(specserve_draft_tokens_total[$__rate_interval])
  coverage:         rate(specserve_steps_with_drafts_total[$__rate_interval])
                    / rate(specserve_target_steps_total[$__rate_interval])
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
