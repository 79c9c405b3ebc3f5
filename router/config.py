"""Router configuration: pydantic models are the single source of truth for the YAML file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from ..policies.registry import build_policy, policy_names
from .admission_config import AdmissionConfig
# Re-exported: the rest of the router imports every config name from here.
from .config_base import ConfigError, ReplicaUrl, _Strict, normalize_replica_url
from .config_disaggregation import SGLANG_BOOTSTRAP_PORT, DisaggregationConfig, PrefillServer, parse_prefill_spec
from .discovery_config import DiscoveryConfig
from .tokenizers import load_tokenizer


class ServerConfig(_Strict):
    host: str = Field("127.0.0.1", description="Address the data port binds to.")
    port: int = Field(8000, ge=0, le=65535, description="Data port (0 picks a free port).")
    max_body_bytes: int = Field(
        32 * 1024 * 1024, gt=0, description="Request bodies above this get 413."
    )
    replica_header: bool = Field(
        False, description="Name the serving replica in an x-kvrouter-replica response header (load tests)."
    )
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="On SIGTERM, in-flight requests get this long to finish before they are cut."
    )
    shutdown_delay_s: float = Field(
        0.0, ge=0, description="On SIGTERM, keep the listener open this long answering /ready 503 "
        "(and new requests 503) so load balancers notice, before it closes.",
    )
    client_header_timeout_s: float = Field(
        15.0, gt=0, description="A connection must deliver complete request headers within this "
        "(also the idle keep-alive timeout): bounds slowloris clients.",
    )
    client_body_timeout_s: float = Field(
        60.0, gt=0, description="Reading a request body taking longer than this answers 408."
    )


class UpstreamConfig(_Strict):
    """Only connect failures (and 502/503 before any byte) are retried and count against a
    replica's health; a replica that took the request and then timed out is neither: it may still
    be working on it, and re-running a long generation elsewhere would double its cost."""

    # A replica on the same network accepts in milliseconds, even when busy (queueing happens after
    # the request is read): 2 s only ever expires on a dead or unreachable host.
    connect_timeout_s: float = Field(
        2.0, gt=0, description="TCP (and TLS) connect timeout per attempt. A connect timeout is "
        "retried on another replica and counts as a replica failure.",
    )
    # Streams get their headers at once; a non-streaming answer sends them only after the whole
    # generation: queueing behind a busy replica (minutes), a cold 100k-token prefill (seconds to
    # tens of seconds) and the decode (~8k tokens at 20-50 tok/s under batching: 3-7 minutes).
    # 600 s covers that; longer non-streaming generations need a higher value (or streaming).
    header_timeout_s: float = Field(
        600.0, gt=0, description="From the request sent to the response headers. Non-streaming "
        "responses send headers only when the generation ends, so this must allow queueing, a long "
        "prefill and a whole decode (600 s: e.g. 2 minutes queued, then ~8k tokens at 20 tok/s). "
        "On expiry: 504, not retried, the replica is not marked down.",
    )
    # The longest silence of a healthy stream is its first event: queueing behind other requests
    # plus the prefill of a 100k-token prompt (~5 s cold on one replica, several of them queued
    # ahead on a busy one). Between tokens the gaps are tens of milliseconds.
    idle_timeout_s: float = Field(
        120.0, gt=0, description="Longest gap between response body bytes (counted from the headers). "
        "The longest healthy gap is a stream's first token: queueing plus a 100k-token prefill "
        "(~5 s cold), so 120 s leaves room for a queue of such prefills. On expiry an "
        "SSE stream ends with an error event and [DONE]; not retried, the replica is not marked down.",
    )
    # A cap, not a hang detector (idle_timeout_s is): ~32k output tokens at ~20 tok/s is ~27 min.
    total_timeout_s: float = Field(
        1800.0, gt=0, description="Whole upstream exchange, streaming included: a cap for runaway "
        "generations (~32k tokens at 20 tok/s fits). Handled like idle_timeout_s (before the "
        "headers: 504).",
    )
    # An SSE event is a few hundred bytes (a token delta) to a few hundred KiB (SGLang's /generate
    # stream repeats the whole text so far; logprobs add more): 4 MiB is far above any real event,
    # yet bounds what one upstream that never ends an event can make the router hold.
    max_sse_event_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Largest incomplete SSE event the relay holds back "
        "(it forwards whole events only): real events are bytes to a few hundred KiB (/generate "
        "repeats the text so far), so 4 MiB only stops an upstream that never ends an event. Past "
        "it the stream ends with an SSE error event.",
    )
    max_attempts: int = Field(
        3, ge=1, le=10, description="Replicas tried before any byte reaches the client."
    )
    retry_statuses: tuple[int, ...] = Field(
        (502, 503), description="Upstream statuses retried on another replica (before first byte)."
    )
    api_key_env: str | None = Field(
        None, description="Environment variable holding a key the router sends to every replica as "
        "`Authorization: Bearer <key>` (SGLang --api-key); never logged or echoed.",
    )


class SignalsConfig(_Strict):
    source: Literal["metrics", "loads", "health"] = Field(
        "metrics", description="What each replica is polled for: SGLang /metrics, /v1/loads, or only /health."
    )
    interval_s: float = Field(
        0.25, gt=0, description="Poll interval per replica: a round starts every interval_s, its scrapes "
        "spread evenly over it, and does not wait for slow ones (a replica whose scrape is still "
        "running sits the round out).",
    )
    timeout_s: float = Field(1.0, gt=0, description="Timeout of one scrape.")
    stale_after_s: float = Field(2.0, gt=0, description="Signals older than this are treated as unknown.")
    failure_threshold: int = Field(
        3, ge=1, description="Consecutive failures (scrapes or connects) that mark a replica unhealthy."
    )


class RoutingConfig(_Strict):
    session_headers: tuple[str, ...] = Field(
        ("x-session-id", "x-smg-routing-key", "x-dynamo-session-id"),
        description="Headers carrying a session id, in order of precedence.",
    )
    session_fields: tuple[str, ...] = Field(
        ("session_id", "prompt_cache_key", "user"), description="Body fields tried after the headers."
    )
    block_chars: int = Field(256, ge=16, description="Prefix block size in characters (~64 tokens).")
    prefix_chain_cache_mb: float = Field(
        64.0, ge=0, description="Memory for recent prompts' block-hash chains, and as much again "
        "for recent chat bodies' parsed prefixes, so a turn that extends an earlier prompt parses "
        "and hashes only its new bytes (0: parse and hash every prompt whole).",
    )
    session_ttl_s: float = Field(3600.0, gt=0, description="Idle sessions are forgotten after this.")
    dp_size: int = Field(
        1, ge=1, le=1024, description="DP-attention ranks per replica (SGLang --attn-dp-size, "
        "formerly --dp-size with --enable-dp-attention; with disaggregation, per prefill server). Above 1 the router also "
        "picks the rank, by per-rank prefix and load, and sends routed_dp_rank; needs "
        "signals.source: loads (per-rank /v1/loads).",
    )
    rebalance_interval_s: float = Field(10.0, gt=0, description="How often fresh replicas are checked and idle sessions moved to them.")
    rebalance_max_moves: int = Field(4, ge=0, description="Sessions moved to fresh replicas per interval at most.")
    rebalance_kv_pressure: bool = Field(
        False, description="Also move long-idle sessions off replicas whose homed KV exceeds their capacity (helps fleets over-committed by a few very busy sessions; see docs/routing.md)."
    )
    allow_target_hint: bool = Field(
        False, description="Honour a client's choice of replica (header or body field), only among "
        "known replicas (unknown -> 400). Off: the header is ignored and stripped.",
    )
    target_hint_header: str = Field("x-smg-target-worker", description="Header naming the replica URL.")
    target_hint_field: str = Field("target_worker", description="Body field naming the replica URL.")
    shadow: tuple[str, ...] = Field(
        (), description="Shadow policies (types or presets, default params): each request's "
        "snapshot also goes to them, no traffic moves; the decision log and the "
        "kvrouter_shadow_* metrics record where each would have sent it and its predicted cost.",
    )
    shadow_sample: float = Field(
        1.0, gt=0.0, le=1.0, description="Share of decisions the shadow policies are asked about, "
        "drawn at random per decision (1: every one). Each decision asked costs a decision and a "
        "prediction per shadow, and the live pick's prediction when neither the decision log nor "
        "tracing is on (tens of us at 100 replicas, see docs/observability.md); the agreement and "
        "gain in the metrics and `kvrouter report` are then over the decisions asked. Read at start.",
    )

    @field_validator("shadow")
    @classmethod
    def _known_shadows(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if name not in policy_names():
                raise ValueError(f"unknown policy {name!r} (known: {', '.join(policy_names())})")
        if len(set(value)) != len(value):
            raise ValueError("a shadow policy is named twice")
        return value


class LearningConfig(_Strict):
    """What the router learns from the usage replicas report with every response."""

    inject_stream_usage: bool = Field(
        True, description="Ask for the usage event on OpenAI streams whose client did not "
        "(`stream_options.include_usage`) and drop that one event before the client sees it.",
    )
    calibrate: bool = Field(
        True, description="Learn bytes per token per model and replica from the reported prompt "
        "tokens (off: a fixed 4 bytes per token).",
    )
    learnt_capacity: Literal["unreported", "always"] = Field(
        "unreported", description="Where the KV capacity learnt from reported cache misses bounds "
        "the shadow index: only for replicas that report no max_total_num_tokens, or for every "
        "replica (the lower of the two: running requests and outputs share the reported pool).",
    )
    eviction_order: Literal["learn", "leaf_first"] = Field(
        "learn", description="How the shadow index evicts a replica's conversations: from their "
        "end, as SGLang's radix cache does, until the replica's reported cache hits show it "
        "evicts them from their root (a plain LRU of pages), then whole (`learn`; not with "
        "routing.dp_size > 1); or always from their end (`leaf_first`).",
    )
    ewma_weight: float = Field(
        0.1, gt=0, le=1, description="Weight of each new report in the bytes-per-token and "
        "effective-capacity estimates.",
    )


class KVEventEndpoint(_Strict):
    endpoint: str = Field(..., description="ZMQ endpoint of the replica's KV-event PUB socket, e.g. tcp://10.0.0.5:5557.")
    replay_endpoint: str | None = Field(None, description="ZMQ endpoint of its replay ROUTER socket, if any.")


class KVEventsConfig(_Strict):
    """Exact KV index from SGLang's KV events (`--kv-events-config '{"publisher":"zmq",...}'`)."""

    enabled: bool = Field(
        False, description="Subscribe to every replica's KV events and route on the exact index "
        "instead of the approximate shadow index.",
    )
    port: int = Field(5557, ge=1, le=65535, description="Each replica's KV-event PUB port: the router connects to tcp://<replica host>:<port>.")
    replay_port: int | None = Field(
        None, ge=1, le=65535, description="Each replica's replay ROUTER port (SGLang `replay_endpoint`); "
        "missed batches are fetched from it, else a gap drops that replica's index.",
    )
    topic: str = Field("kv-events", description="Topic to subscribe to (SGLang's `topic`; \"\" = everything).")
    page_size: int = Field(64, ge=1, description="The replicas' --page-size: tokens per published block.")
    tokenizer: str = Field(
        "kvrouter.router.tokenizers:input_ids",
        description="Import path module:function of `(route, body) -> list[int] | None`: the token "
        "ids the engine will prefill (its chat template + tokenizer). None = no prefix info.",
    )
    endpoints: dict[ReplicaUrl, KVEventEndpoint] = Field(
        default_factory=dict,
        description="Per-replica endpoints overriding port/replay_port (e.g. several replicas on one host).",
    )
    tokenizer_threads: int = Field(
        1, ge=0, le=64, description="Threads that tokenize requests and hash their blocks off the "
        "event loop (a large prompt would stall every other request); 0 = on the event loop. "
        "More than 1 only helps a tokenizer that releases the GIL (e.g. Hugging Face's Rust one).",
    )
    tokenizer_queue: int = Field(
        32, ge=0, le=4096, description="Requests that may wait for a tokenizer thread; when all "
        "are taken, a request is routed without the exact match instead of waiting "
        "(kvrouter_tokenizer_overflow_total).",
    )

    @field_validator("tokenizer")
    @classmethod
    def _import_path(cls, value: str) -> str:
        module, sep, name = value.partition(":")
        if not (module and sep and name):
            raise ValueError(f"{value!r} is not an import path module:function")
        return value

    @model_validator(mode="after")
    def _tokenizer_importable(self) -> "KVEventsConfig":
        if self.enabled:
            load_tokenizer(self.tokenizer)  # fail at load time, naming the key, not per request
        return self


