"""SGLang's metric names, labels, HELP strings and histogram buckets, declared once.

Everything here was checked against SGLang's source (see ``docs/sglang-fidelity.md`` for
paths). Names are kept as *base* names (no prefix); :func:`prefixed` / :func:`both_names`
add SGLang's ``sglang:`` prefix (what ``/metrics`` serves) or the ``sglang_`` prefix (what
``/v1/loads?format=prometheus`` and some relabelled scrapes use). The router's parsers
(``signals.py``, ``loads.py``) and the simulated replica (``loadtest/sim_metrics.py``) read
the names from here.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Optional

__all__ = [
    "PREFIX_COLON",
    "PREFIX_UNDERSCORE",
    "PREFIXES",
    "prefixed",
    "both_names",
    "strip_prefix",
    "MetricSpec",
    "METRIC_SPECS",
    "SCHEDULER_LABELS",
    "TOKENIZER_LABELS",
    "OPTIONAL_SCHEDULER_LABELS",
    "TTFT_BUCKETS",
    "ITL_BUCKETS",
    "E2E_LATENCY_BUCKETS",
    "QUEUE_TIME_BUCKETS",
    "QUEUE_TIME_BUCKETS_LEGACY",
    "CACHE_SOURCES",
    "IS_STREAMING",
    "CACHE_TYPE",
    "POOL",
    "streaming_label",
    "RADIX_CACHE_TYPE",
    "HICACHE_CACHE_TYPE",
    "SPEC_BY_BASE",
    "iter_metric_names",
]

# --------------------------------------------------------------------------------------
# Prefixes
# --------------------------------------------------------------------------------------

PREFIX_COLON = "sglang:"
PREFIX_UNDERSCORE = "sglang_"
PREFIXES = (PREFIX_COLON, PREFIX_UNDERSCORE)


def prefixed(base: str, prefix: str = PREFIX_COLON) -> str:
    """``prefixed("num_running_reqs") == "sglang:num_running_reqs"``."""
    if prefix not in PREFIXES:
        raise ValueError(f"unknown SGLang metric prefix {prefix!r}")
    return prefix + base


def both_names(base: str) -> tuple[str, str]:
    """Both spellings of a metric: ``("sglang:<base>", "sglang_<base>")``."""
    return PREFIX_COLON + base, PREFIX_UNDERSCORE + base


def strip_prefix(name: str) -> Optional[str]:
    """Base name of an SGLang sample/family name, or None when it is not an SGLang name."""
    if name.startswith(PREFIX_COLON):
        return name[len(PREFIX_COLON) :]
    if name.startswith(PREFIX_UNDERSCORE):
        return name[len(PREFIX_UNDERSCORE) :]
    return None


# --------------------------------------------------------------------------------------
# Base names (python/sglang/srt/observability/metrics_collector.py)
# --------------------------------------------------------------------------------------

# SchedulerMetricsCollector -- gauges, refreshed by log_stats() after each prefill batch, every
# --decode-log-interval (40) decode steps and, when idle, every 30 s: never at scrape time.
# cache_hit_rate is the last prefill batch's and is reset to 0 at every decode report.
NUM_RUNNING_REQS = "num_running_reqs"
NUM_QUEUE_REQS = "num_queue_reqs"
NUM_GRAMMAR_QUEUE_REQS = "num_grammar_queue_reqs"
GEN_THROUGHPUT = "gen_throughput"
CACHE_HIT_RATE = "cache_hit_rate"
DECODE_SUM_SEQ_LENS = "decode_sum_seq_lens"
TOKEN_USAGE = "token_usage"
FULL_TOKEN_USAGE = "full_token_usage"
SWA_TOKEN_USAGE = "swa_token_usage"
MAMBA_USAGE = "mamba_usage"
NUM_USED_TOKENS = "num_used_tokens"
KV_AVAILABLE_TOKENS = "kv_available_tokens"
KV_EVICTABLE_TOKENS = "kv_evictable_tokens"
KV_USED_TOKENS = "kv_used_tokens"
SPEC_ACCEPT_LENGTH = "spec_accept_length"
SPEC_ACCEPT_RATE = "spec_accept_rate"
NUM_RETRACTED_REQS = "num_retracted_reqs"  # the last retraction's count, set at prefill reports
NUM_PAUSED_REQS = "num_paused_reqs"
UTILIZATION = "utilization"
NEW_TOKEN_RATIO = "new_token_ratio"  # the last prefill batch's admission ratio
HICACHE_HOST_USED_TOKENS = "hicache_host_used_tokens"  # only with --enable-hierarchical-cache
HICACHE_HOST_TOTAL_TOKENS = "hicache_host_total_tokens"  # only with --enable-hierarchical-cache
# Constants, emitted once at start-up (emit_constants()).
MAX_TOTAL_NUM_TOKENS = "max_total_num_tokens"
PAGE_SIZE = "page_size"
NUM_PAGES = "num_pages"
CONTEXT_LEN = "context_len"
# Scheduler counters / histograms.
# increment_retracted_reqs, at each retraction (registered as `requests`, not `reqs`).
NUM_RETRACTED_REQUESTS_TOTAL = "num_retracted_requests_total"
NUM_RETRACTED_INPUT_TOKENS_TOTAL = "num_retracted_input_tokens_total"
NUM_RETRACTED_OUTPUT_TOKENS_TOTAL = "num_retracted_output_tokens_total"
REALTIME_TOKENS_TOTAL = "realtime_tokens_total"  # label mode
QUEUE_TIME_SECONDS = "queue_time_seconds"

# TokenizerMetricsCollector -- counters/histograms, updated when a request finishes.
PROMPT_TOKENS_TOTAL = "prompt_tokens_total"
GENERATION_TOKENS_TOTAL = "generation_tokens_total"
CACHED_TOKENS_TOTAL = "cached_tokens_total"  # label cache_source
NUM_REQUESTS_TOTAL = "num_requests_total"
NUM_ABORTED_REQUESTS_TOTAL = "num_aborted_requests_total"
TIME_TO_FIRST_TOKEN_SECONDS = "time_to_first_token_seconds"
INTER_TOKEN_LATENCY_SECONDS = "inter_token_latency_seconds"
E2E_REQUEST_LATENCY_SECONDS = "e2e_request_latency_seconds"

# RadixCacheMetricsCollector (one per radix cache, labelled cache_type=<its class>) /
# StorageMetricsCollector.
EVICTED_TOKENS_TOTAL = "evicted_tokens_total"
LOAD_BACK_TOKENS_TOTAL = "load_back_tokens_total"
EVICTION_DURATION_SECONDS = "eviction_duration_seconds"
LOAD_BACK_DURATION_SECONDS = "load_back_duration_seconds"
PREFETCHED_TOKENS_TOTAL = "prefetched_tokens_total"
BACKUPED_TOKENS_TOTAL = "backuped_tokens_total"

# /v1/loads?format=prometheus spells the waiting queue after the JSON field.
NUM_WAITING_REQS = "num_waiting_reqs"

# --------------------------------------------------------------------------------------
# Labels
# --------------------------------------------------------------------------------------

#: Scheduler-side collectors (SchedulerMetricsCollector.init_new), in registration order.
SCHEDULER_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
#: Added to SCHEDULER_LABELS only when relevant: ``priority`` with priority scheduling
#: (totals carry ``priority=""``), ``dp_rank`` when the scheduler has a DP rank.
OPTIONAL_SCHEDULER_LABELS = ("priority", "dp_rank")
#: Tokenizer-side collectors (TokenizerMetricsCollector). ``priority`` and custom labels
#: are added the same way when enabled.
TOKENIZER_LABELS = ("model_name", "engine_type")
#: Values of the ``cache_source`` label on ``cached_tokens_total``; storage hits are
#: ``storage_<backend>`` (e.g. ``storage_file``), and ``total`` is the fallback when a
#: request carries no per-tier breakdown.
CACHE_SOURCES = ("device", "host", "total")
#: TokenizerMetricsCollector splits prompt/generation tokens, requests, TTFT and e2e latency by
#: streaming: ``is_streaming="true"|"false"``.
IS_STREAMING = "is_streaming"
#: RadixCacheMetricsCollector labels: the cache's class name; load-back also by host pool.
CACHE_TYPE = "cache_type"
POOL = "pool"
RADIX_CACHE_TYPE = "RadixCache"
HICACHE_CACHE_TYPE = "HiRadixCache"


def streaming_label(stream: bool) -> str:
    """The ``is_streaming`` label value SGLang writes."""
    return "true" if stream else "false"

# --------------------------------------------------------------------------------------
# Histogram buckets (defaults; each is overridable by a server flag)
# --------------------------------------------------------------------------------------

TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
    0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip
E2E_LATENCY_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200,
    1800, 2400,
)  # fmt: skip
#: queue_time_seconds in current SGLang (sub-100 ms buckets added).
QUEUE_TIME_BUCKETS = (
    0.0, 0.001, 0.005, 0.010, 0.050, 0.100, 0.200, 0.500, 1, 2, 3, 4, 5, 10, 15, 20, 30,
    40, 50, 60, 70, 80, 90, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400,
    1600, 1800, 2000, 2500, 3000,
)  # fmt: skip
#: queue_time_seconds in older releases (started 0.0, 0.1, 0.2, 0.5, ...).
QUEUE_TIME_BUCKETS_LEGACY = (
    0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200,
    300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000,
)  # fmt: skip
#: eviction_duration_seconds / load_back_duration_seconds.
HICACHE_DURATION_BUCKETS = (
    0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.01, 0.02, 0.03, 0.04,
    0.05, 0.1, 0.2, 0.5, 1.0,
)  # fmt: skip


# --------------------------------------------------------------------------------------
# What a simulated replica must export
# --------------------------------------------------------------------------------------


class MetricSpec(NamedTuple):
    base: str
    type: str  # "gauge" | "counter" | "histogram"
    help: str  # SGLang's documentation string, verbatim
    labels: tuple[str, ...]
    buckets: Optional[tuple[float, ...]] = None

    def name(self, prefix: str = PREFIX_COLON) -> str:
        """Registered name. For counters this includes ``_total`` as SGLang registers it."""
        return prefixed(self.base, prefix)


_S = SCHEDULER_LABELS
_T = TOKENIZER_LABELS
_TS = TOKENIZER_LABELS + (IS_STREAMING,)

#: The metrics a faithful simulated replica exports (HELP strings verbatim from SGLang).
METRIC_SPECS: tuple[MetricSpec, ...] = (
    MetricSpec(NUM_RUNNING_REQS, "gauge", "The number of running requests.", _S),
    MetricSpec(NUM_QUEUE_REQS, "gauge", "The number of requests in the waiting queue.", _S),
    MetricSpec(NUM_GRAMMAR_QUEUE_REQS, "gauge", "The number of requests in the grammar waiting queue.", _S),
    MetricSpec(GEN_THROUGHPUT, "gauge", "The generation throughput (token/s).", _S),
    MetricSpec(CACHE_HIT_RATE, "gauge", "The prefix cache hit rate.", _S),
    MetricSpec(DECODE_SUM_SEQ_LENS, "gauge", "The sum of all sequence lengths in decode.", _S),
    MetricSpec(TOKEN_USAGE, "gauge", "The token usage.", _S),
    MetricSpec(FULL_TOKEN_USAGE, "gauge", "The token usage for full attention layers.", _S),
    MetricSpec(NUM_USED_TOKENS, "gauge", "The number of used tokens.", _S),
    MetricSpec(KV_AVAILABLE_TOKENS, "gauge", "Number of free token slots in the KV cache pool.", _S),
    MetricSpec(KV_EVICTABLE_TOKENS, "gauge", "Number of evictable (radix-cached) token slots in the KV cache pool.", _S),
    MetricSpec(KV_USED_TOKENS, "gauge", "Number of actively used token slots in the KV cache pool.", _S),
    MetricSpec(SPEC_ACCEPT_LENGTH, "gauge", "Mean acceptance length of speculative decoding (accepted drafts + bonus token per forward).", _S),
    MetricSpec(SPEC_ACCEPT_RATE, "gauge", "Speculative acceptance rate (`accepted drafts / proposed drafts` in batch).", _S),
    MetricSpec(UTILIZATION, "gauge", "The utilization.", _S),
    MetricSpec(NUM_RETRACTED_REQS, "gauge", "The number of retracted requests.", _S),
    MetricSpec(NEW_TOKEN_RATIO, "gauge", "The new token ratio.", _S),
    MetricSpec(MAX_TOTAL_NUM_TOKENS, "gauge", "Maximum total number of tokens in the KV cache pool.", _S),
    MetricSpec(PAGE_SIZE, "gauge", "KV cache page size in tokens.", _S),
    MetricSpec(NUM_PAGES, "gauge", "Number of KV cache pages.", _S),
    MetricSpec(CONTEXT_LEN, "gauge", "Maximum context length.", _S),
    MetricSpec(HICACHE_HOST_USED_TOKENS, "gauge", "Number of tokens currently used in the host KV cache.", _S),
    MetricSpec(HICACHE_HOST_TOTAL_TOKENS, "gauge", "Total capacity of the host KV cache in tokens.", _S),
    MetricSpec(NUM_RETRACTED_REQUESTS_TOTAL, "counter", "Total number of retracted requests.", _S),
    MetricSpec(NUM_RETRACTED_INPUT_TOKENS_TOTAL, "counter", "Total number of retracted input tokens.", _S),
    MetricSpec(NUM_RETRACTED_OUTPUT_TOKENS_TOTAL, "counter", "Total number of retracted output tokens.", _S),
    MetricSpec(QUEUE_TIME_SECONDS, "histogram", "Histogram of queueing time in seconds.", _S, QUEUE_TIME_BUCKETS),
    MetricSpec(EVICTED_TOKENS_TOTAL, "counter", "The number of device KV token slots freed by eviction, regardless of whether the data was backed up to host (see sglang:hicache_backup_tokens_total) or destroyed (see sglang:hicache_dropped_tokens_total).", (CACHE_TYPE,)),
    MetricSpec(LOAD_BACK_TOKENS_TOTAL, "counter", "The number of tokens loaded back from local host DRAM (L2) to GPU, by host pool (kv, swa, mamba, ...).", (CACHE_TYPE, POOL)),
    MetricSpec(PROMPT_TOKENS_TOTAL, "counter", "Number of prefill tokens processed.", _TS),
    MetricSpec(GENERATION_TOKENS_TOTAL, "counter", "Number of generation tokens processed.", _TS),
    MetricSpec(CACHED_TOKENS_TOTAL, "counter", "Number of cached prompt tokens by source (device/host/storage).", _T + ("cache_source",)),
    MetricSpec(NUM_REQUESTS_TOTAL, "counter", "Number of requests processed.", _TS),
    MetricSpec(NUM_ABORTED_REQUESTS_TOTAL, "counter", "Number of requests aborted.", _T),
    MetricSpec(TIME_TO_FIRST_TOKEN_SECONDS, "histogram", "Histogram of time to first token in seconds.", _TS, TTFT_BUCKETS),
    MetricSpec(INTER_TOKEN_LATENCY_SECONDS, "histogram", "Histogram of inter-token latency in seconds.", _T, ITL_BUCKETS),
    MetricSpec(E2E_REQUEST_LATENCY_SECONDS, "histogram", "Histogram of End-to-end request latency in seconds", _TS, E2E_LATENCY_BUCKETS),
)  # fmt: skip

#: METRIC_SPECS by base name.
SPEC_BY_BASE: dict[str, MetricSpec] = {spec.base: spec for spec in METRIC_SPECS}


def iter_metric_names(prefix: str = PREFIX_COLON) -> Iterable[str]:
    """All registered names of :data:`METRIC_SPECS` under one prefix."""
    return (spec.name(prefix) for spec in METRIC_SPECS)
