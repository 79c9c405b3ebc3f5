"""Expected time-to-first-token of a request on a replica: the quantity placement minimises.

    cost = queueing + decode batch + prefill(uncached | cached prefix) + host load-back
         + KV pressure (token_usage past capacity_target)
         + KV demand (homed sessions' context / capacity) + homed sessions (their future load)
         + capacity penalty (homed KV past capacity_target)

The last three count only when placing a session (`placement`), not for one overflow request.

Defaults are the roofline of the reference replica (Kimi K2.6 NVFP4 on 4xB200, see
loadtest/profiles/kimi-k2.6-b200-tp4.yaml): 2 x 32e9 active FLOPs per token and 2.5e6 attention
FLOPs per token pair over 4 GPUs at ~1 PFLOP/s effective each; host KV reloads at ~50 GB/s per GPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from .domain import FleetMemo, ReplicaView, RequestSummary

# KV capacity (tokens) of the reference replica, assumed until a replica reports its own
# max_total_num_tokens: the one routing default the policy, the engine and the KV index share.
# deploy/sglang's Kimi K2.6 on 4 x B200 with FP8 KV, derived from SGLang's memory plan in
# docs/profiles.md (profile kimi-k2.6-b200-tp4-fp8kv-hicache).
DEFAULT_CAPACITY_TOKENS = 511_552


class CostParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill_s_per_token: float = Field(1.6e-5, ge=0, description="Linear prefill cost (2*N_active/(G*F_eff)).")
    attn_s_per_token_pair: float = Field(6.25e-10, ge=0, description="Attention cost per (new, context) token pair (A/(G*F_eff)).")
    load_back_s_per_token: float = Field(3.5e-7, ge=0, description="Host-tier (HiCache) reload per token (KV bytes / host BW).")
    queue_s_per_waiting: float = Field(0.5, ge=0, description="Expected wait per request queued ahead (a typical prefill).")
    decode_s_per_running: float = Field(0.01, ge=0, description="Small per-running-request term: spreads decode batches.")
    max_running: int = Field(40, ge=1, description="Requests a replica runs before new ones wait (slots).")
    default_capacity_tokens: int = Field(DEFAULT_CAPACITY_TOKENS, gt=0, description="KV capacity assumed until a replica reports max_total_num_tokens.")
    capacity_target: float = Field(0.9, gt=0, le=1.0, description="Fraction of KV capacity homed sessions may fill before the penalty starts.")
    capacity_weight: float = Field(1.0, ge=0, description="Weight of the re-prefill cost of KV this placement would push out.")
    kv_demand_s: float = Field(0.5, ge=0, description="Cost (s) per full KV of context homed on the replica: spreads sessions' KV before any eviction.")
    session_s: float = Field(0.2, ge=0, description="Cost (s) per session homed on the replica: each brings future requests (load).")


def prefill_s(p: CostParams, uncached: int, cached: int) -> float:
    return uncached * (p.prefill_s_per_token + p.attn_s_per_token_pair * (cached + uncached / 2))


def expected_cost(
    p: CostParams,
    replica: ReplicaView,
    request: RequestSummary,
    *,
    is_home: bool = False,
    placement: bool = True,
) -> float:
    """Seconds until this request's first token on `replica`. With `placement` (a session being
    homed there) the cost also counts the KV demand and sessions already homed there and the
    capacity penalty; without it (one overflow request, the home unchanged) only the wait and
    the prefill count."""
    return expected_costs(p, (replica,), request, home=replica.id if is_home else None,
                          placement=placement)[0]


def expected_costs(
    p: CostParams,
    replicas: Iterable[ReplicaView],
    request: RequestSummary,
    *,
    home: str | None = None,
    placement: bool = True,
    memo: FleetMemo | None = None,
    remember: bool = True,
) -> list[float]:
    """`expected_cost` of one request on each replica (`home`: the one it is homed on), in one
    loop: what a decision over many candidates needs, without a call per candidate.

    With the snapshot's `memo`, a replica this request was already costed on (by this policy or
    any other with equal cost parameters: the live decision, the shadows, the decision log's
    prediction) is not costed again; `remember=False` only reads it. The cost without placement
    terms is the first part of the one with them, so either one costs the other's half."""
    model = _model(p)
    base = full = None
    if memo is not None:
        tables = memo.cost_tables(request)
        base = tables.get((model.key, False, None))
        if base is None:
            base = tables[(model.key, False, None)] = {}
        full = base
        if placement:
            full = tables.get((model.key, True, home))
            if full is None:
                full = tables[(model.key, True, home)] = {}
    return _costs(p, model, replicas, request, home, placement, base, full, remember)


