"""Parsing SGLang /metrics expositions and /v1/loads bodies into ReplicaSignals."""

import pytest

from kvrouter.sglang_protocol import metric_names as sg
from kvrouter.sglang_protocol.loads import parse_loads_json
from kvrouter.sglang_protocol.signals import ReplicaSignals, SignalParseError, parse_metrics_text

L = 'engine_type="unified",model_name="kimi",moe_ep_rank="0",pp_rank="0"'


def gauge(base, help_, rows, prefix="sglang:"):
    out = [f"# HELP {prefix}{base} {help_}", f"# TYPE {prefix}{base} gauge"]
    out += [f"{prefix}{base}{{{labels}}} {value}" for labels, value in rows]
    return "\n".join(out)


def histogram(base, help_, buckets, labels, prefix="sglang:"):
    name = prefix + base
    out = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
    for i, b in enumerate(buckets):
        out.append(f'{name}_bucket{{{labels},le="{float(b)}"}} {float(i)}')
    out.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(len(buckets))}')
    out.append(f"{name}_count{{{labels}}} {float(len(buckets))}")
    out.append(f"{name}_sum{{{labels}}} 12.5")
    out.append(f"# HELP {name}_created {help_}")
    out.append(f"# TYPE {name}_created gauge")
    out.append(f"{name}_created{{{labels}}} 1.7e+09")
    return "\n".join(out)


def counter(base, help_, rows, prefix="sglang:"):
    name = prefix + base  # base already ends in _total
    stem = name[: -len("_total")]
    out = [f"# HELP {name} {help_}", f"# TYPE {name} counter"]
    out += [f"{name}{{{labels}}} {v}" for labels, v in rows]
    out += [f"# HELP {stem}_created {help_}", f"# TYPE {stem}_created gauge"]
    out += [f"{stem}_created{{{labels}}} 1.7e+09" for labels, _ in rows]
    return "\n".join(out)


def single_rank_exposition(prefix="sglang:"):
    s = f'{L},tp_rank="0"'
    tok = 'engine_type="unified",model_name="kimi"'
    parts = [
        "# HELP python_gc_objects_collected_total Objects collected during gc",
        "# TYPE python_gc_objects_collected_total counter",
        'python_gc_objects_collected_total{generation="0"} 1234.0',
        gauge("num_running_reqs", "The number of running requests.", [(s, 7.0)], prefix),
        gauge("num_queue_reqs", "The number of requests in the waiting queue.", [(s, 2.0)], prefix),
        gauge("token_usage", "The token usage.", [(s, 0.25)], prefix),
        gauge("num_used_tokens", "The number of used tokens.", [(s, 100000.0)], prefix),
        gauge("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", [(s, 400000.0)], prefix),
        gauge("cache_hit_rate", "The prefix cache hit rate.", [(s, 0.8125)], prefix),
        gauge("gen_throughput", "The generation throughput (token/s).", [(s, 1234.5)], prefix),
        gauge("kv_available_tokens", "Number of free token slots in the KV cache pool.", [(s, 200000.0)], prefix),
        gauge("kv_evictable_tokens", "Number of evictable (radix-cached) token slots in the KV cache pool.", [(s, 100000.0)], prefix),
        gauge("kv_used_tokens", "Number of actively used token slots in the KV cache pool.", [(s, 100000.0)], prefix),
        gauge("hicache_host_used_tokens", "Number of tokens currently used in the host KV cache.", [(s, 5000.0)], prefix),
        gauge("hicache_host_total_tokens", "Total capacity of the host KV cache in tokens.", [(s, 800000.0)], prefix),
        gauge("spec_accept_length", "Mean acceptance length of speculative decoding (accepted drafts + bonus token per forward).", [(s, 3.1)], prefix),
        histogram("queue_time_seconds", "Histogram of queueing time in seconds.", sg.QUEUE_TIME_BUCKETS, s, prefix),
        counter("prompt_tokens_total", "Number of prefill tokens processed.", [(tok, 9.0e6)], prefix),
        counter("cached_tokens_total", "Number of cached prompt tokens by source (device/host/storage).",
                [(tok + ',cache_source="device"', 7.0e6), (tok + ',cache_source="host"', 1.0e6)], prefix),
        counter("evicted_tokens_total", "The number of tokens evicted from GPU to CPU.", [(s, 3.0e5)], prefix),
        counter("load_back_tokens_total", "The number of tokens loaded from CPU to GPU.", [(s, 2.0e5)], prefix),
        histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.", sg.TTFT_BUCKETS, tok, prefix),
        histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", sg.ITL_BUCKETS, tok, prefix),
        histogram("e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", sg.E2E_LATENCY_BUCKETS, tok, prefix),
    ]
    return "\n".join(parts) + "\n"


