"""SGLang KV-cache events: wire codec and ZMQ framing (the block-hash rule is block_hash.py).

Own implementation (plain ``msgpack``) of the format SGLang publishes from
``python/sglang/srt/disaggregation/kv_events.py``. There the types are ``msgspec.Struct``
classes declared ``array_like=True`` (a struct is a msgpack *array* of its fields in
declaration order, not a map) and the event base class is ``tag=True`` (the class name is
prepended as the first array element). Field order::

    EventBatch / KVEventBatch  = [ts: float64, events: [event, ...], attn_dp_rank: int|nil]
    BlockStored                = ["BlockStored", block_hashes: [int64...],
                                  parent_block_hash: int64|nil, token_ids: [int...],
                                  block_size: int, lora_id: int|nil, medium: str|nil]
    BlockRemoved               = ["BlockRemoved", block_hashes: [int64...], medium: str|nil]
    AllBlocksCleared           = ["AllBlocksCleared"]

Current SGLang does not set ``omit_defaults``, so ``medium`` and ``attn_dp_rank`` are always
on the wire (nil when unset); the publisher fills ``attn_dp_rank`` with its DP rank.
Older releases (``omit_defaults=True``, no ``medium``) sent 6-element ``BlockStored`` and
2-element ``BlockRemoved``; :func:`decode_batch` accepts both and ``encode_batch(...,
legacy=True)`` produces the old shape. ``medium`` is ``"GPU"`` for device-resident blocks
and ``"CPU_PINNED"`` for HiCache host copies (``StorageMedium`` enum; ``"DISK"`` and
``"EXTERNAL"`` exist for lower tiers). A ``BlockStoredWithMetadata`` variant (same
``"BlockStored"`` tag) appends an 8th element, the map ``{"cache_salt": str}``.

Example -- one batch, one page of tokens ``[1, 2, 3, 4]`` stored from the tree root on the
GPU (page_size 4), ``ts=1700000000.5``, DP rank 0; block hash = :func:`block_hash.token_block_hashes`
``([1, 2, 3, 4], 4) == [-3488128144981237669]``::

    93                              array(3)                        KVEventBatch
      cb 41d954fc40200000           float64 1700000000.5              ts
      91                            array(1)                          events
        97                          array(7)                          BlockStored
          ab 426c6f636b53746f726564 str "BlockStored"                   tag
          91 d3 cf97adeedb59e05b    [int64 -3488128144981237669]        block_hashes
          c0                        nil                                 parent_block_hash
          94 01 02 03 04            [1, 2, 3, 4]                        token_ids
          04                        4                                   block_size
          c0                        nil                                 lora_id
          a3 475055                 "GPU"                               medium
      00                            0                                 attn_dp_rank

ZMQ: the PUB socket sends three frames per batch: ``topic`` (UTF-8, default ``""``), the
sequence number as 8 bytes big-endian (starting at 0), and the msgpack payload above.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import msgpack

__all__ = [
    "MEDIUM_GPU",
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_EXTERNAL",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVEvent",
    "KVEventBatch",
    "KVEventDecodeError",
    "encode_batch",
    "decode_batch",
    "pack_seq",
    "unpack_seq",
    "END_SEQ",
    "encode_message",
    "decode_message",
    "split_topic",
    "replay_request",
    "offset_endpoint_port",
]

# StorageMedium values (kv_events.py).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU_PINNED"
MEDIUM_DISK = "DISK"
MEDIUM_EXTERNAL = "EXTERNAL"

TokenId = Union[int, tuple[int, int]]


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[Any]  # ints; (draft, target) pairs in EAGLE bigram mode
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None
    #: BlockStoredWithMetadata's trailing map, e.g. {"cache_salt": "..."}.
    metadata: Optional[dict] = None
    #: Any further trailing wire elements from newer SGLang builds, kept verbatim.
    extra: tuple = ()


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: Optional[str] = None
    extra: tuple = ()


@dataclass(slots=True)
class AllBlocksCleared:
    extra: tuple = ()


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(slots=True)
class KVEventBatch:
    ts: float
    events: list[KVEvent] = field(default_factory=list)
    attn_dp_rank: Optional[int] = None


class KVEventDecodeError(ValueError):
    """Bytes that are not an SGLang KVEventBatch."""


# --------------------------------------------------------------------------------------
# Codec
# --------------------------------------------------------------------------------------


def _token_to_wire(t: Any) -> Any:
    return list(t) if isinstance(t, tuple) else t


def _event_to_wire(ev: KVEvent, legacy: bool) -> list:
    if isinstance(ev, BlockStored):
        out = [
            "BlockStored",
            list(ev.block_hashes),
            ev.parent_block_hash,
            [_token_to_wire(t) for t in ev.token_ids],
            ev.block_size,
            ev.lora_id,
        ]
        if not legacy:
            out.append(ev.medium)
            if ev.metadata is not None:
                out.append(ev.metadata)
            out.extend(ev.extra)
        return out
    if isinstance(ev, BlockRemoved):
        out = ["BlockRemoved", list(ev.block_hashes)]
        if not legacy:
            out.append(ev.medium)
            out.extend(ev.extra)
        return out
    if isinstance(ev, AllBlocksCleared):
        return ["AllBlocksCleared", *ev.extra]
    raise TypeError(f"not a KV event: {ev!r}")


def encode_batch(batch: KVEventBatch, *, legacy: bool = False) -> bytes:
    """msgpack payload as SGLang's ``msgspec.msgpack.Encoder().encode(batch)`` writes it.

    ``legacy=True`` writes the pre-``medium`` layout (omit_defaults: no medium, and no
    ``attn_dp_rank`` when it is None).
    """
    wire: list = [float(batch.ts), [_event_to_wire(e, legacy) for e in batch.events]]
    if not legacy or batch.attn_dp_rank is not None:
        wire.append(batch.attn_dp_rank)
    return msgpack.packb(wire, use_bin_type=True)


def _ints(v: Any, what: str) -> list[int]:
    if not isinstance(v, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in v
    ):
        raise KVEventDecodeError(f"{what} is not a list of ints: {v!r:.80}")
    return v


def _opt_int(v: Any, what: str) -> Optional[int]:
    if v is None or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise KVEventDecodeError(f"{what} is not an int or nil: {v!r:.80}")


def _opt_str(v: Any, what: str) -> Optional[str]:
    if v is None or isinstance(v, str):
        return v
    raise KVEventDecodeError(f"{what} is not a str or nil: {v!r:.80}")


def _event_from_wire(raw: Any) -> KVEvent:
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise KVEventDecodeError(f"event is not a tagged array: {raw!r:.80}")
    tag, fields = raw[0], raw[1:]
    if tag == "BlockStored":
        if len(fields) < 5:
            raise KVEventDecodeError(f"BlockStored has {len(fields)} fields, want >= 5")
        tokens = fields[2]
        if not isinstance(tokens, list):
            raise KVEventDecodeError("BlockStored.token_ids is not a list")
        tokens = [tuple(t) if isinstance(t, list) else t for t in tokens]
        block_size = fields[3]
        if not isinstance(block_size, int) or isinstance(block_size, bool):
            raise KVEventDecodeError("BlockStored.block_size is not an int")
        medium = _opt_str(fields[5], "BlockStored.medium") if len(fields) > 5 else None
        rest = fields[6:]
        metadata = None
        if rest and isinstance(rest[0], dict):
            metadata, rest = rest[0], rest[1:]
        return BlockStored(
            block_hashes=_ints(fields[0], "BlockStored.block_hashes"),
            parent_block_hash=_opt_int(fields[1], "BlockStored.parent_block_hash"),
            token_ids=tokens,
            block_size=block_size,
            lora_id=_opt_int(fields[4], "BlockStored.lora_id"),
            medium=medium,
            metadata=metadata,
            extra=tuple(rest),
        )
    if tag == "BlockRemoved":
        if not fields:
            raise KVEventDecodeError("BlockRemoved has no block_hashes")
        medium = _opt_str(fields[1], "BlockRemoved.medium") if len(fields) > 1 else None
        return BlockRemoved(
            block_hashes=_ints(fields[0], "BlockRemoved.block_hashes"),
            medium=medium,
            extra=tuple(fields[2:]),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared(extra=tuple(fields))
    raise KVEventDecodeError(f"unknown event tag {tag!r}")


def decode_batch(payload: bytes) -> KVEventBatch:
    """Inverse of :func:`encode_batch`; accepts current and legacy SGLang layouts."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise KVEventDecodeError(f"not msgpack: {exc}") from exc
    if not isinstance(raw, list) or len(raw) < 2:
        raise KVEventDecodeError(f"batch is not an array of >= 2: {raw!r:.80}")
    ts, events = raw[0], raw[1]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise KVEventDecodeError(f"batch ts is not a number: {ts!r}")
    if not isinstance(events, list):
        raise KVEventDecodeError("batch events is not an array")
    dp = _opt_int(raw[2], "batch attn_dp_rank") if len(raw) > 2 else None
    return KVEventBatch(
        ts=float(ts), events=[_event_from_wire(e) for e in events], attn_dp_rank=dp
    )


