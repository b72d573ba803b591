"""The routing bench's workload and figures alone (specserve bench routing)."""

from specserve.acceptance.replicas import ReplicaTable
from specserve.tools.bench.conversations import figures, make_conversations, replica_counters


def test_the_workload_is_seeded_and_shares_system_prompts():
    a = make_conversations(6, 3, seed=1)
    assert a == make_conversations(6, 3, seed=1) != make_conversations(6, 3, seed=2)
    assert len(a) == 6 and all(len(c.users) == 3 for c in a)
    assert len({c.system for c in a}) == 2 and a[0].system == a[2].system != a[1].system
    assert len({u for c in a for u in c.users}) == 18  # every turn its own
    assert all(len(c.system) >= 300 and all(len(u) >= 80 for u in c.users) for c in a)


def _report(replica: str, hits: int, queries: int, requests: int) -> dict:
    """What a target replica reports (TargetServer.metrics_report), from the
    engine's own totals."""
    from specserve.target.engine import SpecTotals

    t = SpecTotals(prefix_cache_hits=hits, prefix_cache_queries=queries)
    for _ in range(requests):
        t.e2e.observe(0.5)
    return {"replica": replica, "model_name": "m", "engine": t.snapshot(), "branches": {}}


def test_counters_from_the_metrics_text_and_the_figures():
    table = ReplicaTable()
    table.update(_report("r1", hits=0, queries=100, requests=1), 0.0)
    before = replica_counters("\n".join(table.prometheus_lines(1.0, {})) + "\n")
    assert before == {"r1": {"queries": 100, "hits": 0, "requests": 1}}
    table.update(_report("r1", hits=270, queries=400, requests=7), 2.0)
    table.update(_report("r2", hits=30, queries=100, requests=3), 2.0)
    after = replica_counters("\n".join(table.prometheus_lines(3.0, {})) + "\n")
    f = figures(before, after, [0.3, 0.1, 0.2], replicas=2)
    assert f["prefix_cache_hit_rate"] == 300 / 400
    assert f["ttft_p50_s"] == 0.2
    assert f["requests_per_replica"] == [6, 3] and f["max_over_mean_requests"] == 6 / 4.5
    # a replica that served nothing counts
    one = figures({}, {"r1": {"queries": 0, "hits": 0, "requests": 4}}, [], replicas=2)
    assert one["requests_per_replica"] == [4, 0] and one["max_over_mean_requests"] == 2.0
    assert one["prefix_cache_hit_rate"] is None and one["ttft_p50_s"] is None
