"""Routing state shared by every router on one Redis, so each one sees all the traffic.

A router learns its shadow KV index (router/kv_index_shadow.py) from the requests it routes
itself, and its session table (router/sessions.py: each replica's homed sessions and their
context sizes, the KV demand new sessions are placed by) from the sessions it serves. With N
routers on one fleet (`serve --workers N`, or several pods behind a load balancer) each would
see 1/N of the traffic: a request without a session key would be matched against 1/N of what
the replicas hold, and new sessions placed against 1/N of the KV already homed. With
`affinity.store: redis` and `affinity.share_routing_state`, every router publishes what each
accepted request put on a replica (the replica and the prompt's prefix block hashes) and each
session-keyed request's home and context size, and applies what the others publish, so every
router's index and session table follow all the traffic, as a single router's would. With a
`registry`, each router also publishes its requests in flight per replica (its totals, whenever
they change, and again every `in_flight_refresh_s` while any is non-zero): a replica's load in
every router's snapshot then counts every router's dispatches at once, as one router's would,
instead of only its own until the next poll of the replica. A router's totals count until
`in_flight_stale_s` after its last message, so a router that died or lost Redis stops counting.
The policy is untouched: the shared records only feed what its snapshot is built from.

Wire: Redis pub/sub on `{key_prefix}peers:{block_chars}` (routers hashing blocks of another
size never share a channel). One PUBLISH per `flush_s` at most, msgpack-encoded
`[sender, [replica, blocks, ...], [session, home, tokens, ...], in_flight]`, blocks packed as
signed 64-bit ints, tokens -1 when unknown (a home moved by a retry), `in_flight` nil or the
sender's whole set of non-zero counts `[replica, requests, ...]` (a message of three members, as
routers without in-flight sharing send, is read too). A router skips its own messages (by sender
id) and records naming replicas it does not know (another config, or removed since).

Best effort, never in a request's way: publishing happens in the background; pending records
are bounded (the excess is dropped and counted), a batch that Redis refuses is dropped and
counted, and the subscriber reconnects with backoff. Pub/sub delivers only to connected
subscribers: a router that was disconnected knows less for a while, as it would unshared (a
session's home itself always comes from the affinity store). On a Redis Cluster, `redis_url`'s
node carries both sides (a cluster broadcasts PUBLISH to every node).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .kv_index_shadow import ShadowKVIndex
from .redis_pipe import PipelinedRedis, RedisError as PipeRedisError
from .replicas import ReplicaRegistry
from .sessions import SessionTable
from .supervise import DEFAULT_BACKOFF

log = logging.getLogger("kvrouter.peer_share")


def share_channel(key_prefix: str, block_chars: int) -> str:
    return f"{key_prefix}peers:{block_chars}"


class PeerShare:
    def __init__(
        self,
        url: str,
        channel: str,
        *,
        index: ShadowKVIndex | None,
        table: SessionTable | None,
        known: Callable[[str], bool],
        clock: Callable[[], float] = time.monotonic,
        password: str | None = None,
        op_timeout_s: float = 0.25,
        flush_s: float = 0.01,
        max_pending: int = 4096,
        metrics: Any = None,
        registry: ReplicaRegistry | None = None,
        in_flight_refresh_s: float = 0.5,
        in_flight_stale_s: float = 2.0,
        max_peers: int = 256,
    ) -> None:
        self.index = index  # None: not shared (the exact index follows the replicas' KV events)
        self.table = table
        self.url = url
        self.channel = channel
        self.known = known
        self.clock = clock
        self.password = password
        self.op_timeout_s = op_timeout_s
        self.flush_s = flush_s
        self.max_pending = max_pending
        self.metrics = metrics  # a RouterMetrics, or None
        self.sender = uuid.uuid4().bytes[:8]
        self.subscribed = asyncio.Event()  # set while the subscription is live (tests wait on it)
        self._records: list[Any] = []  # replica, packed blocks, replica, packed blocks, ...
        self._homes: list[Any] = []  # session, home, tokens, ...
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._publisher: PipelinedRedis | None = None
        # In-flight sharing (None: off): this router's counts are read from the registry's views
        # (`in_flight`) when published; the others' land in each view's `peer_in_flight`.
        self.registry = registry
        self.in_flight_refresh_s = in_flight_refresh_s
        self.in_flight_stale_s = in_flight_stale_s
        self.max_peers = max_peers
        self._in_flight_dirty = False
        self._sent_in_flight = False  # the last counts published had a non-zero one
        # sender -> (when its last counts arrived, {replica: requests}), least recent first
        self._peers: dict[bytes, tuple[float, dict[str, int]]] = {}
        self._peer_totals: dict[str, int] = {}  # replica -> the sum over live peers
        if registry is not None:
            registry.on_in_flight = self.in_flight_changed

    # -- outgoing --------------------------------------------------------------------------------
    def _room(self) -> bool:
        if len(self._records) // 2 + len(self._homes) // 3 >= self.max_pending:
            self._count("dropped")
            return False
        self._wake.set()
        return True

    def recorded(self, replica: str, blocks: Sequence[int]) -> None:
        """This router recorded `blocks` on `replica` (an accepted request): publish it soon."""
        if self.index is not None and self._room():
            self._records += (replica, array("q", blocks).tobytes())

    def homed(self, session: str, home: str, tokens: int | None) -> None:
        """The affinity store holds `home` for `session`, whose context is `tokens` (None:
        unchanged): publish it soon."""
        if self.table is not None and self._room():
            self._homes += (session, home, -1 if tokens is None else tokens)

    def in_flight_changed(self) -> None:
        """This router's in-flight count on a replica changed: publish its counts soon."""
        if not self._in_flight_dirty:
            self._in_flight_dirty = True
            self._wake.set()

    def _own_in_flight(self) -> list[Any]:
        """This router's non-zero counts, `[replica, requests, ...]`."""
        assert self.registry is not None
        out: list[Any] = []
        for view in self.registry.snapshot().replicas:
            if view.in_flight:
                out += (view.id, view.in_flight)
        self._sent_in_flight = bool(out)
        return out

    async def _publish_loop(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.flush_s)  # let the records of this moment join one message
            self._wake.clear()
            records, homes = self._records, self._homes
            self._records, self._homes = [], []
            in_flight = None
            if self._in_flight_dirty and self.registry is not None:
                self._in_flight_dirty = False
                in_flight = self._own_in_flight()
            if records or homes or in_flight is not None:
                await self._publish(records, homes, in_flight)

    async def _in_flight_loop(self) -> None:
        """Publish this router's counts again while any is non-zero (the others drop counts
        `in_flight_stale_s` old), and drop the others' stale ones."""
        while True:
            await asyncio.sleep(self.in_flight_refresh_s)
            if self._sent_in_flight:
                self.in_flight_changed()
            self.expire_peers()

    async def _publish(self, records: list[Any], homes: list[Any],
                       in_flight: list[Any] | None = None) -> None:
        n = len(records) // 2 + len(homes) // 3
        assert self._publisher is not None
        # no counts: the three members that routers from before in-flight sharing read
        message = [self.sender, records, homes] if in_flight is None else \
            [self.sender, records, homes, in_flight]
        try:
            await self._publisher.execute(b"PUBLISH", self.channel, msgpack.packb(message))
        except (PipeRedisError, OSError, TimeoutError) as err:
            log.debug("peer share: publish failed: %s", err)
            self._count("publish_errors")
            self._count("dropped", n)
            return
        self._count("published", n)

    # -- incoming --------------------------------------------------------------------------------
    def apply(self, payload: bytes) -> int:
        """Apply another router's batch to the index and the session table; returns the records
        applied."""
        try:
            message = msgpack.unpackb(payload)
            if not isinstance(message, list) or len(message) not in (3, 4):
                raise ValueError("not [sender, records, homes, in_flight]")
            sender, records, homes = message[:3]
            if sender == self.sender:
                return 0
            if len(records) % 2 or len(homes) % 3:
                raise ValueError("records or homes cut short")
            counts = self._read_in_flight(message[3]) if len(message) == 4 else None
            applied = 0
            if self.index is not None:
                for i in range(0, len(records), 2):
                    replica, packed = records[i], records[i + 1]
                    if isinstance(replica, str) and self.known(replica):
                        blocks = array("q")
                        blocks.frombytes(packed)
                        self.index.record(replica, blocks)
                        applied += 1
            if self.table is not None:
                now = self.clock()
                for i in range(0, len(homes), 3):
                    session, home, tokens = homes[i], homes[i + 1], homes[i + 2]
                    if isinstance(session, str) and isinstance(home, str) and self.known(home):
                        self.table.touch(session, now, home=home, tokens=tokens if tokens >= 0 else None)
                        applied += 1
            if counts is not None and isinstance(sender, bytes):
                self._peer_in_flight(sender, counts)
        except (ValueError, TypeError, msgpack.UnpackException) as err:
            log.debug("peer share: bad message ignored: %s", err)
            self._count("bad_messages")
            return 0
        self._count("received", applied)
        return applied

    def _read_in_flight(self, raw: Any) -> dict[str, int] | None:
        """A message's in-flight counts, on the replicas this router knows (None: none sent)."""
        if raw is None or self.registry is None:
            return None
        if not isinstance(raw, list) or len(raw) % 2:
            raise ValueError("in-flight counts cut short")
        counts: dict[str, int] = {}
        for i in range(0, len(raw), 2):
            replica, requests = raw[i], raw[i + 1]
            if not isinstance(replica, str) or not isinstance(requests, int) or requests < 0:
                raise ValueError("not [replica, requests, ...]")
            if self.known(replica):
                counts[replica] = requests
        return counts

    def _peer_in_flight(self, sender: bytes, counts: dict[str, int]) -> None:
        """`sender`'s counts replace its earlier ones."""
        old = self._peers.pop(sender, None)
        if old is None and len(self._peers) >= self.max_peers:  # bounded: the least recent goes
            self._forget_peer(next(iter(self._peers)))
        self._peers[sender] = (self.clock(), counts)
        self._add_totals(old[1] if old is not None else {}, counts)

    def _forget_peer(self, sender: bytes) -> None:
        _, counts = self._peers.pop(sender)
        self._add_totals(counts, {})

    def expire_peers(self) -> None:
        """Drop the counts of routers silent for `in_flight_stale_s` (gone, or cut off)."""
        limit = self.clock() - self.in_flight_stale_s
        stale = [sender for sender, (at, _) in self._peers.items() if at < limit]
        for sender in stale:
            self._forget_peer(sender)

    def _add_totals(self, old: dict[str, int], new: dict[str, int]) -> None:
        """Replace one peer's `old` counts by `new` in the totals and in the registry's views."""
        assert self.registry is not None
        totals = self._peer_totals
        for replica in old.keys() | new.keys():
            total = totals.get(replica, 0) - old.get(replica, 0) + new.get(replica, 0)
            if total > 0:
                totals[replica] = total
            else:
                totals.pop(replica, None)
            self.registry.set_peer_in_flight(replica, max(0, total))

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
                log.warning("peer share: subscription lost (%s); again in %.1fs", err, delay)
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
        # The affinity store's kind of connection: a cancelled call leaves it usable (redis-py's
        # client could hang a cancelled PUBLISH, and with it the router's shutdown).
        self._publisher = PipelinedRedis(self.url, timeout=self.op_timeout_s, password=self.password)
        self._tasks = [spawn("peer-share-publish", self._publish_loop),
                       spawn("peer-share-subscribe", self._subscribe_loop)]
        if self.registry is not None:
            self._tasks.append(spawn("peer-share-in-flight", self._in_flight_loop))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            # redis-py's get_message can swallow a cancel that lands as its read times out, and
            # the loop reads on: cancel again until the task has ended
            while not task.done():
                await asyncio.wait([task], timeout=0.1)
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._publisher is not None:
            with contextlib.suppress(Exception):
                await self._publisher.aclose()
            self._publisher = None

    def _count(self, what: str, n: int = 1) -> None:
        if self.metrics is not None and n:
            self.metrics.peer_share.labels(what).inc(n)