@dataclass(frozen=True, slots=True)
class _Model:
    """A `CostParams` read once: the terms the loop uses, and a key that equal parameter sets
    share (the live policy's defaults and the prediction's are equal, not the same object)."""

    params: CostParams
    key: int
    terms: tuple[float, float, int, float, int, float, float, float]


_MODELS: dict[int, _Model] = {}  # id(params) -> model (params held, so the id stays theirs)
_KEYS: dict[tuple[object, ...], int] = {}  # parameter values -> key


def _model(p: CostParams) -> _Model:
    found = _MODELS.get(id(p))
    if found is None or found.params is not p:
        if len(_MODELS) >= 256:  # parameter sets are made at start-up; tests make many
            _MODELS.clear()
        values = tuple(getattr(p, name) for name in type(p).model_fields)
        key = _KEYS.setdefault(values, len(_KEYS))
        terms = (p.queue_s_per_waiting, p.decode_s_per_running, p.max_running, p.capacity_target,
                 p.default_capacity_tokens, p.kv_demand_s, p.session_s, p.load_back_s_per_token)
        found = _MODELS[id(p)] = _Model(p, key, terms)
    return found


def _costs(
    p: CostParams,
    model: _Model,
    replicas: Iterable[ReplicaView],
    request: RequestSummary,
    home: str | None,
    placement: bool,
    base: dict[str, float] | None,
    full: dict[str, float] | None,
    remember: bool = True,
) -> list[float]:
    """The costs, looked up in `full` (this call's terms) and `base` (without placement terms)
    when given, and stored into them with `remember`."""
    prompt = request.prompt_tokens
    cached_on, host_on = request.cached_tokens, request.host_cached_tokens
    cold_prefill = prefill_s(p, prompt, 0)  # most candidates hold nothing of the prompt
    # The parameters, read once: this loop runs on every candidate of every decision.
    queue_s, decode_s, max_running, target, default_capacity, kv_demand_s, session_s, load_back_s = model.terms
    pressure_span = 1.0 - target + 1e-9
    out: list[float] = []
    append = out.append
    for replica in replicas:
        rid = replica.id
        cost = None
        if full is not None:
            cost = full.get(rid)
            if cost is not None:
                append(cost)
                continue
            cost = base.get(rid) if base is not full else None  # type: ignore[union-attr]
        if cost is None:
            cached = cached_on.get(rid, 0) if cached_on else 0
            on_host = host_on.get(rid, 0) if host_on else 0
            if cached or on_host:
                cached = min(cached, prompt)
                on_host = min(on_host, prompt - cached)
                uncached = prompt - cached - on_host
                cost = prefill_s(p, uncached, cached + on_host) + on_host * load_back_s
            else:
                cost = cold_prefill

            load = replica.load
            queued = replica.num_queue_reqs or 0
            waiting = load - max_running if load - max_running > queued else queued
            cost += waiting * queue_s + (load if load < max_running else max_running) * decode_s

            # Running requests' KV near the limit: new work waits for memory (or forces a retraction).
            usage = replica.token_usage or 0.0
            if usage > target:
                cost += queue_s * (usage - target) / pressure_span
            if remember and base is not None:
                base[rid] = cost

        if placement:
            # KV the replica's homed sessions already need; a new session adds its whole context.
            capacity = replica.max_total_num_tokens or default_capacity
            new = rid != home
            demand = replica.homed_tokens + (prompt if new else 0)
            cost += kv_demand_s * demand / capacity
            cost += session_s * (replica.homed_sessions + new)
            overflow = int(demand - target * capacity)
            if overflow > 0:  # that much cached context gets evicted and recomputed later
                cost += p.capacity_weight * prefill_s(p, overflow, 0)
            if remember and full is not None:
                full[rid] = cost
        append(cost)
    return out
