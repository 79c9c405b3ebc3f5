"""Parse a chat request body that extends a recent one by parsing only its new bytes.

A coding agent's next turn resends its whole conversation with a few messages appended, so its
JSON body starts with the previous body's bytes up to the end of that body's last message.
`BodyPrefixes` keeps, for recent bodies, that prefix (the body itself and a length: no copy) with
its parse, finds one the new body starts with (a memcmp of the whole prefix, never a digest),
and parses only the rest: the result equals `orjson.loads` of the whole body, and the body is
valid JSON exactly when that rest is a valid continuation of the proven prefix.

How the rest is parsed: the prefix ends inside the top-level "messages" array, right after a
value, so the rest is parsed behind `{"messages":["<nonce>"`, which leaves the parser in that
same state. The nonce (random per process, never sent anywhere) proves the parsed "messages"
is the array the prefix opened and not a later duplicate key, and, appended to a prefix, that
the array open at its end is "messages". Key order and duplicate keys come out as a full parse
gives them (first position, last value), since the members merge like a dict's updates.

Where a body's prefix ends (before the `]` closing "messages") is found from the right: a `]`
followed by the next member's name (or by the object's end). In a body that extends a stored
prefix, it is proven at once by parsing the new bytes up to it with the nonce at both ends. In a
body parsed whole, it is only a candidate (what follows it must parse as the same members; at
most one more body's bytes are tried), proven by parsing the prefix once when a later body
extends it: a one-off prompt is never parsed twice.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

import orjson

_NONCE = secrets.token_hex(16)
_NONCE_JSON = orjson.dumps(_NONCE)
_OPEN = b'{"messages":[' + _NONCE_JSON  # a parser state like a prefix's end, marked
_CLOSE = b"," + _NONCE_JSON + b"]}"  # closes a prefix, marking the array open at its end
_OPEN_EMPTY = b'{"messages":['
# Bytes before a checkpoint offset that name a prefix in the index (the whole one is compared).
_TAIL_BYTES = 64
# Places tried, from the right, when locating the end of "messages" in a whole body.
_MAX_CANDIDATES = 16
_CLOSER, _COMMA = ord("]"), ord(",")
_JSON_SPACE = b" \t\r\n"
_PER_CHECKPOINT = 4
_MAX_SESSIONS = 1 << 16
# Every byte but those `_parsed_size` counts.
_NOT_MARKS = bytes(b for b in range(256) if b not in b'{[,"')


def _parsed_size(data: bytes, start: int, end: int) -> int:
    """The memory of the Python objects parsed from `data[start:end]`, over-estimated (by up
    to about twice, never under, as measured on CPython 3.11): its decoded text, and a dict per
    `{`, a list per `[`, a list slot and a number per `,`, half a str per `"`. Short messages
    cost many times their JSON bytes; the store's bound counts what they cost."""
    marks = data[start:end].translate(None, _NOT_MARKS)  # one pass; the four counts then
    count = marks.count  # walk only the (few) structural bytes
    return (end - start) + 100 * count(b"{") + 56 * count(b"[") + 32 * count(b",") + 20 * count(b'"')


class _Prefix:
    __slots__ = ("body", "length", "parsed", "parsed_bytes", "checkpoint", "session")

    def __init__(self, body: bytes, length: int, parsed: dict[str, Any] | None,
                 session: str | None, parsed_bytes: int = 0) -> None:
        self.body = body  # a body that starts with the prefix
        self.length = length  # the prefix is body[:length]: its last message, then "]" follows
        # the prefix's own members as parsed from it, "messages" last-valued with its messages;
        # None until proven (a later body extends it)
        self.parsed = parsed
        self.parsed_bytes = parsed_bytes  # the memory `parsed` holds (`_parsed_size`)
        self.checkpoint = _checkpoint_key(body, length)
        self.session = session

    @property
    def cost(self) -> int:
        return len(self.body) + self.parsed_bytes


def _checkpoint(length: int) -> int:
    return 1 << (length.bit_length() - 1)


def _checkpoint_key(data: bytes, length: int) -> tuple[int, bytes]:
    at = _checkpoint(length)
    return at, data[at - _TAIL_BYTES:at]


def _before_space(body: bytes, end: int) -> int:
    """`end` moved back over JSON whitespace."""
    while end > 0 and body[end - 1] in _JSON_SPACE:
        end -= 1
    return end


def _value_end(body: bytes, closer: int) -> int:
    """Where the last value before the `]` at `closer` ends: a next turn puts a comma there."""
    return _before_space(body, closer)


