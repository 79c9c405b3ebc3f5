"""Session identity and prefix block hashes of a request, from its parsed body.

Block hashes are chained (each covers everything before it) over a canonical rendering of the
whole prompt: tools, then every message's role and content, so two conversations share blocks
exactly as long as their text agrees. The chain is seeded by a namespace of model, LoRA,
`cache_salt` and `extra_key`, because SGLang never shares cache across those.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

# ~64 tokens at ~4 characters per token: one SGLang page for Kimi/DeepSeek MLA on B200.
BLOCK_CHARS = 256
BLOCK_TOKENS = 64
DEFAULT_SESSION_HEADERS = ("x-session-id", "x-smg-routing-key", "x-dynamo-session-id")
DEFAULT_SESSION_FIELDS = ("session_id", "prompt_cache_key", "user")
_NAMESPACE_FIELDS = ("model", "lora_path", "lora", "cache_salt", "extra_key")


def session_key(
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    header_names: Sequence[str] = DEFAULT_SESSION_HEADERS,
    body_fields: Sequence[str] = DEFAULT_SESSION_FIELDS,
) -> str | None:
    """The session id from the first configured header, else body field; None if absent.
    It is an identity only: it never becomes prefix text."""
    for name in header_names:
        value = headers.get(name)
        if value:
            return value[:256]
    for name in body_fields:
        value = body.get(name)
        if isinstance(value, str) and value:
            return value[:256]
        if name == "session_id" and isinstance(body.get("session_params"), dict):
            nested = body["session_params"].get("id")
            if isinstance(nested, str) and nested:
                return nested[:256]
    return None


def namespace(body: Mapping[str, Any]) -> bytes:
    parts = [f"{k}={body[k]}" for k in _NAMESPACE_FIELDS if isinstance(body.get(k), (str, int))]
    return "\x1f".join(parts).encode()


def _content_bytes(content: Any) -> bytes:
    if isinstance(content, str):
        return content.encode("utf-8", "surrogatepass")
    if content is None:
        return b""
    return orjson.dumps(content)  # content parts, tool calls: canonical JSON


def render_tools(tools: Any) -> bytes:
    """A chat request's tools, as the canonical prompt renders them (when there are any)."""
    return b"tools\x1e" + orjson.dumps(tools) + b"\x1d"


def render_message(m: Mapping[str, Any]) -> bytes:
    """One chat message, as the canonical prompt renders it (`prompt_bytes`)."""
    role = str(m.get("role", "")).encode()
    calls = orjson.dumps(m["tool_calls"]) if m.get("tool_calls") else b""
    return b"".join((role, b"\x1e", _content_bytes(m.get("content")), calls, b"\x1d"))


def chat_parts(body: Mapping[str, Any]) -> list[Any]:
    """What a chat prompt is rendered from, one entry per `render_part`: the tools (if any),
    then every entry of "messages" (one that is not a message object renders as nothing)."""
    messages = body.get("messages") or ()
    # a copy in one C pass: no per-message check (that costs a call per message, ~10x more)
    parts: list[Any] = list(messages) if isinstance(messages, list) else []
    if body.get("tools"):
        parts.insert(0, _Tools(body["tools"]))
    return parts


class _Tools:
    """The tools entry of `chat_parts` (a message is a dict; this is not)."""

    __slots__ = ("tools",)

    def __init__(self, tools: Any) -> None:
        self.tools = tools

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Tools) and self.tools == other.tools

    __hash__ = None  # type: ignore[assignment]


def render_part(part: Any) -> bytes:
    if isinstance(part, _Tools):
        return render_tools(part.tools)
    return render_message(part) if isinstance(part, dict) else b""  # not a message: nothing


def plain_part(part: Any) -> bool:
    """Equal plain parts render equal. Others (tools, tool calls, content parts: JSON whose key
    order an equal value need not share; a role that is not a string) are compared rendered."""
    return (type(part) is dict and type(part.get("role", "")) is str
            and type(part.get("content", "")) in (str, type(None)) and not part.get("tool_calls"))


def prompt_bytes(route: str, body: Mapping[str, Any]) -> bytes:
    """The prompt as one canonical byte string (not the wire JSON, whose key order may vary)."""
    return prompt_bytes_and_boundaries(route, body)[0]


def prompt_bytes_and_boundaries(route: str, body: Mapping[str, Any]) -> tuple[bytes, tuple[int, ...]]:
    """`prompt_bytes`, and the offsets in it where a chat request's tools and each message end
    (where an earlier turn of the same conversation ended); none for other routes."""
    if route == "/v1/chat/completions":
        parts: list[bytes] = []
        ends: list[int] = []
        size = 0
        if body.get("tools"):
            part = render_tools(body["tools"])
            parts.append(part)
            size += len(part)
            ends.append(size)
        for m in body.get("messages") or ():
            if isinstance(m, dict):  # pieces joined once: the prompt is copied once, not per piece
                role = str(m.get("role", "")).encode()
                content = _content_bytes(m.get("content"))
                parts += (role, b"\x1e", content)
                size += len(role) + len(content) + 2
                if m.get("tool_calls"):
                    calls = orjson.dumps(m["tool_calls"])
                    parts.append(calls)
                    size += len(calls)
                parts.append(b"\x1d")
                ends.append(size)
        return b"".join(parts), tuple(ends)
    if route == "/generate" and isinstance(body.get("input_ids"), list):
        ids = [i for i in body["input_ids"] if isinstance(i, int) and 0 <= i < 2**32]
        return array("I", ids).tobytes(), ()  # 4 bytes per token keeps block size in step
    key = "text" if route == "/generate" else "prompt"
    return _content_bytes(body.get(key)), ()


def text_block_hashes(data: bytes, ns: bytes, block_chars: int = BLOCK_CHARS) -> tuple[int, ...]:
    """Chained 64-bit hashes (blake2b) of every whole block of the prompt text `data`: the shadow
    index's blocks. Not SGLang's block hashes (sglang_protocol/block_hash.py hashes token ids)."""
    return chain_block_hashes(hashlib.blake2b(ns, digest_size=8), data, 0, block_chars, ())[1]


def chain_block_hashes(
    hasher: "hashlib._Hash", data: bytes, start: int, block_chars: int, before: tuple[int, ...]
) -> tuple["hashlib._Hash", tuple[int, ...]]:
    """Continue a block chain: `hasher` has absorbed `data[:start]` (whole blocks, whose hashes
    are `before`); returns it having absorbed every whole block of `data`, and all the hashes."""
    view = memoryview(data)
    update, copy = hasher.update, hasher.copy
    digests = []
    for begin in range(start, len(data) - block_chars + 1, block_chars):
        update(view[begin : begin + block_chars])
        digests.append(copy().digest())
    # each 8-byte digest as a signed big-endian int, all in one call (not one per block)
    out = struct.unpack(f">{len(digests)}q", b"".join(digests)) if hasher.digest_size == 8 \
        else tuple(int.from_bytes(digest, "big", signed=True) for digest in digests)
    return hasher, before + out if before else out
