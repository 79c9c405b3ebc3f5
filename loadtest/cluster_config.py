"""The cluster simulator's configuration: the fleet, the run, the router's defaults, and the
scale events (replicas added or killed at given times)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..router.config import RoutingConfig, SignalsConfig, UpstreamConfig
from .world import World

DEFAULT_SESSION_TTL_S: float = RoutingConfig.model_fields["session_ttl_s"].default


@dataclass(frozen=True)
class ScaleEvent:
    """At `at_s`, add `add` fresh replicas and/or kill the replicas named in `remove`."""

    at_s: float
    add: int = 0
    remove: tuple[str, ...] = ()


@dataclass(frozen=True)
class SimConfig:
    replicas: int
    profile: str = "kimi-k2.6-b200-tp4"
    duration_s: float = 600.0
    seed: int = 0
    sessions: int | None = None  # concurrent sessions kept alive (closed loop); default 5 per replica
    # Sessions start spread evenly over this long (model s), as the load driver's `ramp_s`; None:
    # 60 s, or a quarter of `duration_s` if that is shorter.
    ramp_s: float | None = None
    poll_interval_s: float = 0.25
    sample_interval_s: float = 5.0
    housekeeping_interval_s: float = 1.0
    rebalance_interval_s: float = 10.0
    rebalance_max_moves: int = 4
    rebalance_kv_pressure: bool = False  # as routing.rebalance_kv_pressure in the router config
    drain_s: float = 300.0  # after `duration_s`, in-flight requests get this long to finish
    # Initial sessions start at a random point of their life (steady-state context sizes, cold
    # caches, as after a restart); requests starting before `warmup_s` are not measured.
    warm_start: bool = True
    warmup_s: float = 60.0
    # How far into its life each session starts (with `warm_start`): False, a draw of the
    # simulator's own, session after session (the saved results' traffic); True, as the load
    # driver of `kvrouter compare` and `kvrouter demo` does it: each user's first session is made
    # and numbered at its ramp time (a replacement started cold during the ramp takes the next
    # number first, so, as live, which sessions start warm can differ by policy) and starts at
    # the driver's draw for that seed and session (`workload.warm_start_batch`).
    warm_start_as_driver: bool = False
    # Replies end at an EOS drawn as `kvrouter sim-replica` draws it for a request without
    # `ignore_eos` (lognormal of this median, capped by max_tokens), as in `kvrouter compare` and
    # `kvrouter demo`; None: every reply is its turn's max_tokens long (the workload's length).
    eos_median: int | None = None
    scale_events: tuple[ScaleEvent, ...] = ()
    # The router's shadow index tracks prefixes in blocks of this many tokens (Mooncake's block
    # size): match precision of 512 tokens on ~100k-token prompts, 8x less work than 64.
    index_block_tokens: int = 512
    # Simulation resolution: the replica model's page size in tokens (None = the profile's, 64 for
    # Kimi on B200). Per-page bookkeeping dominates large runs; 512-token pages cut it 8x while
    # cached-token counts move by less than one page (0.5% of a 100k prompt) - see docs/simulation.md.
    page_tokens: int | None = None
    policy_params: dict[str, Any] = field(default_factory=dict)
    # The live router's defaults (routing.session_ttl_s, signals.*, upstream.max_attempts).
    session_ttl_s: float = DEFAULT_SESSION_TTL_S
    failure_threshold: int = SignalsConfig.model_fields["failure_threshold"].default
    max_attempts: int = UpstreamConfig.model_fields["max_attempts"].default
    # The fleet's true speed, KV capacity and signal lag (nominal: the profile as written).
    world: World = World()