EXPECTED_SINGLE = ReplicaSignals(
    num_running_reqs=7,
    num_queue_reqs=2,
    token_usage=0.25,
    num_used_tokens=100000,
    max_total_num_tokens=400000,
    cache_hit_rate=0.8125,
    gen_throughput=1234.5,
    kv_available_tokens=200000,
    kv_evictable_tokens=100000,
    host_used_tokens=5000,
    host_total_tokens=800000,
)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("prefix", ["sglang:", "sglang_"])
def test_single_rank_both_prefixes(prefix, strict):
    assert parse_metrics_text(single_rank_exposition(prefix), strict=strict) == EXPECTED_SINGLE


def test_types_are_ints_and_floats():
    sig = parse_metrics_text(single_rank_exposition())
    assert isinstance(sig.num_running_reqs, int) and isinstance(sig.token_usage, float)
    with pytest.raises(AttributeError):
        sig.num_running_reqs = 1  # frozen


def test_missing_signals_are_none():
    text = gauge("num_running_reqs", "x", [(f'{L},tp_rank="0"', 1.0)]) + "\n"
    sig = parse_metrics_text(text)
    assert sig.num_running_reqs == 1 and sig.host_total_tokens is None and sig.token_usage is None


def test_dp_ranks_summed_and_tp_copies_deduplicated():
    rows_running = [
        (f'{L},tp_rank="0",dp_rank="0"', 3.0),
        (f'{L},tp_rank="1",dp_rank="0"', 3.0),  # --enable-metrics-for-all-schedulers copy
        (f'{L},tp_rank="4",dp_rank="1"', 5.0),
    ]
    rows_usage = [(f'{L},tp_rank="0",dp_rank="0"', 0.2), (f'{L},tp_rank="4",dp_rank="1"', 0.6)]
    rows_hit = [(f'{L},tp_rank="0",dp_rank="0"', 0.5), (f'{L},tp_rank="4",dp_rank="1"', 0.7)]
    rows_cap = [(f'{L},tp_rank="0",dp_rank="0"', 1000.0), (f'{L},tp_rank="4",dp_rank="1"', 1000.0)]
    text = "\n".join([
        gauge("num_running_reqs", "The number of running requests.", rows_running),
        gauge("token_usage", "The token usage.", rows_usage),
        gauge("cache_hit_rate", "The prefix cache hit rate.", rows_hit),
        gauge("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", rows_cap),
    ]) + "\n"
    sig = parse_metrics_text(text)
    assert sig.num_running_reqs == 8
    assert sig.token_usage == pytest.approx(0.6)
    assert sig.cache_hit_rate == pytest.approx(0.6)
    assert sig.max_total_num_tokens == 2000


def test_priority_breakdown_not_double_counted():
    rows = [
        (f'{L},tp_rank="0",priority=""', 10.0),
        (f'{L},tp_rank="0",priority="0"', 4.0),
        (f'{L},tp_rank="0",priority="1"', 6.0),
    ]
    text = gauge("num_queue_reqs", "The number of requests in the waiting queue.", rows) + "\n"
    assert parse_metrics_text(text).num_queue_reqs == 10


def test_v1_loads_prometheus_format():
    # /v1/loads?format=prometheus: sglang_ prefix, dp_rank label only, num_waiting_reqs.
    text = (
        "# TYPE sglang_num_running_reqs gauge\n"
        'sglang_num_running_reqs{dp_rank="0"} 2\n'
        'sglang_num_running_reqs{dp_rank="1"} 3\n'
        "# TYPE sglang_num_waiting_reqs gauge\n"
        'sglang_num_waiting_reqs{dp_rank="0"} 1\n'
        'sglang_num_waiting_reqs{dp_rank="1"} 0\n'
        "# TYPE sglang_memory_token_capacity gauge\n"
        'sglang_memory_token_capacity{dp_rank="0"} 1000\n'
    )
    sig = parse_metrics_text(text)
    assert (sig.num_running_reqs, sig.num_queue_reqs) == (5, 1)


