"""Add a member to a client's JSON object body without parsing, re-serializing or copying it.

A body of hundreds of KB costs a dump (and a parse) when the router adds one member the
object model's way, and a copy when the member is joined into its bytes. Here the member goes
in front of the object's closing brace in a `SplicedBody`: the client's bytes and the member as
pieces, which the upstream connection writes with one vectored write. A key the object already
has is named twice: JSON parsers (Python's json, pydantic via FastAPI, orjson) keep the last
value, which is the one added.
"""

from __future__ import annotations

_JSON_SPACE = b" \t\r\n"


class SplicedBody:
    """A JSON object body as pieces: the client's bytes (views, not copies) with members added.
    Its last piece is the object's closing brace and whatever followed it."""

    __slots__ = ("pieces", "_length")

    def __init__(self, pieces: tuple[bytes | memoryview, ...]) -> None:
        self.pieces = pieces
        self._length = sum(len(piece) for piece in pieces)

    def __len__(self) -> int:
        return self._length

    def __bytes__(self) -> bytes:
        return b"".join(self.pieces)


def body_bytes(body: bytes | SplicedBody) -> bytes:
    """The body as one bytes object (a spliced one joined: one copy)."""
    return body if isinstance(body, bytes) else bytes(body)


def with_member(raw: bytes | SplicedBody, member: bytes) -> SplicedBody:
    """`raw`, a valid JSON object (whitespace around it allowed), with `member` (`"key":value`,
    valid JSON) as its last member."""
    if isinstance(raw, SplicedBody):  # it has a member already: the one added last
        *before, closing = raw.pieces
        return SplicedBody((*before, b"," + member, closing))
    end = len(raw)
    while raw[end - 1] in _JSON_SPACE:
        end -= 1
    brace = end - 1  # the object's closing brace
    last = brace
    while raw[last - 1] in _JSON_SPACE:
        last -= 1
    comma = b"" if raw[last - 1] == ord("{") else b","  # `{}`: no member before this one
    view = memoryview(raw)
    return SplicedBody((view[:brace], comma + member, view[brace:]))