def _candidates(body: bytes, later: list[str], start: int) -> Iterable[int]:
    """Where "messages" may close in `body` after `start`, `later` naming the members after it:
    a `]` followed by the object's end, or (from the right, a few) by `,` and the next member's
    name as a client most likely writes it."""
    if not later:
        closer = _before_space(body, _before_space(body, len(body)) - 1) - 1  # before the "}"
        return (closer,) if closer > start and body[closer] == _CLOSER else ()
    return _closers_before(body, orjson.dumps(later[0]), start)


def _closers_before(body: bytes, key: bytes, start: int) -> Iterator[int]:
    """From the right, a few offsets after `start` of a `]` followed by `,` and the member name
    `key`."""
    pos = len(body)
    for _ in range(_MAX_CANDIDATES):
        pos = body.rfind(key, start, pos)
        if pos < 0:
            return
        comma = _before_space(body, pos) - 1
        if comma > start and body[comma] == _COMMA:
            closer = _before_space(body, comma) - 1
            if closer > start and body[closer] == _CLOSER:
                yield closer


def _is_nonce(value: Any) -> bool:
    return type(value) is str and value == _NONCE


class BodyPrefixes:
    """Bounded store of recent chat bodies' parsed prefixes; `max_bytes` bounds the bodies kept
    and the memory of their parses, bodies shorter than `min_bytes` are parsed whole, not kept."""

    def __init__(self, max_bytes: int, min_bytes: int = 4096) -> None:
        self.max_bytes = max_bytes
        self.min_bytes = max(min_bytes, 2 * _TAIL_BYTES)
        self._lru: OrderedDict[int, _Prefix] = OrderedDict()
        self._by_checkpoint: dict[tuple[int, bytes], list[_Prefix]] = {}
        self._by_session: OrderedDict[str, _Prefix] = OrderedDict()
        self._bytes = 0
        self.hits = 0  # bodies parsed from a stored prefix on
        self.misses = 0

    def __len__(self) -> int:
        return len(self._lru)

    def loads(self, body: bytes, session: str | None = None) -> Any:
        """`orjson.loads(body)` (raising as it does), parsing only what follows the longest
        stored prefix found (by `session`, else by the body's bytes) that `body` starts with.
        The result shares its messages and other values with the store: read them, never
        change them in place (the top-level dict and its "messages" list are the caller's)."""
        if len(body) < self.min_bytes or self.max_bytes <= 0:
            return orjson.loads(body)
        found = self._find(body, session)
        if found is not None and (found.parsed is not None or self._prove(found)):
            parsed = self._extend(body, found, session)
            if parsed is not None:
                self.hits += 1
                return parsed
        self.misses += 1
        parsed = orjson.loads(body)
        if isinstance(parsed, dict) and type(parsed.get("messages")) is list and parsed["messages"]:
            end = self._messages_end(body, parsed)
            if end is not None:
                self._keep(_Prefix(body, end, None, session))
        return parsed

    def _find(self, body: bytes, session: str | None) -> _Prefix | None:
        if session is not None:
            chain = self._by_session.get(session)
            if chain is not None and chain.length < len(body) \
                    and body.startswith(memoryview(chain.body)[:chain.length]):
                return chain
        at = _checkpoint(len(body))
        while at >= self.min_bytes // 2:
            for chain in self._by_checkpoint.get((at, body[at - _TAIL_BYTES:at]), ()):
                if chain.length < len(body) and body.startswith(memoryview(chain.body)[:chain.length]):
                    return chain
            at >>= 1
        return None

    def _prove(self, chain: _Prefix) -> bool:
        """Parse the prefix (appending the nonce): proven when the array open at its end is
        "messages"; otherwise it is forgotten."""
        try:
            parsed = orjson.loads(b"".join((memoryview(chain.body)[:chain.length], _CLOSE)))
        except orjson.JSONDecodeError:
            parsed = None
        messages = parsed.get("messages") if isinstance(parsed, dict) else None
        if type(messages) is not list or not messages or not _is_nonce(messages[-1]):
            self._drop(chain)
            return False
        messages.pop()
        chain.parsed = parsed
        chain.parsed_bytes = _parsed_size(chain.body, 0, chain.length)
        self._bytes += chain.parsed_bytes
        return True

    def _extend(self, body: bytes, found: _Prefix, session: str | None) -> dict[str, Any] | None:
        """The parse of `body` from the proven prefix `found`; None to parse it whole (its rest is
        not valid JSON, to get the full parse's error, or names "messages" again)."""
        assert found.parsed is not None
        try:
            rest = orjson.loads(b"".join((_OPEN, memoryview(body)[found.length:])))
        except orjson.JSONDecodeError:
            return None
        new = rest.get("messages")
        if type(new) is not list or not new or not _is_nonce(new[0]):
            return None  # a duplicate "messages" member: whatever the full parse makes of it
        messages = found.parsed["messages"] + new[1:]
        parsed = dict(found.parsed)
        parsed.update(rest)
        parsed["messages"] = messages
        if len(new) > 1:
            end = self._end_of_new_messages(body, found.length, rest)
            if end is not None:
                prefix_parsed = dict(found.parsed)
                prefix_parsed["messages"] = messages[:]  # its own list: the caller gets `messages`
                self._drop(found)  # superseded
                self._keep(_Prefix(body, end, prefix_parsed, session, found.parsed_bytes
                                   + _parsed_size(body, found.length, end)))
                return parsed
        self._touch(found, session)
        return parsed

    def _end_of_new_messages(self, body: bytes, start: int, rest: dict[str, Any]) -> int | None:
        """Where "messages" ends in `body` (valid JSON) after `start` (a proven prefix's end),
        `rest` being the parse of what follows `start`: a candidate `]` (as `_candidates` finds
        them, after `start`), proven by parsing the bytes from `start` to it with the nonce at
        both ends and the new messages in between."""
        count = len(rest["messages"]) + 1  # the nonce, the new messages, the nonce again
        budget = len(body) - start  # at most the new bytes once more
        view = memoryview(body)
        for pos in _candidates(body, list(rest)[1:], start):
            budget -= pos - start
            if budget < 0:
                return None
            try:
                before = orjson.loads(b"".join((_OPEN, view[start:pos], _CLOSE)))
            except orjson.JSONDecodeError:
                continue
            messages = before.get("messages")
            if type(messages) is list and len(messages) == count \
                    and _is_nonce(messages[0]) and _is_nonce(messages[-1]):
                return _value_end(body, pos)
        return None

    def _messages_end(self, body: bytes, parsed: dict[str, Any]) -> int | None:
        """Where "messages" likely ends in `body` (parsed whole as `parsed`): a `]` followed by
        the member first named after it (the last of a few tried from the right), or by the
        object's end, which the bytes after it parse as. Only a candidate: proven when a later
        body extends it."""
        keys = list(parsed)
        later = keys[keys.index("messages") + 1:]  # members first named after "messages"
        view = memoryview(body)
        budget = len(body)  # bytes parsed after candidates: at most one more whole parse
        for pos in _candidates(body, later, 0):
            budget -= len(body) - pos
            if budget < 0:
                return None
            try:
                after = orjson.loads(b"".join((_OPEN_EMPTY, view[pos:])))
            except orjson.JSONDecodeError:
                continue
            try:
                if after.get("messages") == [] and all(k in after for k in later) and all(
                        k == "messages" or (k in parsed and parsed[k] == v)
                        for k, v in after.items()):
                    return _value_end(body, pos)
            except RecursionError:  # values nested about as deep as orjson reads: not kept
                return None
        return None

    def _keep(self, chain: _Prefix) -> None:
        if chain.cost > self.max_bytes or chain.length < self.min_bytes:
            return
        self._lru[id(chain)] = chain
        self._by_checkpoint.setdefault(chain.checkpoint, []).insert(0, chain)
        del self._by_checkpoint[chain.checkpoint][_PER_CHECKPOINT:]
        self._bytes += chain.cost
        if chain.session is not None:
            self._index_session(chain)
        while self._bytes > self.max_bytes and self._lru:
            self._drop(next(iter(self._lru.values())))

    def _touch(self, chain: _Prefix, session: str | None) -> None:
        self._lru.move_to_end(id(chain))
        if session is not None and chain.session is None:
            chain.session = session
            self._index_session(chain)

    def _index_session(self, chain: _Prefix) -> None:
        assert chain.session is not None
        self._by_session[chain.session] = chain
        self._by_session.move_to_end(chain.session)
        if len(self._by_session) > _MAX_SESSIONS:
            self._by_session.popitem(last=False)

    def _drop(self, chain: _Prefix) -> None:
        if self._lru.pop(id(chain), None) is None:
            return
        self._bytes -= chain.cost
        peers = self._by_checkpoint.get(chain.checkpoint)
        if peers is not None:
            if chain in peers:
                peers.remove(chain)
            if not peers:
                del self._by_checkpoint[chain.checkpoint]
        if chain.session is not None and self._by_session.get(chain.session) is chain:
            del self._by_session[chain.session]
