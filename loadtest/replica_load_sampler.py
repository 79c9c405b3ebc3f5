"""Sampling the replicas' running requests from their ``/metrics`` during a load run.

The samples feed the load-imbalance figures (see :mod:`kvrouter.loadtest.report`); a round where
any replica did not answer is dropped, so every kept sample has one value per replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import aiohttp

from kvrouter.sglang_protocol.signals import parse_metrics_text

__all__ = ["metrics_url", "sample_loads"]


def metrics_url(base: str) -> str:
    base = base.rstrip("/")
    return base if base.endswith("/metrics") else base + "/metrics"


async def _running_reqs(http: aiohttp.ClientSession, url: str, timeout_s: float) -> float | None:
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
        value = parse_metrics_text(text).num_running_reqs
        return None if value is None else float(value)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


async def sample_loads(
    http: aiohttp.ClientSession,
    urls: Sequence[str],
    interval_s: float,
    stop: asyncio.Event,
    samples: list[list[float]],
    times: list[float] | None = None,
    clock: Callable[[], float] | None = None,
) -> None:
    """Append one sample (running requests per replica) every ``interval_s`` until ``stop``;
    with ``times``, also the ``clock()`` value at which each kept sample was taken."""
    while not stop.is_set():
        t = clock() if clock is not None else 0.0
        values = await asyncio.gather(*(_running_reqs(http, u, max(interval_s, 0.2)) for u in urls))
        if all(v is not None for v in values):
            samples.append([v for v in values if v is not None])
            if times is not None:
                times.append(t)
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except asyncio.TimeoutError:
            pass
