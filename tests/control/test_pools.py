"""What the ops views show about pools (specserve.control.pools, pure): replica counts
from Serve's status, the autoscaling decision log, their Prometheus lines; and
that the Serve policy functions publish each changed decision."""

from types import SimpleNamespace

from specserve.control import autoscale

from specserve.control import pools


def test_replica_counts_per_pool_with_bounds():
    rows = pools.replica_counts(
        {"router": {"RUNNING": 1}, "draft-llama-1b": {"RUNNING": 2, "STARTING": 1, "STOPPING": 0},
         "target": {"RUNNING": 1}},
        {"target": (1, 4), "llama-1b": (2, 8), "llama-8b": (1, 4)},
        {"llama-1b": "model", "llama-8b": "suffix"})
    assert [r["pool"] for r in rows] == ["target", "llama-1b", "llama-8b"]
    target, small, big = rows
    assert target == {"pool": "target", "kind": "target", "deployment": "target",
                      "states": {"RUNNING": 1},
                      "running": 1, "min_replicas": 1, "max_replicas": 4}
    assert small["states"] == {"RUNNING": 2, "STARTING": 1} and small["running"] == 2
    assert small["kind"] == "model"
    assert (small["min_replicas"], small["max_replicas"]) == (2, 8)
    # A configured pool Serve does not report (yet): shown with 0 running.
    assert big == {"pool": "llama-8b", "kind": "suffix", "deployment": "draft-llama-8b",
                   "states": {},
                   "running": 0, "min_replicas": 1, "max_replicas": 4}
    assert pools.prometheus_lines(rows)[2:] == [
        'specserve_pool_replicas{pool="target",kind="target"} 1',
        'specserve_pool_replicas{pool="llama-1b",kind="model"} 2',
        'specserve_pool_replicas{pool="llama-8b",kind="suffix"} 0']


def test_pool_names():
    assert pools.pool_name("target") == "target"
    assert pools.pool_name("draft-llama-1b") == "llama-1b"
    assert pools.pool_name("router") is None


def test_decision_log_keeps_the_latest_newest_first():
    log = pools.DecisionLog(keep=3)
    for i in range(5):
        log.record(100.0 + i, "same", 1, 1 + i % 2, f"reason {i}")
    recent = log.recent()
    assert [d["reason"] for d in recent] == ["reason 4", "reason 3", "reason 2"]
    assert recent[0] == {"at": 104.0, "pool": "same", "previous": 1, "replicas": 1,
                         "reason": "reason 4"}
    assert [d["reason"] for d in log.recent(1)] == ["reason 4"]


def test_policies_publish_changed_decisions(monkeypatch):
    published = []
    monkeypatch.setattr(pools, "publish", lambda *a: published.append(a))
    ctx = SimpleNamespace(current_num_replicas=1, capacity_adjusted_min_replicas=1,
                          capacity_adjusted_max_replicas=3, deployment_name="draft-same",
                          policy_state={}, aggregated_metrics={
                              "coverage": {"r": 0.2}, "lag": {"r": 3.0}, "active": {"r": 4.0}})
    n, state = autoscale.draft_policy(ctx)
    assert n == 2
    (at, pool, previous, replicas, reason), = published
    assert (pool, previous, replicas) == ("same", 1, 2) and "late" in reason
    ctx.policy_state = state  # the same decision again: not published twice
    autoscale.draft_policy(ctx)
    assert len(published) == 1


def test_with_adapt_puts_each_adapting_pools_figures_on_its_row():
    rows = pools.replica_counts({}, {"target": (1, 1), "a": (1, 2), "b": (1, 1), "c": (1, 1)},
                                {"a": "model", "b": "model", "c": "hybrid"})
    figures = {"a": {"version": "v1", "buffer_tokens": 10}, "b": None}
    out = {r["pool"]: r for r in pools.with_adapt(rows, figures, {"a", "c"})}
    assert out["a"]["adapt"] == {"version": "v1", "buffer_tokens": 10}
    assert out["b"]["adapt"] is None  # adapt off
    assert out["c"]["adapt"] == "unavailable: no replica answered"
    assert "adapt" not in out["target"] and all("adapt" not in r for r in rows)
    down = pools.with_adapt(rows, "unavailable: TimeoutError", {"a"})
    assert [r.get("adapt") for r in down] == [None, "unavailable: TimeoutError", None, None]


def test_adapt_figures_on_metrics_per_adapting_pool():
    """An adapting pool's figures as gauges, its swaps and rollbacks as
    counters and its serving version as an info gauge; a null alpha writes no
    sample; no adapt families while no row holds figures."""
    rows = pools.replica_counts({}, {"target": (1, 1), "a": (1, 1), "b": (1, 1), "c": (1, 1)},
                                {"a": "model", "b": "model", "c": "hybrid"})
    assert pools.prometheus_lines(pools.with_adapt(rows, {}, set())) == \
        pools.prometheus_lines(rows)
    assert all("adapt" not in line
               for line in pools.prometheus_lines(pools.with_adapt(rows, "unavailable: x", {"a"})))
    figures = {"a": {"version": "v2", "heldout_alpha_serving": 0.61,
                     "heldout_alpha_candidate": None, "buffer_tokens": 900,
                     "heldout_tokens": 100, "swaps": 2, "rollbacks": 1, "rounds": 3,
                     "train_seconds": 4.5, "last_round": "promoted v2"},
               "c": {"version": None, "heldout_alpha_serving": None,
                     "heldout_alpha_candidate": None, "buffer_tokens": 0, "heldout_tokens": 0,
                     "swaps": 0, "rollbacks": 0, "rounds": 0, "train_seconds": 0.0,
                     "last_round": None}}
    lines = pools.prometheus_lines(pools.with_adapt(rows, figures, {"a", "c"}))
    samples = [line for line in lines if line.startswith("specserve_adapt")]
    assert samples == [
        'specserve_adapt_heldout_alpha_serving{pool="a",kind="model"} 0.61',
        'specserve_adapt_buffer_tokens{pool="a",kind="model"} 900',
        'specserve_adapt_buffer_tokens{pool="c",kind="hybrid"} 0',
        'specserve_adapt_heldout_tokens{pool="a",kind="model"} 100',
        'specserve_adapt_heldout_tokens{pool="c",kind="hybrid"} 0',
        'specserve_adapt_train_seconds{pool="a",kind="model"} 4.5',
        'specserve_adapt_train_seconds{pool="c",kind="hybrid"} 0.0',
        'specserve_adapt_swaps_total{pool="a",kind="model"} 2',
        'specserve_adapt_swaps_total{pool="c",kind="hybrid"} 0',
        'specserve_adapt_rollbacks_total{pool="a",kind="model"} 1',
        'specserve_adapt_rollbacks_total{pool="c",kind="hybrid"} 0',
        'specserve_adapt_version_info{pool="a",kind="model",version="v2"} 1']
    # Every family keeps its HELP and TYPE, samples or not (the candidate's).
    assert "# TYPE specserve_adapt_heldout_alpha_candidate gauge" in lines
    assert "# TYPE specserve_adapt_swaps_total counter" in lines