# --------------------------------------------------------------------------------------
# ZMQ framing
# --------------------------------------------------------------------------------------

#: End-of-replay marker: -1 as a signed 8-byte big-endian integer.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

# Markers a snapshot-enabled publisher appends to the topic frame (prefix-compatible with
# plain SUB filters): topic + EPOCH_MARKER + epoch [+ SNAPSHOT_MARKER + barrier_id].
EPOCH_MARKER = b"\x00sgl-kv-epoch="
SNAPSHOT_MARKER = b"\x00sgl-kv-snapshot="


def pack_seq(seq: int) -> bytes:
    """8-byte big-endian sequence number (``seq.to_bytes(8, "big")``)."""
    return seq.to_bytes(8, "big", signed=seq < 0)


def unpack_seq(frame: bytes) -> int:
    """Sequence number of a frame; :data:`END_SEQ` decodes to -1."""
    if len(frame) != 8:
        raise KVEventDecodeError(f"sequence frame has {len(frame)} bytes, want 8")
    if frame == END_SEQ:
        return -1
    return struct.unpack(">Q", frame)[0]


def encode_message(topic: Union[str, bytes], seq: int, batch: KVEventBatch) -> list[bytes]:
    """The three frames SGLang's PUB socket sends: ``[topic, seq_be8, payload]``."""
    t = topic.encode("utf-8") if isinstance(topic, str) else bytes(topic)
    return [t, pack_seq(seq), encode_batch(batch)]


