"""The request path's queued counts and observations (RouterMetrics.count/observe) read exactly
as immediate updates would, by every way the registry is read."""

from kvrouter.metrics.router_metrics import RouterMetrics


def test_queued_counts_and_observations_appear_on_collection() -> None:
    m = RouterMetrics()
    m.count(m.requests, ("/v1/chat/completions", "200"))
    m.count(m.requests, ("/v1/chat/completions", "200"))
    m.count(m.prompt_tokens, (), 120)
    m.observe(m.duration, ("/v1/chat/completions",), 0.003)
    m.observe(m.upstream_ttfb, ("http://a:1",), 0.2)
    reg = m.registry
    assert reg.get_sample_value("kvrouter_requests_total",
                                {"route": "/v1/chat/completions", "status": "200"}) == 2
    assert reg.get_sample_value("kvrouter_prompt_tokens_total") == 120
    assert reg.get_sample_value("kvrouter_request_duration_seconds_bucket",
                                {"route": "/v1/chat/completions", "le": "0.01"}) == 1
    assert reg.get_sample_value("kvrouter_upstream_ttfb_seconds_sum", {"replica": "http://a:1"}) == 0.2
    m.count(m.requests, ("/v1/chat/completions", "200"))
    assert b'kvrouter_requests_total{route="/v1/chat/completions",status="200"} 3.0' in m.render()


def test_a_forgotten_replica_leaves_no_queued_series() -> None:
    m = RouterMetrics()
    m.observe(m.upstream_ttfb, ("http://gone:1",), 0.1)
    m.observe(m.upstream_ttfb, ("http://kept:1",), 0.1)
    m.forget_replica("http://gone:1")
    text = m.render()
    assert b"http://gone:1" not in text
    assert b'kvrouter_upstream_ttfb_seconds_count{replica="http://kept:1"} 1.0' in text


def test_observations_are_applied_before_the_queue_grows_unbounded() -> None:
    m = RouterMetrics()
    for _ in range(10_000):
        m.observe(m.duration, ("/generate",), 0.5)
    assert len(m._pending_observations) < 5000
    assert m.registry.get_sample_value("kvrouter_request_duration_seconds_count", {"route": "/generate"}) == 10_000
