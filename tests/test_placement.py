"""A request's routing lifecycle (router/placement.py): reserve at decision time, claim the
session's home, release exactly once; and, end to end, a burst of new sessions behind a slow
shared affinity store spread over the replicas."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import aiohttp

from kvrouter.loadtest.sim_server import build_app
from kvrouter.metrics.router_metrics import RouterMetrics
from kvrouter.policies.domain import Decision, RequestSummary, SessionView, Snapshot
from kvrouter.router.affinity import LocalAffinity
from kvrouter.router.engine import RoutingEngine
from kvrouter.router.kv_index_shadow import ShadowKVIndex
from kvrouter.router.replicas import ReplicaRegistry
from kvrouter.router.sessions import SessionTable

A, B, C = "http://a", "http://b", "http://c"


class Scripted:
    """A policy that returns the decisions it is given, in order, and keeps what it was asked."""

    name = "scripted"

    def __init__(self, *decisions: Decision) -> None:
        self.decisions = list(decisions)
        self.asked: list[RequestSummary] = []

    def decide(self, snapshot: Snapshot, request: RequestSummary, rng: random.Random) -> Decision | None:
        self.asked.append(request)
        return self.decisions.pop(0) if self.decisions else None


class CountingAffinity(LocalAffinity):
    def __init__(self, table: SessionTable) -> None:
        super().__init__(table, clock=lambda: 0.0)
        self.begins = 0
        self.moves: list[tuple[str, str]] = []

    def begin(self, key: str, home: str | None, *, force: bool, tokens: int) -> str | None:
        self.begins += 1
        return super().begin(key, home, force=force, tokens=tokens)

    def move(self, key: str, home: str) -> None:
        self.moves.append((key, home))
        super().move(key, home)


def engine(*decisions: Decision) -> RoutingEngine:
    table = SessionTable()
    return RoutingEngine(Scripted(*decisions), ReplicaRegistry([A, B, C]), ShadowKVIndex(), table,
                         random.Random(0), metrics=RouterMetrics())


def in_flight(eng: RoutingEngine) -> dict[str, int]:
    return {url: eng.registry.view(url).in_flight for url in (A, B, C)}


def gauge(eng: RoutingEngine, url: str) -> float | None:
    """The in-flight gauge of `url` as exported (None: no such series)."""
    assert eng.metrics is not None
    return eng.metrics.registry.get_sample_value("kvrouter_replica_in_flight_requests", {"replica": url})


def test_place_reserves_at_once_and_done_releases_exactly_once():
    eng = engine(Decision(A, "new_session", home=A), Decision(A, "affinity"))
    first = eng.place(RequestSummary("/v1/chat/completions", session_key="s", prompt_tokens=100), None)
    assert first is not None and first.held
    assert in_flight(eng) == {A: 1, B: 0, C: 0} and gauge(eng, A) == 1
    assert eng.registry.view(A).in_flight_prompt_tokens == 100
    # The next decision sees the first one's slot, before any home was confirmed.
    second = eng.place(RequestSummary("/v1/chat/completions", prompt_tokens=50), None)
    assert second is not None
    assert in_flight(eng)[A] == 2 and gauge(eng, A) == 2
    first.done()
    first.done()
    assert in_flight(eng)[A] == 1 and gauge(eng, A) == 1 and not first.held
    second.done()
    assert in_flight(eng)[A] == 0 and gauge(eng, A) == 0
    assert eng.registry.view(A).in_flight_prompt_tokens == 0


def test_release_after_the_replica_was_removed_leaves_no_negative_gauge():
    eng = engine(Decision(B, "least_load"))
    placement = eng.place(RequestSummary("/x"), None)
    assert placement is not None
    eng.remove_replica(B)
    assert eng.metrics is not None
    eng.metrics.forget_replica(B)
    placement.done()
    assert gauge(eng, B) is None


def test_no_replica_gives_no_placement_and_counts_nothing():
    eng = engine()
    assert eng.place(RequestSummary("/x"), None) is None
    assert in_flight(eng) == {A: 0, B: 0, C: 0}


def test_retry_excludes_every_replica_tried_and_claims_the_home_once():
    eng = engine(Decision(A, "new_session", home=A), Decision(B, "retry"), Decision(C, "rehome", home=C))
    store = CountingAffinity(eng.table)
    summary = RequestSummary("/x", session_key="s", prompt_tokens=10)
    first = eng.place(summary, store.acquire("s"))
    assert first is not None
    first.confirm_home_now(store)
    assert store.begins == 1 and eng.table.view("s").home == A
    second = first.retry()
    assert second is not None and second.url == B
    assert not first.held and in_flight(eng) == {A: 0, B: 1, C: 0}
    second.confirm_home_now(store)  # a retry that keeps the home records nothing
    third = second.retry()
    assert third is not None and third.url == C
    third.confirm_home_now(store)  # placed elsewhere with a new home: moved, not begun again
    asked = eng.policy.asked  # type: ignore[attr-defined]
    assert [r.exclude for r in asked] == [frozenset(), {A}, {A, B}]
    assert store.begins == 1 and store.moves == [("s", C)]
    assert eng.table.view("s").home == C
    assert third.retry() is None  # the policy has nothing left
    assert in_flight(eng) == {A: 0, B: 0, C: 0}


def test_a_home_another_router_set_first_wins_and_takes_the_slot():
    eng = engine(Decision(A, "new_session", home=A))
    store = LocalAffinity(eng.table, clock=lambda: 0.0)
    view = store.acquire("s")  # read as homeless...
    store.begin("s", B, force=False, tokens=1)  # ...then another router homed it on B
    placement = eng.place(RequestSummary("/x", session_key="s"), view)
    assert placement is not None and placement.url == A
    placement.confirm_home_now(store)
    assert placement.url == B and eng.table.view("s").home == B
    assert in_flight(eng) == {A: 0, B: 1, C: 0} and gauge(eng, A) == 0 and gauge(eng, B) == 1
    placement.done()
    assert in_flight(eng) == {A: 0, B: 0, C: 0}


def test_an_unhealthy_home_set_elsewhere_is_not_followed():
    eng = engine(Decision(A, "new_session", home=A))
    store = LocalAffinity(eng.table, clock=lambda: 0.0)
    view = store.acquire("s")
    store.begin("s", B, force=False, tokens=1)
    eng.registry.drain(B)
    placement = eng.place(RequestSummary("/x", session_key="s"), view)
    assert placement is not None
    placement.confirm_home_now(store)
    assert placement.url == A


def test_a_rehome_overwrites_the_stored_home():
    eng = engine(Decision(C, "rehome", home=C))
    store = LocalAffinity(eng.table, clock=lambda: 0.0)
    store.begin("s", A, force=False, tokens=1)
    placement = eng.place(RequestSummary("/x", session_key="s"), store.acquire("s"))
    assert placement is not None
    placement.confirm_home_now(store)
    assert placement.url == C and eng.table.view("s").home == C


def test_a_hinted_target_sets_no_home_and_is_not_retried():
    eng = engine()
    store = CountingAffinity(eng.table)
    placement = eng.place(RequestSummary("/x", session_key="s"), SessionView("s"), target=B)
    assert placement is not None and placement.decision.reason == "target_hint"
    placement.confirm_home_now(store)
    assert eng.table.view("s").home is None
    assert placement.retry() is None and in_flight(eng) == {A: 0, B: 0, C: 0}


class _BlockingBegin:
    """An async store whose `begin` waits until released (a stalled shared store)."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def begin(self, key: str, home: str | None, *, force: bool, tokens: int) -> str | None:
        self.entered.set()
        await self.release.wait()
        return home

    async def move(self, key: str, home: str) -> None:
        return None


