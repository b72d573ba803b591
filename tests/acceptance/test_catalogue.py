"""The metric catalogue (specserve.acceptance.catalogue) is what /metrics, Ray's
metrics, docs/metrics.md and the Grafana dashboard come from; label values are
escaped so that any draft name leaves the scrape parseable."""

import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.acceptance import catalogue
from specserve.acceptance.exposition import escape, family
from specserve.acceptance.outcomes import HttpOutcomes
from specserve.acceptance.prometheus import prometheus_lines
from specserve.acceptance.record import Acceptance, TargetReport
from specserve.acceptance.replicas import ReplicaTable
from specserve.acceptance.stats import RequestRecord, SpecStats
from specserve.control import pools
from specserve.target.engine import SpecTotals

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from grafana import (grafana_expressions, grafana_targets, legend_labels,  # noqa: E402
                     promql_grouping, promql_labels, promql_metrics)

ODD = 'we"ird\\name\nx'  # a draft name from gRPC metadata
ADAPT = {"version": "v1", "heldout_alpha_serving": 0.5, "heldout_alpha_candidate": 0.55,
         "buffer_tokens": 10, "heldout_tokens": 2, "swaps": 1, "rollbacks": 0, "rounds": 1,
         "train_seconds": 0.3, "last_round": "promoted v1"}  # specserve.adapt.figures


def full_metrics_text(draft_model="d", draft_replica="r1") -> str:
    """What the router's /metrics writes, every family filled."""
    stats = SpecStats(4)
    stats.record(RequestRecord(TargetReport("t1", draft_model, draft_replica,
                                            Acceptance(4, 10, 8, (1, 1, 1)), draft_lag=0.5),
                               0.1, 0.5, 100.0))
    stats.current_k[draft_model] = 4
    outcomes = HttpOutcomes()
    outcomes.started("/v1/completions")
    outcomes.responded("/v1/completions", 200)
    outcomes.stream_failed("/v1/completions")
    outcomes.ended("/v1/completions", aborted=True)
    table = ReplicaTable()
    table.update({"replica": "t1", "model_name": "tiny", "engine": SpecTotals(
        accepted_per_position=[1, 0]).snapshot(),
        "branches": {f"{draft_model}/{draft_replica}": {"branch_hits": 1}}}, now=100.0)
    kinds = {draft_model: "suffix"}
    lines = [*prometheus_lines(stats, 100.0, kinds), *outcomes.prometheus_lines(),
             *pools.prometheus_lines(pools.with_adapt(pools.replica_counts(
                 {"target": {"RUNNING": 1}}, {"target": (1, 1), draft_model: (1, 1)}, kinds),
                 {draft_model: ADAPT}, {draft_model})),
             *table.prometheus_lines(now=100.0, kinds=kinds)]
    return "\n".join(lines) + "\n"


def test_metrics_families_are_the_catalogues_with_their_type_help_and_labels():
    families = {f.name: f for f in text_string_to_metric_families(full_metrics_text())}
    # the parser names a counter family without its _total
    by_family = {(m.name[: -len("_total")] if m.type == "counter" else m.name): m
                 for m in catalogue.BY_NAME.values()}
    assert set(families) == set(by_family)  # each catalogued family is written, no other
    for name, fam in families.items():
        m = by_family[name]
        assert fam.type == m.type and fam.documentation == m.help, name
        assert fam.samples, name
        for s in fam.samples:
            assert set(s.labels) - {"le"} == set(m.labels), (name, s.labels)


def test_a_label_value_with_quote_backslash_newline_keeps_the_scrape_parseable():
    assert escape(ODD) == 'we\\"ird\\\\name\\nx'
    text = full_metrics_text(draft_model=ODD)
    models = {s.labels.get("draft_model") for f in text_string_to_metric_families(text)
              for s in f.samples}
    assert ODD in models


def test_every_draft_series_has_its_pools_kind():
    """A pool's kind (catalogue.kind_of) on each per-draft sample: the draft's
    ("suffix", as configured), the target's, "none" for target-only requests."""
    seen = {}
    for f in text_string_to_metric_families(full_metrics_text()):
        for s in f.samples:
            pool = s.labels.get("draft_model", s.labels.get("pool"))
            if pool is not None:
                seen.setdefault(pool, set()).add(s.labels["kind"])
    assert seen == {"d": {"suffix"}, "none": {"none"}, "target": {"target"}}


def test_kind_of_a_pool():
    kinds = {"llama-1b": "model", "sfx": "suffix"}
    assert [catalogue.kind_of(p, kinds) for p in ("llama-1b", "sfx", "target", "none", "gone")] \
        == ["model", "suffix", "target", "none", "unknown"]
    # a draft pool named like a label keeps its configured kind
    assert catalogue.kind_of("none", {"none": "model"}) == "model"


def test_a_family_refuses_labels_the_catalogue_does_not_have():
    with pytest.raises(ValueError, match="labels"):
        family("specserve_k", [({"draft_model": "d", "extra": 1}, 4)])
    with pytest.raises(KeyError, match="catalogue"):
        family("specserve_not_catalogued", [])


def test_latency_buckets_are_vllms():
    from vllm.v1.metrics import buckets

    assert catalogue.TTFT_BUCKETS_S == buckets.TIME_TO_FIRST_TOKEN_BUCKETS
    assert catalogue.ITL_BUCKETS_S == buckets.INTER_TOKEN_LATENCY_BUCKETS
    assert catalogue.E2E_BUCKETS_S == buckets.REQUEST_LATENCY_BUCKETS


def test_every_dashboard_query_names_catalogued_metrics():
    names = catalogue.series_names()
    for expr in grafana_expressions():
        metrics, _ = promql_metrics(expr)
        assert metrics and metrics <= names, (expr, sorted(metrics - names))
    assert "specserve_branch_hits_total" in names and "specserve_no_such" not in names


def test_every_dashboard_label_is_catalogued_and_pools_are_grouped_by_kind():
    """Each label a query or legend names is a catalogued label of a metric it
    queries (`job`: the scrape's); a panel per draft model or pool groups by
    the pool's kind too, and its legend shows it."""
    labels = catalogue.series_labels()
    grouped_by_pool = 0
    for t in grafana_targets():
        expr = t["expr"]
        metrics, _ = promql_metrics(expr)
        known = set().union(*(labels[m] for m in metrics)) | {"job"}
        used = promql_labels(expr) | legend_labels(t.get("legendFormat"))
        assert used <= known, (expr, sorted(used - known))
        for group in promql_grouping(expr):
            if group & {"draft_model", "pool"} and "kind" in known:
                grouped_by_pool += 1
                assert "kind" in group, (expr, group)
                assert "kind" in legend_labels(t.get("legendFormat")), t
    assert grouped_by_pool >= 8
    assert promql_labels('sum by (a) (x{b=~"q,{c}", d!="1"}) / on (e) y') == {"a", "b", "d", "e"}


def test_docs_table_is_the_catalogues():
    doc = (REPO / "docs" / "metrics.md").read_text(encoding="utf-8")
    begin, end = catalogue.DOC_BEGIN, catalogue.DOC_END
    assert begin in doc and end in doc, "docs/metrics.md lacks the catalogue markers"
    table = doc[doc.index(begin) + len(begin):doc.index(end)].strip("\n")
    assert table == catalogue.markdown_table(), (
        "docs/metrics.md's table is stale: run `python -m specserve.acceptance.catalogue`")
