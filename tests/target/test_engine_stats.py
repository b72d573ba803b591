"""The target's stat logger (specserve.target.engine.spec_counter_factory) adds up
what vLLM's Prometheus logger exports, from vLLM's own stats objects, with no
engine: the figures /metrics shows under vLLM's names."""

from vllm.v1.metrics.stats import (FinishedRequestStats, IterationStats, PrefixCacheStats,
                                   SchedulerStats)
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from specserve.target.engine import spec_counter_factory


def test_a_step_adds_vllms_figures_and_a_snapshot_is_a_copy():
    factory, totals = spec_counter_factory()
    logger = factory(vllm_config=None)
    sched = SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.5,
                           prefix_cache_stats=PrefixCacheStats(queries=256, hits=128))
    sched.spec_decoding_stats = SpecDecodingStats.new(num_spec_tokens=2)
    sched.spec_decoding_stats.observe_draft(num_draft_tokens=2, num_accepted_tokens=1)
    it = IterationStats()
    it.num_generation_tokens = 5
    it.time_to_first_tokens_iter = [300.0]  # a long prompt
    it.inter_token_latencies_iter = [0.02, 0.03]
    it.finished_requests = [FinishedRequestStats(finish_reason=None, e2e_latency=12.0,
                                                 mean_time_per_output_token=0.025)]
    logger.record(sched, it)
    logger.record(sched, None)  # a step without outputs: the counters go on
    snap = totals.snapshot()
    assert (snap["running"], snap["waiting"], snap["kv_cache_usage"]) == (3, 1, 0.5)
    assert (snap["prefix_cache_queries"], snap["prefix_cache_hits"]) == (512, 256)
    assert (snap["num_drafts"], snap["draft_tokens"], snap["accepted_tokens"]) == (2, 4, 2)
    assert snap["accepted_per_position"] == [2, 0] and snap["generation_tokens"] == 5
    ttft = snap["ttft"]
    assert ttft.total == 1 and ttft.counts[ttft.bounds.index(640.0)] == 1
    assert ttft.counts[ttft.bounds.index(160.0)] == 0
    assert snap["itl"].total == 2 and snap["e2e"].sum_s == 12.0 and snap["tpot"].total == 1
    logger.record(sched, it)
    assert snap["ttft"].total == 1 and totals.ttft.total == 2  # the snapshot stayed