async def test_cancelled_while_confirming_the_home_releases_the_slot():
    eng = engine(Decision(A, "new_session", home=A))
    store = _BlockingBegin()

    async def attempt() -> None:  # the relay's shape: done() in a finally right after place()
        placement = eng.place(RequestSummary("/x", session_key="s"), SessionView("s"))
        assert placement is not None
        try:
            await placement.confirm_home(store)
        finally:
            placement.done()

    task = asyncio.create_task(attempt())
    await asyncio.wait_for(store.entered.wait(), 5)
    assert in_flight(eng)[A] == 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert in_flight(eng)[A] == 0 and gauge(eng, A) == 0


async def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_a_burst_of_new_sessions_behind_a_slow_redis_spreads(start_app, start_router, redis_server):
    """Every new session's home claim is a Redis round trip after its decision. With Redis
    stalled, a burst of new sessions all reach their decisions at once when it answers: each
    must see the in-flight slots the earlier ones reserved (least_load then fills every replica
    evenly) instead of deciding on the same snapshot."""
    replicas = [await start_app(build_app("tiny", time_scale=1.0, seed=i)) for i in range(6)]
    router, url = await start_router(
        replicas,
        server={"host": "127.0.0.1", "port": 0, "replica_header": True},
        signals={"interval_s": 60.0},  # no poll between the decisions: only this router's in-flight counts
        policy={"name": "least-load"},
        affinity={"store": "redis", "redis_url": redis_server.url, "key_prefix": "burst:", "op_timeout_s": 5.0},
    )
    async with aiohttp.ClientSession() as http:
        async def chat(session: str) -> str:
            body = {"model": "tiny", "max_tokens": 8,
                    "messages": [{"role": "user", "content": f"task {session} " * 50}]}
            async with http.post(url + "/v1/chat/completions", json=body,
                                 headers={"x-session-id": session}) as resp:
                assert resp.status == 200, await resp.text()
                return resp.headers["x-kvrouter-replica"]

        await chat("warm")  # loads the Lua scripts: a stalled call then runs once Redis resumes
        keys = [f"new-{i}" for i in range(12)]
        redis_server.pause()
        try:
            burst = [asyncio.create_task(chat(k)) for k in keys]

            def all_waiting_on_redis() -> bool:  # each counted locally, its Redis read stalled
                return all((e := router.table.entry(k)) is not None and e.in_flight == 1 for k in keys)

            await _until(all_waiting_on_redis)
        finally:
            redis_server.resume()
        placed = Counter(await asyncio.gather(*burst))
    assert sorted(placed.values()) == [2] * 6, placed


