"""What a session sends: a :class:`TurnRequest` is a tuple of :class:`Segment` messages.

Every message is a :class:`Segment` (role, token count, content key). Its text is rendered lazily
and deterministically from the key at ~4 ASCII characters per token (:func:`synthetic_text`), so
the HTTP driver sends real text while the discrete-event simulator uses ``TurnRequest.segments`` /
token counts and never builds a string. Equal key = equal text = equal page keys
(:mod:`kvrouter.loadtest.segment_keys`), which is how sessions share prefix cache.

A reply becomes an assistant segment (:func:`reply_as_segment`): the text the server returned
(the driver), a token count (the simulator), or ``None`` (a failed request: the expected length).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Union

__all__ = [
    "CHARS_PER_TOKEN",
    "synthetic_text",
    "count_tokens",
    "Segment",
    "TurnRequest",
    "ReplyLike",
    "reply_as_segment",
]

CHARS_PER_TOKEN = 4

_WORDS = (
    "def", "return", "self", "import", "class", "if", "else", "for", "in", "while", "try",
    "except", "yield", "async", "await", "None", "True", "False", "value", "result", "items",
    "config", "request", "response", "cache", "token", "page", "index", "count", "buffer",
    "session", "replica", "prefix", "=", "==", "+=", "(", ")", ":", ",", ".", "[", "]", "0",
    "1", "x", "y", "n", "path", "len", "dict", "list", "str", "int", "assert", "raise",
)


def synthetic_text(key: str, n_tokens: int) -> str:
    """Deterministic pseudo-code of exactly ``4 * n_tokens`` ASCII characters for ``key``."""
    if n_tokens <= 0:
        return ""
    rng = random.Random(key)  # str seeds hash with SHA-512: stable across runs and hosts
    target = CHARS_PER_TOKEN * n_tokens
    lines: list[str] = []
    size = 0
    while size < target:
        line = "    " * rng.randrange(4) + " ".join(rng.choices(_WORDS, k=rng.randint(3, 12))) + "\n"
        lines.append(line)
        size += len(line)
    return "".join(lines)[:target]


@lru_cache(maxsize=8)
def _shared_text(key: str, n_tokens: int) -> str:
    return synthetic_text(key, n_tokens)


def count_tokens(text: str) -> int:
    """Token count under a ~4 characters/token tokenizer."""
    return (len(text.encode("utf-8")) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


@dataclass(eq=False, slots=True)
class Segment:
    """One chat message. ``key`` names its content: equal key = equal text. Immutable by use."""

    role: str
    tokens: int
    key: str
    _text: str | None = field(default=None, repr=False)
    shared: bool = False  # same text in every session (the system prompt): its text is cached
    # Make the text from this key instead of ``key`` (synthetic text is prefix-stable, so a short
    # segment can be the start of a longer one's text while its key, for the simulator, stays its own).
    text_key: str | None = None

    def text(self) -> str:
        if self._text is None:
            self._text = (_shared_text if self.shared else synthetic_text)(self.text_key or self.key, self.tokens)
        return self._text

    def message(self) -> dict[str, str]:
        return {"role": self.role, "content": self.text()}


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """One request of a session. ``segments`` is the source of truth; ``messages`` renders it."""

    session_id: str
    turn_index: int
    branch_index: int
    n_branches: int
    segments: tuple[Segment, ...]
    max_tokens: int
    expected_output_tokens: int
    think_time_s: float  # model-time pause before this request (same for all branches of a turn)
    is_edit: bool
    edit_message_index: int | None  # index in segments of the rewritten message
    compacted: bool  # history was compacted just before this turn
    new_tokens: int  # this request's own new user/tool message
    reused_tokens: int  # leading tokens identical to the previous turn's history (cacheable)

    @property
    def prompt_tokens(self) -> int:
        return sum(s.tokens for s in self.segments)

    @property
    def messages(self) -> list[dict[str, str]]:
        return [s.message() for s in self.segments]


ReplyLike = Union[str, int, None]


def reply_as_segment(key: str, req: TurnRequest, reply: ReplyLike) -> Segment:
    """A reply as an assistant segment: the server's text, a token count, or (None, a failed
    request) the expected length."""
    if isinstance(reply, str):
        return Segment("assistant", count_tokens(reply), key, _text=reply)
    tokens = req.expected_output_tokens if reply is None else int(reply)
    return Segment("assistant", tokens, key)