class AffinityConfig(_Strict):
    store: Literal["memory", "redis"] = Field("memory", description="Where session homes live.")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="redis:// or rediss:// (TLS) URL.")
    password_env: str | None = Field(
        None, description="Environment variable holding the Redis AUTH password (instead of putting "
        "it in redis_url); never logged.",
    )
    key_prefix: str = Field(
        "kvrouter:", description="Prefix of every Redis key (isolation); no '{' or '}' (they make "
        "Redis Cluster hash tags).",
    )
    ttl_s: int = Field(3600, ge=1, description="Session key TTL, refreshed on use.")
    lease_s: float = Field(10.0, gt=0, description="A router's in-flight counts expire this long after its last heartbeat.")
    op_timeout_s: float = Field(0.25, gt=0, description="Timeout of one Redis operation.")
    retry_after_s: float = Field(1.0, gt=0, description="After a Redis failure, local state only for this long.")
    max_sessions: int = Field(
        1_000_000, ge=1, description="Sessions kept at most, in the router's table and in Redis; the "
        "least recently used idle one is evicted first, one with a request in flight never (if all "
        "are busy the cap is exceeded until one is idle).",
    )
    redis_cluster: bool = Field(
        False, description="redis_url names a node of a Redis (or Valkey) Cluster: calls are routed "
        "to each key's slot node. Off: one pipelined connection to a single Redis.",
    )
    redis_buckets: int | None = Field(
        None, ge=1, le=16384, description="Redis keys are spread over this many hash-tagged buckets "
        "(each one cluster slot), each holding ceil(max_sessions / redis_buckets) sessions at most. "
        "Default: 64 with redis_cluster (spread over the nodes), else 1 (releases batch into one "
        "call). Every router sharing key_prefix must use the same value.",
    )

    share_routing_state: bool = Field(
        True, description="With store: redis: every router publishes (Redis pub/sub) the prefix "
        "blocks each accepted request put on a replica (shadow index only) and each session's home "
        "and context size, and applies the others', so each router's index and session table see "
        "all routers' traffic (serve --workers N, several pods): requests without a session key "
        "find their prefix whichever router they reach, and new sessions are placed against all "
        "the KV already homed.",
    )
    share_in_flight: bool = Field(
        True, description="With share_routing_state: every router also publishes its requests in "
        "flight per replica and counts the others' in each replica's load, so requests placed by "
        "load (new conversations, overflow) see every router's dispatches at once rather than "
        "after the next poll of the replica.",
    )

    @field_validator("key_prefix")
    @classmethod
    def _no_hash_tag(cls, value: str) -> str:
        if "{" in value or "}" in value:
            raise ValueError("must not contain '{' or '}' (keys carry their own Redis Cluster hash tags)")
        return value


