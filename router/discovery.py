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

A prefill/decode-disaggregated fleet (``disaggregation.from_discovery``) is discovered the same
way, with a role per endpoint (:class:`Endpoint`): ``decode`` endpoints join the decode pool
(router/decode_pool.py; one that vanishes leaves it, its running requests finish), the others
are the routed prefill pool above, with the bootstrap port the source gives (SGLang's default
otherwise). A router that is not in PD mode ignores endpoints with a role and counts an error:
a prefill or decode server refuses a request without bootstrap fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

import orjson
import yaml

from .config import normalize_replica_url
from .discovery_config import DiscoveryConfig, FileDiscoveryConfig
from .membership import ReplicaMembership
from .supervise import spawn

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("kvrouter.discovery")

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")


class Endpoint(NamedTuple):
    """A discovered server: its URL and, in a disaggregated fleet, its role and (prefill
    servers) its SGLang bootstrap port. A bare URL string means ``Endpoint(url)``."""

    url: str
    role: Role | None = None
    bootstrap_port: int | None = None


Publish = Callable[[Iterable["str | Endpoint"]], None]


class PDMembership(Protocol):
    """What discovery may change in a disaggregated fleet besides the routed (prefill) pool."""

    def add_decode(self, url: str) -> bool:
        """Add a decode server; False if it is already there."""
        ...

    def remove_decode(self, url: str) -> bool:
        """Remove a decode server (its running requests finish); False if unknown."""
        ...

    def set_bootstrap_ports(self, ports: dict[str, int]) -> None:
        """The bootstrap ports of the discovered prefill servers (all of them, each time)."""
        ...


class Source(Protocol):
    name: str

    async def run(self, publish: Publish) -> None:
        """Publish the full current set whenever it may have changed; loop until cancelled.
        Expected errors (keep the last set) are handled inside; anything else raised is a crash:
        the source is restarted with backoff (router/supervise.py), its last set kept."""


class Discovery:
    """Merges the sets published by every source and applies the difference to the router's
    replica membership (router/membership.py)."""

    def __init__(
        self, membership: ReplicaMembership, sources: Iterable[Source], metrics: Any = None,
        pd: PDMembership | None = None,
    ) -> None:
        self.membership = membership
        self.sources = list(sources)
        self.metrics = metrics
        self.pd = pd  # None: not a disaggregated fleet (endpoints with a role are ignored)
        self._sets: dict[str, dict[str, Endpoint]] = {}
        self.owned: set[str] = set()  # URLs discovery added (and so may remove)
        self.owned_decode: set[str] = set()  # decode servers discovery added
        self._drained: set[str] = set()  # URLs discovery drained (gone from every source)
        self._tasks: list[asyncio.Task[None]] = []
        self.changed = asyncio.Event()  # set after every applied change (tests wait on it)

    def publish(self, source: str, endpoints: Iterable[str | Endpoint]) -> None:
        clean: dict[str, Endpoint] = {}
        ignored: list[str] = []
        for entry in endpoints:
            endpoint = Endpoint(entry) if isinstance(entry, str) else entry
            try:
                url = normalize_replica_url(endpoint.url)
            except ValueError as err:
                log.warning("discovery %s: ignoring %s", source, err)
                continue
            if endpoint.role is not None and self.pd is None:
                ignored.append(f"{url} ({endpoint.role})")
                continue
            clean[url] = endpoint._replace(url=url)
        if ignored:
            self.error(source, f"ignoring {', '.join(sorted(ignored))}: endpoints with a role need "
                               "disaggregation.from_discovery", kept_last=False)
        self._sets[source] = clean
        if self.metrics is not None:
            self.metrics.discovery_replicas.labels(source).set(len(clean))
        self._apply(source)

    def error(self, source: str, message: str, *, kept_last: bool = True) -> None:
        """A source failed (it keeps its last known replicas), or, `kept_last=False`, some of
        what it listed cannot be used (the rest is)."""
        suffix = " (keeping its last known replicas)" if kept_last else ""
        log.warning("discovery %s: %s%s", source, message, suffix)
        if self.metrics is not None:
            self.metrics.discovery_errors.labels(source).inc()

    @property
    def desired(self) -> set[str]:
        """The routed pool's URLs (replicas; in PD mode the prefill servers) every source lists."""
        out: set[str] = set()
        for endpoints in self._sets.values():
            out |= {url for url, e in endpoints.items() if e.role != "decode"}
        return out - self._conflicts()

    @property
    def desired_decode(self) -> set[str]:
        out: set[str] = set()
        for endpoints in self._sets.values():
            out |= {url for url, e in endpoints.items() if e.role == "decode"}
        return out - self._conflicts()

    def _conflicts(self) -> set[str]:
        """URLs one source calls decode and another not: used as neither until they agree."""
        decode: set[str] = set()
        other: set[str] = set()
        for endpoints in self._sets.values():
            for url, e in endpoints.items():
                (decode if e.role == "decode" else other).add(url)
        return decode & other

    def _bootstrap_ports(self) -> dict[str, int]:
        ports: dict[str, int] = {}
        for endpoints in self._sets.values():
            for url, e in endpoints.items():
                if e.role != "decode" and e.bootstrap_port is not None:
                    ports[url] = e.bootstrap_port
        return ports

    def _apply(self, source: str) -> None:
        conflicts = self._conflicts()
        if conflicts:
            self.error(source, f"{sorted(conflicts)} listed as decode by one source and not by "
                               "another: used as neither", kept_last=False)
        desired = self.desired
        changed = False
        if self.pd is not None:  # before the prefill servers join: their ports must be known
            self.pd.set_bootstrap_ports(self._bootstrap_ports())
            changed = self._apply_decode()
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

    def _apply_decode(self) -> bool:
        assert self.pd is not None
        desired = self.desired_decode
        changed = False
        for url in sorted(desired - self.owned_decode):
            if self.pd.add_decode(url):  # False: a static decode server
                self.owned_decode.add(url)
                changed = True
                log.info("discovery: +decode %s", url)
        for url in sorted(self.owned_decode - desired):
            self.owned_decode.discard(url)
            if self.pd.remove_decode(url):
                changed = True
                log.info("discovery: -decode %s (no new requests, in-flight ones finish)", url)
        return changed

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
    config: DiscoveryConfig, membership: ReplicaMembership, metrics: Any = None,
    pd: PDMembership | None = None,
) -> Callable[["web.Application"], AsyncIterator[None]]:
    """An aiohttp cleanup context running the configured discovery sources against `membership`
    (and `pd`, a disaggregated fleet's decode pool and bootstrap ports; none configured: a
    no-op). The composition root appends it after its own lifecycle, so it stops first on
    shutdown."""

    async def ctx(app: "web.Application") -> AsyncIterator[None]:
        discovery = None
        if config.enabled:
            discovery = Discovery(membership, [], metrics, pd)
            discovery.sources = build_sources(config, discovery.error)
            discovery.start()
        yield
        if discovery is not None:
            await discovery.close()

    return ctx


