"""The router's HTTP outcome counters (specserve.acceptance.outcomes), alone."""

from specserve.acceptance.outcomes import HttpOutcomes, route_label


def test_outcomes_count_status_aborts_failures_and_inflight():
    o = HttpOutcomes()
    assert route_label("/v1/completions/") == "/v1/completions"
    assert route_label("/v1/secret-probe") == "other"  # bounded label set
    for _ in range(3):
        o.started("/v1/completions")
    o.responded("/v1/completions", 200)
    o.ended("/v1/completions")
    o.responded("/v1/completions", 200)
    o.ended("/v1/completions", aborted=True)
    o.responded("/v1/completions", 503)
    o.stream_failed("/v1/completions")
    text = "\n".join(o.prometheus_lines())
    assert 'specserve_http_responses_total{route="/v1/completions",status="200"} 2' in text
    assert 'specserve_http_responses_total{route="/v1/completions",status="503"} 1' in text
    assert 'specserve_http_aborts_total{route="/v1/completions"} 1' in text
    assert 'specserve_http_stream_failures_total{route="/v1/completions"} 1' in text
    assert 'specserve_http_inflight{route="/v1/completions"} 1' in text
