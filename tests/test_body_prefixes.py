"""Parsing only an append-only turn's new bytes (router/body_prefixes.py): always what
`orjson.loads` of the whole body gives (values and key order), the same error for a body that is
not JSON, and a whole parse only where no proven prefix of a recent body is found; adding a
member by splicing (router/json_splice.py); the router forwarding the client's bytes and
refusing a turn whose new bytes are not JSON."""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.router.body_prefixes import BodyPrefixes
from kvrouter.router.json_splice import with_member
from kvrouter.router.ranks import routed_body

from .fakes import FakeUpstream

CHAT = "/v1/chat/completions"
TRICKY = 'a ]["{}\\/\n\t\u00e9\u20ac\U0001F600,:'
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "required": ["a", "b"], "enum": [[1], [2]]}}}] * 3


def same(store: BodyPrefixes, body: bytes, session: str | None = None) -> dict[str, Any]:
    got = store.loads(body, session)
    want = orjson.loads(body)
    assert got == want and list(got) == list(want)  # the same values, keys in the same order
    assert orjson.dumps(got) == orjson.dumps(want)
    return got


def turns(count: int, encode: Any, content: str = "x ] y") -> list[bytes]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "system " * 800}]
    out = []
    for n in range(count):
        messages.append({"role": "user", "content": f"{n} {content}"})
        out.append(encode(messages))
        messages.append({"role": "assistant", "content": [{"type": "text", "text": f"[{n}] {content}"}]})
    return out


ENCODINGS = {
    "compact, messages between": lambda m: orjson.dumps({"model": "m", "messages": m, "stream": True}),
    "python json, tools after": lambda m: json.dumps(
        {"messages": m, "model": "m", "tools": TOOLS, "stream": True}).encode(),
    "indented, unescaped, messages last": lambda m: json.dumps(
        {"model": "m", "tools": TOOLS, "stream_options": {"include_usage": False}, "messages": m},
        indent=2, ensure_ascii=False).encode() + b"\n",
}


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_each_turn_parses_only_its_new_bytes_and_equals_a_whole_parse(encoding: str) -> None:
    for session in (None, "s1"):
        store = BodyPrefixes(max_bytes=1 << 24)
        for body in turns(8, ENCODINGS[encoding], TRICKY):
            same(store, body, session)
        # the first turn is parsed whole, the second proves its prefix; the rest only parse new bytes
        assert (store.misses, store.hits) == (1, 7)
        assert len(store) == 1  # each turn's prefix supersedes the one it extends


def test_a_resent_body_and_a_changed_tail_reuse_the_prefix() -> None:
    store = BodyPrefixes(max_bytes=1 << 24)
    first, second = turns(2, ENCODINGS["compact, messages between"])
    same(store, first)
    same(store, second)
    same(store, second)
    same(store, second.replace(b'"stream":true', b'"stream":false,"model":"other"'))
    assert store.hits == 3


def test_a_body_that_is_not_json_gets_the_whole_parse_error() -> None:
    store = BodyPrefixes(max_bytes=1 << 24)
    bodies = turns(3, ENCODINGS["compact, messages between"])
    same(store, bodies[0])
    same(store, bodies[1])
    for bad in (bodies[2][:-1], bodies[2] + b"x", bodies[2].replace(b'"role":"user","content":"2',
                                                                   b'"role":"user","content":"\xff'),
                bodies[2][:-1] + b',"a":}'):
        with pytest.raises(orjson.JSONDecodeError) as got:
            store.loads(bad)
        with pytest.raises(orjson.JSONDecodeError) as want:
            orjson.loads(bad)
        assert str(got.value) == str(want.value)
    same(store, bodies[2])  # the proven prefix is still there


@pytest.mark.parametrize("tail", [
    b',"messages":[{"role":"user","content":"other"}]}',  # "messages" named again: the last wins
    b',"m\\u0065ssages":[1]}',
    b',"model":"again","model":"third"}',  # a member of the prefix named again
    b',"tools":[],"stream":null}',
])
def test_duplicate_members_after_the_prefix_come_out_as_a_whole_parse_has_them(tail: bytes) -> None:
    store = BodyPrefixes(max_bytes=1 << 24)
    bodies = turns(3, lambda m: orjson.dumps({"model": "m", "messages": m}))
    same(store, bodies[0])
    same(store, bodies[1])
    same(store, bodies[2][:-1] + tail)
    same(store, bodies[2])


