"""A TLS front for the plain test Redis, as stunnel or a managed Redis's TLS endpoint would be.

The packaged valkey-server is built without TLS, so the handshake, certificate checks and
client certificates are done here with the standard library's ssl module, and the decrypted
bytes are piped to the real server. The router's redis client sees a real rediss:// endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl


class TLSTerminator:
    def __init__(self, backend_port: int, context: ssl.SSLContext) -> None:
        self.backend_port = backend_port
        self.context = context
        self.port = 0
        self.sessions = 0  # connections that completed the TLS handshake
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0, ssl=self.context,
                                                  ssl_handshake_timeout=5)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.sessions += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.backend_port)
        except OSError:
            writer.close()
            return
        pumps = [asyncio.create_task(self._pump(reader, up_writer)),
                 asyncio.create_task(self._pump(up_reader, writer))]
        self._tasks.update(pumps)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
            self._tasks.discard(task)
        for w in (writer, up_writer):
            w.close()
            with contextlib.suppress(OSError, ssl.SSLError):
                await w.wait_closed()

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ssl.SSLError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
