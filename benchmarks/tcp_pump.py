"""The floor for any proxy on this machine: a byte pump with no HTTP in it.

Each client connection gets its own connection to the upstream and bytes are copied both ways
as they arrive (uvloop protocols, TCP_NODELAY, back-pressure through pause/resume). It parses
nothing, routes nothing and counts nothing, so whatever it costs is the price of the extra hop
itself (two more sockets, two more reads and writes per exchange, more context switches).
benchmarks/dataplane.py runs it with --external to show how close a router can get to direct.

    python benchmarks/tcp_pump.py PORT http://127.0.0.1:UPSTREAM_PORT
"""

from __future__ import annotations

import asyncio
import socket
import sys
from urllib.parse import urlsplit


class _Half(asyncio.Protocol):
    """One side of a pair: what arrives here is written to the peer."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Half | None = None
        self.pending: list[bytes] = []  # bytes that arrived before the peer was connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.write(data)
        else:
            self.pending.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    # The peer's send buffer is full: stop reading here until it drains.
    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


async def serve(port: int, upstream: str) -> None:
    target = urlsplit(upstream)
    loop = asyncio.get_running_loop()

    def accept() -> _Half:
        client = _Half()

        async def connect() -> None:
            try:
                _, up = await loop.create_connection(_Half, target.hostname, target.port)
            except OSError:
                if client.transport is not None:
                    client.transport.abort()
                return
            up.peer, client.peer = client, up
            for data in client.pending:
                up.transport.write(data)  # type: ignore[union-attr]
            client.pending.clear()

        loop.create_task(connect())
        return client

    server = await loop.create_server(accept, "127.0.0.1", port, reuse_address=True)
    await server.serve_forever()


def main() -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(int(sys.argv[1]), sys.argv[2]))


if __name__ == "__main__":
    main()
