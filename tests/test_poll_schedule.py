"""Poll rounds run on a fixed schedule: a replica whose scrape hangs until its timeout does not
lengthen the other replicas' poll period (their signals do not go stale), it is not scraped
again while that scrape is under way, a loop held up skips the slots it missed instead of
running them back to back, and stopping the poller cancels the scrapes still under way."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import pytest
from aiohttp import web

from kvrouter.loadtest.process_group import free_port
from kvrouter.metrics.router_metrics import RouterMetrics
from kvrouter.router.config import SignalsConfig
from kvrouter.router.poller import SignalPoller
from kvrouter.router.replicas import ReplicaRegistry

from .test_dp_kv_room import loads_body
from .test_poll_spread import FakeTime, _until
from .test_sglang_metrics_parse import single_rank_exposition


@pytest.fixture
async def start_replica():
    """Starts a real /metrics server; one started with `hold=True` answers only once its
    event is set (every held one is let go at teardown, so the servers stop at once)."""
    runners: list[web.AppRunner] = []
    holds: list[asyncio.Event] = []

    async def start(hold: bool = False) -> tuple[str, asyncio.Event]:
        release = asyncio.Event()
        if not hold:
            release.set()
        holds.append(release)

        async def metrics(request: web.Request) -> web.Response:
            await release.wait()
            return web.Response(body=single_rank_exposition().encode(), content_type="text/plain")

        async def loads(request: web.Request) -> web.Response:
            await release.wait()
            return web.json_response(loads_body(0.5, 0.25))

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/v1/loads", loads)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return f"http://127.0.0.1:{port}", release

    yield start
    for release in holds:
        release.set()
    for runner in runners:
        await runner.cleanup()


@dataclass
class Scrape:
    url: str
    started: float
    ended: float | None = None  # on the fake clock; None while under way
    cancelled: bool = False


@dataclass
class Watch:
    time: FakeTime
    scrapes: list[Scrape]
    overlaps: list[str]  # replicas scraped while a scrape of theirs was under way
    stale: list[tuple[str, float]]  # (replica, time) its signals were found stale

    def started(self, url: str) -> list[float]:
        return [s.started for s in self.scrapes if s.url == url]


def watched_poller(urls: list[str], config: SignalsConfig, *, held: tuple[str, ...] = (),
                   times_out: tuple[str, ...] = ()) -> tuple[SignalPoller, Watch]:
    """A poller on a fake clock that records every scrape. The fake sleep waits for the scrapes
    under way to end, except those of `held` and `times_out` replicas (which may not answer);
    a scrape of a `times_out` replica ends by its timeout, so on the fake clock it took
    `timeout_s` (at the least)."""
    time = FakeTime()
    poller = SignalPoller(ReplicaRegistry(urls), RouterMetrics(), config, clock=time.clock, sleep=time.sleep)
    watch = Watch(time, [], [], [])
    under_way: set[str] = set()
    poll, expire_stale = poller.poll, poller.expire_stale

    async def watched_poll(url: str) -> None:
        scrape = Scrape(url, time.now)
        watch.scrapes.append(scrape)
        if url in under_way:
            watch.overlaps.append(url)
        under_way.add(url)
        if url not in held and url not in times_out:
            time.answering.add(url)
        try:
            await poll(url)
        except asyncio.CancelledError:
            scrape.cancelled = True
            raise
        finally:
            if url in times_out:
                time.now = max(time.now, scrape.started + config.timeout_s)
            scrape.ended = time.now
            under_way.discard(url)
            time.answering.discard(url)

    def watched_expire_stale() -> None:
        expire_stale()
        for url in poller.reached:
            view = poller.registry.view(url)
            if view is not None and view.num_running_reqs is None:
                watch.stale.append((url, time.now))

    poller.poll = watched_poll  # type: ignore[method-assign]
    poller.expire_stale = watched_expire_stale  # type: ignore[method-assign]
    return poller, watch


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_replica_that_never_answers_does_not_lengthen_the_others_poll_period(start_replica):
    """Three replicas answer, the fourth never does (each of its scrapes runs to timeout_s).
    The others are still scraped every interval_s, so with stale_after_s only a little above
    interval_s their signals never go stale; the hung one is not scraped again while its scrape
    is under way; stopping the poller cancels that scrape."""
    answering = [(await start_replica())[0] for _ in range(3)]
    hung, _ = await start_replica(hold=True)
    config = SignalsConfig(interval_s=1.5, timeout_s=1.0, stale_after_s=2.0)
    poller, watch = watched_poller([*answering, hung], config, times_out=(hung,))
    await run_until(poller, lambda: all(len(watch.started(u)) >= 4 for u in answering))
    for i, url in enumerate(answering):  # the i-th of 4 starts i/4 of an interval into each round
        assert watch.started(url)[:4] == pytest.approx([k * 1.5 + i * 0.375 for k in range(4)])
    assert watch.started(hung)[0] == pytest.approx(1.125)
    assert watch.overlaps == []
    assert watch.stale == []
    assert all(poller.registry.view(u).num_running_reqs == 7 for u in answering)
    assert all(s.ended is not None for s in watch.scrapes)  # nothing left running after the stop


async def test_a_replica_whose_scrape_is_under_way_is_skipped_until_it_ends(start_replica):
    """A scrape that runs longer than the interval (here until the test lets its replica
    answer) is not joined by a second one: that replica sits out the rounds that come while it
    runs, the others do not wait for it, and once it has answered the next round scrapes it."""
    answering = [(await start_replica())[0] for _ in range(2)]
    slow, release = await start_replica(hold=True)
    poller, watch = watched_poller([*answering, slow], SignalsConfig(interval_s=1.0, timeout_s=30.0), held=(slow,))
    async with contextlib.aclosing(poller):
        task = asyncio.create_task(poller.run())
        try:
            await _until(lambda: len(watch.started(answering[0])) >= 3, timeout_s=5.0)
            assert watch.started(answering[0])[:3] == pytest.approx([0.0, 1.0, 2.0])
            assert watch.started(slow) == pytest.approx([2 / 3])  # once, still under way
            release.set()
            await _until(lambda: len(watch.started(slow)) >= 2)
        finally:
            await stop(task)
    first, second = [s for s in watch.scrapes if s.url == slow][:2]
    assert first.ended is not None and not first.cancelled
    assert second.started >= first.ended  # not before the first had ended
    assert (second.started - 2 / 3) % 1.0 == pytest.approx(0.0, abs=1e-6)  # at its turn in a round
    assert watch.overlaps == []
    assert poller.registry.view(slow).num_running_reqs == 7


async def test_a_loop_held_up_skips_the_slots_it_missed(start_replica):
    """When the loop falls behind (here one wait overshoots by 2.3 intervals), the next round
    starts at the next slot of the schedule: the missed rounds are not run back to back, and
    the schedule does not slide to the late time either."""
    a, b = [(await start_replica())[0] for _ in range(2)]
    poller, watch = watched_poller([a, b], SignalsConfig(interval_s=1.0))
    clock_moves_after_first_sleep(poller, watch, 2.3)
    await run_until(poller, lambda: len(watch.started(a)) >= 3)
    assert watch.started(a)[:3] == pytest.approx([0.0, 3.0, 4.0])
    assert watch.started(b)[:2] == pytest.approx([2.8, 3.5])


async def test_an_unexpected_error_in_a_scrape_ends_the_loop_only_once_the_others_have_ended(start_replica):
    """A scrape that raises something the poller does not expect (a bug) ends the loop, for its
    supervisor to log and restart it, but not before the scrapes under way have ended: none of
    them is cancelled on its account."""
    buggy, _ = await start_replica()
    slow, release = await start_replica(hold=True)
    poller, watch = watched_poller([buggy, slow], SignalsConfig(interval_s=1.0, timeout_s=30.0), held=(slow,))

    def on_signals(url: str, signals) -> None:
        if url == buggy:
            raise RuntimeError("bug in a signals hook")

    poller.on_signals = on_signals
    async with contextlib.aclosing(poller):
        task = asyncio.create_task(poller.run())
        try:
            await _until(lambda: watch.started(slow) != [])
            release.set()
            with pytest.raises(RuntimeError, match="bug in a signals hook"):
                await asyncio.wait_for(task, 10.0)
        finally:
            task.cancel()
    (scrape,) = [s for s in watch.scrapes if s.url == slow]
    assert scrape.ended is not None and not scrape.cancelled
    assert poller.registry.view(slow).num_running_reqs == 7


async def run_until(poller, done) -> None:
    """Run the poller's loop until `done()` holds, then stop it."""
    async with contextlib.aclosing(poller):
        task = asyncio.create_task(poller.run())
        try:
            await _until(done)
        finally:
            await stop(task)


