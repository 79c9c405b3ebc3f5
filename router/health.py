"""Active health probes: each replica's GET /health on an interval, all probes concurrent, so a
slow or dead replica never delays the others. Request failures count too (see Relay)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from ..metrics.router_metrics import RouterMetrics
from .config import HealthConfig
from .replicas import ReplicaRegistry

log = logging.getLogger("kvrouter.health")


class HealthProber:
    def __init__(
        self, registry: ReplicaRegistry, metrics: RouterMetrics, config: HealthConfig
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.config = config

    async def probe(self, session: aiohttp.ClientSession, url: str) -> None:
        try:
            async with session.get(
                url + "/health", timeout=aiohttp.ClientTimeout(total=self.config.timeout_s)
            ) as resp:
                await resp.read()
                ok = resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok = False
        if ok:
            if self.registry.record_success(url):
                log.info("replica %s is healthy again", url)
        elif self.registry.record_failure(url):
            log.warning("replica %s marked unhealthy", url)
        view = self.registry.view(url)
        if view is not None:
            self.metrics.replica_healthy.labels(url).set(1 if view.healthy else 0)

    async def probe_all(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self.probe(session, url) for url in self.registry.urls()))

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            await self.probe_all(session)
            await asyncio.sleep(self.config.interval_s)
