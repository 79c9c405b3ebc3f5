"""The routing engine end to end on 127.0.0.1: routers + simulated SGLang replicas + real Redis."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import openai
import pytest

from kvrouter.loadtest.sim_server import SIM_KEY, build_app

from .fault_ledger import CLEAN_ERROR, COMPLETE, NOTHING, Outcome, sim_counts

FAST = 100.0  # simulated-model seconds per wall second


@pytest.fixture
async def fleet(start_app):
    async def _fleet(n: int, time_scale: float = FAST) -> list[str]:
        return [await start_app(build_app("tiny", time_scale=time_scale, seed=i)) for i in range(n)]
    return _fleet


def router_config(**extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": 0, "replica_header": True},
        "signals": {"interval_s": 0.05},
        "policy": {"name": "coding-agent"},
    }
    cfg.update(extra)
    return cfg


class Chat:
    """A multi-turn session through one router: history grows by each reply and a new message."""

    def __init__(self, base_url: str, session: str, words: int = 200) -> None:
        self.client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
        self.session = session
        self.messages = [{"role": "system", "content": "You are a coding agent. " * 20},
                         {"role": "user", "content": f"repo {session} " + "def f(x): return x\n" * words}]

    async def turn(self, text: str = "next", max_tokens: int = 30, record: bool = True) -> tuple[str, int]:
        messages = self.messages + [{"role": "user", "content": f"{text} {self.session}"}]
        raw = await self.client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=max_tokens,
            extra_headers={"x-session-id": self.session}, extra_body={"ignore_eos": True},
        )
        reply = raw.parse()
        if record:
            self.messages = messages + [{"role": "assistant", "content": reply.choices[0].message.content}]
        cached = reply.usage.prompt_tokens_details.cached_tokens
        return raw.headers["x-kvrouter-replica"], cached

    async def close(self) -> None:
        await self.client.close()


async def test_session_stays_home_and_its_cache_grows(fleet, start_router):
    replicas = await fleet(4)
    _, url = await start_router(replicas, **router_config())
    chat = Chat(url, "s-1")
    try:
        seen, cached = [], []
        for i in range(5):
            replica, hit = await chat.turn(f"turn {i}")
            seen.append(replica)
            cached.append(hit)
    finally:
        await chat.close()
    assert len(set(seen)) == 1  # every turn at the same home
    assert cached[0] == 0 and all(b > a for a, b in zip(cached, cached[1:]))  # the prefix keeps hitting


async def test_burst_on_one_session_spreads_above_high_water(fleet, start_router):
    replicas = await fleet(4, time_scale=10.0)  # slow enough that the burst overlaps
    _, url = await start_router(replicas, **router_config())
    chat = Chat(url, "burst")
    try:
        home, _ = await chat.turn("warm up")
        results = await asyncio.gather(*(chat.turn(f"branch {i}", max_tokens=200, record=False)
                                         for i in range(8)))
    finally:
        await chat.close()
    where = Counter(r for r, _ in results)
    assert where[home] >= 2  # up to the high-water mark at home (where the cache is)...
    assert len(where) >= 3  # ...and the overflow shed to other replicas


async def test_new_replica_takes_new_sessions_and_warm_sessions_stay(fleet, start_app, start_router):
    replicas = await fleet(4)
    router, url = await start_router(replicas, **router_config())
    warm = [Chat(url, f"warm-{i}") for i in range(4)]
    try:
        homes = {c.session: (await c.turn())[0] for c in warm}
        fifth = await start_app(build_app("tiny", time_scale=FAST, seed=9))
        assert router.membership.add(fifth)
        new = [Chat(url, f"new-{i}") for i in range(2)]
        new_homes = [(await c.turn())[0] for c in new]
        after = {c.session: (await c.turn())[0] for c in warm}
        for c in new:
            await c.close()
    finally:
        for c in warm:
            await c.close()
    assert new_homes == [fifth, fifth]  # fresh replica first
    assert after == homes  # no warm session moved


async def test_two_routers_on_one_redis_agree(fleet, start_router, redis_server):
    replicas = await fleet(4)
    # A generous op timeout: this checks agreement, not what a slow Redis does (a call timing out
    # on a loaded CI machine would rightly route on local state and could disagree).
    shared = {"store": "redis", "redis_url": redis_server.url, "key_prefix": "it:", "op_timeout_s": 2.0}
    _, url_a = await start_router(replicas, **router_config(affinity=shared))
    _, url_b = await start_router(replicas, **router_config(affinity=shared))
    for i in range(6):
        a, b = Chat(url_a, f"shared-{i}"), Chat(url_b, f"shared-{i}")
        try:
            # The first requests of a session race through both routers at once.
            (ra, _), (rb, _) = await asyncio.gather(a.turn(), b.turn())
            rb2, _ = await b.turn("again")
        finally:
            await a.close(), await b.close()
        assert ra == rb == rb2


async def _turn(chat: Chat, text: str, record) -> None:
    """One recorded turn: openai's client raises for an error status (a clean error when the body
    is OpenAI-shaped, which is what the client parses) and for a broken connection (nothing)."""
    req = record.send(chat.session)
    try:
        _, _ = await chat.turn(text)
    except openai.APIStatusError as exc:
        req.got(Outcome(CLEAN_ERROR, exc.status_code, exc.message))
    except openai.APIError as exc:
        req.got(Outcome(NOTHING, None, f"{type(exc).__name__}: {exc}"))
    else:
        req.got(Outcome(COMPLETE, 200))


@pytest.mark.parametrize("fault", [
    pytest.param("killed", marks=pytest.mark.fault_matrix(
        fault="Redis killed and restarted mid-run",
        clients_saw="every request 200; affinity degraded to local state while down, shared again after restart")),
    pytest.param("stalled", marks=pytest.mark.fault_matrix(
        fault="Redis answering slowly (SIGSTOPped), then resumed",
        clients_saw="every request 200; affinity calls bounded by affinity.op_timeout_s, then local state; "
                    "shared again once Redis answers")),
])
async def test_redis_fault_mid_run_loses_no_request(fault, start_app, start_router, redis_server, fault_record):
    apps = [build_app("tiny", time_scale=FAST, seed=i) for i in range(4)]
    replicas = [await start_app(a) for a in apps]
    router, url = await start_router(replicas, **router_config(
        affinity={"store": "redis", "redis_url": redis_server.url, "op_timeout_s": 0.2,
                  "retry_after_s": 0.1}))
    chats = [Chat(url, f"r-{i}") for i in range(4)]
    try:
        for round_ in range(12):
            if round_ == 4:
                redis_server.kill() if fault == "killed" else redis_server.pause()
            if round_ == 8:
                assert router.affinity.degraded
                redis_server.start() if fault == "killed" else redis_server.resume()
                await asyncio.sleep(0.3)
            await asyncio.gather(*(_turn(c, f"round {round_}", fault_record) for c in chats))
    finally:
        if fault == "stalled":
            redis_server.resume()
        for c in chats:
            await c.close()
    for i, app in enumerate(apps):
        fault_record.replica(sim_counts(f"replica {i}", app[SIM_KEY]))
    assert [r.outcome.kind for r in fault_record.requests] == ["complete"] * 48
    assert not router.affinity.degraded  # restored once Redis came back
