"""Replica signal pollers: every `interval_s`, scrape each replica's SGLang `/metrics` (or
`/v1/loads`); a scrape that answers is also a health check. The scrapes of one round start
spread evenly over the interval, not all at once: answering a scrape costs each replica some
CPU, and a round that hits every replica at the same instant stalls them all together (with the
router parsing every page back to back) where they share CPU. Rounds start on a fixed schedule,
one every `interval_s`, and never wait for a slow scrape: a replica that hangs until its
`timeout_s` does not stretch the others' poll period (it is skipped, not scraped twice at once,
while its scrape is still running). Signals older than `stale_after_s` are cleared
to unknown; `failure_threshold` consecutive failures make a replica unhealthy until a scrape
succeeds again. A replica without metrics (404) is health-checked on `/health` instead.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

import orjson
from multidict import CIMultiDict
from yarl import URL

from ..metrics.router_metrics import RouterMetrics
from ..sglang_protocol.loads import parse_loads_json, parse_rank_loads
from ..sglang_protocol.signals import ReplicaSignals, SignalParseError, parse_metrics_text
from .config import SignalsConfig
from .replicas import ReplicaRegistry
from .upstream_errors import UpstreamBodyTooLarge, UpstreamError
from .upstream_http import UpstreamPool

log = logging.getLogger("kvrouter.poller")

# A scrape follows this many redirects within the replica's origin (as a browser-like client
# would; SGLang itself answers /metrics directly).
_MAX_REDIRECTS = 3
_REDIRECTS = frozenset((301, 302, 303, 307, 308))
# A page larger than this is refused, not read into memory whole (SGLang's is tens of KB).
_MAX_PAGE_BYTES = 16 << 20


def _same_origin(url: str, requested: str, location: str | None, path: str) -> tuple[str, str]:
    """(origin, path and query) of a redirect from `requested` to `location`, which must stay on
    the origin of the replica at `url`."""
    if not location:
        raise SignalParseError(f"{path}: a redirect without a Location")
    target = URL(requested).join(URL(location))
    origin = URL(url).origin()
    if target.origin() != origin:
        raise SignalParseError(f"{path}: redirected off the replica, to {location}")
    return str(origin), target.raw_path_qs


class SignalPoller:
    def __init__(
        self,
        registry: ReplicaRegistry,
        metrics: RouterMetrics,
        config: SignalsConfig,
        clock: Callable[[], float] = time.monotonic,
        on_signals: Callable[[str, ReplicaSignals], None] | None = None,
        on_rank_loads: Callable[[str, dict[int, ReplicaSignals]], None] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.config = config
        self.clock = clock
        self.sleep = sleep  # waits between the scrapes of a round (tests pass a fake one)
        self.on_signals = on_signals or (lambda url, signals: None)
        self.on_rank_loads = on_rank_loads  # DP attention: each rank's /v1/loads entry
        self.last_update: dict[str, float] = {}
        self.reached: set[str] = set()  # replicas that answered a poll at least once
        # Each replica's last /metrics page and its signals: an idle replica serves the same
        # bytes poll after poll, which need not be decoded and parsed again.
        self.last_page: dict[str, tuple[bytes, ReplicaSignals]] = {}
        self._scrapes: dict[str, asyncio.Task[None]] = {}  # under way, by replica
        # Unexpected errors (bugs, not replica failures) of ended scrapes, not yet raised.
        self._errors: list[Exception] = []
        # Scrapes go over the data plane's own HTTP client, not aiohttp's: a poll is a few
        # hundred microseconds less CPU, and a router polls its replicas several times a second
        # all day. Its own pool: a scrape's whole exchange is bounded by `timeout_s`.
        self.pool = UpstreamPool(config.timeout_s, config.timeout_s)
        self.headers = dict(headers or {})  # sent on every scrape (upstream.inject_headers)
        self._hosts: set[str] = set()  # replicas scraped: their connections go when they do

    def up_count(self) -> int:
        """Healthy replicas that have answered a poll (not merely assumed healthy at start)."""
        return sum(1 for v in self.registry.snapshot().replicas if v.healthy and v.id in self.reached)

    async def _get(self, url: str, path: str) -> tuple[int, bytes]:
        """Status and body of GET `path` on the replica at `url`, following redirects within
        the replica's origin (raises UpstreamError, or SignalParseError for a redirect
        elsewhere, too many redirects or a page over `_MAX_PAGE_BYTES`)."""
        self._hosts.add(url)
        base, target = url, path
        for _ in range(_MAX_REDIRECTS + 1):
            response = await self.pool.request("GET", base, target, CIMultiDict(self.headers), b"")
            try:
                if response.status not in _REDIRECTS:
                    try:
                        return response.status, await response.read(_MAX_PAGE_BYTES)
                    except UpstreamBodyTooLarge:
                        raise SignalParseError(f"{path}: answer over {_MAX_PAGE_BYTES} bytes") from None
                base, target = _same_origin(url, base + target, response.headers.get("Location"), path)
            finally:
                response.close()
        raise SignalParseError(f"{path}: more than {_MAX_REDIRECTS} redirects")

    async def _scrape(self, url: str) -> ReplicaSignals | None:
        """Signals, or None when the replica is alive but exposes none. Raises on failure."""
        path = "/v1/loads" if self.config.source == "loads" else "/metrics"
        if self.config.source != "health":
            status, body = await self._get(url, path)
            if status == 200:
                if self.config.source == "loads":
                    loads = orjson.loads(body)
                    if self.on_rank_loads is not None and url in self.registry:  # (not removed meanwhile)
                        self.on_rank_loads(url, parse_rank_loads(loads))
                    return parse_loads_json(loads)
                return self._read_page(url, body)
            if status not in (404, 405):
                raise SignalParseError(f"{path} answered {status}")
        status, _ = await self._get(url, "/health")
        if status != 200:
            raise SignalParseError(f"/health answered {status}")
        return None

    def _read_page(self, url: str, page: bytes) -> ReplicaSignals:
        """The signals of a /metrics page; the last ones again when the page is the same bytes."""
        last = self.last_page.get(url)
        if last is not None and last[0] == page:
            return last[1]
        signals = parse_metrics_text(page.decode("utf-8", "replace"))
        self.last_page[url] = (page, signals)
        return signals

    async def poll(self, url: str) -> None:
        try:
            signals = await self._scrape(url)
        except (UpstreamError, SignalParseError, ValueError) as err:
            if url not in self.registry:
                return  # removed while scraped: counting it would bring back its metric series
            self.metrics.poll_errors.labels(url).inc()
            if self.on_rank_loads is not None:
                self.on_rank_loads(url, {})  # per-rank loads unknown until it answers again
            if self.registry.record_failure(url):
                log.warning("replica %s marked unhealthy (%s)", url, type(err).__name__)
        else:
            if url not in self.registry:
                return  # removed while scraped: its signals would bring back what removal cleared
            self.reached.add(url)
            if self.registry.record_success(url):
                log.info("replica %s is healthy again", url)
            if signals is not None:
                self.registry.update_signals(url, signals)
                self.last_update[url] = self.clock()
                self.on_signals(url, signals)
        view = self.registry.view(url)
        if view is not None:
            self.metrics.replica_healthy.labels(url).set(1 if view.healthy else 0)

    def expire_stale(self) -> None:
        now = self.clock()
        for url in self.registry.urls():
            seen = self.last_update.get(url)
            if seen is None:
                continue
            age = now - seen
            self.metrics.signal_age.labels(url).set(age)
            if age > self.config.stale_after_s:
                self.registry.update_signals(url, None)
                del self.last_update[url]

    def _start_scrape(self, url: str) -> asyncio.Task[None] | None:
        """Start scraping `url` as a task of its own; None, and nothing started, when the
        replica has been removed or its previous scrape is still under way."""
        if url not in self.registry or url in self._scrapes:
            return None
        task = asyncio.get_running_loop().create_task(self._scrape_task(url), name=f"scrape {url}")
        self._scrapes[url] = task
        task.add_done_callback(lambda _: self._scrapes.pop(url, None))
        return task

    async def _scrape_task(self, url: str) -> None:
        try:
            await self.poll(url)
        except Exception as err:  # a bug, not a replica failure: the others' scrapes go on
            self._errors.append(err)

    async def _start_round(self, spread_s: float, started: list[asyncio.Task[None]] | None = None) -> None:
        """Start one scrape of each replica, the i-th of n `i * spread_s / n` after the first
        (all at once without a spread); returns once the last has started, its scrapes added
        to `started`. Replicas are listed when the round starts; one removed before its turn,
        or whose previous scrape is still under way, is skipped."""
        urls = self.registry.urls()
        began = self.clock()
        for i, url in enumerate(urls):
            if i and spread_s > 0:  # (never more than a turn: the injected clock may go back)
                turn = spread_s / len(urls)
                await self.sleep(max(0.0, min(turn, began + i * turn - self.clock())))
            task = self._start_scrape(url)
            if task is not None and started is not None:
                started.append(task)

    async def _end_round(self) -> None:
        """Cancel removed replicas' scrapes and forget them (one added back is new), clear
        stale signals, and raise the first unexpected error of the scrapes ended so far, once
        none is under way (raising cancels none)."""
        for url, task in list(self._scrapes.items()):
            if url not in self.registry:  # removed: no need to wait out its timeout
                task.cancel()
        for url in [u for u in self.last_page if u not in self.registry]:  # removed replicas
            del self.last_page[url]
        for url in [u for u in self.last_update if u not in self.registry]:
            del self.last_update[url]
        self.reached &= set(self.registry.urls())
        for url in [u for u in self._hosts if u not in self.registry]:  # their idle connections
            self._hosts.discard(url)
            self.pool.forget_replica(url)
            self.pool.forget_replica(str(URL(url).origin()))  # (a redirect's; shared ones are kept)
        self.expire_stale()
        if self._errors:
            if self._scrapes:
                await asyncio.wait(list(self._scrapes.values()))
            error = self._errors[0]
            self._errors.clear()
            raise error  # the supervisor logs it and restarts the loop

    async def _cancel_scrapes(self, tasks: list[asyncio.Task[None]]) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def poll_all(self, spread_s: float = 0.0) -> None:
        """Scrape every replica once; returns when every scrape has ended. With `spread_s`, the
        i-th of n replicas is scraped `i * spread_s / n` after the first (each scrape runs on
        while the next ones start); without, all at once. A replica removed before its turn is
        not scraped. An unexpected error in one scrape is raised after the round has ended."""
        tasks: list[asyncio.Task[None]] = []
        try:
            await self._start_round(spread_s, tasks)
            if tasks:
                await asyncio.wait(tasks)
        finally:
            await self._cancel_scrapes([t for t in tasks if not t.done()])  # when cancelled
        await self._end_round()

    async def run(self) -> None:
        """Start a round each `interval_s`, its scrapes spread over it. The schedule is fixed
        (round k at k intervals after the first), a round does not wait for its scrapes to end,
        and a slot that has passed while the loop was held up is skipped rather than run late
        (rounds never bunch up); a clock that goes back starts a new schedule, never a wait of
        more than an interval. Scrapes still under way are cancelled when the loop stops."""
        interval = self.config.interval_s
        first = self.clock()
        round_no = 0
        try:
            while True:
                await self._start_round(spread_s=interval)
                await self._end_round()
                now = self.clock()
                # the next slot not yet passed (a hair of float error is not a missed slot)
                round_no = max(round_no + 1, math.ceil((now - first) / interval - 1e-9))
                wait = first + round_no * interval - now
                if wait > interval:  # the (injected) clock went back: a new schedule from the next round
                    first, round_no, wait = now + interval, 0, interval
                await self.sleep(max(0.0, wait))
        finally:
            await self._cancel_scrapes(list(self._scrapes.values()))

    async def aclose(self) -> None:
        """Close the scrapes' connections (after `run` has stopped)."""
        await self.pool.close()
