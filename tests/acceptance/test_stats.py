"""The acceptance picture alone (specserve.acceptance.stats and .prometheus)."""

from specserve.acceptance.prometheus import prometheus_text
from specserve.acceptance.record import Acceptance, TargetReport
from specserve.acceptance.stats import RequestRecord, SpecStats


KINDS = {"m": "suffix"}


def rec(model, replica, hist, out, draft_tokens, k=4, target="t1", ttft=0.1, dur=1.0, at=100.0,
        **live):
    report = TargetReport(target, model, replica, Acceptance(k, out, draft_tokens, tuple(hist)),
                          **live)
    return RequestRecord(report, ttft_s=ttft, duration_s=dur, finished_at=at)


def test_figures_add_up_per_model_replica_and_target():
    s = SpecStats(k=4)
    s.record(rec("good", "r1", [0, 0, 0, 0, 2], out=12, draft_tokens=8))
    s.record(rec("good", "r2", [1, 1, 0, 0, 0], out=10, draft_tokens=8, target="t2"))
    s.record(rec("bad", "r3", [4, 0, 0, 0, 0], out=10, draft_tokens=16))
    s.record(rec(None, None, [], out=5, draft_tokens=0))
    snap = s.snapshot(now=100.0, kinds={"good": "model", "bad": "suffix"})
    models = {d["model"]: d for d in snap["draft_models"]}
    assert models["good"]["draft_tokens"] == 16 and models["good"]["accepted_tokens"] == 9
    assert models["good"]["acceptance_rate"] == 9 / 16
    assert models["good"]["accepted_per_position"] == [3, 2, 2, 2]
    # mean accepted length: 1 + accepted / steps with drafts
    assert models["good"]["mean_accepted_length"] == 1 + 9 / 4
    assert models["bad"]["acceptance_rate"] == 0.0
    assert models["bad"]["coverage"] == 4 / 10
    assert [d["replica"] for d in snap["drafts"]] == ["r3", "r1", "r2"]
    assert [d["kind"] for d in snap["drafts"]] == ["suffix", "model", "model"]
    assert models["bad"]["kind"] == "suffix" and models["good"]["kind"] == "model"
    assert snap["target_only"]["requests"] == 1
    assert {t["replica"]: t["requests"] for t in snap["targets"]} == {"t1": 3, "t2": 1}


def test_end_to_end_window_and_prometheus_text():
    s = SpecStats(k=2)
    s.record(rec("m", "r", [1, 1, 1], out=11, draft_tokens=6, k=2, ttft=0.2, dur=2.2, at=50.0))
    e2e = s.end_to_end(now=60.0)
    assert e2e["ttft_p50_s"] == 0.2 and abs(e2e["tpot_p50_s"] - 0.2) < 1e-9
    assert s.end_to_end(now=1000.0)["requests"] == 0
    text = prometheus_text(s, now=60.0, kinds=KINDS)
    assert 'specserve_draft_tokens_total{draft_model="m",draft_replica="r",kind="suffix"} 6' in text
    assert 'specserve_accepted_per_position_total{draft_model="m",draft_replica="r",kind="suffix",position="1"} 1' in text
    assert "# TYPE specserve_k gauge" in text


