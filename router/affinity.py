"""Affinity stores: session -> home replica and the session's in-flight count.

`MemoryAffinityStore` (the default) is the local `SessionTable`, through `LocalAffinity` (its
synchronous form, which the cluster simulator calls directly). `RedisAffinityStore` shares homes
and in-flight counts between router instances. In-flight counts are kept per router, in a field
`r:<router id>` of the session hash, and only count while that router's heartbeat (a sorted set
of routers, one per key bucket) is younger than `lease_s`: a router that dies cannot leak counts.
Every update is one Lua script (atomic). If Redis fails, requests keep flowing on the local table,
`degraded` is set, and Redis is retried after `retry_after_s`.

Routing calls the store through `router/placement.py`: `begin` and `move` are a placement's
`confirm_home`, made after the chosen replica's in-flight slot is already reserved.

Both are bounded: the local table holds `max_sessions` sessions at most, and in Redis each of the
`buckets` key buckets (router/affinity_lua.py) holds ceil(max_sessions / buckets) at most; the
least recently used idle session goes first, one with a request in flight never (if a bucket has
only busy sessions it stays over its cap until one is idle). So clients inventing session ids
grow neither router memory nor Redis without bound. Evictions are reported to `on_evict`.

Redis Cluster: every script is sent keys of one bucket, and a bucket's keys share one hash tag,
so every call touches one slot (router/affinity_lua.py says how). With `cluster=True` calls go
through redis-py's cluster client (router/redis_cluster.py), which routes each to its slot's node.

A request makes one round trip before its routing decision (`acquire`: read the session and
count the request), one more only when it gives the session its first home or a new one
(`begin`), and releases its count after the response, off the request's path (`end`), batched
with the other releases of that moment (one call per bucket in the batch). On a single node all
calls share one pipelined connection (`redis_pipe.py`), so Redis runs them in the order they were
sent. A call that fails may still have run: the sessions it touched get this router's count set
outright on the next heartbeat. (On a cluster, redis-py may spread concurrent calls to one node
over several connections: that order, and so this correction, is best effort there.)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from ..policies.domain import SessionView
from . import affinity_lua as lua
from .redis_cluster import ClusterRedis
from .redis_pipe import PipelinedRedis, Script
from .sessions import DEFAULT_MAX_SESSIONS, SessionTable
from .supervise import spawn

log = logging.getLogger("kvrouter.affinity")

# Decrements (or counts set) in one call at most (one Redis command however many requests ended).
_END_BATCH = 256
CLUSTER_BUCKETS = 64  # key buckets on a Redis Cluster unless configured


class AffinityStore(Protocol):
    table: SessionTable
    degraded: bool

    async def get(self, key: str) -> SessionView: ...  # read only
    # One request of a session: acquire (read + count it), begin (its replica is chosen; may set
    # the home; returns the session's home), end (done; always paired with acquire).
    async def acquire(self, key: str) -> SessionView: ...
    async def begin(self, key: str, home: str | None, *, force: bool, tokens: int) -> str | None: ...
    async def end(self, key: str) -> None: ...
    async def move(self, key: str, home: str) -> None: ...
    async def start(self) -> None: ...
    async def close(self) -> None: ...


class LocalAffinity:
    """Process-local affinity, synchronous: the session table under a clock. The cluster
    simulator calls it directly (in virtual time); `MemoryAffinityStore` is its async face."""

    def __init__(self, table: SessionTable, clock: Callable[[], float] = time.monotonic) -> None:
        self.table = table
        self.clock = clock

    def get(self, key: str) -> SessionView:
        return self.table.view(key)

    def acquire(self, key: str) -> SessionView:
        view = self.table.view(key)
        self.table.acquire(key, self.clock())
        return view

    def begin(self, key: str, home: str | None, *, force: bool, tokens: int) -> str | None:
        return self.table.assign(key, home, force=force, tokens=tokens, now=self.clock())

    def end(self, key: str) -> None:
        self.table.release(key, self.clock())

    def move(self, key: str, home: str) -> None:
        self.table.set_home(key, home, self.clock())


class MemoryAffinityStore:
    """Process-local affinity: the embedded default (one router process). The `AffinityStore`
    port over `LocalAffinity`; nothing here awaits."""

    degraded = False

    def __init__(self, table: SessionTable, clock: Callable[[], float] = time.monotonic) -> None:
        self.table = table
        self.clock = clock
        self.sync = LocalAffinity(table, clock)

    async def get(self, key: str) -> SessionView:
        return self.sync.get(key)

    async def acquire(self, key: str) -> SessionView:
        return self.sync.acquire(key)

    async def begin(self, key: str, home: str | None, *, force: bool, tokens: int) -> str | None:
        return self.sync.begin(key, home, force=force, tokens=tokens)

    async def end(self, key: str) -> None:
        self.sync.end(key)

    async def move(self, key: str, home: str) -> None:
        self.sync.move(key, home)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None


class RedisAffinityStore:
    """Homes and in-flight counts shared by every router on one Redis (or one Redis Cluster)."""

    def __init__(
        self,
        table: SessionTable,
        url: str,
        *,
        key_prefix: str = "kvrouter:",
        ttl_s: int = 3600,
        lease_s: float = 10.0,
        op_timeout_s: float = 0.25,
        retry_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        on_error: Callable[[str], None] | None = None,
        password: str | None = None,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        buckets: int | None = None,
        cluster: bool = False,
        on_evict: Callable[[int], None] | None = None,
        metrics: Any = None,
    ) -> None:
        self.metrics = metrics  # a RouterMetrics: counts restarts of the supervised heartbeat
        self.table = table
        self.local = MemoryAffinityStore(table, clock)
        self.router_id = uuid.uuid4().hex[:12]
        self.prefix = key_prefix
        if buckets is None:  # a cluster spreads its buckets over nodes; one node batches better with one
            buckets = CLUSTER_BUCKETS if cluster else 1
        self.keys = lua.BucketKeys(key_prefix, buckets)
        self.bucket_cap = -(-max_sessions // buckets)  # sessions per bucket at most
        self.ttl_s = ttl_s
        self.lease_ms = int(lease_s * 1000)
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.on_error = on_error or (lambda op: None)
        self.on_evict = on_evict or (lambda n: None)
        self.evicted = 0  # sessions this router's calls evicted from Redis
        self.degraded = False
        self._down_until = 0.0
        self._acquired: dict[str, int] = {}  # sessions whose count Redis holds for this router
        # Sessions whose count in Redis is unknown: a call counting or releasing one of their
        # requests failed after it may have run. The heartbeat sets them outright (_reconcile).
        self._uncertain: set[str] = set()
        self._reading: dict[str, int] = {}  # sessions with an acquire whose reply is pending
        self._releasing: set[str] = set()  # sessions in the release batch on the wire
        self._homeless: set[str] = set()  # sessions Redis had no home for at their last acquire
        self._to_release: dict[str, int] = {}  # decrements not sent yet (the flusher's next batch)
        self._flusher: asyncio.Task[None] | None = None  # sends them, one batch per round trip
        self._closed = False
        # Single node: one pipelined connection that calls from all requests share
        # (router/redis_pipe.py). Cluster: redis-py's cluster client routes each call to its slot.
        self.redis: PipelinedRedis | ClusterRedis
        if cluster:
            self.redis = ClusterRedis(url, timeout=op_timeout_s, password=password or None)
        else:
            self.redis = PipelinedRedis(url, timeout=op_timeout_s, password=password or None)
        self._get, self._claim = Script(lua.GET), Script(lua.CLAIM)
        self._end, self._beat = Script(lua.END), Script(lua.HEARTBEAT)
        self._set_counts = Script(lua.SET_COUNTS)
        self._heartbeat_task: asyncio.Task[None] | None = None

    def _key(self, session: str) -> str:
        return self.keys.session(session)

    def _session_keys(self, session: str) -> list[str]:
        """The keys of one session's script call: its hash, its bucket's routers and LRU index."""
        b = self.keys.bucket(session)
        return [self.keys.session(session, b), self.keys.routers[b], self.keys.lru[b]]

    def _by_bucket(self, sessions: list[str]) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for session in sessions:
            groups.setdefault(self.keys.bucket(session), []).append(session)
        return groups

    def _count_evicted(self, n: int) -> None:
        if n:
            self.evicted += n
            self.on_evict(n)

    def _usable(self) -> bool:
        return self.clock() >= self._down_until

    def _failed(self, op: str, err: Exception) -> None:
        if not self.degraded:
            log.warning("redis %s failed (%s); routing on local state", op, type(err).__name__)
        self.degraded = True
        self._down_until = self.clock() + self.retry_after_s
        self.on_error(op)

    def _ok(self) -> None:
        if self.degraded:
            log.info("redis is back; affinity shared again")
        self.degraded = False

    async def _read(self, key: str, op: str, count: bool) -> SessionView | None:
        """The session from Redis (None if Redis failed); `count`: also count this request."""
        if not self._usable():
            return None
        if count:
            self._reading[key] = self._reading.get(key, 0) + 1
        try:
            args: list[object] = [self.lease_ms, self.ttl_s, self.bucket_cap]
            if count:
                args.append(self.router_id)
            home, total, evicted = await self.redis.evalsha(self._get, self._session_keys(key), args)
            self._ok()
        except Exception as err:  # any Redis failure degrades, never fails a request
            self._failed(op, err)
            if count:
                self._uncertain.add(key)  # the script may have run: Redis may count it
            return None
        finally:
            if count:
                left = self._reading.pop(key) - 1
                if left:
                    self._reading[key] = left
        self._count_evicted(evicted)
        home = home.decode() if isinstance(home, bytes) else None
        if home is not None:
            self.table.touch(key, self.clock(), home=home)
        return SessionView(key, home, int(total))

    async def get(self, key: str) -> SessionView:
        view = await self._read(key, "get", count=False)
        return view if view is not None else await self.local.get(key)

    async def acquire(self, key: str) -> SessionView:
        local = await self.local.acquire(key)
        read = asyncio.ensure_future(self._read(key, "acquire", count=True))
        try:
            view = await asyncio.shield(read)  # a cancelled request must not leave a count behind
        except asyncio.CancelledError:
            self.table.release(key, self.clock())
            read.add_done_callback(lambda done: self._give_back_abandoned(key, done))
            raise
        if view is None:
            self._homeless.add(key)  # unknown: claim the home at begin if Redis is back by then
            return local
        self._acquired[key] = self._acquired.get(key, 0) + 1
        if view.home is None:
            self._homeless.add(key)
        else:
            self._homeless.discard(key)
        return view

    async def _claim_home(self, key: str, home: str, force: bool) -> str | None:
        """Store `home` as the session's home (`force`: even over another); returns the stored one."""
        args = [self.ttl_s, home, int(force), self.lease_ms, self.bucket_cap]
        shared, evicted = await self.redis.evalsha(self._claim, self._session_keys(key), args)
        self._count_evicted(evicted)
        return shared.decode() if isinstance(shared, bytes) else None

    async def begin(self, key: str, home: str | None, *, force: bool, tokens: int) -> str | None:
        local_home = await self.local.begin(key, home, force=force, tokens=tokens)
        # Redis already has this session's home unless it had none at acquire: nothing to send.
        if home is None or not (force or key in self._homeless) or not self._usable():
            return local_home
        try:
            shared_home = await self._claim_home(key, home, force)
            self._ok()
        except Exception as err:
            self._failed("begin", err)
            return local_home
        self._homeless.discard(key)
        if shared_home is not None and shared_home != local_home:
            self.table.touch(key, self.clock(), home=shared_home)  # another router won
        return shared_home or local_home

    async def end(self, key: str) -> None:
        """Local count at once; the shared one in the background (the response is not held
        for a Redis round trip). `settle()` waits for those."""
        await self.local.end(key)
        held = self._acquired.get(key, 0)
        if held <= 1:
            self._acquired.pop(key, None)
            self._homeless.discard(key)
        else:
            self._acquired[key] = held - 1
        if held > 0:  # else acquired while Redis was down: nothing to give back there
            self._spawn_release(key)

    def _give_back_abandoned(self, key: str, read: asyncio.Future[SessionView | None]) -> None:
        """The request whose acquire was cancelled: if Redis counted it after all, uncount it."""
        if not read.cancelled() and read.exception() is None and read.result() is not None:
            self._spawn_release(key)

    def _spawn_release(self, key: str) -> None:
        if self._closed:
            return  # no heartbeat any more: this router's counts expire with its lease
        self._to_release[key] = self._to_release.get(key, 0) + 1
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush_releases(), name="redis-release")

    async def _flush_releases(self) -> None:
        """Send the pending decrements, a batch per round trip: under load, the requests that
        ended while one batch was on the wire share the next commands (one per bucket)."""
        try:
            while self._to_release:
                batch = dict(itertools.islice(self._to_release.items(), _END_BATCH))
                for key in batch:
                    del self._to_release[key]
                self._releasing.update(batch)
                try:
                    await self._send_end(batch)
                    self._ok()
                except Exception as err:
                    self._failed("end", err)
                    # Redis may or may not have applied them: the heartbeat sets these
                    # sessions' counts outright once Redis answers again.
                    self._uncertain.update(batch)
                finally:
                    self._releasing.difference_update(batch)
        finally:
            self._flusher = None

    async def _send_end(self, counts: dict[str, int]) -> None:
        calls = [
            self.redis.evalsha(self._end, [self.keys.session(k, b) for k in sessions],
                               [self.router_id, *(counts[k] for k in sessions)])
            for b, sessions in self._by_bucket(list(counts)).items()
        ]
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise outcome

    async def settle(self) -> None:
        """Wait until every release so far has reached Redis (or failed)."""
        while self._flusher is not None:
            await asyncio.shield(self._flusher)

    async def _reconcile(self) -> None:
        """Set this router's count of each uncertain session to what it knows: the requests
        Redis counted for it that have not ended. Calls run on Redis in the order they were
        sent (one connection), so anything sent earlier is overridden, and anything later
        applies on top; sessions with an acquire reply or a release batch still on the way
        wait for the next heartbeat (their outcome would change what this router knows)."""
        ready = [k for k in self._uncertain if k not in self._reading and k not in self._releasing]
        for b, sessions in self._by_bucket(ready).items():
            for start in range(0, len(sessions), _END_BATCH):
                batch = sessions[start:start + _END_BATCH]
                for key in batch:
                    self._to_release.pop(key, None)  # included: the count below has these ends
                counts = [self._acquired.get(key, 0) for key in batch]
                # If this call fails, the sessions stay uncertain and are set again next time.
                await self.redis.evalsha(self._set_counts,
                                         [self.keys.lru[b], *(self.keys.session(k, b) for k in batch)],
                                         [self.router_id, self.ttl_s, *counts])
                self._uncertain.difference_update(batch)

    async def move(self, key: str, home: str) -> None:
        await self.local.move(key, home)
        if not self._usable():
            return
        try:
            await self._claim_home(key, home, force=True)
            self._ok()
        except Exception as err:
            self._failed("move", err)

    async def _heartbeat(self) -> None:
        """Renew this router's lease in every bucket (each bucket keeps its own, see
        router/affinity_lua.py), then set the counts left uncertain by failed calls."""
        try:
            beats = [self.redis.evalsha(self._beat, [routers], [self.router_id, self.lease_ms])
                     for routers in self.keys.routers]
            for outcome in await asyncio.gather(*beats, return_exceptions=True):
                if isinstance(outcome, BaseException):
                    raise outcome
            self._ok()
            await self._reconcile()
        except Exception as err:
            self._failed("heartbeat", err)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            await self._heartbeat()

    async def start(self) -> None:
        await self._heartbeat()  # this router's counts only count once it has a heartbeat
        self._heartbeat_task = spawn("redis-heartbeat", self._heartbeat_loop, metrics=self.metrics)

    async def close(self) -> None:
        await self.settle()
        self._closed = True
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            try:
                await self._heartbeat_task
            except asyncio.CancelledError:
                pass
        await self.redis.aclose()