# -- the file source ---------------------------------------------------------------------------
ENDPOINT_KEYS = {"url", "role", "bootstrap_port"}


def parse_endpoint(entry: Any) -> str | Endpoint:
    """One list entry: a URL string, or a mapping ``{url, role: prefill|decode, bootstrap_port}``."""
    if isinstance(entry, str):
        normalize_replica_url(entry)
        return entry
    if not isinstance(entry, dict):
        raise ValueError(f"want a replica URL string or a mapping, got {entry!r}")
    unknown = set(entry) - ENDPOINT_KEYS
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)} (want {sorted(ENDPOINT_KEYS)})")
    url, role, port = entry.get("url"), entry.get("role"), entry.get("bootstrap_port")
    if not isinstance(url, str):
        raise ValueError(f"an endpoint needs a `url` string: {entry!r}")
    normalize_replica_url(url)
    if role is not None and role not in ROLES:
        raise ValueError(f"{url}: role {role!r} is not one of {list(ROLES)}")
    if port is not None:
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError(f"{url}: bootstrap_port {port!r} is not a port number")
        if role == "decode":
            raise ValueError(f"{url}: bootstrap_port is a prefill server's, not a decode server's")
    return Endpoint(url, role, port)


def parse_replica_list(text: str) -> list[str | Endpoint]:
    """A YAML (or JSON, which is YAML) list of endpoints, or a mapping with a `replicas:` list.
    An endpoint is a URL string or a mapping with `url`, `role` and `bootstrap_port`."""
    data = yaml.safe_load(text)
    if data is None:
        return []
    if isinstance(data, dict):
        if set(data) - {"replicas"}:
            raise ValueError(f"unknown keys {sorted(set(data) - {'replicas'})} (want a list or `replicas:`)")
        data = data.get("replicas") or []
    if not isinstance(data, list):
        raise ValueError("want a list of replica URL strings or endpoint mappings")
    return [parse_endpoint(e) for e in data]  # a bad entry rejects the whole file: keep the last good one


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
        publish(urls)

    async def run(self, publish: Publish) -> None:
        while True:
            self.poll(publish)
            await asyncio.sleep(self.config.interval_s)
