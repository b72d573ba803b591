"""The metric catalogue: every metric specserve exports, in one list.

Owns each metric's name, type, help, labels and (histograms) buckets. The
router's /metrics (`specserve.acceptance.exposition` renders a family only
from an entry here), its Ray Serve metrics (`deployments.ops.ServeMetrics`,
`specserve.control.autoscale`'s gauge),
docs/metrics.md (the table between the `catalogue` markers is
`markdown_table()`) and the chart's Grafana dashboard (a test holds every
query's names and labels against `series_labels()`) come from it. It also
owns the `kind` label's values (`kind_of`). Pure data: no I/O.

Names: counters are listed by their sample name (`..._total`), as PromQL
queries them. `vllm:*` entries are vLLM's own engine metrics under vLLM's
names and help (vllm/v1/metrics/loggers.py), re-exported per target replica
so that vLLM's dashboards and `vllm bench serve` read them unchanged.
Buckets are vLLM's (vllm/v1/metrics/buckets.py) wherever vLLM has the figure:
a long prompt's TTFT runs to minutes.
"""

from __future__ import annotations

import dataclasses

# vLLM 0.32's defaults (vllm.v1.metrics.buckets), copied so that this module
# stays importable without vLLM.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # inter-token latency and TPOT
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

DRAFT = ("draft_model", "draft_replica", "kind")  # kind: kind_of(draft_model)
TARGET = ("target_replica",)
VLLM = ("model_name", "engine", "target_replica")  # vLLM's labels + which replica


# The `kind` label of a pool: a draft pool's kind (AppConfig.draft_kinds),
# "target" for the target pool, "none" for requests the target ran alone (their
# draft_model label is "none").
TARGET_POOL, NO_DRAFT = "target", "none"


def kind_of(pool: str, kinds: dict[str, str]) -> str:
    """The `kind` label of a pool: "model", "suffix" or "hybrid" for a draft pool in
    `kinds` (AppConfig.draft_kinds()), "target", "none" (no draft), else
    "unknown" (a name the config does not hold, e.g. a pool since removed)."""
    if pool in kinds:
        return kinds[pool]
    if pool == TARGET_POOL:
        return "target"
    if pool == NO_DRAFT:
        return "none"
    return "unknown"


@dataclasses.dataclass(frozen=True)
class Metric:
    name: str  # the sample name PromQL uses (counters end in _total)
    type: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()  # histograms: upper bounds (seconds), +Inf implied
    source: str = "router"  # router | target (per target replica) | vllm | ray

    def __post_init__(self):
        if self.type not in ("counter", "gauge", "histogram"):
            raise ValueError(f"{self.name}: unknown type {self.type!r}")
        if (self.type == "counter") != self.name.endswith("_total"):
            raise ValueError(f"{self.name}: counters, and only counters, end in _total")
        if (self.type == "histogram") != bool(self.buckets):
            raise ValueError(f"{self.name}: histograms, and only histograms, have buckets")

    @property
    def series(self) -> tuple[str, ...]:
        """The series names a query can use."""
        if self.type == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


def _c(name, help_text, labels=(), source="router"):
    return Metric(name, "counter", help_text, tuple(labels), source=source)


def _g(name, help_text, labels=(), source="router"):
    return Metric(name, "gauge", help_text, tuple(labels), source=source)


def _h(name, help_text, buckets, labels=(), source="router"):
    return Metric(name, "histogram", help_text, tuple(labels), tuple(buckets), source)