def clock_moves_after_first_sleep(poller, watch, jump_s: float) -> list[float]:
    """Make the poller's first sleep end with its clock moved by `jump_s` (held up: forward;
    a clock going back: backward); every wait it asks for is appended to the list returned."""
    sleep, waits, jumps = poller.sleep, [], [jump_s]

    async def sleep_then_clock_back_once(seconds: float) -> None:
        waits.append(seconds)
        await sleep(seconds)
        if jumps:
            watch.time.now += jumps.pop()

    poller.sleep = sleep_then_clock_back_once
    return waits


async def test_a_clock_that_goes_back_does_not_hold_up_the_next_round(start_replica):
    """The poller's clock is injected and need not be monotonic: when it goes back (here by
    1000 s between two rounds), the next round still starts one interval later, not once the
    clock has caught up with the old schedule."""
    a, _ = await start_replica()
    poller, watch = watched_poller([a], SignalsConfig(interval_s=1.0))
    waits = clock_moves_after_first_sleep(poller, watch, -1000.0)
    await run_until(poller, lambda: len(watch.started(a)) >= 3)
    assert max(waits) <= 1.0 + 1e-9
    assert watch.started(a)[:3] == pytest.approx([0.0, -999.0, -998.0])


async def test_a_clock_that_goes_back_within_a_round_does_not_hold_up_its_next_scrape(start_replica):
    """The same within a round: a clock that goes back between two of its scrapes makes the
    next one wait no more than its share of the interval."""
    urls = [(await start_replica())[0] for _ in range(3)]
    poller, watch = watched_poller(urls, SignalsConfig(interval_s=1.5))
    waits = clock_moves_after_first_sleep(poller, watch, -1000.0)
    await run_until(poller, lambda: len(watch.started(urls[0])) >= 2)
    assert max(waits) <= 1.5 + 1e-9
    assert watch.started(urls[2])[0] == pytest.approx(-999.0)  # its turn, half an interval on


