"""Expected time-to-first-token of a request on a replica: the quantity placement minimises.

    cost = queueing (the polled queue, or the prefill this router sent there and has no first
           byte of yet, whichever is longer) + decode batch + prefill(uncached | cached prefix)
         + host load-back
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

from .domain import ReplicaView, RequestSummary

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


def pending_prefill_s(p: CostParams, replica: ReplicaView) -> float:
    """The prefill this router sent `replica` that has not answered yet, in seconds: a new
    request there starts behind it. The replica's polled queue shows such a request only at the
    next poll (and not at all while it is being prefilled), so without this two sessions' cold
    first prefills could be stacked on one replica while another sits idle."""
    tokens = replica.pending_prefill_tokens
    return prefill_s(p, tokens, 0) if tokens > 0 else 0.0


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
    if not placement:  # one request's wait and prefill: no home term, no list
        return request_cost(p, replica, request)
    return expected_costs(p, (replica,), request, home=replica.id if is_home else None,
                          placement=placement)[0]


def request_cost(p: CostParams, replica: ReplicaView, request: RequestSummary) -> float:
    """`expected_cost(p, replica, request, placement=False)`, the per-request cost alone (what a
    prediction asks of each pick): the same terms added in the same order as `expected_costs`,
    so the same float, without its loop and list for one replica."""
    model = _MODELS.get(id(p))  # `_model(p)` without its call when made already (every prediction)
    if model is None or model.params is not p:
        model = _model(p)
    terms = replica.cost_terms
    if terms is None or terms[0] is not model.key:
        terms = _view_terms(model, replica)
    prompt = request.prompt_tokens
    cached_on, host_on = request.cached_tokens, request.host_cached_tokens
    cached = cached_on.get(replica.id, 0) if cached_on else 0
    on_host = host_on.get(replica.id, 0) if host_on else 0
    if cached or on_host:
        cached = min(cached, prompt)
        on_host = min(on_host, prompt - cached)
        uncached = prompt - cached - on_host
        cost = prefill_s(p, uncached, cached + on_host) + on_host * p.load_back_s_per_token
    else:
        cost = prefill_s(p, prompt, 0)
    cost += terms[1]  # queueing
    pressure = terms[2]
    if pressure:
        cost += pressure
    return cost


def expected_costs(
    p: CostParams,
    replicas: Iterable[ReplicaView],
    request: RequestSummary,
    *,
    home: str | None = None,
    placement: bool = True,
) -> list[float]:
    """`expected_cost` of one request on each replica (`home`: the one it is homed on), in one
    loop: what a decision over many candidates needs, without a call per candidate.

    The terms that depend on the replica alone (queueing, decode batch, KV pressure, homed KV
    and sessions) are computed once per view and cost model and kept with the view
    (`ReplicaView.cost_terms`): whoever costs the replica next (another policy on the same
    snapshot, the decision log's prediction, the next decisions while the replica is unchanged)
    adds them in the very order this loop always did, so every cost is the same float."""
    model = _model(p)
    key, kv_demand_s = model.key, model.kv_demand_s
    prompt = request.prompt_tokens
    cached_on, host_on = request.cached_tokens, request.host_cached_tokens
    cold_prefill = prefill_s(p, prompt, 0)  # most candidates hold nothing of the prompt
    held = bool(cached_on) or bool(host_on)  # a new prompt: nobody holds any of it
    if placement and not held and home is None:
        # Most placements: a new session's prompt nobody holds. The loop below for that case
        # alone (the same terms in the same order), without the branches it never takes.
        return _cold_placement_costs(model, replicas, prompt, cold_prefill)
    out: list[float] = []
    append = out.append
    for replica in replicas:
        terms = replica.cost_terms
        if terms is None or terms[0] is not key:
            terms = _view_terms(model, replica)
        _, queueing, pressure, capacity, sessions_new, sessions_home, evict_from, homed, _, _ = terms
        rid = replica.id
        cost = cold_prefill
        if held:
            cached = cached_on.get(rid, 0) if cached_on else 0
            on_host = host_on.get(rid, 0) if host_on else 0
            if cached or on_host:
                cached = min(cached, prompt)
                on_host = min(on_host, prompt - cached)
                uncached = prompt - cached - on_host
                cost = prefill_s(p, uncached, cached + on_host) + on_host * p.load_back_s_per_token
        cost += queueing
        if pressure:  # running requests' KV near the limit: new work waits for memory
            cost += pressure

        if placement:
            # KV the replica's homed sessions already need; a new session adds its whole context.
            new = rid != home
            demand = homed + (prompt if new else 0)
            cost += kv_demand_s * demand / capacity
            cost += sessions_new if new else sessions_home
            excess = demand - evict_from
            if excess >= 1:  # int(excess) > 0: that much cached context is evicted, recomputed
                cost += p.capacity_weight * prefill_s(p, int(excess), 0)
        append(cost)
    return out


def _cold_placement_costs(
    model: "_Model", replicas: Iterable[ReplicaView], prompt: int, cold_prefill: float,
    marks: tuple[int, int, float] | None = None, kept: list[ReplicaView] | None = None,
) -> list[float]:
    """`expected_costs(..., placement=True)` of a session nobody homes yet (`home` None) whose
    prompt no replica holds: every replica's cost is a cold prefill plus its kept terms. With
    canonical high-water `marks` (`_canonical_marks`), a replica above any of them is skipped and
    the others are appended to `kept`: the filter and the costs in one pass, the verdict kept
    with the view's terms (`_view_terms`).

    Most new sessions are placed here, over every sampled candidate, so it is written for speed:
    the terms are read by index, not unpacked, so only the ones a cold placement adds are
    touched; they are added in the same order as `expected_costs` adds them."""
    key, kv_demand_s, p = model.key, model.kv_demand_s, model.params
    out: list[float] = []
    append = out.append
    for replica in replicas:
        terms = replica.cost_terms
        if marks is None:
            if terms is None or terms[0] is not key:
                terms = _view_terms(model, replica)
        else:
            if terms is None or terms[0] is not key or terms[8] is not marks:
                terms = _view_terms(model, replica, marks)
            if terms[9]:  # above a high-water mark
                continue
            kept.append(replica)  # type: ignore[union-attr]
        cost = cold_prefill + terms[1]  # queueing
        if terms[2]:  # KV pressure
            cost += terms[2]
        demand = terms[7] + prompt  # homed KV and this session's context
        cost += kv_demand_s * demand / terms[3]  # over the capacity
        cost += terms[4]  # sessions homed, this one included
        if demand - terms[6] >= 1:  # past capacity_target: evicted context is recomputed
            cost += p.capacity_weight * prefill_s(p, int(demand - terms[6]), 0)
        append(cost)
    return out


def cold_placement_costs_under(
    p: CostParams, replicas: Iterable[ReplicaView], request: RequestSummary,
    marks: tuple[int, int, float],
) -> tuple[list[ReplicaView], list[float]] | None:
    """The replicas under the high-water `marks` (a replica whose running+queued reaches
    marks[0], whose queue exceeds marks[1] or whose token_usage exceeds marks[2] is above) and
    their `expected_costs(placement=True)` with no home, in one pass; None unless nobody holds
    any of the request's prompt (the other cases filter, then cost)."""
    if request.cached_tokens or request.host_cached_tokens:
        return None
    kept: list[ReplicaView] = []
    costs = _cold_placement_costs(_model(p), replicas, request.prompt_tokens,
                                  prefill_s(p, request.prompt_tokens, 0),
                                  _MARKS.get(marks) or _canonical_marks(marks), kept)
    return kept, costs


@dataclass(frozen=True, slots=True)
class _Model:
    """A `CostParams` read once. Equal parameter sets share one `key` (object), so the terms a
    view keeps serve every policy costing with them (the prediction's defaults and the policy's
    are equal, not the same object)."""

    params: CostParams
    key: object
    kv_demand_s: float


_MODELS: dict[int, _Model] = {}  # id(params) -> model (the params held, so the id stays theirs)
_KEYS: dict[tuple[object, ...], object] = {}  # parameter values -> key
_MARKS: dict[tuple[int, int, float], tuple[int, int, float]] = {}  # high-water marks, one object per value


def _canonical_marks(marks: tuple[int, int, float]) -> tuple[int, int, float]:
    """One object per set of high-water marks (equal marks of two policies share it), so a
    view's kept verdict is checked by identity."""
    if len(_MARKS) >= 256:
        _MARKS.clear()
    return _MARKS.setdefault(marks, marks)


def _model(p: CostParams) -> _Model:
    found = _MODELS.get(id(p))
    if found is None or found.params is not p:
        if len(_MODELS) >= 256:  # parameter sets are made at start-up (tests make more)
            _MODELS.clear()
        values = tuple(getattr(p, name) for name in type(p).model_fields)
        key = _KEYS.setdefault(values, values)
        found = _MODELS[id(p)] = _Model(p, key, p.kv_demand_s)
    return found


def _view_terms(
    model: _Model, replica: ReplicaView, marks: tuple[int, int, float] | None = None,
) -> tuple[object, ...]:
    """The request-independent terms of `replica`'s cost, each the very expression the cost
    adds (so the sums are unchanged), kept with the view; then the high-water `marks` (a
    canonical object, see `_canonical_marks`) and whether the replica is above any of them
    (None, None until a placement filters by them; without `marks` the verdict already kept,
    which does not depend on the cost model, is carried over)."""
    p = model.params
    queue_s, max_running, target = p.queue_s_per_waiting, p.max_running, p.capacity_target
    load = replica.load
    queued = replica.num_queue_reqs or 0
    waiting = load - max_running if load - max_running > queued else queued
    wait = waiting * queue_s
    if replica.pending_prefill_tokens:  # both count the requests ahead: the longer one, once
        pending = pending_prefill_s(p, replica)
        if pending > wait:
            wait = pending
    queueing = wait + (load if load < max_running else max_running) * p.decode_s_per_running
    usage = replica.token_usage or 0.0
    pressure = queue_s * (usage - target) / (1.0 - target + 1e-9) if usage > target else 0.0
    capacity = replica.max_total_num_tokens or p.default_capacity_tokens
    sessions = replica.homed_sessions
    if marks is not None:  # `HighWater.overloaded`
        above = load >= marks[0] or queued > marks[1] or usage > marks[2]
    else:
        kept = replica.cost_terms
        marks, above = (kept[8], kept[9]) if kept is not None else (None, None)
    terms = (model.key, queueing, pressure, capacity, p.session_s * (sessions + True),
             p.session_s * (sessions + False), target * capacity, replica.homed_tokens, marks, above)
    object.__setattr__(replica, "cost_terms", terms)
    return terms