def test_goodput_target_live_figures_and_draft_lag():
    s = SpecStats(k=2, slo_ttft_s=1.0, slo_tpot_s=0.1)
    fast = rec("m", "r", [0, 1, 0], out=11, draft_tokens=2, k=2, ttft=0.5, dur=1.0, at=50.0,
               target_running=3, target_waiting=1, draft_lag=2.5)
    slow = rec("m", "r", [0, 1, 0], out=11, draft_tokens=2, k=2, ttft=3.0, dur=4.0, at=50.0)
    s.record(slow)
    s.record(fast)
    e2e = s.end_to_end(now=60.0)
    assert e2e["output_tokens_per_s"] == 22 / 60 and e2e["goodput_tokens_per_s"] == 11 / 60
    snap = s.snapshot(now=60.0, kinds={})
    assert snap["targets"][0]["batch_size"] == 3 and snap["targets"][0]["queue_length"] == 1
    assert snap["targets"][0]["output_tokens_per_s"] == 22 / 60
    assert snap["drafts"][0]["draft_lag"] == 2.5
    text = prometheus_text(s, now=60.0, kinds=KINDS)
    assert 'specserve_draft_lag_tokens{draft_model="m",draft_replica="r",kind="suffix"} 2.5' in text
    # Counters and histograms (since start): Prometheus takes rates and quantiles.
    assert "specserve_goodput_tokens_total 11" in text
    assert 'specserve_ttft_seconds_bucket{le="0.5"} 1' in text  # fast only
    assert 'specserve_ttft_seconds_bucket{le="5.0"} 2' in text
    assert 'specserve_ttft_seconds_bucket{le="+Inf"} 2' in text
    assert "specserve_ttft_seconds_count 2" in text and "specserve_ttft_seconds_sum 3.5" in text
    # TPOT: fast (1.0-0.5)/10 = 0.05 s, slow 0.1 s.
    assert 'specserve_tpot_seconds_bucket{le="0.05"} 1' in text
    assert 'specserve_tpot_seconds_bucket{le="0.1"} 2' in text
    assert "per_second" not in text and "p50" not in text  # no unaggregatable gauges


def test_replica_rows_are_pruned_after_the_grace_period():
    s = SpecStats(k=2, grace_s=100.0)
    s.record(rec("m", "old", [1, 1, 0], out=5, draft_tokens=4, k=2, target="t-old", at=0.0,
                 draft_lag=1.0))
    s.record(rec("m", "new", [1, 1, 0], out=5, draft_tokens=4, k=2, target="t-new", at=90.0))
    s.prune(now=150.0)
    assert list(s.by_replica) == [("m", "new")] and list(s.by_target) == ["t-new"]
    assert s.draft_lag == {}
    # The per-model sum keeps what the pruned replica counted.
    assert s.by_model["m"].requests == 2
    text = prometheus_text(s, now=150.0, kinds=KINDS)
    assert 'draft_replica="old"' not in text and 'draft_replica="new"' in text


def test_the_lag_gauge_of_a_draft_replica_without_requests_is_dropped():
    s = SpecStats(k=2)
    s.record(rec("m", "r", [0, 1, 0], out=11, draft_tokens=2, k=2, at=50.0, draft_lag=2.5))
    assert 'specserve_draft_lag_tokens{draft_model="m",draft_replica="r",kind="suffix"} 2.5' in \
        prometheus_text(s, now=60.0, kinds=KINDS)
    later = prometheus_text(s, now=200.0, kinds=KINDS)  # 150 s without a request: dead or idle
    assert "specserve_draft_lag_tokens{" not in later
    assert 'specserve_draft_tokens_total{draft_model="m",draft_replica="r",kind="suffix"} 2' in later


def test_figures_per_draft_weights_version():
    """An adapting pool's records carry the version that drafted them; its
    figures add up per (model, version), and pools without versions have none."""
    s = SpecStats(k=4)
    s.record(rec("a", "r1", [4, 0, 0, 0, 0], out=10, draft_tokens=16, draft_version="v0"))
    s.record(rec("a", "r1", [0, 0, 0, 0, 4], out=20, draft_tokens=16, draft_version="v1"))
    s.record(rec("a", "r2", [0, 0, 0, 0, 2], out=10, draft_tokens=8, draft_version="v1"))
    s.record(rec("b", "r3", [0, 0, 0, 0, 2], out=10, draft_tokens=8))
    versions = s.snapshot(now=100.0, kinds={})["draft_versions"]
    assert [(v["model"], v["version"], v["requests"]) for v in versions] == [
        ("a", "v0", 1), ("a", "v1", 2)]
    assert versions[0]["acceptance_rate"] == 0.0 and versions[1]["acceptance_rate"] == 1.0
