"""Expected time-to-first-token of a request on a replica: the quantity placement minimises.

    cost = queueing + prefill(uncached | cached prefix) + host load-back
         + KV demand (homed sessions' context / capacity) + homed sessions (their future load)
         + capacity penalty (past capacity_target)

Defaults are the roofline of the reference replica (Kimi K2.6 NVFP4 on 4xB200, see
loadtest/profiles/kimi-k2.6-b200-tp4.yaml): 2 x 32e9 active FLOPs per token and 2.5e6 attention
FLOPs per token pair over 4 GPUs at ~1 PFLOP/s effective each; host KV reloads at ~50 GB/s per GPU.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .base import ReplicaView, RequestSummary


class CostParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill_s_per_token: float = Field(1.6e-5, ge=0, description="Linear prefill cost (2*N_active/(G*F_eff)).")
    attn_s_per_token_pair: float = Field(6.25e-10, ge=0, description="Attention cost per (new, context) token pair (A/(G*F_eff)).")
    load_back_s_per_token: float = Field(3.5e-7, ge=0, description="Host-tier (HiCache) reload per token (KV bytes / host BW).")
    queue_s_per_waiting: float = Field(0.5, ge=0, description="Expected wait per request queued ahead (a typical prefill).")
    decode_s_per_running: float = Field(0.01, ge=0, description="Small per-running-request term: spreads decode batches.")
    max_running: int = Field(40, ge=1, description="Requests a replica runs before new ones wait (slots).")
    default_capacity_tokens: int = Field(444_672, gt=0, description="KV capacity assumed until a replica reports max_total_num_tokens.")
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
    prompt = request.prompt_tokens
    cached = min(request.cached_tokens.get(replica.id, 0), prompt)
    on_host = min(request.host_cached_tokens.get(replica.id, 0), prompt - cached)
    uncached = prompt - cached - on_host
    cost = prefill_s(p, uncached, cached + on_host) + on_host * p.load_back_s_per_token

    load = replica.load
    waiting = max(replica.num_queue_reqs or 0, load - p.max_running)
    cost += waiting * p.queue_s_per_waiting + min(load, p.max_running) * p.decode_s_per_running

    # Running requests' KV near the limit: new work waits for memory (or forces a retraction).
    usage = replica.token_usage or 0.0
    if usage > p.capacity_target:
        cost += p.queue_s_per_waiting * (usage - p.capacity_target) / (1.0 - p.capacity_target + 1e-9)

    if not placement:
        return cost

    # KV the replica's homed sessions already need; a new session adds its whole context.
    capacity = replica.max_total_num_tokens or p.default_capacity_tokens
    demand = replica.homed_tokens + (0 if is_home else prompt)
    cost += p.kv_demand_s * demand / capacity
    cost += p.session_s * (replica.homed_sessions + (0 if is_home else 1))
    overflow = int(demand - p.capacity_target * capacity)
    if overflow > 0:  # that much cached context gets evicted and recomputed later
        cost += p.capacity_weight * prefill_s(p, overflow, 0)
    return cost
