"""One replica response as the relay's upstream client (router/upstream_http.py) receives it:
status and headers, then the body as it arrives, with back-pressure on the connection."""

from __future__ import annotations

import asyncio
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

from multidict import CIMultiDict

from .upstream_errors import UpstreamBodyTooLarge

if TYPE_CHECKING:
    from .upstream_http import _Connection

# Unread response bytes above this pause reading from the replica (TCP back-pressure).
_READ_HIGH_WATER = 1 << 20


class UpstreamResponse:
    """One response: status and headers now, the body as it arrives (`readany`/`read`).
    `close()` must follow: it returns a finished keep-alive connection to the pool and
    aborts an unfinished one (so the replica stops working on a request nobody reads)."""

    __slots__ = ("status", "headers", "names", "content_length", "content_type", "_conn", "_chunks",
                 "_size", "_done", "_error", "_waiter", "_closed")

    def __init__(self, conn: _Connection, status: int, headers: CIMultiDict[str],
                 names: AbstractSet[str] | None = None) -> None:
        self.status = status
        self.headers = headers
        self.names = names  # the header names present, lower-cased (None: not known)
        length = headers.get("Content-Length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        self.content_type = headers.get("Content-Type", "").partition(";")[0].strip().lower()
        self._conn = conn
        self._chunks: list[bytes] = []
        self._size = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    # -- fed by the connection --------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > _READ_HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _finish(self, error: BaseException | None = None) -> None:
        if self._done or self._error is not None:
            return
        if error is None:
            self._done = True
        else:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- read by the relay --------------------------------------------------------------------
    async def readany(self) -> bytes:
        """The bytes received since the last call; b"" at the end. Bytes that arrived before a
        failure are returned first, then the failure is raised."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._size = 0
        self._conn.resume()
        return data

    @property
    def waiting(self) -> bool:
        """No body bytes, end or failure has arrived unread: the next `readany` waits."""
        return not self._chunks and not self._done and self._error is None

    @property
    def at_eof(self) -> bool:
        """The whole body has arrived and been read: the next `readany` returns b"". Lets the
        relay send its last bytes with the end of the response in one write."""
        return self._done and not self._chunks

    def body_now(self) -> bytes | None:
        """What `read` returns, if the whole body has arrived (a small answer usually comes
        with its head: no await), else None."""
        if not self._done:
            return None
        chunks, self._chunks = self._chunks, []
        self._size = 0
        self._conn.resume()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def read(self, limit: int | None = None) -> bytes:
        """The rest of the body; with `limit`, UpstreamBodyTooLarge as soon as it is longer."""
        parts, size = [], 0
        while chunk := await self.readany():
            size += len(chunk)
            if limit is not None and size > limit:
                raise UpstreamBodyTooLarge(f"body over {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._done and not self._chunks:
            self._conn.release()
        else:
            self._conn.abort()
