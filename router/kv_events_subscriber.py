"""Follow every replica's SGLang KV-event stream (ZMQ SUB) into the exact KV index.

One task per replica. Batches carry a sequence number (0, 1, ... per publisher): a jump means
batches were dropped (PUB drops at its high-water mark, or we were slow to join). Then the
missed batches are asked from the replica's replay socket; if they are not all there (no replay
socket, buffer already overwritten, timeout), the replica's index is dropped, because an index
that misses a BlockRemoved would route to a cache that is gone. A sequence that goes backwards
is a restarted replica, whose cache is new as well.

Each subscription runs supervised (router/supervise.py): after an unexpected error the replica's
index is dropped and the subscription starts again, refilled from the replay socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from yarl import URL

from ..sglang_protocol.kv_events import (
    KVEventBatch,
    KVEventDecodeError,
    decode_batch,
    decode_message,
    replay_request,
    split_topic,
    unpack_seq,
)
from ..metrics.router_metrics import RouterMetrics
from .config import KVEventsConfig
from .kv_index_exact import ExactKVIndex
from .supervise import spawn

log = logging.getLogger("kvrouter")

REPLAY_TIMEOUT_S = 2.0  # per reply frame; a silent replay socket must not stall the stream
RCVHWM = 100_000  # SGLang's default send high-water mark


@dataclass(slots=True)
class _Stream:
    next_seq: int | None = None  # None until the first batch
    replayed_from: int = 0  # seqs in [replayed_from, next_seq) came from a replay: duplicates


class KVEventSubscriber:
    def __init__(self, index: ExactKVIndex, config: KVEventsConfig, metrics: RouterMetrics) -> None:
        self.index = index
        self.config = config
        self.metrics = metrics
        self._topic = config.topic.encode()
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping: set[asyncio.Task[None]] = set()

    def endpoints(self, replica: str) -> tuple[str, str | None]:
        """(PUB endpoint, replay endpoint or None) of a replica."""
        override = self.config.endpoints.get(replica)
        if override is not None:
            return override.endpoint, override.replay_endpoint
        host = URL(replica).raw_host or "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"  # IPv6 literal
        replay = self.config.replay_port
        return (f"tcp://{host}:{self.config.port}",
                f"tcp://{host}:{replay}" if replay is not None else None)

    # -- lifecycle (on the event loop) ------------------------------------------------------------
    def start(self, replicas: Iterable[str]) -> None:
        self._ctx = zmq.asyncio.Context()
        for replica in replicas:
            self.add(replica)

    def add(self, replica: str) -> None:
        if self._ctx is None or replica in self._tasks:
            return  # not started yet: start() subscribes to every registered replica
        self._tasks[replica] = spawn(  # a crashed subscriber resubscribes and replays
            "kv-events", functools.partial(self._follow, replica), metrics=self.metrics,
            detail=replica,
        )

    def remove(self, replica: str) -> None:
        task = self._tasks.pop(replica, None)
        if task is not None:
            task.cancel()  # its socket closes in the task; close() waits for it
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)
        self.index.forget(replica)

    async def close(self) -> None:
        tasks = [*self._tasks.values(), *self._stopping]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # -- one replica ------------------------------------------------------------------------------
    async def _follow(self, replica: str) -> None:
        assert self._ctx is not None
        endpoint, replay = self.endpoints(replica)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RCVHWM)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        sub.connect(endpoint)  # ZMQ reconnects by itself while the replica is down
        stream = _Stream()
        try:
            if replay is not None:
                # Subscribed first, then the history: batches published meanwhile arrive on the
                # SUB socket and are skipped as replay duplicates. After a crash (the index was
                # dropped) this is what refills it, without waiting for the next batch.
                await self._catch_up(replica, replay, stream, 0, gap=False)
            while True:
                frames = await sub.recv_multipart()
                try:
                    topic, seq, batch = decode_message(frames)
                except KVEventDecodeError as err:
                    log.warning("kv events from %s: dropped undecodable message: %s", replica, err)
                    continue  # its seq is skipped: the next batch sees a gap and replays it
                if self._topic and split_topic(topic)[0] != self._topic:
                    continue  # a longer topic that merely starts with ours
                await self._on_batch(replica, replay, stream, seq, batch)
        except Exception:
            # What it knew may be incomplete now; the supervisor logs the crash and restarts.
            self.index.forget(replica)
            raise
        finally:
            sub.close(linger=0)

    async def _on_batch(
        self, replica: str, replay: str | None, stream: _Stream, seq: int, batch: KVEventBatch
    ) -> None:
        if stream.next_seq is not None and seq < stream.next_seq:
            if seq >= stream.replayed_from:
                return  # already applied from a replay
            log.info("kv events from %s: sequence restarted at %d", replica, seq)
            self.index.forget(replica)
            stream.next_seq = None
        if stream.next_seq is None:
            if seq > 0 and replay is not None:
                await self._catch_up(replica, replay, stream, 0, gap=False)  # history, best effort
        elif seq > stream.next_seq:
            self.metrics.kv_events_gaps.labels(replica).inc()
            await self._catch_up(replica, replay, stream, stream.next_seq, gap=True)
        if stream.next_seq is not None and seq < stream.next_seq:
            return  # the replay covered it
        self._apply(replica, batch)
        stream.next_seq = seq + 1
        stream.replayed_from = stream.next_seq

    async def _catch_up(
        self, replica: str, replay: str | None, stream: _Stream, start: int, *, gap: bool
    ) -> None:
        """Apply the replayed batches from `start`; after a gap the replica's index is dropped
        unless they begin exactly at `start` (anything missing could be a removal)."""
        batches = await self._replay(replay, start) if replay is not None else []
        if gap and (not batches or batches[0][0] != start):
            log.warning("kv events from %s: batches from %d lost; index dropped", replica, start)
            self.index.forget(replica)
        for i, (seq, batch) in enumerate(batches):
            self._apply(replica, batch)
            stream.next_seq = seq + 1
            if i % 256 == 255:
                await asyncio.sleep(0)  # a long replay must not starve the requests
        stream.replayed_from = start

    async def _replay(self, endpoint: str, start: int) -> list[tuple[int, KVEventBatch]]:
        """Buffered batches with seq >= start from a replay ROUTER socket; [] on failure."""
        assert self._ctx is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, KVEventBatch]] = []
        try:
            dealer.connect(endpoint)
            await dealer.send_multipart([b"", replay_request(start)])
            while True:
                if not await dealer.poll(REPLAY_TIMEOUT_S * 1000):
                    log.warning("kv events: replay from %s timed out", endpoint)
                    return []
                frames = await dealer.recv_multipart()
                if len(frames) != 3:
                    return []
                seq = unpack_seq(frames[1])
                if seq == -1:
                    return out
                if seq >= start and (not out or seq == out[-1][0] + 1):
                    out.append((seq, decode_batch(frames[2])))
                elif seq >= start:
                    return out  # a hole inside the replay: keep the contiguous part
        except (zmq.ZMQError, KVEventDecodeError) as err:
            log.warning("kv events: replay from %s failed: %s", endpoint, err)
            return []
        finally:
            dealer.close(linger=0)

    def _apply(self, replica: str, batch: KVEventBatch) -> None:
        self.index.apply(replica, batch)
        self.metrics.kv_events.labels(replica).inc(len(batch.events))
