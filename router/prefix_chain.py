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

A chat request need not even be rendered whole (`chat_block_hashes`): its stored turn keeps the
parsed messages instead of their bytes, a candidate is found by (message count, the last
message's rendered tail) and proved by comparing the messages as parsed (a memcmp per string;
those whose JSON key order could differ under equal values are compared rendered), and only the
messages after it are rendered.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from .prefix import chain_block_hashes, chat_parts, namespace, plain_part, render_part

# Bytes before a boundary that name it in the index (the whole stored prompt is compared anyway).
_TAIL_BYTES = 32
# Message boundaries tried per keyless request, newest first: a turn adds a few messages.
_MAX_BOUNDARY_TRIES = 32
_SHORT_PARTS = 4  # a chat prompt of at most this many messages is checked for being short
# Per stored block hash: the tuple slot and the int object, roughly.
_BYTES_PER_HASH = 48
_MAX_SESSIONS = 1 << 16

# Per stored chat message: its list slot, dict and strings' headers, roughly.
_BYTES_PER_PART = 400

# (namespace, block size, prompt length, its last bytes), or for a chat chain
# ("chat", namespace, block size, message count, its last message's last bytes)
_EndKey = tuple


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


class _ChatChain:
    """A chat prompt's chain state, kept as the parts (tools, messages) it was rendered from."""

    __slots__ = ("parts", "rendered", "length", "tail", "hasher", "hashes", "session")

    def __init__(self, parts: list[Any], rendered: dict[int, bytes], length: int, tail: bytes,
                 hasher: "hashlib._Hash", hashes: tuple[int, ...], session: tuple[bytes, str] | None) -> None:
        self.parts = parts
        self.rendered = rendered  # the parts not `plain_part`, rendered: compared as bytes
        self.length = length  # of the rendered prompt
        self.tail = tail  # its bytes after the last whole block
        self.hasher = hasher
        self.hashes = hashes
        self.session = session

    @property
    def cost(self) -> int:
        return self.length + _BYTES_PER_PART * len(self.parts) + _BYTES_PER_HASH * len(self.hashes)

    def prefix_of(self, parts: list[Any], render: "Callable[[int], bytes]") -> bool:
        """Whether `parts` start with this prompt's parts, rendering as they would. A part that
        is the stored object itself (a body parsed from a stored prefix shares its messages,
        never changed in place) is not rendered again."""
        mine = self.parts
        count = len(mine)
        if count > len(parts) or parts[:count] != mine:
            return False
        return all(parts[i] is mine[i] or render(i) == old for i, old in self.rendered.items())


def _chat_key(ns: bytes, block_chars: int, count: int, last: bytes) -> _EndKey:
    return "chat", ns, block_chars, count, last[-_TAIL_BYTES:]


def _end_key(ns: bytes, block_chars: int, data: bytes, end: int) -> _EndKey:
    return ns, block_chars, end, data[max(0, end - _TAIL_BYTES):end]