@pytest.mark.parametrize(
    "garbage",
    ["", "hello world\n", "<html><body>502 Bad Gateway</body></html>\n", '{"loads": []}',
     "# TYPE foo gauge\nfoo 1\n", "sglang:num_running_reqs{tp_rank=\"0\"} many\n",
     "sglang:num_running_reqs{tp_rank=0} 1\n"],
)
def test_garbage_raises(garbage):
    for strict in (False, True):
        with pytest.raises(SignalParseError):
            parse_metrics_text(garbage, strict=strict)
    assert issubclass(SignalParseError, ValueError)


def test_non_text_raises():
    with pytest.raises(SignalParseError):
        parse_metrics_text(b"sglang:num_running_reqs 1\n")  # type: ignore[arg-type]


# v1_loads.get_loads / LoadSnapshot.to_dict with no include: core keys in _CORE_KEYS order,
# no per-rank timestamp, every section that exists (no LoRA here: left out, not null).
V1_LOADS = {
    "timestamp": "2026-01-01T00:00:00+00:00",
    "version": "0.5.23",
    "accelerator": "NVIDIA B200",
    "num_accelerators": 4,
    "loads": [
        {
            "dp_rank": 0,
            "num_running_reqs": 12,
            "num_waiting_reqs": 3,
            "num_waiting_uncached_tokens": 9000,
            "num_used_tokens": 50000,
            "num_total_tokens": 61000,
            "max_total_num_tokens": 200000,
            "max_running_requests": 48,
            "token_usage": 0.25,
            "gen_throughput": 900.5,
            "cache_hit_rate": 0.75,
            "utilization": 0.0,
            "memory": {"weight_gb": 120.0, "kv_cache_gb": 40.0, "graph_gb": 2.0, "token_capacity": 200000},
            "speculative": {"accept_length": 3.2, "accept_rate": 0.55},
            "disaggregation": {
                "mode": "null", "prefill_bootstrap_queue_reqs": 0, "prefill_inflight_queue_reqs": 0,
                "decode_prealloc_queue_reqs": 0, "decode_transfer_queue_reqs": 0,
                "decode_retracted_queue_reqs": 0, "kv_transfer_speed_gb_s": 0.0,
                "kv_transfer_latency_ms": 0.0,
            },
            "queues": {"waiting": 3, "grammar": 0, "paused": 0, "retracted": 0},
        }
    ],
}


def test_v1_loads_without_rank_timestamp_and_core_only():
    assert "timestamp" not in V1_LOADS["loads"][0]
    core = {k: v for k, v in V1_LOADS["loads"][0].items() if not isinstance(v, dict)}
    assert parse_loads_json({"loads": [core]}) == parse_loads_json(V1_LOADS)


def test_real_exposition_with_stream_and_cache_type_labels_parses_strictly():
    tok = 'engine_type="unified",model_name="kimi"'
    text = "\n".join([
        single_rank_exposition(),
        counter("prompt_tokens_total", "Number of prefill tokens processed.",
                [(tok + ',is_streaming="false"', 100.0), (tok + ',is_streaming="true"', 50.0)]),
        counter("evicted_tokens_total", "The number of device KV token slots freed by eviction.",
                [('cache_type="HiRadixCache"', 4096.0)]),
        counter("load_back_tokens_total", "The number of tokens loaded back.",
                [('cache_type="HiRadixCache",pool="kv"', 512.0)]),
    ]) + "\n"
    assert parse_metrics_text(text, strict=True) == EXPECTED_SINGLE
    assert parse_metrics_text(text) == EXPECTED_SINGLE


def test_v1_loads_single_rank():
    sig = parse_loads_json(V1_LOADS)
    assert sig == ReplicaSignals(
        num_running_reqs=12, num_queue_reqs=3, token_usage=0.25, num_used_tokens=50000,
        max_total_num_tokens=200000, cache_hit_rate=0.75, gen_throughput=900.5,
    )