CATALOGUE: tuple[Metric, ...] = (
    # -- the router's acceptance record (specserve.acceptance.prometheus) ------
    _c("specserve_draft_tokens_total", "Drafted tokens the target verified.", DRAFT),
    _c("specserve_accepted_tokens_total", "Drafted tokens the target accepted.", DRAFT),
    _c("specserve_target_steps_total", "Target verify steps (one request, one forward pass).",
       DRAFT),
    _c("specserve_steps_with_drafts_total", "Target steps that found drafts waiting.", DRAFT),
    _c("specserve_output_tokens_total", "Tokens emitted to clients.", DRAFT),
    _c("specserve_requests_total", "Finished requests.", DRAFT),
    _c("specserve_accepted_per_position_total",
       "Accepted drafted tokens by position in the draft.", DRAFT + ("position",)),
    _g("specserve_k", "Current number of speculative tokens per draft model.",
       ("draft_model", "kind")),
    _g("specserve_draft_lag_tokens",
       "Tokens a draft replica was behind the verified position, recently.", DRAFT),
    _h("specserve_ttft_seconds", "Time to first token of finished requests (router).",
       TTFT_BUCKETS_S),
    _h("specserve_tpot_seconds", "Time per output token of finished requests (router).",
       ITL_BUCKETS_S),
    _c("specserve_goodput_tokens_total",
       "Output tokens of requests that met both latency objectives (speculation SLOs)."),
    # -- the router's HTTP edge (specserve.acceptance.outcomes) ----------------
    _c("specserve_http_responses_total", "HTTP responses by route and status.",
       ("route", "status")),
    _c("specserve_http_aborts_total",
       "Responses the client left before their end (the engine slot was freed).", ("route",)),
    _c("specserve_http_stream_failures_total",
       "Streams the target failed after their start (an error event ended them).", ("route",)),
    _g("specserve_http_inflight", "HTTP requests in flight in this router.", ("route",)),
    # -- Serve's pools (specserve.control.pools) --------------------------------
    _g("specserve_pool_replicas", "Running replicas per pool (target or draft model).",
       ("pool", "kind")),
    # -- online draft adaptation per draft pool, as one replica of the pool
    # answers (specserve.adapt.figures via specserve.control.pools) ------------
    _g("specserve_adapt_heldout_alpha_serving",
       "Held-out alpha of the serving draft weights, latest measure (no sample until "
       "measured).", ("pool", "kind")),
    _g("specserve_adapt_heldout_alpha_candidate",
       "Held-out alpha of the latest candidate draft weights (no sample until one is "
       "judged).", ("pool", "kind")),
    _g("specserve_adapt_buffer_tokens",
       "Tokens kept in the adaptation buffer (held-out ones included).",
       ("pool", "kind")),
    _g("specserve_adapt_heldout_tokens",
       "Tokens of the buffer held out of training to judge candidates.",
       ("pool", "kind")),
    _g("specserve_adapt_train_seconds", "Training seconds of the latest adaptation round.",
       ("pool", "kind")),
    _c("specserve_adapt_swaps_total", "Draft weight versions promoted to serve (swaps).",
       ("pool", "kind")),
    _c("specserve_adapt_rollbacks_total", "Rollbacks to the previously serving version.",
       ("pool", "kind")),
    _g("specserve_adapt_version_info", "The serving draft weight version (1 on its label).",
       ("pool", "kind", "version")),
    # -- per target replica, from its engine and draft sink --------------------
    _g("specserve_target_batch_size", "Running requests in the target engine.", TARGET,
       "target"),
    _g("specserve_target_queue_length", "Queued requests in the target engine.", TARGET,
       "target"),
    _c("specserve_branch_hits_total", "Steps after a rejection that found a matching branch.",
       TARGET + DRAFT, "target"),
    _c("specserve_steps_after_rejection_total", "Steps after a rejection.", TARGET + DRAFT,
       "target"),
    _c("specserve_covered_after_rejection_total",
       "Steps after a rejection that found drafts (branch or bounded wait).", TARGET + DRAFT,
       "target"),
    _c("specserve_steps_after_accepted_total", "Steps after a fully accepted window.",
       TARGET + DRAFT, "target"),
    _c("specserve_covered_after_accepted_total",
       "Steps after a fully accepted window that found drafts.", TARGET + DRAFT, "target"),
    _c("specserve_wait_seconds_total", "Seconds the proposer held steps for fresh drafts.",
       TARGET + DRAFT, "target"),
    _c("specserve_proposer_steps_total", "Proposer steps with rows of this draft.",
       TARGET + DRAFT, "target"),
    _c("specserve_released_requests_total",
       "Requests given up: speculation.release_after_steps steps in a row without drafts.",
       TARGET + DRAFT, "target"),
    _c("specserve_draft_stream_cuts_total",
       "Draft streams the target's sink cut off (over its message rate, not reading "
       "verified updates, or a sink error).", TARGET + DRAFT, "target"),
    # -- vLLM's own engine metrics, per target replica, under vLLM's names -----
    _g("vllm:num_requests_running", "Number of requests in model execution batches.", VLLM,
       "vllm"),
    _g("vllm:num_requests_waiting", "Number of requests waiting to be processed.", VLLM,
       "vllm"),
    _g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", VLLM,
       "vllm"),
    _c("vllm:prefix_cache_queries_total",
       "Prefix cache queries, in terms of number of queried tokens.", VLLM, "vllm"),
    _c("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.",
       VLLM, "vllm"),
    _c("vllm:prompt_tokens_total", "Number of prefill tokens processed.", VLLM, "vllm"),
    _c("vllm:generation_tokens_total", "Number of generation tokens processed.", VLLM, "vllm"),
    _c("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.", VLLM, "vllm"),
    _c("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.", VLLM, "vllm"),
    _c("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.", VLLM,
       "vllm"),
    _c("vllm:spec_decode_num_accepted_tokens_per_pos_total",
       "Accepted tokens per draft position.", VLLM + ("position",), "vllm"),
    _h("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
       TTFT_BUCKETS_S, VLLM, "vllm"),
    _h("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
       ITL_BUCKETS_S, VLLM, "vllm"),
    _h("vllm:request_time_per_output_token_seconds",
       "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS_S, VLLM, "vllm"),
    _h("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
       E2E_BUCKETS_S, VLLM, "vllm"),
    # -- through ray.serve.metrics (Ray's agent adds the ray_ prefix and Serve's
    # own tags: deployment, replica, application) --------------------------------
    _c("specserve_draft_tokens_total", "Drafted tokens the target verified.", DRAFT, "ray"),
    _c("specserve_accepted_tokens_total", "Drafted tokens the target accepted.", DRAFT, "ray"),
    _c("specserve_output_tokens_total", "Tokens emitted to clients.", DRAFT, "ray"),
    _h("specserve_ttft_seconds", "Time to first token.", TTFT_BUCKETS_S, (), "ray"),
    _h("specserve_tpot_seconds", "Time per output token.", ITL_BUCKETS_S, (), "ray"),
    _g("specserve_autoscale_desired_replicas",
       "Replicas the specserve policy asks for (reasons: the decision log).", ("pool",), "ray"),
)

