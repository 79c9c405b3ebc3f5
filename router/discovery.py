"""Replica discovery: keep the router's replica set in line with a file, DNS or Kubernetes.

Each source runs as one asyncio task and publishes the *whole* set of replica URLs it currently
sees; :class:`Discovery` merges the sets of all sources and applies the difference to the
router's replica membership (``ReplicaMembership``, router/membership.py):

- a URL that appears goes through ``Membership.add`` (so it is *fresh*: the scale-out rule
  prefers it for new sessions and moves a few idle sessions onto it);
- a URL that vanishes is drained, not cut: ``Membership.drain`` takes it out of every decision
  (it looks unhealthy to policies) while requests already relayed to it keep their upstream
  connection and run to the end; the router's housekeeping removes it once its in-flight count is
  zero. Sessions homed there are rehomed on their next request. A URL that comes back while
  still draining is re-added as a fresh replica.

Only replicas discovery itself added are ever removed by it: a replica from the static
``replicas:`` list (or added by an operator) stays when a source stops listing it. A source that
fails (unreadable file, DNS error, API down) keeps its last published set instead of draining the
fleet, and counts the failure in ``kvrouter_discovery_errors_total{source}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import orjson
import yaml

from .config import normalize_replica_url
from .discovery_config import DiscoveryConfig, FileDiscoveryConfig
from .membership import ReplicaMembership
from .supervise import spawn

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("kvrouter.discovery")

Publish = Callable[[set[str]], None]


class Source(Protocol):
    name: str

    async def run(self, publish: Publish) -> None:
        """Publish the full current set whenever it may have changed; loop until cancelled.
        Expected errors (keep the last set) are handled inside; anything else raised is a crash:
        the source is restarted with backoff (router/supervise.py), its last set kept."""


class Discovery:
    """Merges the sets published by every source and applies the difference to the router's
    replica membership (router/membership.py)."""

    def __init__(self, membership: ReplicaMembership, sources: Iterable[Source], metrics: Any = None) -> None:
        self.membership = membership
        self.sources = list(sources)
        self.metrics = metrics
        self._sets: dict[str, set[str]] = {}
        self.owned: set[str] = set()  # URLs discovery added (and so may remove)
        self._drained: set[str] = set()  # URLs discovery drained (gone from every source)
        self._tasks: list[asyncio.Task[None]] = []
        self.changed = asyncio.Event()  # set after every applied change (tests wait on it)

    def publish(self, source: str, urls: Iterable[str]) -> None:
        clean: set[str] = set()
        for url in urls:
            try:
                clean.add(normalize_replica_url(url))
            except ValueError as err:
                log.warning("discovery %s: ignoring %s", source, err)
        self._sets[source] = clean
        if self.metrics is not None:
            self.metrics.discovery_replicas.labels(source).set(len(clean))
        self._apply()

    def error(self, source: str, message: str) -> None:
        log.warning("discovery %s: %s (keeping its last known replicas)", source, message)
        if self.metrics is not None:
            self.metrics.discovery_errors.labels(source).inc()

    @property
    def desired(self) -> set[str]:
        out: set[str] = set()
        for urls in self._sets.values():
            out |= urls
        return out

    def _apply(self) -> None:
        desired = self.desired
        changed = False
        members = self.membership
        for url in sorted(desired - self.owned):
            if url in self._drained and members.is_draining(url):
                members.remove(url)  # back while still draining: a fresh replica again
            self._drained.discard(url)
            if members.add(url):  # False: already there (static list, operator)
                self.owned.add(url)
                changed = True
                log.info("discovery: +%s (fresh)", url)
        for url in sorted(self.owned - desired):
            self.owned.discard(url)
            if members.drain(url):
                # Stays registered, unhealthy to policies, until its in-flight requests end.
                self._drained.add(url)
                changed = True
                log.info("discovery: -%s (draining: no new requests, in-flight ones finish)", url)
            elif members.remove(url):
                changed = True
                log.info("discovery: -%s (removed: no new requests, in-flight ones finish)", url)
        if changed:
            self.changed.set()

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        for source in self.sources:
            publish: Publish = lambda urls, _name=source.name: self.publish(_name, urls)  # noqa: E731
            self._tasks.append(spawn(
                f"discovery-{source.name}", functools.partial(source.run, publish),
                metrics=self.metrics,
            ))  # a source that crashes is restarted; its last published set stays meanwhile

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()


def build_sources(config: DiscoveryConfig, on_error: Callable[[str, str], None]) -> list[Source]:
    sources: list[Source] = []
    if config.file is not None:
        sources.append(FileSource(config.file, on_error))
    if config.dns is not None:
        from .discovery_dns import DNSSource

        sources.append(DNSSource(config.dns, on_error))
    if config.kubernetes is not None:
        from .discovery_k8s import KubernetesSource

        sources.append(KubernetesSource(config.kubernetes, on_error))
    return sources


def discovery_ctx(
    config: DiscoveryConfig, membership: ReplicaMembership, metrics: Any = None
) -> Callable[["web.Application"], AsyncIterator[None]]:
    """An aiohttp cleanup context running the configured discovery sources against `membership`
    (none configured: a no-op). The composition root appends it after its own lifecycle, so it
    stops first on shutdown."""

    async def ctx(app: "web.Application") -> AsyncIterator[None]:
        discovery = None
        if config.enabled:
            discovery = Discovery(membership, [], metrics)
            discovery.sources = build_sources(config, discovery.error)
            discovery.start()
        yield
        if discovery is not None:
            await discovery.close()

    return ctx


# -- the file source ---------------------------------------------------------------------------
def parse_replica_list(text: str) -> list[str]:
    """A YAML (or JSON, which is YAML) list of URLs, or a mapping with a `replicas:` list."""
    data = yaml.safe_load(text)
    if data is None:
        return []
    if isinstance(data, dict):
        if set(data) - {"replicas"}:
            raise ValueError(f"unknown keys {sorted(set(data) - {'replicas'})} (want a list or `replicas:`)")
        data = data.get("replicas") or []
    if not isinstance(data, list) or not all(isinstance(u, str) for u in data):
        raise ValueError("want a list of replica URL strings")
    for url in data:
        normalize_replica_url(url)  # a bad entry rejects the whole file: keep the last good one
    return data


class FileSource:
    name = "file"

    def __init__(self, config: FileDiscoveryConfig, on_error: Callable[[str, str], None]) -> None:
        self.config = config
        self.on_error = on_error
        self._last: bytes | None = None

    def poll(self, publish: Publish) -> None:
        path = Path(self.config.path)
        try:
            raw = path.read_bytes()
        except OSError as err:
            self.on_error(self.name, f"cannot read {path}: {err.strerror}")
            return
        if raw == self._last:
            return
        try:
            urls = parse_replica_list(raw.decode())
        except (ValueError, yaml.YAMLError, UnicodeDecodeError, orjson.JSONDecodeError) as err:
            self.on_error(self.name, f"{path}: {err}")
            return
        self._last = raw
        publish(set(urls))

    async def run(self, publish: Publish) -> None:
        while True:
            self.poll(publish)
            await asyncio.sleep(self.config.interval_s)
