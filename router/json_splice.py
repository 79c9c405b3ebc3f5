"""Add a member to a client's JSON object body without parsing and re-serializing it.

A body of hundreds of KB costs a dump (and a parse) when the router adds one member the
object model's way; here the member is written in front of the object's closing brace and the
client's bytes are copied once. A key the object already has is named twice: JSON parsers
(Python's json, pydantic via FastAPI, orjson) keep the last value, which is the one added.
"""

from __future__ import annotations

_JSON_SPACE = b" \t\r\n"


def with_member(raw: bytes, member: bytes) -> bytes:
    """`raw`, a valid JSON object (whitespace around it allowed), with `member` (`"key":value`,
    valid JSON) as its last member."""
    end = len(raw)
    while raw[end - 1] in _JSON_SPACE:
        end -= 1
    brace = end - 1  # the object's closing brace
    last = brace
    while raw[last - 1] in _JSON_SPACE:
        last -= 1
    view = memoryview(raw)
    comma = b"" if raw[last - 1] == ord("{") else b","  # `{}`: no member before this one
    return b"".join((view[:brace], comma, member, view[brace:]))
