"""The shadow KV index shared by every router on one Redis, so each one sees all the traffic.

A router learns its shadow index (router/kv_index_shadow.py) from the requests it routes
itself. With N routers on one fleet (`serve --workers N`, or several pods behind a load
balancer) each would see 1/N of the traffic, and a request without a session key would be
matched against 1/N of what the replicas hold. With `affinity.store: redis` and
`affinity.share_prefix_index`, every router publishes what each accepted request put on a
replica (the replica and the prompt's prefix block hashes) and records what the others
publish, so every router's index follows all the traffic, as a single router's would. The
policy is untouched: the shared records only feed the index its snapshot is matched against.

Wire: Redis pub/sub on `{key_prefix}prefix-index:{block_chars}` (routers hashing blocks of
another size never share a channel). One PUBLISH per `flush_s` at most, msgpack-encoded
`[sender, replica, blocks, replica, blocks, ...]` with blocks packed as signed 64-bit ints.
A router skips its own messages (by sender id) and records for replicas it does not know
(another config, or removed since).

Best effort, never in a request's way: publishing happens in the background; pending records
are bounded (the excess is dropped and counted), a batch that Redis refuses is dropped and
counted, and the subscriber reconnects with backoff. Pub/sub delivers only to connected
subscribers: a router that was disconnected knows less for a while, as it would unshared.
On a Redis Cluster, `redis_url`'s node carries both sides (a cluster broadcasts PUBLISH).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .kv_index_shadow import ShadowKVIndex
from .supervise import DEFAULT_BACKOFF

log = logging.getLogger("kvrouter.index_share")


def share_channel(key_prefix: str, block_chars: int) -> str:
    return f"{key_prefix}prefix-index:{block_chars}"


class IndexShare:
    def __init__(
        self,
        index: ShadowKVIndex,
        url: str,
        channel: str,
        *,
        known: Callable[[str], bool],
        password: str | None = None,
        op_timeout_s: float = 0.25,
        flush_s: float = 0.01,
        max_pending: int = 4096,
        metrics: Any = None,
    ) -> None:
        self.index = index
        self.url = url
        self.channel = channel
        self.known = known
        self.password = password
        self.op_timeout_s = op_timeout_s
        self.flush_s = flush_s
        self.max_pending = max_pending
        self.metrics = metrics  # a RouterMetrics, or None
        self.sender = uuid.uuid4().bytes[:8]
        self.subscribed = asyncio.Event()  # set while the subscription is live (tests wait on it)
        self._pending: list[tuple[str, bytes]] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._publisher: aioredis.Redis | None = None

    # -- outgoing --------------------------------------------------------------------------------
    def recorded(self, replica: str, blocks: Sequence[int]) -> None:
        """This router recorded `blocks` on `replica` (an accepted request): publish it soon."""
        if len(self._pending) >= self.max_pending:
            self._count("dropped")
            return
        self._pending.append((replica, array("q", blocks).tobytes()))
        self._wake.set()

    async def _publish_loop(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.flush_s)  # let the records of this moment join one message
            self._wake.clear()
            batch, self._pending = self._pending, []
            if batch:
                await self._publish(batch)

    async def _publish(self, batch: list[tuple[str, bytes]]) -> None:
        flat: list[Any] = [self.sender]
        for replica, blocks in batch:
            flat += (replica, blocks)
        try:
            async with asyncio.timeout(self.op_timeout_s):
                assert self._publisher is not None
                await self._publisher.publish(self.channel, msgpack.packb(flat))
        except (RedisError, OSError, TimeoutError) as err:
            log.debug("prefix index share: publish failed: %s", err)
            self._count("publish_errors")
            self._count("dropped", len(batch))
            return
        self._count("published", len(batch))

    # -- incoming --------------------------------------------------------------------------------
    def apply(self, payload: bytes) -> int:
        """Record another router's batch in the index; returns the records applied."""
        try:
            flat = msgpack.unpackb(payload)
            if not isinstance(flat, list) or len(flat) % 2 != 1:
                raise ValueError("not [sender, replica, blocks, ...]")
            if flat[0] == self.sender:
                return 0
            applied = 0
            for i in range(1, len(flat), 2):
                replica, packed = flat[i], flat[i + 1]
                if not isinstance(replica, str) or not self.known(replica):
                    continue
                blocks = array("q")
                blocks.frombytes(packed)
                self.index.record(replica, blocks)
                applied += 1
        except (ValueError, TypeError, msgpack.UnpackException) as err:
            log.debug("prefix index share: bad message ignored: %s", err)
            self._count("bad_messages")
            return 0
        self._count("received", applied)
        return applied

    async def _subscribe_loop(self) -> None:
        failures = 0
        while True:
            client = aioredis.Redis.from_url(
                self.url, password=self.password, socket_connect_timeout=self.op_timeout_s * 4,
                health_check_interval=5,
            )
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                self.subscribed.set()
                failures = 0
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        self.apply(message["data"])
            except (RedisError, OSError, TimeoutError) as err:
                self.subscribed.clear()
                self._count("subscribe_errors")
                delay = DEFAULT_BACKOFF.delay(failures, random)
                failures += 1
                log.warning("prefix index share: subscription lost (%s); again in %.1fs", err, delay)
                await asyncio.sleep(delay)
            finally:
                self.subscribed.clear()
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                with contextlib.suppress(Exception):
                    await client.aclose()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, spawn: Callable[[str, Callable[[], Any]], asyncio.Task[None]]) -> None:
        """Start publishing and subscribing; `spawn` supervises each loop (router/supervise.py)."""
        self._publisher = aioredis.Redis.from_url(
            self.url, password=self.password, socket_timeout=self.op_timeout_s,
            socket_connect_timeout=self.op_timeout_s,
        )
        self._tasks = [spawn("prefix-index-publish", self._publish_loop),
                       spawn("prefix-index-subscribe", self._subscribe_loop)]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._publisher is not None:
            with contextlib.suppress(Exception):
                await self._publisher.aclose()
            self._publisher = None

    def _count(self, what: str, n: int = 1) -> None:
        if self.metrics is not None and n:
            self.metrics.index_share.labels(what).inc(n)