def test_v1_loads_bytes_and_two_ranks():
    import json

    body = json.loads(json.dumps(V1_LOADS))
    second = dict(body["loads"][0], dp_rank=1, num_running_reqs=4, num_waiting_reqs=0,
                  token_usage=0.5, num_used_tokens=100000, cache_hit_rate=0.25)
    body["loads"].append(second)
    sig = parse_loads_json(json.dumps(body).encode())
    assert sig.num_running_reqs == 16 and sig.num_queue_reqs == 3
    assert sig.max_total_num_tokens == 400000 and sig.num_used_tokens == 150000
    assert sig.token_usage == pytest.approx(0.5)
    assert sig.cache_hit_rate == pytest.approx(0.5)
    assert sig.gen_throughput == pytest.approx(1801.0)


def test_v1_loads_core_only_section_missing_capacity_uses_memory():
    entry = {"dp_rank": 0, "num_running_reqs": 1, "num_waiting_reqs": 0, "num_used_tokens": 10,
             "memory": {"token_capacity": 100}}
    sig = parse_loads_json({"loads": [entry]})
    assert sig.max_total_num_tokens == 100 and sig.token_usage == pytest.approx(0.1)


def test_get_load_legacy_and_current_shapes():
    legacy = [{"rid": None, "http_worker_ipc": None, "dp_rank": None,
               "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 700}]
    sig = parse_loads_json(legacy)
    assert (sig.num_running_reqs, sig.num_queue_reqs, sig.num_used_tokens) == (3, 2, 700)
    current = [
        {"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 700,
         "num_pending_tokens": 200, "ts_tic": 123.4},
        {"dp_rank": 1, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 50,
         "num_pending_tokens": 0, "ts_tic": 123.4},
    ]
    sig = parse_loads_json(current)
    assert (sig.num_running_reqs, sig.num_queue_reqs, sig.num_used_tokens) == (4, 2, 550)
    assert sig.token_usage is None


@pytest.mark.parametrize(
    "bad",
    [None, 3, "not json", b"\xff", {"loads": "x"}, {"loads": []}, [], [1, 2], [{"foo": 1}],
     {"loads": [{"num_running_reqs": "many"}]}, {"loads": [{"num_running_reqs": True}]}],
)
def test_loads_garbage_raises(bad):
    with pytest.raises(SignalParseError):
        parse_loads_json(bad)


def test_name_helpers_and_specs():
    assert sg.both_names(sg.NUM_RUNNING_REQS) == ("sglang:num_running_reqs", "sglang_num_running_reqs")
    assert sg.prefixed("token_usage", "sglang_") == "sglang_token_usage"
    assert sg.strip_prefix("sglang:kv_used_tokens") == "kv_used_tokens"
    assert sg.strip_prefix("vllm:x") is None
    names = set(sg.iter_metric_names())
    for must in ["sglang:num_running_reqs", "sglang:cached_tokens_total",
                 "sglang:time_to_first_token_seconds", "sglang:hicache_host_used_tokens"]:
        assert must in names
    spec = {s.base: s for s in sg.METRIC_SPECS}
    assert spec["cached_tokens_total"].labels[-1] == "cache_source"
    for base in ("prompt_tokens_total", "generation_tokens_total", "num_requests_total",
                 "time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert spec[base].labels == sg.TOKENIZER_LABELS + ("is_streaming",), base
    assert "is_streaming" not in spec["inter_token_latency_seconds"].labels
    assert spec["evicted_tokens_total"].labels == ("cache_type",)
    assert spec["load_back_tokens_total"].labels == ("cache_type", "pool")
    assert spec["time_to_first_token_seconds"].buckets == sg.TTFT_BUCKETS
    assert sg.TTFT_BUCKETS[0] == 0.1 and sg.TTFT_BUCKETS[-1] == 400


def test_strict_mode_rejects_garbage_outside_read_signals():
    text = single_rank_exposition() + "this is not prometheus\n"
    assert parse_metrics_text(text) == EXPECTED_SINGLE
    with pytest.raises(SignalParseError):
        parse_metrics_text(text, strict=True)


def test_only_unread_sglang_metrics_gives_empty_signals():
    text = counter("prompt_tokens_total", "Number of prefill tokens processed.", [('model_name="m"', 1.0)]) + "\n"
    assert parse_metrics_text(text) == ReplicaSignals()
