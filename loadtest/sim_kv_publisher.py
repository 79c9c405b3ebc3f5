"""KV-cache events of a simulated replica, published the way SGLang's ``ZmqEventPublisher`` does.

The replica model's radix cache calls a *kv_sink* (``stored`` / ``removed`` / ``cleared``) with its
own page keys (blake2b chains that include the cache namespace). This module is that sink: it
translates each page into SGLang's event block hash (``sglang_protocol/block_hash.py``: SHA-256 chained on
the parent page's digest, first 8 bytes as a signed int64), buffers the events of one model step,
and :meth:`SimKVPublisher.flush` sends them as one ``KVEventBatch`` on a ZMQ PUB socket as
``[topic, seq (8 bytes big-endian, from 0), msgpack payload]``.

Fidelity notes (see ``docs/sglang-fidelity.md`` section 5):

* Device pages are ``medium="GPU"``; pages the HiCache model moves to host are announced as
  ``BlockRemoved(GPU)`` + ``BlockStored(CPU_PINNED)`` (SGLang keeps a write-through host copy and
  so would announce the host copy earlier; the set of hashes per medium after each batch is what
  the model holds).
* A parent-linked run of pages stored in one call becomes one ``BlockStored`` with several hashes
  and the concatenated token ids (block_size = page size), as SGLang's recorder coalesces.
  ``BlockRemoved`` carries all pages removed by one call.
* Requests without ``extra_key``/``cache_salt``/LoRA hash from the root with no prior digest,
  exactly like SGLang. Other namespaces seed the chain with ``sha256(namespace)`` so that they
  never collide; SGLang's own namespace-seeded event hash was not found in its source, so those
  values are *not* SGLang's (documented approximation).
* Endpoint semantics follow SGLang: the PUB socket binds when the endpoint contains ``*``,
  ``::``, ``0.0.0.0`` or is ``ipc://``/``inproc://``, and connects otherwise. With
  ``replay_endpoint`` a ROUTER socket answers ``[identity, b"", start_seq]`` with every buffered
  batch ``[identity, b"", seq, payload]`` and then ``[identity, b"", END_SEQ, b""]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from array import array
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from ..sglang_protocol.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    encode_batch,
    pack_seq,
    unpack_seq,
)
from ..sglang_protocol.block_hash import hash_hex_to_int64, namespace_prior, page_hash_hex

log = logging.getLogger("kvrouter.sim")

DEFAULT_ENDPOINT = "tcp://*:5557"


def _should_bind(endpoint: str) -> bool:
    # ZmqEventPublisher: bind for wildcard / local transports, else connect.
    return (
        "*" in endpoint
        or "::" in endpoint
        or "0.0.0.0" in endpoint
        or endpoint.startswith(("ipc://", "inproc://"))
    )


class KVHashTracker:
    """Page key -> SGLang block hash, plus which media each page is on; no I/O.

    Also usable on its own (tests, the cluster simulator) as a kv_sink that only collects events.
    """

    def __init__(self, page_size: int, default_namespace: str = "") -> None:
        self.page_size = page_size
        self.default_namespace = default_namespace
        self._hex: dict[int, str] = {}
        self._tokens: dict[int, array] = {}
        self._media: dict[int, set[str]] = {}
        self._root_ns: dict[int, str] = {}
        self._maybe_dead: set[int] = set()
        self.pending: list[KVEvent] = []

    # -- namespaces --------------------------------------------------------------------------
    def note_root(self, first_page_key: int, namespace: str) -> None:
        """Tell the tracker which namespace a root page (parent None) belongs to."""
        if namespace != self.default_namespace:
            self._root_ns[first_page_key] = namespace

    def block_hash(self, key: int) -> int | None:
        hx = self._hex.get(key)
        return None if hx is None else hash_hex_to_int64(hx)

    def hashes_on(self, medium: str) -> set[int]:
        """SGLang hashes of the pages this tracker believes are on `medium`."""
        return {hash_hex_to_int64(self._hex[k]) for k, m in self._media.items() if medium in m}

    # -- kv_sink duck type ---------------------------------------------------------------------
    def stored(self, pages: list[tuple[int, int | None, Sequence[int] | None]], medium: str) -> None:
        run: BlockStored | None = None
        prev_key: int | None = None
        for key, parent, tokens in pages:
            hx = self._hex.get(key)
            if tokens is not None:
                tok = array("I", tokens)
                self._tokens[key] = tok
            else:
                tok = self._tokens.get(key)
            if hx is None:
                if tok is None:
                    log.debug("kv events: page %x stored without token ids; not published", key)
                    prev_key = None
                    run = None
                    continue
                if parent is None:
                    ns = self._root_ns.get(key)
                    prior = namespace_prior(ns) if ns is not None else None
                else:
                    prior = self._hex.get(parent)
                    if prior is None:
                        log.debug("kv events: parent of page %x unknown; not published", key)
                        prev_key = None
                        run = None
                        continue
                hx = page_hash_hex(tok, prior)
                self._hex[key] = hx
            self._media.setdefault(key, set()).add(medium)
            self._maybe_dead.discard(key)
            bh = hash_hex_to_int64(hx)
            if run is not None and parent is not None and parent == prev_key:
                run.block_hashes.append(bh)
                run.token_ids.extend(tok)
            else:
                phex = self._hex.get(parent) if parent is not None else None
                run = BlockStored(
                    block_hashes=[bh],
                    parent_block_hash=hash_hex_to_int64(phex) if phex else None,
                    token_ids=list(tok),
                    block_size=self.page_size,
                    lora_id=None,
                    medium=medium,
                )
                self.pending.append(run)
            prev_key = key

    def removed(self, keys: list[int], medium: str) -> None:
        hashes = []
        for key in keys:
            media = self._media.get(key)
            if media is None or medium not in media:
                continue
            media.discard(medium)
            hashes.append(hash_hex_to_int64(self._hex[key]))
            if not media:
                self._maybe_dead.add(key)  # may come back on another medium in this same step
        if hashes:
            self.pending.append(BlockRemoved(block_hashes=hashes, medium=medium))

    def cleared(self) -> None:
        self._hex.clear()
        self._tokens.clear()
        self._media.clear()
        self._maybe_dead.clear()
        self.pending.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """The events since the last take; forgets pages that are on no medium any more."""
        for key in self._maybe_dead:
            if not self._media.get(key):
                self._media.pop(key, None)
                self._hex.pop(key, None)
                self._tokens.pop(key, None)
                self._root_ns.pop(key, None)
        self._maybe_dead.clear()
        events, self.pending = self.pending, []
        return events


class SimKVPublisher(KVHashTracker):
    """kv_sink + ZMQ PUB (+ optional ROUTER replay), one instance per simulated replica."""

    def __init__(
        self,
        page_size: int,
        *,
        endpoint: str = DEFAULT_ENDPOINT,
        topic: str = "",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10000,
        hwm: int = 100000,
        dp_rank: int = 0,
        default_namespace: str = "",
    ) -> None:
        super().__init__(page_size, default_namespace)
        self.topic = topic.encode("utf-8")
        self.dp_rank = dp_rank
        self.seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, buffer_steps))
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if _should_bind(endpoint):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self._replay: Any = None
        self.replay_endpoint: str | None = None
        self._replay_task: asyncio.Task | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    def descriptor(self) -> dict[str, Any]:
        return {
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.topic.decode("utf-8"),
        }

    def start(self) -> None:
        """Start serving replay requests (needs a running event loop)."""
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def flush(self, ts: float | None = None) -> int | None:
        """Publish the events gathered since the last flush as one batch; returns its seq."""
        events = self.take()
        if not events:
            return None
        batch = KVEventBatch(ts=time.time() if ts is None else ts, events=events, attn_dp_rank=self.dp_rank)
        payload = encode_batch(batch)
        seq = self.seq
        self.seq += 1
        self._buffer.append((seq, payload))
        try:
            # Reading EVENTS makes libzmq process pending commands (a new peer and its
            # subscriptions) before the send, so a long-idle publisher does not drop the batch.
            self._pub.getsockopt(zmq.EVENTS)
            # PUB never blocks: at HWM (or with no peer) ZMQ drops, like SGLang's publisher.
            self._pub.send_multipart((self.topic, pack_seq(seq), payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # pragma: no cover - EAGAIN only on odd socket states
            log.debug("kv events: send failed: %s", exc)
        return seq

    async def _serve_replay(self) -> None:
        sock = self._replay
        while True:
            try:
                frames = await sock.recv_multipart()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            if len(frames) < 3:
                continue
            ident, start_frame = frames[0], frames[-1]
            try:
                start = unpack_seq(start_frame)
            except ValueError:
                continue
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await sock.send_multipart((ident, b"", pack_seq(seq), payload))
            await sock.send_multipart((ident, b"", END_SEQ, b""))

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._replay_task
            self._replay_task = None
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


def parse_kv_events_config(raw: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """``--kv-events-config`` JSON -> dict, or None for no publisher (``"publisher": "null"``)."""
    if raw is None or raw == "":
        return None
    if isinstance(raw, str):
        import orjson

        try:
            cfg = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from exc
    else:
        cfg = dict(raw)
    if not isinstance(cfg, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    publisher = cfg.get("publisher", "null")
    if publisher in (None, "null"):
        return None
    if publisher != "zmq":
        raise ValueError(f"--kv-events-config: unsupported publisher {publisher!r} (null|zmq)")
    return cfg


def publisher_from_config(
    cfg: dict[str, Any], page_size: int, default_namespace: str = ""
) -> SimKVPublisher:
    return SimKVPublisher(
        page_size,
        endpoint=cfg.get("endpoint") or DEFAULT_ENDPOINT,
        topic=cfg.get("topic") or "",
        replay_endpoint=cfg.get("replay_endpoint"),
        buffer_steps=int(cfg.get("buffer_steps", 10000)),
        hwm=int(cfg.get("hwm", 100000)),
        default_namespace=default_namespace,
    )
