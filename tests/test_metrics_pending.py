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


def test_deferred_observations_fill_the_buckets_observe_would() -> None:
    deferred, immediate = RouterMetrics(), RouterMetrics()
    values = [0.0, 0.005, 0.01, 0.0100001, 0.05, 0.3, 1.0, 999.0, 1000.0, 5000.0, -1.0, float("inf")]
    for v in values:
        deferred.observe(deferred.duration, ("/generate",), v)
        immediate.duration.labels("/generate").observe(v)
    def samples(m: RouterMetrics) -> list[tuple[str, dict[str, str], float]]:
        return [(s.name, s.labels, s.value) for family in m.registry.collect()
                if family.name == "kvrouter_request_duration_seconds"
                for s in family.samples if not s.name.endswith("_created")]
    assert samples(deferred) == samples(immediate) and len(samples(deferred)) == 18


def test_deferred_gauge_moves_both_ways() -> None:
    m = RouterMetrics()
    m.count(m.in_flight, ("http://a:1",), 1)
    m.count(m.in_flight, ("http://a:1",), 1)
    m.count(m.in_flight, ("http://a:1",), -1)
    assert m.registry.get_sample_value("kvrouter_replica_in_flight_requests", {"replica": "http://a:1"}) == 1


def test_deferred_observations_of_an_unlabelled_histogram_fill_its_buckets() -> None:
    deferred, immediate = RouterMetrics(), RouterMetrics()
    for v in (-2.0, -0.3, 0.0, 0.02, 0.5, 3.0):
        deferred.observe(deferred.cache_prediction_error, (), v)
        immediate.cache_prediction_error.observe(v)

    def samples(m: RouterMetrics) -> list[tuple[str, dict[str, str], float]]:
        return [(s.name, s.labels, s.value) for family in m.registry.collect()
                if family.name == "kvrouter_cache_prediction_error_ratio"
                for s in family.samples if not s.name.endswith("_created")]
    assert samples(deferred) == samples(immediate) and len(samples(deferred)) == 12  # no _sum: negative buckets
