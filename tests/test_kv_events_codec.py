"""KV-event codec: byte layout of SGLang's msgspec array_like/tagged structs."""

import msgpack
import pytest

from kvrouter.sglang_protocol.kv_events import (
    END_SEQ,
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventDecodeError,
    decode_batch,
    decode_message,
    encode_batch,
    encode_message,
    offset_endpoint_port,
    split_topic,
    unpack_seq,
)
from kvrouter.sglang_protocol.block_hash import (
    block_hash_chain_hex,
    token_block_hashes,
    block_stored_events,
    hash_hex_to_int64,
    page_hash_hex,
)

# Hand-assembled from SGLang's struct declarations (see the module docstring):
# [ts, [["BlockStored", [hash], nil, [1,2,3,4], 4, nil, "GPU"]], 0]
GOLDEN = bytes.fromhex(
    "93"  # array(3): KVEventBatch
    "cb41d954fc40200000"  # float64 1700000000.5
    "91"  # events: array(1)
    "97"  # BlockStored: array(7)
    "ab426c6f636b53746f726564"  # "BlockStored"
    "91d3cf97adeedb59e05b"  # [int64 -3488128144981237669]
    "c0"  # parent_block_hash nil
    "9401020304"  # token_ids
    "04"  # block_size
    "c0"  # lora_id nil
    "a3475055"  # "GPU"
    "00"  # attn_dp_rank 0
)
H1 = -3488128144981237669


def golden_batch():
    return KVEventBatch(
        ts=1700000000.5,
        events=[BlockStored([H1], None, [1, 2, 3, 4], 4, None, MEDIUM_GPU)],
        attn_dp_rank=0,
    )


def test_golden_encode():
    assert encode_batch(golden_batch()) == GOLDEN


def test_golden_decode():
    assert decode_batch(GOLDEN) == golden_batch()


def test_golden_hash_is_sglang_page_hash():
    assert token_block_hashes([1, 2, 3, 4], 4) == [H1]
    assert page_hash_hex([1, 2, 3, 4]).startswith("cf97adeedb59e05b")


def test_round_trip_all_event_types():
    batch = KVEventBatch(
        ts=12.25,
        events=[
            BlockStored([1, -2, 2**62], 7, [5, 6], 2, 3, MEDIUM_CPU),
            BlockStored([9], None, [(1, 2), (3, 4)], 2, None, MEDIUM_GPU, {"cache_salt": "s"}),
            BlockRemoved([1, -2], MEDIUM_GPU),
            AllBlocksCleared(),
        ],
        attn_dp_rank=3,
    )
    payload = encode_batch(batch)
    assert decode_batch(payload) == batch
    raw = msgpack.unpackb(payload)
    assert raw[1][2] == ["BlockRemoved", [1, -2], "GPU"]
    assert raw[1][3] == ["AllBlocksCleared"]
    assert raw[1][1][-1] == {"cache_salt": "s"}


def test_legacy_layout_round_trip():
    batch = KVEventBatch(ts=1.0, events=[BlockStored([1], None, [1], 1), BlockRemoved([1])])
    payload = encode_batch(batch, legacy=True)
    raw = msgpack.unpackb(payload)
    assert len(raw) == 2 and len(raw[1][0]) == 6 and len(raw[1][1]) == 2
    assert decode_batch(payload) == batch


def test_unknown_trailing_fields_tolerated():
    payload = msgpack.packb(
        [1.0, [["BlockStored", [1], None, [1], 1, None, "GPU", {"cache_salt": "x"}, "sess"]], 0]
    )
    ev = decode_batch(payload).events[0]
    assert ev.metadata == {"cache_salt": "x"} and ev.extra == ("sess",)


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0, [["Nope"]]]),
     msgpack.packb([1.0, [["BlockStored", "x", None, [], 1, None]]])],
)
def test_garbage_rejected(payload):
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)


def test_zmq_frames():
    frames = encode_message("kv-events", 5, golden_batch())
    assert frames[0] == b"kv-events"
    assert frames[1] == b"\x00\x00\x00\x00\x00\x00\x00\x05"
    assert frames[2] == GOLDEN
    topic, seq, batch = decode_message(frames)
    assert (topic, seq, batch) == (b"kv-events", 5, golden_batch())
    assert unpack_seq(END_SEQ) == -1


def test_topic_markers_and_ports():
    assert split_topic(b"kv") == (b"kv", None, None)
    t = b"kv\x00sgl-kv-epoch=abc\x00sgl-kv-snapshot=bar"
    assert split_topic(t) == (b"kv", "abc", "bar")
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("inproc://c", 1) == "inproc://c_dp1"


def test_hash_chain_is_prefix_stable_and_split_independent():
    toks = list(range(10))
    whole = block_hash_chain_hex(toks, 4, include_partial=False)
    assert len(whole) == 2
    # Hashing the second page from the first page's digest == hashing the whole chain.
    assert page_hash_hex(toks[4:8], whole[0]) == whole[1]
    assert block_hash_chain_hex(toks, 4)[-1] == page_hash_hex(toks[8:], whole[1])
    assert hash_hex_to_int64("ffffffffffffffff" + "0" * 48) == -1
    assert hash_hex_to_int64("7fffffffffffffff" + "0" * 48) == 2**63 - 1


def test_block_stored_events_parent_links():
    evs = block_stored_events(list(range(8)), 4)
    assert evs[0].parent_block_hash is None
    assert evs[1].parent_block_hash == evs[0].block_hashes[0]
    prior = block_hash_chain_hex(list(range(8)), 4)[-1]
    more = block_stored_events(list(range(8, 12)), 4, prior_hash_hex=prior)
    assert more[0].parent_block_hash == evs[1].block_hashes[0]
    assert more[0].block_hashes == token_block_hashes(list(range(12)), 4)[2:]


def test_token_out_of_range():
    with pytest.raises(ValueError):
        page_hash_hex([-1])