class PolicyConfig(_Strict):
    name: str = Field("coding-agent", description="Routing policy type or preset name.")
    params: dict[str, Any] = Field(default_factory=dict, description="Policy parameters.")

    @field_validator("name")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in policy_names():
            raise ValueError(f"unknown policy {value!r} (known: {', '.join(policy_names())})")
        return value

    @model_validator(mode="after")
    def _params_valid(self) -> "PolicyConfig":
        build_policy(self.name, self.params)  # raises ValueError naming the parameter
        return self


class AdminConfig(_Strict):
    """Admin API (replicas, drain, reload, state) on its own port, behind a bearer token."""

    enabled: bool = Field(True, description="Serve the admin API (only if the token variable is set).")
    host: str = Field("127.0.0.1", description="Admin port bind address.")
    port: int = Field(8001, ge=0, le=65535, description="Admin port (0 picks a free port).")
    token_env: str = Field(
        "KVROUTER_ADMIN_TOKEN", description="Environment variable holding the bearer token; "
        "unset or empty disables the admin API.",
    )


class AuthConfig(_Strict):
    """Optional client API keys (`Authorization: Bearer <key>`) and per-key concurrency limits."""

    api_keys_env: str | None = Field(
        None, description="Environment variable holding comma-separated client API keys."
    )
    api_keys_file: str | None = Field(None, description="File with one client API key per line.")
    max_concurrent_per_key: int = Field(
        0, ge=0, description="In-flight requests per key; above it 429 with Retry-After (0 = no limit)."
    )
    retry_after_s: int = Field(1, ge=1, description="Retry-After of a 429.")