@pytest.mark.parametrize("source", ["metrics", "loads"])
async def test_a_replica_removed_while_it_is_scraped_leaves_nothing_when_the_scrape_ends(start_replica, source):
    """Removal does not wait for a scrape under way: whether that scrape then answers or times
    out, nothing of the removed replica comes back (no metric series, no signals or per-rank
    loads hook call, no entry in the poller's tables)."""
    answers, release = await start_replica(hold=True)
    times_out, _ = await start_replica(hold=True)
    config = SignalsConfig(source=source, timeout_s=0.3)
    poller, watch = watched_poller([answers, times_out], config, held=(answers, times_out))
    signalled: list[str] = []
    poller.on_signals = lambda url, signals: signalled.append(url)
    poller.on_rank_loads = lambda url, per_rank: signalled.append(url)
    async with contextlib.aclosing(poller):
        round_ = asyncio.create_task(poller.poll_all())
        await _until(lambda: watch.started(answers) and watch.started(times_out))
        for url in (answers, times_out):
            poller.registry.remove(url)
            poller.metrics.forget_replica(url)
        release.set()
        await round_
    page = poller.metrics.render().decode()
    assert answers not in page and times_out not in page
    assert signalled == []
    assert not {answers, times_out} & (poller.reached | set(poller.last_update) | set(poller.last_page))


async def test_the_scrape_of_a_removed_replica_is_cancelled_at_the_end_of_the_next_round(start_replica):
    """A replica removed (by discovery, say) while its scrape hangs does not keep that scrape
    running until its timeout: the round after the removal cancels it."""
    stays, _ = await start_replica()
    hung, _ = await start_replica(hold=True)
    poller, watch = watched_poller([stays, hung], SignalsConfig(interval_s=1.0, timeout_s=30.0), held=(hung,))
    async with contextlib.aclosing(poller):
        task = asyncio.create_task(poller.run())
        try:
            await _until(lambda: watch.started(hung) != [])
            poller.registry.remove(hung)
            (scrape,) = [s for s in watch.scrapes if s.url == hung]
            await _until(lambda: scrape.cancelled, timeout_s=5.0)
            rounds = len(watch.started(stays))
            await _until(lambda: len(watch.started(stays)) > rounds)  # the loop goes on
        finally:
            await stop(task)
    assert watch.started(hung) == pytest.approx([0.5])


async def test_a_replica_added_back_is_new_to_the_poller(start_replica):
    """A replica removed and later added back under the same URL has not answered a poll yet
    (it does not count as up, e.g. for /ready of a disaggregated fleet) and has no signals age
    until it does: the poller forgets a removed replica at the end of the next round."""
    url, release = await start_replica(hold=True)
    poller, watch = watched_poller([url], SignalsConfig(), held=(url,))
    release.set()
    async with contextlib.aclosing(poller):
        await poller.poll_all()
        assert poller.up_count() == 1
        poller.registry.remove(url)
        poller.metrics.forget_replica(url)
        await poller.poll_all()  # a round without it
        poller.registry.add(url)
        release.clear()  # its first scrape as a new replica has not answered yet
        round_ = asyncio.create_task(poller.poll_all())
        await _until(lambda: len(watch.started(url)) == 2)
        assert poller.up_count() == 0
        poller.expire_stale()
        assert url not in poller.metrics.render().decode()
        release.set()
        await round_
    assert poller.up_count() == 1