async def test_a_request_cut_while_its_home_is_claimed_releases_its_slot(start_app, start_router):
    """Through the relay: the slot reserved at place() is released when the handler is cancelled
    while waiting on the affinity store (here a store whose `begin` stalls)."""
    replica = await start_app(build_app("tiny", seed=0))
    router, url = await start_router([replica], signals={"interval_s": 60.0})
    stalled = _BlockingBegin()
    memory = router.relay.affinity
    memory.begin = stalled.begin  # type: ignore[method-assign]
    async with aiohttp.ClientSession() as http:
        body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        post = asyncio.create_task(http.post(url + "/v1/chat/completions", json=body,
                                             headers={"x-session-id": "s"}))
        await asyncio.wait_for(stalled.entered.wait(), 10)
        assert router.registry.view(replica).in_flight == 1
        assert router.relay.cut_requests("shutting down") == 1
        async with await post as resp:
            assert resp.status == 503
    assert router.registry.view(replica).in_flight == 0
    assert router.metrics.registry.get_sample_value(
        "kvrouter_replica_in_flight_requests", {"replica": replica}) == 0


def test_a_slot_reserved_before_a_remove_and_re_add_is_not_released_on_the_new_registration():
    """Discovery drains and re-adds a replica whose streams still run: an old request ending
    must not take the new registration's in-flight count (or its gauge) below what runs on it."""
    eng = engine(Decision(A, "x"), Decision(A, "x"))
    old = eng.place(RequestSummary("/v1/chat/completions", prompt_tokens=100), None)
    eng.remove_replica(A)
    eng.metrics.forget_replica(A)  # as router/membership.py removes it
    eng.add_replica(A, now=0.0)
    new = eng.place(RequestSummary("/v1/chat/completions", prompt_tokens=100), None)
    old.done()
    assert eng.registry.view(A).in_flight == 1
    eng.metrics.flush()  # the request path's gauge moves are applied on collection
    assert eng.metrics.in_flight.labels(A)._value.get() == 1
    new.done()
    assert eng.registry.view(A).in_flight == 0
    eng.metrics.flush()
    assert eng.metrics.in_flight.labels(A)._value.get() == 0


def test_a_hinted_target_that_became_unhealthy_is_not_placed():
    """The handler checks a routing hint's target before awaits (tokenizer, Redis); the
    placement checks again, so a replica drained meanwhile gets no request."""
    eng = engine()
    eng.registry.drain(B)
    assert eng.place(RequestSummary("/v1/chat/completions"), None, target=B) is None
    assert eng.registry.view(B).in_flight == 0