class ObservabilityConfig(_Strict):
    """What the router records about its decisions (docs/observability.md)."""

    decision_log: str | None = Field(
        None, description="File that gets one JSON line per request (time, session hash, prompt "
        "size, replica, reason, predicted and reported cached tokens, TTFT, status), written by a "
        "background thread and rotated by size. None: no log.",
    )
    decision_log_max_bytes: int = Field(
        100 * 1024 * 1024, ge=4096, description="Size at which the decision log is rotated."
    )
    decision_log_backups: int = Field(5, ge=0, description="Rotated decision-log files kept.")
    decision_log_queue: int = Field(
        10_000, ge=1, description="Lines waiting for the writer thread at most; past it lines are "
        "dropped and counted (kvrouter_decision_log_dropped_total), never waited for.",
    )
    otel_endpoint: str | None = Field(
        None, description="OTLP/HTTP base URL spans are exported to (`/v1/traces` is appended), "
        "e.g. http://otel-collector:4318. None: the standard OTEL_EXPORTER_OTLP_ENDPOINT (or "
        "..._TRACES_ENDPOINT) variable if set, else no tracing. Needs the `otel` extra.",
    )
    otel_service_name: str = Field("kvrouter", description="The spans' service.name.")


class RouterConfig(_Strict):
    server: ServerConfig = ServerConfig()
    replicas: tuple[ReplicaUrl, ...] = Field(
        (), description="Static replica base URLs (with disaggregation: the prefill servers, "
        "filled in from disaggregation.prefill when empty).",
    )
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    policy: PolicyConfig = PolicyConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    signals: SignalsConfig = SignalsConfig()
    routing: RoutingConfig = RoutingConfig()
    learning: LearningConfig = LearningConfig()
    affinity: AffinityConfig = AffinityConfig()
    kv_events: KVEventsConfig = KVEventsConfig()
    admin: AdminConfig = AdminConfig()
    auth: AuthConfig = AuthConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    observability: ObservabilityConfig = ObservabilityConfig()
    admission: AdmissionConfig = AdmissionConfig()

    @model_validator(mode="after")
    def _ranks_need_rank_loads(self) -> RouterConfig:
        if self.routing.dp_size > 1 and self.signals.source != "loads":
            raise ValueError("routing.dp_size > 1 needs signals.source: loads (per-rank /v1/loads)")
        return self

    @model_validator(mode="after")
    def _discovered_pd_needs_discovery(self) -> RouterConfig:
        if self.disaggregation.from_discovery and not self.discovery.enabled:
            raise ValueError("disaggregation.from_discovery needs a discovery source (discovery.file or "
                             "discovery.kubernetes)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _prefill_pool_is_the_replica_pool(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        pd = data.get("disaggregation")
        if not isinstance(pd, dict) or not pd.get("prefill"):
            return data
        prefill = [parse_prefill_spec(p) if isinstance(p, str) else p for p in pd["prefill"]]
        urls = [p.get("url") if isinstance(p, dict) else p for p in prefill]
        given = data.get("replicas")
        if given and _normalized(given) != _normalized(urls):  # a dumped config repeats them
            raise ValueError(
                "replicas: with disaggregation the routed pool is disaggregation.prefill; "
                "leave replicas empty"
            )
        return {**data, "replicas": urls}


def _normalized(urls: Any) -> list[str] | None:
    try:
        return [normalize_replica_url(u) for u in urls]
    except (TypeError, ValueError):
        return None


def _one_line(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        parts.append(f"{key}: {msg}")
    return "; ".join(parts)


def parse_config(data: Any, source: str = "config") -> RouterConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping, got {type(data).__name__}")
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source}: {_one_line(err)}") from None


def load_config(path: str | Path) -> RouterConfig:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise ConfigError(f"{p}: cannot read ({err.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{p}:{where} invalid YAML ({getattr(err, 'problem', err)})") from None
    return parse_config(data, str(p))


def with_overrides(config: RouterConfig, **flags: Any) -> RouterConfig:
    """Apply command-line flags on top of a file (flags win). `None` means not given."""
    data = config.model_dump()
    if flags.get("host") is not None:
        data["server"]["host"] = flags["host"]
    if flags.get("port") is not None:
        data["server"]["port"] = flags["port"]
    if flags.get("replicas"):
        data["replicas"] = list(flags["replicas"])
    if flags.get("prefill") or flags.get("decode"):
        data["disaggregation"] = {"prefill": list(flags.get("prefill") or ()),
                                  "decode": list(flags.get("decode") or ())}
        if not flags.get("replicas"):
            data["replicas"] = []  # the prefill servers become the pool
    if flags.get("policy") is not None:
        data["policy"] = {"name": flags["policy"], "params": {}}
    return parse_config(data, "command line")