def decode_message(frames: Sequence[bytes]) -> tuple[bytes, int, KVEventBatch]:
    """``(topic, seq, batch)`` from the three frames of one published message."""
    if len(frames) != 3:
        raise KVEventDecodeError(f"expected 3 frames, got {len(frames)}")
    topic, seq, payload = frames
    return bytes(topic), unpack_seq(bytes(seq)), decode_batch(bytes(payload))


def split_topic(topic: bytes) -> tuple[bytes, Optional[str], Optional[str]]:
    """``(base_topic, epoch, snapshot_barrier_id)`` of a topic frame.

    A publisher with ``snapshot_endpoint`` configured appends epoch metadata to every live
    topic, and a barrier id to the (empty) batch that marks a snapshot cut. Without
    snapshots the topic is the configured one and both extras are None.
    """
    base, sep, rest = topic.partition(EPOCH_MARKER)
    if not sep:
        return topic, None, None
    epoch, sep2, barrier = rest.partition(SNAPSHOT_MARKER)
    return base, epoch.decode("utf-8"), (barrier.decode("utf-8") if sep2 else None)


def replay_request(start_seq: int) -> bytes:
    """Body of a replay request to the ROUTER ``replay_endpoint``.

    Send it from a REQ socket (or DEALER as ``[b"", body]``): the publisher answers with
    ``[seq_be8, payload]`` for every buffered batch with seq >= start_seq, then
    ``[END_SEQ, b""]``.
    """
    return pack_seq(start_seq)


def offset_endpoint_port(endpoint: Optional[str], dp_rank: int) -> Optional[str]:
    """Endpoint a DP rank publishes on: TCP port + dp_rank, or ``inproc`` suffix ``_dp<r>``."""
    if not endpoint or dp_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{dp_rank}"
    if "tcp" in endpoint:
        if ":" in endpoint:
            base, _, port = endpoint.rpartition(":")
            return f"{base}:{int(port) + dp_rank}"
        return endpoint
    raise ValueError("Invalid endpoint: must contain 'inproc' or 'tcp'")