BY_NAME: dict[str, Metric] = {m.name: m for m in CATALOGUE if m.source != "ray"}
RAY: dict[str, Metric] = {m.name: m for m in CATALOGUE if m.source == "ray"}


def metric(name: str) -> Metric:
    """The catalogue's entry for a /metrics family (KeyError names the fix)."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not in specserve.acceptance.catalogue.CATALOGUE; "
                       "add it there (name, type, help, labels)") from None


def ray_name(m: Metric) -> str:
    """The name to give ray.serve.metrics (it adds _total to counters itself)."""
    return m.name[: -len("_total")] if m.type == "counter" else m.name


def series_labels() -> dict[str, tuple[str, ...]]:
    """Every series a query can name (/metrics' and, with Ray's prefix, Ray's)
    with the labels the catalogue gives it (`le` on a histogram's buckets; not
    the labels a scrape or Ray's agent add, such as `job`)."""
    out: dict[str, tuple[str, ...]] = {}
    for m in CATALOGUE:
        names = [f"ray_{s}" if m.source == "ray" else s for s in m.series]
        if m.source == "ray" and m.type == "counter":  # Ray's exporter names both
            names.append(f"ray_{ray_name(m)}")
        for n in names:
            n = n.replace(":", "_") if n.startswith("ray_") else n
            out[n] = m.labels + (("le",) if n.endswith("_bucket") else ())
    return out


def series_names() -> set[str]:
    """Every series a query can name: /metrics' and, with Ray's prefix, Ray's."""
    return set(series_labels())


DOC_BEGIN, DOC_END = "<!-- catalogue: begin -->", "<!-- catalogue: end -->"


def markdown_table() -> str:
    """docs/metrics.md's table of every metric."""
    rows = ["| metric | type | labels | source | help |", "|---|---|---|---|---|"]
    for m in CATALOGUE:
        name = f"ray_{m.name}" if m.source == "ray" else m.name
        labels = ", ".join(f"`{label}`" for label in m.labels) or "—"
        rows.append(f"| `{name}` | {m.type} | {labels} | {m.source} | {m.help} |")
    return "\n".join(rows)


if __name__ == "__main__":  # rewrite docs/metrics.md's table: python -m ... docs/metrics.md
    import sys
    from pathlib import Path

    path = Path(sys.argv[1])
    doc = path.read_text(encoding="utf-8")
    head, rest = doc.split(DOC_BEGIN, 1)
    path.write_text(f"{head}{DOC_BEGIN}\n{markdown_table()}\n{DOC_END}{rest.split(DOC_END, 1)[1]}",
                    encoding="utf-8")