class PrefixChains:
    """Bounded store of recent prompts' hash chains. `max_bytes` bounds the prompts kept (their
    bytes and their hashes); prompts shorter than `min_bytes` are hashed whole and not kept."""

    def __init__(self, max_bytes: int, min_bytes: int = 4096) -> None:
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self._by_end: OrderedDict[_EndKey, _Chain | _ChatChain] = OrderedDict()
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

    def chat_block_hashes(self, body: dict[str, Any], ns: bytes | None, block_chars: int,
                          session: str | None = None) -> tuple[tuple[int, ...], int]:
        """`text_block_hashes(prompt_bytes(chat route, body), ns, block_chars)` and the prompt's
        length, rendering only the messages after the longest stored chat prompt found (by
        `session`, or by its message count and last message) that this one extends. `ns` None:
        the body's own `namespace` (made only if a block is hashed)."""
        parts = chat_parts(body)
        short = self._short_chat(parts)
        if short is not None:
            length = len(short)
            if length < block_chars:  # not one whole block: nothing to hash
                return (), length
            if ns is None:
                ns = namespace(body)
            return chain_block_hashes(hashlib.blake2b(ns, digest_size=8), short, 0, block_chars, ())[1], length
        renders: dict[int, bytes] = {}

        def render(i: int) -> bytes:
            out = renders.get(i)
            if out is None:
                out = renders[i] = render_part(parts[i])
            return out

        if ns is None:
            ns = namespace(body)
        found = self._find_chat(parts, render, ns, block_chars, session) if self.max_bytes > 0 else None
        if found is None and session and self.max_bytes > 0:
            rewritten = self._last_message_rewritten(parts, render, ns, block_chars, session)
            if rewritten is not None:
                return rewritten
        start = len(found.parts) if found is not None else 0
        suffix = b"".join([render(i) for i in range(start, len(parts))])
        if found is None:
            length = len(suffix)
            hasher, hashes = chain_block_hashes(hashlib.blake2b(ns, digest_size=8), suffix, 0,
                                                block_chars, ())
            if length < self.min_bytes or self.max_bytes <= 0:
                return hashes, length
            self.misses += 1
            tail = suffix[len(hashes) * block_chars:]
        else:
            self.hits += 1
            length = found.length + len(suffix)
            todo = found.tail + suffix
            hasher, hashes = chain_block_hashes(found.hasher.copy(), todo, 0, block_chars, found.hashes)
            tail = todo[(len(hashes) - len(found.hashes)) * block_chars:]
            if start < len(parts):
                self._drop(_chat_key(ns, block_chars, start, render(start - 1)))  # superseded
        rendered = dict(found.rendered) if found is not None else {}
        rendered.update((i, render(i)) for i in range(start, len(parts)) if not plain_part(parts[i]))
        chain = _ChatChain(parts, rendered, length, tail, hasher, hashes,
                           (ns, session) if session else None)
        if parts:
            self._keep_at(_chat_key(ns, block_chars, len(parts), render(len(parts) - 1)), chain)
        return hashes, length

    def _short_chat(self, parts: list[Any]) -> bytes | None:
        """The whole rendered prompt of a chat request of a few short plain messages, when it
        is under `min_bytes`; else None. Such a prompt is hashed whole and not kept, with no
        lookup: it cannot extend a kept one (those are `min_bytes` long or more)."""
        if len(parts) > _SHORT_PARTS:
            return None
        chars = 0
        for part in parts:
            content = part.get("content") if type(part) is dict else None
            if type(content) is not str:
                return None
            chars += len(content)
        if chars >= self.min_bytes:  # (no render yet: a long prompt is rendered only as needed)
            return None
        rendered = b"".join([render_part(part) for part in parts])
        return rendered if len(rendered) < self.min_bytes else None

    def _last_message_rewritten(self, parts: list[Any], render: Callable[[int], bytes], ns: bytes,
                                block_chars: int, session: str) -> "tuple[tuple[int, ...], int] | None":
        """`chat_block_hashes` of a prompt that differs from the session's stored one only after
        the stored chain's last whole block, inside its last message (a client that sends the
        conversation as one message that grows each turn, as trace replays do, rewriting its
        partial last block), hashing only from that block on; None if it is not one. The earlier
        parts are compared as `_find_chat` compares them, the last message's shared bytes by a
        memcmp of the two renderings."""
        key = self._by_session.get((ns, session))
        chain = self._by_end.get(key) if key is not None else None
        if not isinstance(chain, _ChatChain) or key[2] != block_chars or key[3] != len(parts) \
                or not parts:
            return None
        last = len(parts) - 1
        earlier = {i: r for i, r in chain.rendered.items() if i != last}
        head = _ChatChain(chain.parts[:-1], earlier, 0, b"", chain.hasher, (), None)
        if not head.prefix_of(parts[:-1], render):
            return None
        old = render_part(chain.parts[-1])
        shared = len(chain.hashes) * block_chars - (chain.length - len(old))  # of the last message
        new = render(last)
        if shared <= 0 or len(new) < shared or old[:shared] != new[:shared]:
            return None
        todo = new[shared:]
        hasher, hashes = chain_block_hashes(chain.hasher.copy(), todo, 0, block_chars, chain.hashes)
        rendered = earlier
        if not plain_part(parts[last]):
            rendered[last] = new
        rewritten = _ChatChain(parts, rendered, chain.length - len(old) + len(new),
                               todo[(len(hashes) - len(chain.hashes)) * block_chars:], hasher, hashes,
                               chain.session)
        self.hits += 1
        self._drop(key)  # superseded
        self._keep_at(_chat_key(ns, block_chars, len(parts), new), rewritten)
        return hashes, rewritten.length

    def _find_chat(self, parts: list[Any], render: Callable[[int], bytes], ns: bytes,
                   block_chars: int, session: str | None) -> "_ChatChain | None":
        if session:
            key = self._by_session.get((ns, session))
            chain = self._by_end.get(key) if key is not None else None
            if isinstance(chain, _ChatChain) and key[2] == block_chars and chain.prefix_of(parts, render):
                return chain
        for count in range(len(parts), max(0, len(parts) - _MAX_BOUNDARY_TRIES), -1):
            chain = self._by_end.get(_chat_key(ns, block_chars, count, render(count - 1)))
            if isinstance(chain, _ChatChain) and chain.prefix_of(parts, render):
                return chain
        return None

    def _find(self, data: bytes, ns: bytes, block_chars: int, session: str | None,
              boundaries: Sequence[int]) -> _Chain | None:
        if session:
            key = self._by_session.get((ns, session))
            chain = self._by_end.get(key) if key is not None else None
            if isinstance(chain, _Chain) and key is not None and key[1] == block_chars \
                    and data.startswith(chain.data):
                return chain
        for end in reversed(boundaries[-_MAX_BOUNDARY_TRIES:]):
            if end <= 0 or end > len(data):
                continue
            chain = self._by_end.get(_end_key(ns, block_chars, data, end))
            if isinstance(chain, _Chain) and data.startswith(chain.data):
                return chain
        return None

    def _keep(self, chain: _Chain, ns: bytes, block_chars: int) -> None:
        self._keep_at(_end_key(ns, block_chars, chain.data, len(chain.data)), chain)

    def _keep_at(self, key: _EndKey, chain: "_Chain | _ChatChain") -> None:
        if chain.cost > self.max_bytes:
            return
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
