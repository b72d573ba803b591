"""Per-target-replica figures on /metrics (specserve.acceptance.replicas), alone:
labelled by replica, pruned after the grace period, gauges only of live
replicas, vLLM's names read by vLLM's own benchmark client."""

import asyncio
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from specserve.acceptance.replicas import ReplicaTable
from specserve.target.engine import SpecTotals


KINDS = {"same": "model"}


def report(replica, running=2, drafts=10, draft_tokens=40, accepted=30, per_pos=(9, 8, 7, 6),
           branch_hits=3):
    totals = SpecTotals(num_drafts=drafts, draft_tokens=draft_tokens, accepted_tokens=accepted,
                        accepted_per_position=list(per_pos), running=running, waiting=1,
                        kv_cache_usage=0.25, prefix_cache_queries=256, prefix_cache_hits=128)
    totals.ttft.observe(0.2)
    totals.ttft.observe(300.0)  # a long prompt: still inside a bucket
    return {"replica": replica, "model_name": "tiny", "engine": totals.snapshot(),
            "branches": {"same/d1": {"branch_hits": branch_hits, "steps": 7}}}


def samples(text):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_each_replica_is_its_own_series_and_dead_ones_leave():
    t = ReplicaTable(grace_s=600, live_s=60)
    t.update(report("t1", running=2), now=0.0)
    t.update(report("t2", running=5, branch_hits=4), now=100.0)
    got = samples("\n".join(t.prometheus_lines(now=100.0, kinds=KINDS)) + "\n")
    hits = {dict(k[1])["target_replica"]: v for k, v in got.items()
            if k[0] == "specserve_branch_hits_total"}
    assert hits == {"t1": 3, "t2": 4}
    assert {dict(k[1])["kind"] for k in got if k[0] == "specserve_branch_hits_total"} == {"model"}
    # t1 was last heard from 100 s ago: its counters stay, its gauges are gone.
    running = {dict(k[1])["target_replica"]: v for k, v in got.items()
               if k[0] == "vllm:num_requests_running"}
    batch = {dict(k[1])["target_replica"] for k in got if k[0] == "specserve_target_batch_size"}
    assert running == {"t2": 5} and batch == {"t2"}
    assert t.branch_totals(now=100.0) == {"same/d1": {"branch_hits": 7, "steps": 14}}
    # After the grace period the replica's rows are dropped altogether.
    t.prune(now=700.0)
    assert t.replicas() == ["t2"]
    got = samples("\n".join(t.prometheus_lines(now=700.0, kinds=KINDS)) + "\n")
    assert not any(dict(k[1]).get("target_replica") == "t1" for k in got)


def test_vllm_names_and_buckets():
    t = ReplicaTable()
    t.update(report("t1"), now=0.0)
    text = "\n".join(t.prometheus_lines(now=0.0, kinds=KINDS)) + "\n"
    got = samples(text)
    labels = (("engine", "0"), ("model_name", "tiny"), ("target_replica", "t1"))
    assert got[("vllm:spec_decode_num_draft_tokens_total", labels)] == 40
    assert got[("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                tuple(sorted((*labels, ("position", "2")))))] == 7
    assert got[("vllm:kv_cache_usage_perc", labels)] == 0.25
    assert got[("vllm:prefix_cache_hits_total", labels)] == 128
    # vLLM's TTFT buckets reach minutes: 300 s falls in le=640, not only in +Inf.
    assert got[("vllm:time_to_first_token_seconds_bucket",
                tuple(sorted((*labels, ("le", "640.0")))))] == 2
    assert got[("vllm:time_to_first_token_seconds_bucket",
                tuple(sorted((*labels, ("le", "160.0")))))] == 1


def test_vllm_benchmark_client_reads_the_spec_decode_counters():
    """vllm.benchmarks.serve's own parser over two replicas' series: the sums."""
    from vllm.benchmarks.serve import fetch_spec_decode_metrics

    t = ReplicaTable()
    t.update(report("t1"), now=0.0)
    t.update(report("t2", drafts=5, draft_tokens=20, accepted=10, per_pos=(4, 3, 2, 1)), now=0.0)
    text = "\n".join(t.prometheus_lines(now=0.0, kinds=KINDS)) + "\n"

    class Response:
        status = 200

        async def text(self):
            return text

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

    session = SimpleNamespace(get=lambda url: Response())
    m = asyncio.run(fetch_spec_decode_metrics("http://x", session))
    assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens) == (15, 60, 40)
    assert m.accepted_per_pos == {0: 13, 1: 11, 2: 9, 3: 7}


def test_with_serves_list_a_replica_it_no_longer_runs_loses_its_gauges_at_once():
    t = ReplicaTable()
    t.update(report("t1"), now=0.0)
    t.update(report("t2"), now=0.0)
    t.set_running({"t2"}, now=1.0)  # t1 died (or was scaled away) a second ago
    t.update(report("t3"), now=2.0)  # a new replica, newer than Serve's list
    got = samples("\n".join(t.prometheus_lines(now=2.0, kinds=KINDS)) + "\n")
    running = {dict(k[1])["target_replica"] for k in got if k[0] == "vllm:num_requests_running"}
    assert running == {"t2", "t3"}
    # ... its counters stay until the grace period ends.
    drafts = {dict(k[1])["target_replica"] for k in got
              if k[0] == "vllm:spec_decode_num_drafts_total"}
    assert drafts == {"t1", "t2", "t3"}
