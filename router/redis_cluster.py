"""The affinity store's calls on a Redis Cluster (or Valkey cluster), through redis-py's asyncio
`RedisCluster`: it learns which node serves which slot, sends each script to the node of its
keys' slot and follows MOVED/ASK redirections. Same interface as `PipelinedRedis` (the
single-node connection), so the store does not care which one it has.

`url` is any node of the cluster (redis:// or rediss://, as redis-py reads it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from .redis_pipe import Script


class ClusterRedis:
    def __init__(self, url: str, *, timeout: float, password: str | None = None) -> None:
        self.timeout = timeout
        extra: dict[str, Any] = {"password": password} if password is not None else {}
        self._client = RedisCluster.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, **extra
        )
        self._ready = asyncio.Lock()
        self._initialized = False

    async def _initialize(self) -> None:
        """Learn the slot map once before calls go out concurrently: redis-py refreshes the
        node table when calls race its first initialization, which can drop connections that
        are still handshaking."""
        async with self._ready:
            if not self._initialized:
                await self._client.initialize()
                self._initialized = True

    async def execute(self, *args: object) -> Any:
        """One command, routed by its key; at most `timeout` (redirections included)."""
        async with asyncio.timeout(self.timeout):
            if not self._initialized:
                await self._initialize()
            return await self._client.execute_command(*args)

    async def evalsha(self, script: Script, keys: list[str], args: list[object]) -> Any:
        """Run `script` on the node serving `keys` (all of one slot: redis-py refuses others)."""
        async with asyncio.timeout(self.timeout):
            if not self._initialized:
                await self._initialize()
            try:
                return await self._client.evalsha(script.sha.decode(), len(keys), *keys, *args)
            except NoScriptError:  # first call on this node: EVAL caches it there
                return await self._client.eval(script.source.decode(), len(keys), *keys, *args)

    async def aclose(self) -> None:
        await self._client.aclose()
