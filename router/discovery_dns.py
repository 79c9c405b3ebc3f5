"""DNS discovery: the A/AAAA records of a name (a headless Service), re-resolved on an interval.

Resolution goes through the event loop's ``getaddrinfo`` (the system resolver, so
``/etc/resolv.conf`` search domains and ``/etc/hosts`` apply, exactly as for the replicas' own
clients). A failed lookup keeps the last set: a DNS hiccup must not drain the fleet.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable

from .discovery import Publish
from .discovery_config import DNSDiscoveryConfig

Resolver = Callable[[str, int, int], Awaitable[list[str]]]

_FAMILIES = {"any": socket.AF_UNSPEC, "ipv4": socket.AF_INET, "ipv6": socket.AF_INET6}


async def system_resolve(name: str, port: int, family: int) -> list[str]:
    """Addresses of `name` from the system resolver (A and/or AAAA)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        name, port, family=family, type=socket.SOCK_STREAM
    )
    return [str(info[4][0]) for info in infos]


def address_url(scheme: str, address: str, port: int) -> str:
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    return f"{scheme}://{host}:{port}"


class DNSSource:
    name = "dns"

    def __init__(
        self,
        config: DNSDiscoveryConfig,
        on_error: Callable[[str, str], None],
        resolve: Resolver = system_resolve,
    ) -> None:
        self.config = config
        self.on_error = on_error
        self.resolve = resolve

    async def poll(self, publish: Publish) -> None:
        c = self.config
        try:
            addresses = await asyncio.wait_for(
                self.resolve(c.name, c.port, _FAMILIES[c.family]), timeout=max(1.0, c.interval_s)
            )
        except (OSError, asyncio.TimeoutError) as err:  # socket.gaierror is an OSError
            self.on_error(self.name, f"resolving {c.name}: {err}")
            return
        urls = set()
        for address in addresses:
            try:
                urls.add(address_url(c.scheme, address, c.port))
            except ValueError:
                self.on_error(self.name, f"{c.name}: not an IP address {address!r}")
        publish(urls)

    async def run(self, publish: Publish) -> None:
        while True:
            await self.poll(publish)
            await asyncio.sleep(self.config.interval_s)
