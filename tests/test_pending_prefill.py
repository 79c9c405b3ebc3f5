"""Prefill work the router sent and the replica has not answered yet: the registry keeps it per
replica (dispatch adds the request's uncached tokens, its first byte or its end takes them off),
and the cost model waits behind it, so two cold prefills are not stacked on one replica while
another is free (the replica's polled queue does not show a request it received a moment ago)."""

from __future__ import annotations

import random

import pytest

from kvrouter.metrics.router_metrics import RouterMetrics
from kvrouter.policies.coding_agent import CodingAgent
from kvrouter.policies.cost import CostParams, expected_costs, pending_prefill_s, prefill_s
from kvrouter.policies.domain import Decision, ReplicaView, RequestSummary, SessionView, Snapshot
from kvrouter.router.engine import RoutingEngine
from kvrouter.router.kv_index_shadow import ShadowKVIndex
from kvrouter.router.replicas import ReplicaRegistry
from kvrouter.router.sessions import SessionTable

from .test_placement import A, B, C, Scripted

CHAT = "/v1/chat/completions"


def test_a_new_session_avoids_a_replica_still_prefilling_what_the_router_just_sent():
    # a: one request in flight, an 80k-token cold prefill the replica has not started answering
    # (its polled queue still says 0); b: two requests in flight, both past their first token.
    # By request counts alone a is cheaper (less decode batch) and equal within the tie margin.
    reps = [ReplicaView("a", in_flight=1, pending_prefill_tokens=80_000),
            ReplicaView("b", in_flight=2)]
    request = RequestSummary(CHAT, session_key="s2", prompt_tokens=50_000)
    picks = {CodingAgent().decide(Snapshot(tuple(reps), SessionView("s2")), request,
                                  random.Random(seed)).replica for seed in range(20)}
    assert picks == {"b"}


def test_pending_prefill_waits_once_not_on_top_of_the_polled_queue():
    p = CostParams()
    idle = ReplicaView("x")
    pending = ReplicaView("x", in_flight=1, pending_prefill_tokens=30_000)
    both = ReplicaView("x", in_flight=1, num_running_reqs=0, num_queue_reqs=1,
                       pending_prefill_tokens=30_000)
    request = RequestSummary(CHAT, prompt_tokens=1_000)
    base, alone, with_queue = (expected_costs(p, [v], request, placement=False)[0]
                               for v in (idle, pending, both))
    wait = pending_prefill_s(p, pending)
    assert wait == prefill_s(p, 30_000, 0) > p.queue_s_per_waiting
    assert alone == base + wait + p.decode_s_per_running
    # the queued request the replica reports is the one the router knows is pending: counted once
    assert with_queue == pytest.approx(alone)


def engine(*decisions: Decision) -> RoutingEngine:
    return RoutingEngine(Scripted(*decisions), ReplicaRegistry([A, B, C]), ShadowKVIndex(),
                         SessionTable(), random.Random(0), metrics=RouterMetrics())


def pending(eng: RoutingEngine, url: str) -> int:
    view = eng.registry.view(url)
    assert view is not None
    return view.pending_prefill_tokens


def test_dispatch_adds_the_uncached_tokens_and_the_first_byte_takes_them_off_once():
    eng = engine(Decision(A, "new_session", home=A))
    summary = RequestSummary(CHAT, session_key="s", prompt_tokens=1_000)
    placement = eng.place(summary, None)
    assert placement is not None
    assert pending(eng, A) == 1_000  # nothing of it cached there
    placement.first_byte(0.5)
    assert pending(eng, A) == 0 and eng.registry.view(A).in_flight == 1
    placement.first_byte(0.6)  # a second first byte (a PD pair's) changes nothing
    placement.done()
    assert pending(eng, A) == 0 and eng.registry.view(A).in_flight == 0


def test_only_the_uncached_part_is_pending_and_an_attempt_that_ends_early_takes_it_off():
    eng = engine(Decision(B, "affinity"))
    eng.index.record(B, (11, 12, 13, 14))  # the first blocks of the prompt are cached on B
    summary = RequestSummary(CHAT, session_key="s", prompt_tokens=10_000,
                             prefix_blocks=(11, 12, 13, 14, 15, 16, 17, 18))
    placement = eng.place(summary, None)
    assert placement is not None
    cached = placement.summary.cached_tokens[B]
    assert 0 < cached < 10_000
    assert pending(eng, B) == 10_000 - cached
    placement.done()  # it failed before a byte came back
    assert pending(eng, B) == 0


def test_a_view_s_kept_cost_terms_follow_its_pending_prefill():
    # The request-independent cost terms are kept on a view; a first byte changes the view, so
    # the next snapshot's costs no longer wait behind the answered prefill.
    eng = engine(Decision(A, "new_session", home=A))
    p = CostParams()
    request = RequestSummary(CHAT, prompt_tokens=1_000)
    idle = expected_costs(p, [eng.registry.snapshot().get(A)], request, placement=False)[0]
    placement = eng.place(RequestSummary(CHAT, session_key="s", prompt_tokens=30_000), None)
    busy_view = eng.registry.snapshot().get(A)
    busy = expected_costs(p, [busy_view], request, placement=False)[0]
    assert busy_view.cost_terms is not None and busy > idle + prefill_s(p, 30_000, 0) * 0.99
    placement.first_byte(0.5)
    answered = expected_costs(p, [eng.registry.snapshot().get(A)], request, placement=False)[0]
    assert answered == idle + p.decode_s_per_running  # still in flight (decoding), nothing pending
    placement.done()
    assert expected_costs(p, [eng.registry.snapshot().get(A)], request, placement=False)[0] == idle
