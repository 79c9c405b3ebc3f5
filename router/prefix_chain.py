"""Prefix block hashes that cost only the new bytes of an append-only conversation.

Coding-agent sessions resend their whole prompt every turn and add a few KB to its end. Hashing
the whole prompt again each turn makes the router's CPU per request grow with the conversation;
`PrefixChains` keeps the chain state of recent prompts (bounded by their bytes, least recently
used first out), finds the one the new prompt extends, proves it does byte for byte, and hashes
only the bytes after it. The result always equals `text_block_hashes` of the whole prompt.

A stored prompt is found by the request's session key, or, without one, by where it ended: the
previous turn's prompt ended at a message boundary of the new one, so each of the new prompt's
last boundaries is looked up by (offset, the bytes just before it). A candidate is used only if
the new prompt starts with its stored bytes (one memcmp), never on a length or a digest alone.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from .prefix import chain_block_hashes

# Bytes before a boundary that name it in the index (the whole stored prompt is compared anyway).
_TAIL_BYTES = 32
# Message boundaries tried per keyless request, newest first: a turn adds a few messages.
_MAX_BOUNDARY_TRIES = 32
# Per stored block hash: the tuple slot and the int object, roughly.
_BYTES_PER_HASH = 48
_MAX_SESSIONS = 1 << 16

_EndKey = tuple[bytes, int, int, bytes]  # namespace, block size, prompt length, its last bytes


class _Chain:
    __slots__ = ("data", "hasher", "hashes", "session")

    def __init__(self, data: bytes, hasher: "hashlib._Hash", hashes: tuple[int, ...],
                 session: tuple[bytes, str] | None) -> None:
        self.data = data  # the prompt, to prove a new one extends it
        self.hasher = hasher  # chain state after the last whole block
        self.hashes = hashes
        self.session = session

    @property
    def cost(self) -> int:
        return len(self.data) + _BYTES_PER_HASH * len(self.hashes)


def _end_key(ns: bytes, block_chars: int, data: bytes, end: int) -> _EndKey:
    return ns, block_chars, end, data[max(0, end - _TAIL_BYTES):end]


class PrefixChains:
    """Bounded store of recent prompts' hash chains. `max_bytes` bounds the prompts kept (their
    bytes and their hashes); prompts shorter than `min_bytes` are hashed whole and not kept."""

    def __init__(self, max_bytes: int, min_bytes: int = 4096) -> None:
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self._by_end: OrderedDict[_EndKey, _Chain] = OrderedDict()
        self._by_session: OrderedDict[tuple[bytes, str], _EndKey] = OrderedDict()
        self._bytes = 0
        self.hits = 0  # requests that hashed only a suffix
        self.misses = 0

    def __len__(self) -> int:
        return len(self._by_end)

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    def block_hashes(
        self,
        data: bytes,
        ns: bytes,
        block_chars: int,
        session: str | None = None,
        boundaries: Sequence[int] = (),
    ) -> tuple[int, ...]:
        """`text_block_hashes(data, ns, block_chars)`, hashing only what follows the longest
        stored prompt found (by `session`, or at one of the message `boundaries`, offsets into
        `data`) that `data` starts with."""
        if len(data) < self.min_bytes or self.max_bytes <= 0:
            return chain_block_hashes(hashlib.blake2b(ns, digest_size=8), data, 0, block_chars, ())[1]
        found = self._find(data, ns, block_chars, session, boundaries)
        if found is None:
            self.misses += 1
            hasher, hashes = chain_block_hashes(hashlib.blake2b(ns, digest_size=8), data, 0,
                                                block_chars, ())
        else:
            self.hits += 1
            hasher, hashes = chain_block_hashes(found.hasher.copy(), data, len(found.hashes) * block_chars,
                                                block_chars, found.hashes)
            if len(found.data) < len(data):
                self._drop(_end_key(ns, block_chars, found.data, len(found.data)))  # superseded
        self._keep(_Chain(data, hasher, hashes, (ns, session) if session else None), ns, block_chars)
        return hashes

    def _find(self, data: bytes, ns: bytes, block_chars: int, session: str | None,
              boundaries: Sequence[int]) -> _Chain | None:
        if session:
            key = self._by_session.get((ns, session))
            chain = self._by_end.get(key) if key is not None else None
            if chain is not None and key is not None and key[1] == block_chars \
                    and data.startswith(chain.data):
                return chain
        for end in reversed(boundaries[-_MAX_BOUNDARY_TRIES:]):
            if end <= 0 or end > len(data):
                continue
            chain = self._by_end.get(_end_key(ns, block_chars, data, end))
            if chain is not None and data.startswith(chain.data):
                return chain
        return None

    def _keep(self, chain: _Chain, ns: bytes, block_chars: int) -> None:
        if chain.cost > self.max_bytes:
            return
        key = _end_key(ns, block_chars, chain.data, len(chain.data))
        self._drop(key)
        self._by_end[key] = chain
        self._bytes += chain.cost
        if chain.session is not None:
            self._by_session[chain.session] = key
            self._by_session.move_to_end(chain.session)
            if len(self._by_session) > _MAX_SESSIONS:
                self._by_session.popitem(last=False)
        while self._bytes > self.max_bytes:
            oldest = next(iter(self._by_end))
            self._drop(oldest)

    def _drop(self, key: _EndKey) -> None:
        chain = self._by_end.pop(key, None)
        if chain is None:
            return
        self._bytes -= chain.cost
        if chain.session is not None and self._by_session.get(chain.session) == key:
            del self._by_session[chain.session]
