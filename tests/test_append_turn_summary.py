"""The append-turn fast path as a whole: a chat body parsed from a stored prefix on
(`BodyPrefixes`) and summarized with stored hash chains (`PrefixChains`) gives the same summary
and prompt size as parsing the body whole and hashing its whole prompt, turn after turn, on
random conversations (tool calls, tools, image parts, non-ASCII text, non-object messages) whose
bodies are sometimes edited before their end or truncated instead of extended, sent with their own
session key, another's or none; the shadow index fed those summaries holds what it holds when fed
the whole computation's."""

from __future__ import annotations

import json
import random
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.router.body_prefixes import BodyPrefixes
from kvrouter.router.config import RoutingConfig
from kvrouter.router.kv_index_shadow import ShadowKVIndex
from kvrouter.router.prefix import chat_parts, prompt_bytes, render_part
from kvrouter.router.prefix_chain import PrefixChains
from kvrouter.router.summary import summarize

CHAT = "/v1/chat/completions"
_TEXTS = ["plain text " * 40, "naïve café — 東京 🙂 " * 20, 'quote " back\\slash \u2028 ' * 10, ""]


def _message(rng: Any) -> Any:
    kind = rng.random()
    if kind < 0.5:
        return {"role": rng.choice(["user", "assistant"]), "content": rng.choice(_TEXTS) + str(rng.random())}
    if kind < 0.65:
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{rng.randint(0, 9)}", "type": "function",
             "function": {"name": "read", "arguments": json.dumps({"path": "é/" * rng.randint(1, 9)})}}]}
    if kind < 0.75:
        return {"role": "tool", "tool_call_id": "c1", "content": "résultat " * rng.randint(1, 60)}
    if kind < 0.9:
        return {"role": "user", "content": [
            {"type": "text", "text": rng.choice(_TEXTS)},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "iVBORw0K" * rng.randint(1, 80)}}]}
    return rng.choice([7, "a bare string", None, ["x"]])  # not a message: skipped by the render


def _edit(rng: Any, messages: list[Any]) -> list[Any]:
    """The conversation with one message before its end rewritten (a client that compacts)."""
    edited = list(messages)
    at = rng.randrange(len(edited))
    edited[at] = {"role": "user", "content": f"rewritten {rng.random()} ü"}
    return edited


def _turns(rng: Any) -> tuple[BodyPrefixes, PrefixChains]:
    """Random turns through both stores, each checked against the whole computation."""
    config = RoutingConfig(block_chars=64)
    store = BodyPrefixes(max_bytes=rng.choice([1 << 24, 30_000]), min_bytes=rng.choice([0, 4096]))
    chains = PrefixChains(max_bytes=rng.choice([1 << 24, 30_000]), min_bytes=rng.choice([0, 4096]))
    conversations: list[list[Any]] = [[{"role": "system", "content": "système " * rng.randint(50, 900)}]
                                      for _ in range(2)]
    extra = rng.choice([{}, {"tools": [{"type": "function", "function": {"name": "read"}}]}])
    # the shadow index fed the fast summaries, and one fed the whole computation's
    shadows = (ShadowKVIndex(), ShadowKVIndex())
    for _ in range(rng.randint(3, 12)):
        which = rng.randrange(len(conversations))
        change = rng.random()
        if change < 0.15:
            conversations[which] = _edit(rng, conversations[which])
        elif change < 0.25:  # truncated: a client that drops its latest turns
            conversations[which] = conversations[which][:rng.randint(1, len(conversations[which]))]
        conversations[which] += [_message(rng) for _ in range(rng.randint(1, 3))]
        body = orjson.dumps({"model": "m", "messages": conversations[which], "stream": True, **extra})
        # a session key is usually the conversation's own, sometimes another's (a switch)
        session = which if rng.random() < 0.8 else rng.randrange(len(conversations))
        headers = rng.choice([{}, {"x-session-id": f"s{session}"}])
        fast = store.loads(body, headers.get("x-session-id"))
        whole = orjson.loads(body)
        assert fast == whole
        assert chat_parts(fast) == chat_parts(whole)
        summary = summarize(CHAT, fast, headers, config, chains=chains)
        computed = summarize(CHAT, whole, headers, config)
        assert summary == computed
        blocks = summary[0].prefix_blocks, computed[0].prefix_blocks
        assert shadows[0].match(blocks[0]) == shadows[1].match(blocks[1])
        for shadow, chain in zip(shadows, blocks):
            shadow.record("r", chain)
        assert set(shadows[0].held_blocks("r")) == set(shadows[1].held_blocks("r"))
    return store, chains


@settings(max_examples=40, deadline=None)
@given(rng=st.randoms(use_true_random=False))
def test_a_turn_parsed_from_a_stored_prefix_summarizes_as_the_whole_body(rng: Any) -> None:
    _turns(rng)


def test_the_random_turns_take_the_fast_paths() -> None:
    rng = random.Random(3)
    hits = [(store.hits, chains.hits) for store, chains in (_turns(rng) for _ in range(20))]
    assert sum(h for h, _ in hits) > 20 and sum(h for _, h in hits) > 20, hits


def test_chat_parts_keeps_the_message_objects_and_renders_what_is_not_one_as_nothing() -> None:
    messages: list[Any] = [{"role": "user", "content": "a"}, 3, "s", None, [1], {"role": "tool"}]
    body = {"messages": messages, "tools": [{"type": "function"}]}
    parts = chat_parts(body)
    assert len(parts) == 7 and parts[1] is messages[0] and parts[6] is messages[5]
    assert [render_part(part) for part in parts[2:6]] == [b""] * 4
    assert b"".join(render_part(part) for part in parts) == prompt_bytes(CHAT, body)
    assert chat_parts({"messages": "not a list"}) == [] and chat_parts({}) == []
    assert chat_parts({"messages": messages})[0] is messages[0]
