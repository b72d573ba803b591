"""The autoscaling decisions alone (specserve.control.autoscale)."""

from types import SimpleNamespace

from specserve.control.autoscale import draft_policy, draft_pool, target_policy, target_pool


def test_draft_pool_grows_when_drafts_are_late_under_load():
    d = draft_pool(1, 1, 3, coverage=0.2, lag=3.0, active=4.0)
    assert d.replicas == 2 and "late" in d.reason
    assert draft_pool(3, 1, 3, 0.2, 3.0, 4.0).replicas == 3  # at the maximum


def test_draft_pool_holds_when_timely_and_shrinks_when_idle():
    assert draft_pool(2, 1, 3, coverage=0.9, lag=0.0, active=4.0).replicas == 2
    assert draft_pool(2, 1, 3, coverage=0.2, lag=0.2, active=4.0).replicas == 2  # not lagging
    idle = draft_pool(2, 1, 3, coverage=None, lag=None, active=0.0)
    assert idle.replicas == 1 and "idle" in idle.reason
    assert draft_pool(1, 1, 3, None, None, 0.0).replicas == 1  # at the minimum
    assert draft_pool(2, 1, 3, None, None, None).reason == "no figures yet"


def test_draft_pool_counts_released_requests_as_uncovered_and_late():
    """Requests the target gave up (their drafts kept coming too late) get no
    more updates, so the drafts the replica still sends can look timely: 3 of
    4 assigned released, the last one covered 0.9 of its steps, no lag."""
    d = draft_pool(1, 1, 3, coverage=0.9, lag=0.0, active=4.0, released=3.0)
    assert d.replicas == 2 and "late" in d.reason and "0.23" in d.reason
    assert "3.0 released" in d.reason
    # Without the releases the same figures are a pool that keeps up ...
    assert draft_pool(1, 1, 3, 0.9, 0.0, 4.0, released=0.0).reason == "keeping up"
    assert draft_pool(1, 1, 3, 0.9, 0.0, 4.0).reason == "keeping up"
    # ... and one release in four leaves most steps covered.
    assert draft_pool(1, 1, 3, 0.9, 0.0, 4.0, released=1.0).reason == "keeping up"
    # Every assigned request released: nothing covered.
    assert draft_pool(1, 1, 3, 1.0, 0.0, 2.0, released=2.0).replicas == 2
    # Not under load: no growth, however many were released.
    assert draft_pool(1, 1, 3, 1.0, 0.0, 0.5, released=0.5).replicas == 1


def test_target_pool_follows_queue_and_load():
    assert target_pool(1, 1, 4, load=0.95, waiting=0.0).replicas == 2
    assert target_pool(1, 1, 4, load=0.5, waiting=3.0).replicas == 2
    assert target_pool(3, 1, 4, load=0.1, waiting=0.0).replicas == 2
    assert target_pool(2, 1, 4, load=0.5, waiting=0.0).replicas == 2
    assert target_pool(1, 1, 4, load=0.1, waiting=0.0).replicas == 1


def ctx(metrics, current=1, lo=1, hi=2, state=None, name="draft-x"):
    return SimpleNamespace(aggregated_metrics=metrics, current_num_replicas=current,
                           capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi,
                           policy_state=state or {}, deployment_name=name)


def test_serve_policy_functions_average_replicas_and_keep_the_reason():
    m = {"coverage": {"a": 0.1, "b": 0.3}, "lag": {"a": 2.0, "b": 4.0}, "active": {"a": 3, "b": 5}}
    n, state = draft_policy(ctx(m, current=2, hi=3))
    assert n == 3 and "late" in state["reason"]
    m = {"coverage": {"a": 1.0, "b": 0.8}, "lag": {"a": 0.0, "b": 0.0},
         "active": {"a": 2, "b": 4}, "released": {"a": 2, "b": 2}}
    n, state = draft_policy(ctx(m, current=2, hi=3, state=state))
    assert n == 3 and "2.0 released" in state["reason"]
    n, state = draft_policy(ctx({"active": {"a": 0.0}}, current=2, state=state))
    assert n == 1 and "idle" in state["reason"]
    n, state = target_policy(ctx({"load": {"a": 1.0}, "waiting": {"a": 2.0}}, name="target"))
    assert n == 2 and "queueing" in state["reason"]


def test_desired_replicas_gauge_has_one_series_per_pool(monkeypatch):
    """The reason (free text with figures) is no label: it would make a new
    series for every decision; reasons go to the decision log."""
    import ray.serve.metrics

    from specserve.control import autoscale

    made = []

    class FakeGauge:
        def __init__(self, name, description="", tag_keys=()):
            made.append((name, tuple(tag_keys)))

        def set(self, value, tags=None):
            made.append((value, dict(tags or {})))

    monkeypatch.setattr(ray.serve.metrics, "Gauge", FakeGauge)
    autoscale._export("target", autoscale.Decision(3, "queueing: 4.2 waiting"))
    assert made == [("specserve_autoscale_desired_replicas", ("pool",)), (3, {"pool": "target"})]
