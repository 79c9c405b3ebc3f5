"""A polling round spreads its scrapes over the interval instead of hitting every replica at the
same instant (each scrape costs the replica CPU; four at once stall replicas that share CPU)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp import web

from kvrouter.loadtest.process_group import free_port
from kvrouter.metrics.router_metrics import RouterMetrics
from kvrouter.router.config import SignalsConfig
from kvrouter.router.poller import SignalPoller
from kvrouter.router.replicas import ReplicaRegistry

from .test_sglang_metrics_parse import single_rank_exposition


class FakeTime:
    """The poller's clock and sleep: a sleep moves the clock on as soon as the scrapes under way
    that will answer have ended (a loopback scrape takes no time on this clock)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.answering: set[str] = set()  # replicas whose scrape is under way and will answer

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        until = self.now + seconds
        await asyncio.sleep(0)  # what was started before the sleep starts at the time it was due
        await _until(lambda: not self.answering)
        self.now = max(self.now, until)


@pytest.fixture
async def replicas():
    """Four real /metrics servers."""
    runners, urls = [], []
    for _ in range(4):
        port = free_port()
        url = f"http://127.0.0.1:{port}"

        async def metrics(request: web.Request) -> web.Response:
            return web.Response(body=single_rank_exposition().encode(), content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        urls.append(url)
    yield urls
    for runner in runners:
        await runner.cleanup()


def timed_poller(urls: list[str], config: SignalsConfig) -> tuple[SignalPoller, list[tuple[str, float]]]:
    """A poller on a fake clock, and the (replica, time) each of its scrapes started at."""
    time = FakeTime()
    poller = SignalPoller(ReplicaRegistry(urls), RouterMetrics(), config, clock=time.clock, sleep=time.sleep)
    scraped: list[tuple[str, float]] = []
    poll = poller.poll

    async def timed_poll(url: str) -> None:
        scraped.append((url, time.now))
        time.answering.add(url)
        try:
            await poll(url)
        finally:
            time.answering.discard(url)

    poller.poll = timed_poll  # type: ignore[method-assign]
    return poller, scraped


async def _until(condition, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


async def test_a_round_spreads_its_scrapes_evenly_over_the_interval(replicas):
    urls = replicas
    poller, scraped = timed_poller(urls, SignalsConfig(interval_s=1.0))
    registry = poller.registry
    async with contextlib.aclosing(poller):
        task = asyncio.create_task(poller.run())
        try:
            await _until(lambda: len(scraped) >= 8)  # two whole rounds
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    first, second = scraped[:4], scraped[4:8]
    assert [t for _, t in first] == pytest.approx([0.0, 0.25, 0.5, 0.75])
    assert sorted(u for u, _ in first) == sorted(urls)  # each replica once a round
    # the next round starts one interval after the first: each replica is polled every interval_s
    assert [t for _, t in second] == pytest.approx([1.0, 1.25, 1.5, 1.75])
    assert [u for u, _ in second] == [u for u, _ in first]
    assert all(registry.view(u).num_running_reqs == 7 for u in urls)


async def test_poll_all_without_a_spread_scrapes_every_replica_at_once(replicas):
    urls = replicas
    poller, scraped = timed_poller(urls, SignalsConfig())
    async with contextlib.aclosing(poller):
        await poller.poll_all()
    assert sorted(u for u, _ in scraped) == sorted(urls)
    assert {t for _, t in scraped} == {0.0}
    assert all(poller.registry.view(u).num_running_reqs == 7 for u in urls)


async def test_one_scrape_failing_unexpectedly_spares_the_rest_of_the_round(replicas):
    """A scrape that raises something the poller does not expect (a bug, not a replica failure)
    neither cancels the other scrapes nor keeps the round's later replicas from being scraped;
    the error still reaches the supervisor once the round has ended."""
    urls = replicas
    poller, scraped = timed_poller(urls, SignalsConfig(interval_s=1.0))
    signalled: list[str] = []

    def on_signals(url: str, signals) -> None:
        if url == urls[0]:
            raise RuntimeError("bug in a signals hook")
        signalled.append(url)

    poller.on_signals = on_signals
    async with contextlib.aclosing(poller):
        with pytest.raises(RuntimeError, match="bug in a signals hook"):
            await poller.poll_all(spread_s=1.0)
    assert [u for u, _ in scraped] == urls
    assert sorted(signalled) == sorted(urls[1:])
    assert all(poller.registry.view(u).num_running_reqs == 7 for u in urls)


async def test_a_replica_removed_before_its_turn_in_the_round_is_not_scraped(replicas):
    """The round's replicas are listed when it starts; one removed while the round waits for
    its turn is skipped, so a scrape does not bring back what its removal cleared."""
    urls = replicas
    poller, scraped = timed_poller(urls, SignalsConfig(interval_s=1.0))
    signalled: list[str] = []
    poller.on_signals = lambda url, signals: signalled.append(url)
    sleep = poller.sleep

    async def sleep_then_remove_the_last(seconds: float) -> None:
        await sleep(seconds)
        poller.registry.remove(urls[-1])

    poller.sleep = sleep_then_remove_the_last
    async with contextlib.aclosing(poller):
        await poller.poll_all(spread_s=1.0)
    assert [u for u, _ in scraped] == urls[:-1]
    assert sorted(signalled) == sorted(urls[:-1])
    assert urls[-1] not in poller.reached and urls[-1] not in poller.last_update
