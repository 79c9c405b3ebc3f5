"""One pipelined Redis connection for the affinity store.

redis-py costs 70-140 us of CPU per call on the benchmark VM (pool checkout, retry wrapper,
a timeout context per read, command objects), and the store makes one or two calls per
session-keyed request: with Redis affinity that was the largest part of the router's CPU. Here
each call is one write on a single shared connection, replies are matched to calls first in,
first out, and hiredis parses them: ~6 us of CPU per call when calls overlap, ~46 us alone
(mostly the syscalls), measured side by side with redis-py.

URLs mean exactly what they mean to redis-py, which parses them and builds the TLS context:
redis://, rediss:// with its ssl_* query arguments, unix://, user, password and db.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
from typing import Any

import hiredis
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection, parse_url


class RedisError(Exception):
    """Redis answered with an error."""


class RedisConnectionError(ConnectionError):
    """No connection, or it broke (or timed out) with calls outstanding."""


def _encode(arg: object) -> bytes:
    if isinstance(arg, bytes):
        return arg
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return repr(arg).encode()
    raise TypeError(f"cannot send {type(arg).__name__} to Redis")


def pack(args: tuple[object, ...]) -> bytes:
    """A command as a RESP array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = _encode(arg)
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


class _Resp(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader(replyError=RedisError)
        self.waiters: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.loop = asyncio.get_running_loop()
        self.silent_since = 0.0  # the last byte received, or the oldest waiting call's send
        self.said: str | None = None  # what the server said unasked (e.g. max clients reached)

    def send(self, args: tuple[object, ...]) -> asyncio.Future[Any]:
        if self.closed or self.transport is None:
            raise RedisConnectionError(self.why_closed(None))
        data = pack(args)  # first: a bad argument must not leave a waiter without a reply
        future: asyncio.Future[Any] = self.loop.create_future()
        if not self.waiters:
            self.silent_since = self.loop.time()
        self.waiters.append(future)
        self.transport.write(data)
        return future

    def why_closed(self, exc: Exception | None) -> str:
        return f"redis connection lost: {self.said or exc or 'closed'}"

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.silent_since = self.loop.time()
        self.reader.feed(data)
        try:
            while (reply := self.reader.gets()) is not False:
                if not self.waiters:  # a reply nobody asked for: keep what it said, then close
                    self.said = str(reply)
                    self.abort()
                    return
                waiter = self.waiters.popleft()  # a call whose caller gave up still owns its reply
                if waiter.done():
                    continue
                if isinstance(reply, RedisError):
                    waiter.set_exception(reply)
                else:
                    waiter.set_result(reply)
        except hiredis.ProtocolError:
            self.said = "garbled reply"
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        error = RedisConnectionError(self.why_closed(exc))
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)


class Script:
    def __init__(self, source: str) -> None:
        self.source = source.encode()
        self.sha = hashlib.sha1(self.source).hexdigest().encode()


class PipelinedRedis:
    """Calls from many tasks share one connection, (re)opened on demand. A call that times out
    or is cancelled leaves its reply to be skipped when it comes, so the others keep theirs
    (Redis may still run them). Only a connection that has answered nothing for `dead_after`
    while calls wait is dropped (failing those calls); the next call reconnects."""

    def __init__(self, url: str, *, timeout: float, password: str | None = None) -> None:
        params = parse_url(url)
        kind = params.pop("connection_class", None)
        self.timeout = timeout
        self.dead_after = max(1.0, 4 * timeout)
        self._db = int(params.get("db") or 0)
        self._username = params.get("username")
        self._password = password if password is not None else params.get("password")
        self._path: str | None = params.get("path") if kind is UnixDomainSocketConnection else None
        if kind is UnixDomainSocketConnection and not self._path:
            raise ValueError(f"redis URL {url!r} names no socket path")
        self._host = params.get("host", "localhost")
        self._port = int(params.get("port", 6379))
        self._ssl = None
        if kind is SSLConnection:  # redis-py turns the ssl_* arguments into a context
            ssl_args = {k: v for k, v in params.items() if k.startswith("ssl_")}
            self._ssl = SSLConnection(host=self._host, port=self._port, **ssl_args).ssl_context.get()
        self._conn: _Resp | None = None
        self._connecting: asyncio.Task[_Resp] | None = None
        self._closed = False

    async def execute(self, *args: object) -> Any:
        """Send one command and return its reply. Raises RedisError, RedisConnectionError or
        TimeoutError (connecting and answering together take at most `timeout`)."""
        conn = self._conn
        try:
            async with asyncio.timeout(self.timeout):
                if conn is None or conn.closed:
                    conn = await self._connection()
                return await conn.send(args)
        except TimeoutError:
            if (conn is not None and conn.waiters
                    and conn.loop.time() - conn.silent_since >= self.dead_after):
                conn.abort()  # answered nothing for that long: the next call reconnects
            raise

    async def evalsha(self, script: Script, keys: list[str], args: list[object]) -> Any:
        try:
            return await self.execute(b"EVALSHA", script.sha, len(keys), *keys, *args)
        except RedisError as err:
            if not str(err).startswith("NOSCRIPT"):
                raise
        return await self.execute(b"EVAL", script.source, len(keys), *keys, *args)  # caches it

    async def _connection(self) -> _Resp:
        if self._closed:
            raise RedisConnectionError("redis client closed")
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
            self._connecting.add_done_callback(self._connected)
        try:
            return await asyncio.shield(self._connecting)  # one caller's timeout must not abort others'
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this caller is cancelled (or timed out)
            raise RedisConnectionError("redis client closed while connecting") from None

    def _connected(self, task: asyncio.Task[_Resp]) -> None:
        self._connecting = None
        if not task.cancelled() and task.exception() is None:
            if self._closed:
                task.result().abort()
            else:
                self._conn = task.result()
        elif not task.cancelled():
            task.exception()  # retrieved: a failed connect is reported to its callers

    async def _connect(self) -> _Resp:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.timeout):
            try:
                if self._path is not None:
                    _, conn = await loop.create_unix_connection(_Resp, self._path)
                else:
                    _, conn = await loop.create_connection(_Resp, self._host, self._port, ssl=self._ssl)
            except OSError as err:
                raise RedisConnectionError(f"cannot connect to redis: {err}") from err
            try:
                if self._password is not None:
                    creds = (self._username, self._password) if self._username else (self._password,)
                    await conn.send((b"AUTH", *creds))
                if self._db:
                    await conn.send((b"SELECT", self._db))
            except BaseException:
                conn.abort()
                raise
        return conn

    async def aclose(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
        if self._conn is not None:
            self._conn.abort()
            self._conn = None