def test_a_prefix_that_ends_in_another_array_is_never_used() -> None:
    # the last member named after "messages" holds `],"stream":` in a nested object: a candidate
    # end that the next turn would not extend; and one that names "messages" twice before
    store = BodyPrefixes(max_bytes=1 << 24)
    for encode in (
        lambda m: orjson.dumps({"messages": m, "stream": True, "meta": {"l": [1], "stream": True}}),
        lambda m: orjson.dumps({"messages": [1], "model": "m", "messages": m, "stream": True}),
    ):
        for body in turns(4, encode):
            same(store, body)


def test_no_memory_means_every_body_is_parsed_whole() -> None:
    store = BodyPrefixes(max_bytes=0)  # routing.prefix_chain_cache_mb: 0
    for body in turns(4, ENCODINGS["compact, messages between"]):
        same(store, body)
    assert (store.hits, len(store)) == (0, 0)


def test_the_callers_dict_and_messages_are_its_own() -> None:
    store = BodyPrefixes(max_bytes=1 << 24)
    bodies = turns(4, ENCODINGS["compact, messages between"])
    for body in bodies:
        got = same(store, body)
        got["messages"].append({"role": "user", "content": "changed"})
        got.pop("model")


def test_the_store_is_bounded_and_stays_correct_when_it_evicts() -> None:
    conversations = [turns(4, lambda m, i=i: orjson.dumps({"model": f"m{i}", "messages": m}))
                     for i in range(6)]
    size = len(conversations[0][-1])
    store = BodyPrefixes(max_bytes=3 * size)
    for n in range(4):
        for conversation in conversations:
            same(store, conversation[n])
    assert len(store) <= 3


_TEXT = st.text(alphabet=st.sampled_from(list(TRICKY) + ["\x00", '"', "u"]), max_size=30)
_KEY = st.sampled_from(["messages", "model", "stream"]) | _TEXT
_VALUE = st.recursive(st.none() | st.booleans() | st.integers(-10, 10) | _TEXT,
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
                      max_leaves=6)


@settings(max_examples=60, deadline=None)
@given(
    before=st.dictionaries(_KEY, _VALUE, max_size=3),
    after=st.dictionaries(_KEY, _VALUE, max_size=3),
    contents=st.lists(_VALUE, min_size=3, max_size=6),
    indent=st.sampled_from([None, 1]),
    session=st.sampled_from([None, "s"]),
)
def test_any_append_only_conversation_parses_as_a_whole_parse(before: dict, after: dict,
                                                              contents: list, indent: int | None,
                                                              session: str | None) -> None:
    store = BodyPrefixes(max_bytes=1 << 24, min_bytes=0)
    messages: list[Any] = [{"role": "system", "content": "s" * 300}]
    for content in contents:
        messages.append({"role": "user", "content": content})
        body = {**before, "messages": messages, **after} if "messages" not in after else \
            {**before, "messages": messages}
        same(store, json.dumps(body, indent=indent).encode(), session)


@pytest.mark.parametrize("raw", [
    b'{}', b' { } ', b'{"a":1}', b'{"a":"}"}\n', b'{"routed_dp_rank":0,"b":[{}]}',
    b'{"x":"\\u00e9\xc3\xa9"\t}\r\n',
])
def test_a_spliced_member_equals_setting_it_on_the_parsed_object(raw: bytes) -> None:
    assert orjson.loads(bytes(routed_body(raw, 3))) == {**orjson.loads(raw), "routed_dp_rank": 3}
    spliced = with_member(raw, b'"k":[1]')
    assert orjson.loads(bytes(spliced)) == {**orjson.loads(raw), "k": [1]}
    assert len(spliced) == len(bytes(spliced))
    twice = routed_body(spliced, 1)  # a rank on top of the usage request: both, last value kept
    assert orjson.loads(bytes(twice)) == {**orjson.loads(raw), "k": [1], "routed_dp_rank": 1}
    assert bytes(twice).startswith(raw.rstrip()[:-1])  # the client's bytes, as they came


