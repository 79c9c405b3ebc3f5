"""A large body is read into the bytes its handler gets (router/body_bytes.py): those bytes are
ordinary bytes once filled, and the bytearray fallback holds the same bytes."""

from __future__ import annotations

import hashlib
import random

import pytest

from kvrouter.router import body_bytes
from kvrouter.router.body_bytes import blank_body, body_with_room


@pytest.mark.parametrize("in_place", [True, False])
def test_filled_body_is_ordinary_bytes(in_place: bool) -> None:
    # The interpreters the router runs on (CPython 3.11+) pass the layout check made at import.
    assert body_bytes.in_place_available()
    data = random.Random(1).randbytes(300_000)
    body, view = blank_body(len(data), in_place)
    assert type(body) is (bytes if in_place else bytearray) and len(view) == len(data)
    view[:] = data
    del view
    assert body == data and bytes(body) == data
    if in_place:
        assert hash(body) == hash(data) and {data: 1}[body] == 1
        assert body.startswith(data[:1000]) and body[-5:] == data[-5:]
        assert hashlib.sha256(body).digest() == hashlib.sha256(data).digest()


@pytest.mark.parametrize("in_place", [True, False])
def test_body_with_room_copies_what_came_and_leaves_the_rest(in_place: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    if not in_place:
        monkeypatch.setattr(body_bytes, "_OFFSET", None)
    data = random.Random(3).randbytes(150_000)
    received = [data[:10], memoryview(data)[10:4000], data[4000:65_000]]
    body, rest = body_with_room(received, len(data) - 65_000)
    assert len(rest) == len(data) - 65_000
    rest[:] = data[65_000:]
    del rest
    assert bytes(body) == data
