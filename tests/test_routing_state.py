"""Session identity, prefix hashing, the shadow KV index, the session table and the engine."""

from __future__ import annotations

import random

from kvrouter.policies.registry import build_policy
from kvrouter.router.engine import RoutingEngine
from kvrouter.router.kv_index_shadow import ShadowKVIndex
from kvrouter.router.prefix import text_block_hashes, namespace, prompt_bytes, session_key
from kvrouter.router.replicas import ReplicaRegistry
from kvrouter.router.sessions import SessionTable


def chat(*contents: str, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": c} for c in contents], **extra}


def test_session_key_precedence_headers_then_body():
    assert session_key({"x-smg-routing-key": "h2", "x-session-id": "h1"}, {"session_id": "b"}) == "h1"
    assert session_key({"x-dynamo-session-id": "d"}, {"user": "u"}) == "d"
    assert session_key({}, {"prompt_cache_key": "p", "user": "u"}) == "p"
    assert session_key({}, {"user": "u"}) == "u"
    assert session_key({}, {"messages": []}) is None


def test_whole_conversation_is_the_prefix_not_the_first_message():
    a = text_block_hashes(prompt_bytes("/v1/chat/completions", chat("x" * 600, "A" * 600)), b"")
    b = text_block_hashes(prompt_bytes("/v1/chat/completions", chat("x" * 600, "B" * 600)), b"")
    assert a[:2] == b[:2] and a[3:] != b[3:]  # shared first message, different second
    turn2 = text_block_hashes(prompt_bytes("/v1/chat/completions", chat("x" * 600, "A" * 600, "C" * 600)), b"")
    assert turn2[: len(a)] == a  # a growing conversation extends its own chain


def test_session_id_never_becomes_prefix_text():
    body = chat("hello " * 100)
    assert prompt_bytes("/v1/chat/completions", {**body, "session_id": "session-1"}) == \
        prompt_bytes("/v1/chat/completions", {**body, "session_id": "session-12"})


def test_namespaces_never_share_blocks():
    data = prompt_bytes("/v1/chat/completions", chat("y" * 2000))
    plain = text_block_hashes(data, namespace(chat("")))
    salted = text_block_hashes(data, namespace(chat("", cache_salt="tenant-a")))
    lora = text_block_hashes(data, namespace(chat("", lora_path="adapter")))
    assert not set(plain) & set(salted) and not set(plain) & set(lora)


def test_index_matches_longest_prefix_per_replica_and_is_capacity_bounded():
    idx = ShadowKVIndex(block_tokens=64)
    idx.set_capacity("a", 64 * 10)
    idx.record("a", [1, 2, 3, 4])
    idx.record("b", [1, 2])
    assert idx.match([1, 2, 3, 4, 5]) == {"a": 256, "b": 128}
    assert idx.match([9, 1]) == {}
    idx.record("a", list(range(100, 108)))  # 12 blocks > capacity 10: the oldest tail goes first
    assert idx.cached_tokens("a") == 640
    m = idx.match([1, 2, 3, 4])
    assert m.get("a", 0) <= 128  # tail blocks 3, 4 were evicted before the root
    idx.forget("b")
    assert "b" not in idx.match([1, 2])


def test_session_table_tracks_homes_and_kv_demand():
    changed = []
    t = SessionTable(ttl_s=10, on_home_change=changed.append)
    t.touch("s1", 0, home="a", tokens=100)
    t.touch("s2", 0, home="a", tokens=50)
    t.touch("s1", 1, tokens=150)
    assert t.homed_sessions["a"] == 2 and t.homed_tokens["a"] == 200
    t.set_home("s2", "b", 2)
    assert t.homed_tokens == {"a": 150, "b": 50}
    t.acquire("s1", 3)
    t.assign("s1", None, force=False, tokens=150, now=3)
    assert t.expire(100) == 1  # s2 idle past TTL; s1 in flight stays
    assert t.homed_tokens["b"] == 0 and "a" in changed


def _engine(n: int) -> RoutingEngine:
    reg = ReplicaRegistry([f"r{i}" for i in range(n)])
    table = SessionTable()
    eng = RoutingEngine(build_policy("coding-agent"), reg, ShadowKVIndex(), table, random.Random(0))
    return eng


def test_rebalance_moves_a_bounded_number_of_small_idle_sessions_to_fresh():
    eng = _engine(2)
    for i in range(6):
        eng.table.touch(f"s{i}", 0, home="r0", tokens=10_000 * (i + 1))
    eng.table.touch("busy", 0, home="r0", tokens=1_000)
    eng.table.acquire("busy", 0)
    eng.table.assign("busy", None, force=False, tokens=1_000, now=0)
    eng.add_replica("r2", now=0)
    assert eng.plan_rebalance(now=1, min_fresh_age_s=10, max_moves=3) == []  # give arrivals a chance
    moves = eng.plan_rebalance(now=20, min_fresh_age_s=10, max_moves=3)
    assert 0 < len(moves) <= 3
    assert all(m.source == "r0" and m.target == "r2" for m in moves)
    assert [m.session for m in moves] == ["s0", "s1", "s2"][: len(moves)]  # cheapest first
    assert "busy" not in {m.session for m in moves}


def test_fresh_replica_settles_at_the_mean():
    eng = _engine(2)
    eng.add_replica("r2", now=0)
    for url in ("r0", "r1"):
        eng.registry.dispatched(url, 0)
    eng.settle_fresh()
    assert eng.registry.view("r2").fresh
    eng.registry.dispatched("r2", 0)
    eng.settle_fresh()
    assert not eng.registry.view("r2").fresh


def test_bisected_match_equals_a_block_by_block_walk():
    """The index bisects on holder sets; on random records with LRU eviction (which keeps each
    replica's blocks prefix-closed) it must agree with the obvious linear walk."""

    def linear(idx: ShadowKVIndex, blocks: list[int]) -> dict[str, int]:
        out = {}
        for replica in ("r0", "r1", "r2", "r3", "r4", "r5", "r6", "r7"):
            held = idx.held_blocks(replica)
            depth = 0
            for b in blocks:
                if b not in held:
                    break
                depth += 1
            if depth:
                out[replica] = depth * idx.block_tokens
        return out

    rng = random.Random(0)
    for _ in range(200):
        idx = ShadowKVIndex(64)
        shared = [rng.getrandbits(60) for _ in range(rng.randrange(0, 10))]
        chains = [[rng.getrandbits(60) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
        for r in range(8):
            idx.set_capacity(f"r{r}", 64 * rng.randrange(5, 60))
            for _ in range(rng.randrange(1, 6)):
                chain = rng.choice(chains)
                idx.record(f"r{r}", shared + chain[: rng.randrange(1, len(chain) + 1)])
        for _ in range(5):
            chain = rng.choice(chains)
            query = shared + chain[: rng.randrange(1, len(chain) + 1)] + [rng.getrandbits(60)]
            assert idx.match(query) == linear(idx, query)


def test_match_limit_keeps_the_deepest_holders():
    idx = ShadowKVIndex(64)
    system = [1, 2, 3]
    for r in range(50):  # the whole fleet holds the shared system prompt
        idx.record(f"r{r:02d}", system)
    idx.record("r07", system + [10, 11, 12])
    idx.record("r31", system + [10])
    full = idx.match(system + [10, 11, 12, 13])
    assert len(full) == 50 and full["r07"] == 6 * 64 and full["r31"] == 4 * 64
    top = idx.match(system + [10, 11, 12, 13], limit=3)
    assert top == {"r07": 6 * 64, "r31": 4 * 64, "r00": 3 * 64}


def test_a_replica_coming_back_shows_the_sessions_still_homed_on_it():
    eng = _engine(2)
    for i in range(3):
        eng.table.acquire(f"s{i}", 0)
        eng.table.assign(f"s{i}", "r1", force=False, tokens=100_000, now=0)
    eng.remove_replica("r1")
    eng.add_replica("r1", now=1)
    view = eng.registry.view("r1")
    assert (view.homed_sessions, view.homed_tokens) == (3, 300_000)


def test_kv_pressure_rebalance_moves_long_idle_sessions_only_when_enabled():
    eng = _engine(3)  # default capacity 511,552 tokens per replica
    for i in range(6):  # 720k tokens homed on r0: over its whole capacity
        eng.table.acquire(f"s{i}", i * 100)
        eng.table.assign(f"s{i}", "r0", force=False, tokens=120_000, now=i * 100)
        eng.table.release(f"s{i}", i * 100)
    assert eng.plan_rebalance(now=600, min_fresh_age_s=10, max_moves=4) == []  # off by default
    moves = eng.plan_rebalance(now=600, min_fresh_age_s=10, max_moves=4, kv_pressure=True)
    # s0..s4 idle >= 120 s; least recently active first, until r0 fits its capacity again.
    assert [m.session for m in moves] == ["s0", "s1"]
    assert {m.target for m in moves} <= {"r1", "r2"}