async def test_a_large_spliced_body_reaches_the_replica_whole(start_app, start_router):
    # above 64 KB the head and the body's pieces go out in one vectored write
    fake = FakeUpstream("one")
    url = await start_app(fake.app())
    _, r_url = await start_router([url])
    body = orjson.dumps({"model": "m", "stream": True,
                         "messages": [{"role": "user", "content": "z" * 300_000}]}) + b"\n"
    async with aiohttp.ClientSession() as s:
        async with s.post(r_url + CHAT, data=body, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 200
            await r.read()
    assert [req["raw"] for req in fake.requests] == \
        [body[:-2] + b',"stream_options":{"include_usage":true}}\n']


async def test_the_router_forwards_the_clients_bytes_and_refuses_a_bad_turn(start_app, start_router):
    fake = FakeUpstream("one")
    url = await start_app(fake.app())
    router, r_url = await start_router([url])
    bodies = turns(4, ENCODINGS["python json, tools after"])
    bad = bodies[3][:-1] + b',"x":tru}'
    async with aiohttp.ClientSession() as s:
        for body in bodies[:3]:
            async with s.post(r_url + CHAT, data=body,
                              headers={"Content-Type": "application/json"}) as r:
                assert r.status == 200
                await r.read()
        async with s.post(r_url + CHAT, data=bad, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
            assert "invalid JSON body" in (await r.json())["error"]["message"]
    assert router.handlers.chat_bodies.hits == 2
    # the client's bytes, and the router's request for the stream's usage after them
    asked = b',"stream_options":{"include_usage":true}}'
    assert [req["raw"] for req in fake.requests] == [body[:-1] + asked for body in bodies[:3]]


def test_locating_the_end_of_messages_parses_at_most_one_body_more(monkeypatch) -> None:
    # 40 nested `],"stream":` after "messages", each followed by 10 KB: the tails tried from the
    # right would add up to many bodies' bytes; the search gives up instead
    import kvrouter.router.body_prefixes as module

    parsed_bytes = []

    class Counting:
        JSONDecodeError = orjson.JSONDecodeError
        dumps = staticmethod(orjson.dumps)

        @staticmethod
        def loads(data: bytes) -> Any:
            parsed_bytes.append(len(data))
            return orjson.loads(data)

    monkeypatch.setattr(module, "orjson", Counting)
    store = BodyPrefixes(max_bytes=1 << 24)
    meta = [{"a": [1], "stream": "z" * 10_000} for _ in range(40)]
    body = orjson.dumps({"messages": [{"role": "user", "content": "x" * 5000}], "stream": True,
                         "meta": meta})
    same(store, body)
    assert len(store) == 0 and sum(parsed_bytes) <= 2 * len(body)


def test_the_memory_kept_stays_within_the_bound_with_many_small_messages() -> None:
    # a parsed short message (a dict, its strings) takes several times its JSON bytes
    import gc
    import tracemalloc

    bound = 1 << 20
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        store = BodyPrefixes(max_bytes=bound)
        for c in range(100):
            messages: list[Any] = [{"role": "system", "content": f"{c} " + "s" * 3000}]
            for turn in range(6):
                messages += [{"role": "user", "content": f"ok {turn}"}] * 20
                body = orjson.dumps({"model": "m", "messages": messages})
                store.loads(bytes(bytearray(body)), f"s{c}")  # an exact block, as a client's is
        del messages, body
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert store.hits > 0 and kept <= 1.2 * bound, kept


_SPLICES = [b"]", b"[", b"{", b"}", b",", b'"', b":", b"1", b"-", b".5", b"1e999", b"NaN", b" ", b"\n",
            b"\xff", b"\xc3", b"\xe2\x82", b"\xef\xbb\xbf", b"\\", b"tru", b"null", b'"messages"',
            b'],"messages":[', b'],"model":"z"}', b'{"a":1}', b"12345678901234567890123",
            b'],"x":[', b"]}", b"]} "]
_BETWEEN = [b'],"messages":[', b'],"model":"z"}', b'],"x":[', b"]}", b"] ,", b'],"messages":[],"x":[']


def _outcome(loads: Any, body: bytes) -> tuple[str, Any]:
    try:
        got = loads(body)
    except orjson.JSONDecodeError as err:
        return "error", str(err)
    return "parsed", (got, orjson.dumps(got) if isinstance(got, dict) else None)


@settings(max_examples=200, deadline=None)
@given(rng=st.randoms(use_true_random=False))
def test_corrupted_turns_of_random_conversations_parse_as_a_whole_parse(rng: Any) -> None:
    # append-only conversations where some turns have bytes inserted, deleted or replaced
    # (near the stored prefix's end or anywhere after it): the store's answer, parse or error,
    # is always orjson's for the whole body
    from kvrouter.router.body_prefixes import _NONCE

    store = BodyPrefixes(max_bytes=rng.choice([1 << 24, 20_000]), min_bytes=rng.choice([0, 4096]))
    indent = rng.choice([None, 1])
    before = rng.choice([{}, {"model": "m"}, {"model": "m", "messages": [1]}])
    after = rng.choice([{}, {"stream": True}, {"tools": TOOLS, "stream": True, "m": {"l": [1], "stream": 1}}])
    messages: list[Any] = [{"role": "system", "content": "s" * rng.randint(100, 5000)}]
    for _ in range(rng.randint(2, 6)):
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": rng.choice(
                [TRICKY, _NONCE, "x" * rng.randint(0, 300), [{"type": "text", "text": "t"}],
                 rng.randint(-2**63, 2**64 - 1), rng.random()])})
        body = json.dumps({**before, "messages": messages, **after}, indent=indent).encode()
        session = rng.choice([None, "s", "t"])
        if rng.random() < 0.5:
            bad = bytearray(body)
            # the commas between messages: there a message array may end, or a new one begin
            between = [body.rfind(b",", 0, m.start()) for m in re.finditer(b'"role"', body)][2:]
            for _ in range(rng.randint(1, 3)):
                at = rng.randint(rng.choice([len(body) // 2, len(body) - 60]), len(bad))
                kind = rng.random()
                if kind < 0.3 and between and len(bad) == len(body):
                    at = rng.choice(between)
                    bad[at:at + 1] = rng.choice(_BETWEEN)
                elif kind < 0.5:
                    bad[at:at] = rng.choice(_SPLICES)
                elif kind < 0.75:
                    del bad[at:at + rng.randint(1, 5)]
                else:
                    bad[at:at + 1] = rng.choice(_SPLICES)
            assert _outcome(lambda b: store.loads(b, session), bytes(bad)) == \
                _outcome(orjson.loads, bytes(bad))
        assert _outcome(lambda b: store.loads(b, session), body) == _outcome(orjson.loads, body)


async def test_a_deeply_nested_member_after_the_messages_is_forwarded(start_app, start_router):
    # locating the end of "messages" compares the members after it with the whole parse's:
    # nested near orjson's limit, that comparison must not fail the request
    fake = FakeUpstream("one")
    url = await start_app(fake.app())
    _, r_url = await start_router([url])
    deep = b"[" * 1000 + b"]" * 1000
    body = b'{"messages":[{"role":"user","content":"' + b"x" * 5000 + b'"}],"x":' + deep + b"}"
    async with aiohttp.ClientSession() as s:
        async with s.post(r_url + CHAT, data=body, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 200, await r.text()
            await r.read()
    assert [req["raw"] for req in fake.requests] == [body]


def test_two_turns_extending_one_prefix_each_parse_as_a_whole_parse() -> None:
    # two requests continuing the same conversation differently (a retry, a fork), in turn:
    # the first supersedes the shared prefix, the second must not be matched to the first's
    store = BodyPrefixes(max_bytes=1 << 24)
    first, second = turns(2, ENCODINGS["python json, tools after"])
    same(store, first, "s")
    same(store, second, "s")
    fork_a = second.replace(b'"1 x ] y"', b'"1 fork a"')
    fork_b = second.replace(b'"1 x ] y"', b'"1 fork b, longer"')
    for body in (fork_a, fork_b, fork_a, fork_b, second):
        for session in ("s", "t", None):
            same(store, body, session)


@given(st.binary(max_size=600), st.integers(0, 700), st.integers(0, 700))
def test_the_parsed_memory_estimate_counts_each_mark_of_the_range(data: bytes, start: int, end: int) -> None:
    from kvrouter.router.body_prefixes import _parsed_size

    start, end = min(start, len(data)), min(max(start, end), len(data))
    piece = data[start:end]
    assert _parsed_size(data, start, end) == len(piece) + 100 * piece.count(b"{") \
        + 56 * piece.count(b"[") + 32 * piece.count(b",") + 20 * piece.count(b'"')
