"""Suffix-only prefix hashing (router/prefix_chain.py): always the full hash, only the new bytes'
cost when a prompt extends a recent one."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.router.config import RoutingConfig
from kvrouter.router.prefix import prompt_bytes_and_boundaries, text_block_hashes
from kvrouter.router.prefix_chain import PrefixChains
from kvrouter.router.summary import summarize

CHAT = "/v1/chat/completions"
BLOCK = 16


def conversation(*contents: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": c} for c in contents]}


def hashes_of(chains: PrefixChains, body: dict, session: str | None) -> tuple[int, ...]:
    data, ends = prompt_bytes_and_boundaries(CHAT, body)
    return chains.block_hashes(data, b"ns", BLOCK, session, ends)


def full(body: dict) -> tuple[int, ...]:
    return text_block_hashes(prompt_bytes_and_boundaries(CHAT, body)[0], b"ns", BLOCK)


def test_appended_turn_hashes_only_its_new_bytes_with_and_without_a_session_key():
    for session in ("s1", None):
        chains = PrefixChains(max_bytes=1 << 20, min_bytes=0)
        turns = ["system " * 200]
        for n in range(4):
            turns.append(f"turn {n} " * 50)
            assert hashes_of(chains, conversation(*turns), session) == full(conversation(*turns))
        assert (chains.misses, chains.hits) == (1, 3)
        assert len(chains) == 1  # each turn's chain supersedes the one it extends


def test_same_length_edit_before_the_stored_end_is_never_taken_for_an_extension():
    chains = PrefixChains(max_bytes=1 << 20, min_bytes=0)
    first = conversation("a" * 500, "b" * 500)
    hashes_of(chains, first, "s")
    edited = conversation("a" * 250 + "X" + "a" * 249, "b" * 500, "c" * 300)  # same ends, same tail
    assert hashes_of(chains, edited, "s") == full(edited)
    assert chains.hits == 0


def test_chain_is_not_shared_across_namespaces_or_block_sizes():
    chains = PrefixChains(max_bytes=1 << 20, min_bytes=0)
    data, ends = prompt_bytes_and_boundaries(CHAT, conversation("x" * 800))
    longer, longer_ends = prompt_bytes_and_boundaries(CHAT, conversation("x" * 800, "y" * 100))
    chains.block_hashes(data, b"model=a", BLOCK, "s", ends)
    assert chains.block_hashes(longer, b"model=b", BLOCK, "s", longer_ends) == \
        text_block_hashes(longer, b"model=b", BLOCK)
    assert chains.block_hashes(longer, b"model=a", 32, "s", longer_ends) == \
        text_block_hashes(longer, b"model=a", 32)
    assert chains.hits == 0


def test_stored_prompts_stay_within_the_byte_bound():
    chains = PrefixChains(max_bytes=20_000, min_bytes=0)
    for n in range(50):
        hashes_of(chains, conversation(f"session {n} " * 100), None)
        assert chains.stored_bytes <= 20_000
    assert 0 < len(chains) < 50
    assert len(chains._by_session) == 0


def test_summarize_with_chains_equals_summarize_without():
    config = RoutingConfig()
    chains = PrefixChains(max_bytes=1 << 20, min_bytes=0)
    turns = ["tools and system " * 400]
    for n in range(3):
        turns.append(f"user turn {n} " * 30)
        body = {**conversation(*turns), "tools": [{"type": "function", "function": {"name": "f"}}]}
        with_chains, size = summarize(CHAT, body, {"x-session-id": "s"}, config, chains=chains)
        assert with_chains == summarize(CHAT, body, {"x-session-id": "s"}, config)[0]
        assert size == len(prompt_bytes_and_boundaries(CHAT, body)[0])
    assert chains.hits == 2


# A conversation is a list of messages; each step appends, truncates, or edits one of them.
_text = st.text(alphabet="ab\x1d\x1eé", max_size=60)
_step = st.one_of(
    st.tuples(st.just("append"), _text),
    st.tuples(st.just("truncate"), st.integers(0, 8)),
    st.tuples(st.just("edit"), st.integers(0, 8), _text),
    st.tuples(st.just("switch"), st.integers(0, 2)),  # another session continues
)


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(_step, min_size=1, max_size=40), keyed=st.booleans(),
       max_bytes=st.sampled_from([0, 300, 1 << 20]))
def test_always_equals_the_full_hash(steps, keyed, max_bytes):
    chains = PrefixChains(max_bytes=max_bytes, min_bytes=0)
    sessions: list[list[str]] = [["base"], ["base"], ["other"]]
    current = 0
    for step in steps:
        current = _apply_chat_step(sessions, [None] * len(sessions), current, step)
        body = conversation(*sessions[current])
        session = f"s{current}" if keyed else None
        assert hashes_of(chains, body, session) == full(body)
        assert chains.stored_bytes <= max(max_bytes, 0)


# Chat messages whose equal values may render differently: JSON key order, True == 1.
_message = st.one_of(
    _text.map(lambda t: {"role": "user", "content": t}),
    _text.map(lambda t: {"role": "assistant", "content": None, "tool_calls": [{"id": t, "type": "f"}]}),
    _text.map(lambda t: {"role": "assistant", "content": None, "tool_calls": [{"type": "f", "id": t}]}),
    _text.map(lambda t: {"role": "tool", "content": [{"type": "text", "text": t}]}),
    _text.map(lambda t: {"role": "tool", "content": [{"text": t, "type": "text"}]}),
    _text.map(lambda t: {"role": True, "content": t}),
    _text.map(lambda t: {"role": 1, "content": t}),
    st.just("not a message"),
)
_tools = st.sampled_from([None, [{"a": 1, "b": 2}], [{"b": 2, "a": 1}]])
_chat_step = st.one_of(
    st.tuples(st.just("append"), _message),
    st.tuples(st.just("truncate"), st.integers(0, 8)),
    st.tuples(st.just("edit"), st.integers(0, 8), _message),
    st.tuples(st.just("tools"), _tools),
    st.tuples(st.just("switch"), st.integers(0, 2)),
    st.tuples(st.just("grow"), _text),
)


def _apply_chat_step(sessions: list[list], tools: list, current: int, step: tuple) -> int:
    """One generated step on the conversations (`sessions`, their `tools`; plain-text or chat
    messages alike); the current one after it."""
    messages = sessions[current]
    if step[0] == "append":
        messages.append(step[1])
    elif step[0] == "truncate":
        del messages[min(step[1], len(messages)):]
    elif step[0] == "edit" and messages:
        messages[step[1] % len(messages)] = step[2]
    elif step[0] == "tools":
        tools[current] = step[1]
    elif step[0] == "switch":
        current = step[1]
    elif step[0] == "grow" and messages and isinstance(messages[-1], dict):
        last = messages[-1]
        if isinstance(last.get("content"), str) or last.get("content") is None:
            messages[-1] = {**last, "content": (last.get("content") or "") + step[1]}
    return current


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(_chat_step, min_size=1, max_size=40), keyed=st.booleans(),
       max_bytes=st.sampled_from([0, 300, 1 << 20]))
def test_chat_hashes_rendering_only_new_messages_always_equal_the_full_hash(steps, keyed, max_bytes):
    chains = PrefixChains(max_bytes=max_bytes, min_bytes=0)
    sessions: list[list] = [[{"role": "system", "content": "base"}], [{"role": "system", "content": "base"}], []]
    tools: list = [None, None, None]
    current = 0
    for step in steps:
        current = _apply_chat_step(sessions, tools, current, step)
        body = {"model": "m", "messages": [dict(m) if isinstance(m, dict) else m for m in sessions[current]]}
        if tools[current]:
            body["tools"] = tools[current]
        data = prompt_bytes_and_boundaries(CHAT, body)[0]
        session = f"s{current}" if keyed else None
        assert chains.chat_block_hashes(body, b"ns", BLOCK, session) == \
            (text_block_hashes(data, b"ns", BLOCK), len(data))
        assert chains.stored_bytes <= max(max_bytes, 0)


def test_a_chat_turn_renders_only_its_new_messages(monkeypatch):
    from kvrouter.router import prefix_chain

    chains = PrefixChains(max_bytes=1 << 20, min_bytes=0)
    rendered = []
    render = prefix_chain.render_part
    monkeypatch.setattr(prefix_chain, "render_part", lambda part: (rendered.append(part), render(part))[1])
    turns = [f"turn {n} " * 40 for n in range(50)]
    for session in ("s", None):
        chains.chat_block_hashes(conversation(*turns), b"ns", BLOCK, session)
        rendered.clear()
        body = conversation(*turns, "reply " * 10, "next question " * 10)
        assert chains.chat_block_hashes(body, b"ns", BLOCK, session)[0] == full(body)
        # the two new messages, and the one before them (it names where the stored prompt ends)
        assert len(rendered) <= 3 and {"role": "user", "content": "next question " * 10} in rendered


def test_a_short_chat_prompt_is_hashed_whole_with_no_lookup_and_not_kept(monkeypatch):
    chains = PrefixChains(max_bytes=1 << 20, min_bytes=512)

    def no_lookup(*args, **kwargs):
        raise AssertionError("a prompt under min_bytes cannot extend a kept one: no lookup")

    monkeypatch.setattr(chains, "_find_chat", no_lookup)
    for contents in (("hi",), ("a" * 40, "b" * 60, "c" * 80), ("\u00e9" * 200,)):
        body = conversation(*contents)
        data = prompt_bytes_and_boundaries(CHAT, body)[0]
        for session in ("s", None):
            assert chains.chat_block_hashes(body, b"ns", BLOCK, session) == (full(body), len(data))
    assert len(chains) == 0
    # over min_bytes once rendered (multi-byte characters): the usual path, which keeps it
    monkeypatch.undo()
    body = conversation("\u00e9" * 300)
    data = prompt_bytes_and_boundaries(CHAT, body)[0]
    assert chains.chat_block_hashes(body, b"ns", BLOCK, "s") == (full(body), len(data))
    assert len(chains) == 1


def test_a_chat_prompt_without_a_given_namespace_is_hashed_in_its_body_s_own():
    from kvrouter.router.prefix import namespace

    for contents in (("hi",), ("x" * 300,), ("y" * 5000, "z" * 40)):
        body = {**conversation(*contents), "cache_salt": "s1"}
        data = prompt_bytes_and_boundaries(CHAT, body)[0]
        expected = (text_block_hashes(data, namespace(body), BLOCK), len(data))
        assert PrefixChains(max_bytes=1 << 20, min_bytes=512).chat_block_hashes(body, None, BLOCK) == expected


def test_a_growing_last_message_hashes_only_its_new_text(monkeypatch):
    # A conversation sent as one message that grows every turn (how trace replays send it):
    # the stored chain is reused past every whole block before the old message's end.
    from kvrouter.router import prefix_chain

    hashed = []
    chain = prefix_chain.chain_block_hashes
    monkeypatch.setattr(prefix_chain, "chain_block_hashes",
                        lambda h, data, start, size, before: (hashed.append(len(data) - start),
                                                              chain(h, data, start, size, before))[1])
    chains = PrefixChains(max_bytes=1 << 20, min_bytes=0)
    text = "context " * 500
    for n in range(5):
        body = {"model": "m", "messages": [{"role": "system", "content": "base"},
                                           {"role": "user", "content": text}]}
        assert chains.chat_block_hashes(body, b"ns", BLOCK, "s") == \
            (full(body), len(prompt_bytes_and_boundaries(CHAT, body)[0]))
        text += f"turn {n} " * 20
    assert (chains.misses, chains.hits) == (1, 4)
    assert hashed[0] > 4000 and max(hashed[1:]) < 200 + 2 * BLOCK  # only the new text after the first
    assert len(chains) == 1


def test_a_last_message_changed_before_the_stored_last_block_is_hashed_whole():
    chains = PrefixChains(max_bytes=1 << 20, min_bytes=0)

    def user(text: str, role: str = "user") -> dict:
        return {"model": "m", "messages": [{"role": "system", "content": "base"},
                                           {"role": role, "content": text}]}

    chains.chat_block_hashes(user("a" * 600), b"ns", BLOCK, "s")
    for body in (user("a" * 600 + "b", role="assistant"), user("a" * 100 + "X" + "a" * 500)):
        chains.chat_block_hashes(user("a" * 600), b"ns", BLOCK, "s")  # stored again
        assert chains.chat_block_hashes(body, b"ns", BLOCK, "s")[0] == full(body)
    chains.chat_block_hashes(user("a" * 600), b"ns", BLOCK, "s")
    hits = chains.hits
    # rewritten only after the stored prompt's last whole block: that block on is hashed
    body = user("a" * 598 + "Xb" + "c" * 50)
    assert chains.chat_block_hashes(body, b"ns", BLOCK, "s")[0] == full(body)
    assert chains.hits == hits + 1


# The last message rewritten from a cut point (the bytes of the stored prompt's last message
# kept up to it, new text after), with the kind of last part and the earlier parts varied.
_rewrite_text = st.text(alphabet="ab\u00e9\u20ac\U0001f600\x1d", min_size=0, max_size=120)
_last_kind = st.sampled_from(["str", "parts", "tool_calls", "none"])


def _last_message(kind: str, text: str, role: str) -> dict:
    if kind == "parts":
        return {"role": role, "content": [{"type": "text", "text": text}]}
    if kind == "tool_calls":
        return {"role": "assistant", "content": text, "tool_calls": [{"id": text[:5], "type": "f"}]}
    if kind == "none" and not text:
        return {"role": role, "content": None}
    return {"role": role, "content": text}


@settings(max_examples=400, deadline=None)
@given(base=_rewrite_text, cut=st.floats(0.0, 1.0), added=_rewrite_text,
       old_kind=_last_kind, new_kind=_last_kind, role=st.sampled_from(["user", "assistant"]),
       change=st.sampled_from(["none", "system", "earlier", "tools", "role"]),
       head=st.integers(0, 70), block=st.sampled_from([4, 7, 16]),
       max_bytes=st.sampled_from([200, 1 << 20]), turns=st.integers(1, 3))
def test_a_rewritten_last_message_always_hashes_as_the_whole_prompt(
        base, cut, added, old_kind, new_kind, role, change, head, block, max_bytes, turns):
    chains = PrefixChains(max_bytes=max_bytes, min_bytes=0)
    system = "s" * head + "\u00e9"  # moves the last message's start against the block grid

    def body_of(last: dict, system_text: str = system, earlier: str = "q", tools=None) -> dict:
        body = {"model": "m", "messages": [{"role": "system", "content": system_text},
                                           {"role": "user", "content": earlier}, last]}
        if tools:
            body["tools"] = tools
        return body

    old = body_of(_last_message(old_kind, base, role))
    for _ in range(turns):  # stored (and re-found) before the rewrite
        data = prompt_bytes_and_boundaries(CHAT, old)[0]
        assert chains.chat_block_hashes(old, b"ns", block, "s") == (text_block_hashes(data, b"ns", block), len(data))
    kept = base[: int(len(base) * cut)]  # a cut inside a multi-byte character's string index is whole
    new_last = _last_message(new_kind, kept + added, "assistant" if change == "role" else role)
    new = body_of(new_last,
                  system_text=system + "!" if change == "system" else system,
                  earlier="Q" if change == "earlier" else "q",
                  tools=[{"a": 1}] if change == "tools" else None)
    data = prompt_bytes_and_boundaries(CHAT, new)[0]
    assert chains.chat_block_hashes(new, b"ns", block, "s") == (text_block_hashes(data, b"ns", block), len(data))
    assert chains.stored_bytes <= max_bytes
    assert chains.stored_bytes == sum(c.cost for c in chains._by_end.values())
    assert len(chains._by_session) <= len(chains._by_end)
    # and the session's next turn, from whatever was stored, still hashes whole
    again = body_of(_last_message(new_kind, kept + added + "z" * 9, new_last.get("role", role)),
                    system_text=new["messages"][0]["content"], earlier=new["messages"][1]["content"],
                    tools=new.get("tools"))
    data = prompt_bytes_and_boundaries(CHAT, again)[0]
    assert chains.chat_block_hashes(again, b"ns", block, "s") == (text_block_hashes(data, b"ns", block), len(data))


def test_a_turn_sharing_the_stored_tool_call_messages_renders_none_of_them_again(monkeypatch):
    """Messages whose JSON key order could differ are compared rendered, unless the new body
    holds the very objects stored (as a body parsed from a stored prefix does)."""
    from kvrouter.router import prefix_chain

    chains = PrefixChains(max_bytes=1 << 20, min_bytes=0)
    calls = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": f"c{n}", "type": "function", "function": {"name": "read", "arguments": f"{{\"n\": {n}}}"}}]}
        for n in range(40)]
    first = {"model": "m", "messages": [{"role": "system", "content": "sys " * 200}, *calls]}
    rendered = []
    render = prefix_chain.render_part
    monkeypatch.setattr(prefix_chain, "render_part", lambda part: (rendered.append(part), render(part))[1])
    for session in ("s", None):
        chains.chat_block_hashes(first, b"ns", BLOCK, session)
        rendered.clear()
        body = {"model": "m", "messages": [*first["messages"], {"role": "user", "content": "next " * 30}]}
        assert chains.chat_block_hashes(body, b"ns", BLOCK, session)[0] == full(body)
        assert len(rendered) <= 3, len(rendered)  # the new message and where the stored one ends
        # an equal copy (a body parsed whole) is still compared rendered, and still matches
        copy = orjson.loads(orjson.dumps(first))
        rendered.clear()
        assert chains.chat_block_hashes(copy, b"ns", BLOCK, session)[0] == full(copy)
        assert len(rendered) >= len(calls)


def test_a_message_that_is_not_an_object_counts_as_a_part_that_renders_nothing():
    chains = PrefixChains(max_bytes=1 << 20, min_bytes=0)
    messages = [{"role": "user", "content": "a " * 100}, 7, "text", None, {"role": "tool", "content": "b " * 50}]
    for end in range(1, len(messages) + 1):
        body = {"model": "m", "messages": messages[:end] + [["x"]] * (end % 2)}
        assert chains.chat_block_hashes(body, b"ns", BLOCK, "s")[0] == full(body)
    assert chains.hits


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(_chat_step, min_size=1, max_size=40), keyed=st.booleans(),
       shared=st.sampled_from(["objects", "parsed"]), max_bytes=st.sampled_from([300, 1 << 20]))
def test_chat_hashes_of_bodies_sharing_the_stored_messages_equal_the_full_hash(steps, keyed, shared, max_bytes):
    """As the live router sees them: each turn's body holds the very message objects of the turns
    before it (a body parsed from a stored prefix shares its messages), so stored parts are met
    again by identity, not only by equality."""
    from kvrouter.router.body_prefixes import BodyPrefixes

    chains = PrefixChains(max_bytes=max_bytes, min_bytes=0)
    bodies = BodyPrefixes(max_bytes=1 << 20, min_bytes=0)
    sessions: list[list] = [[{"role": "system", "content": "base " * 30}], [{"role": "system", "content": "base " * 30}], []]
    tools: list = [None, None, None]
    current = 0
    for step in steps:
        current = _apply_chat_step(sessions, tools, current, step)
        body = {"model": "m", "messages": list(sessions[current])}  # the message objects themselves
        if tools[current]:
            body["tools"] = tools[current]
        session = f"s{current}" if keyed else None
        if shared == "parsed":
            raw = orjson.dumps(body)
            body = bodies.loads(raw, session)
            assert body == orjson.loads(raw)
        data = prompt_bytes_and_boundaries(CHAT, body)[0]
        assert chains.chat_block_hashes(body, b"ns", BLOCK, session) == \
            (text_block_hashes(data, b"ns", BLOCK), len(data))


def test_block_hashes_are_each_blocks_chained_digest_as_a_signed_int():
    """Pinned: block i's hash is the 8-byte blake2b digest (keyed by nothing, seeded with the
    namespace) of blocks 0..i, read as a signed big-endian int; continuing a chain from a
    stored state gives the same hashes as hashing the whole."""
    import hashlib

    from kvrouter.router.prefix import chain_block_hashes, text_block_hashes

    data = bytes(range(256)) * 9 + b"tail"
    reference, h = [], hashlib.blake2b(b"ns", digest_size=8)
    for begin in range(0, len(data) - 63, 64):
        h.update(data[begin:begin + 64])
        reference.append(int.from_bytes(h.copy().digest(), "big", signed=True))
    assert text_block_hashes(data, b"ns", 64) == tuple(reference)
    assert any(x < 0 for x in reference) and any(x > 0 for x in reference)
    hasher, head = chain_block_hashes(hashlib.blake2b(b"ns", digest_size=8), data[:640], 0, 64, ())
    assert chain_block_hashes(hasher, data, 640, 64, head)[1] == tuple(reference)
    assert chain_block_hashes(hashlib.blake2b(b"ns", digest_size=8), b"short", 0, 64, ())[1] == ()
