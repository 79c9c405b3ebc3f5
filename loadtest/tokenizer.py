"""Deterministic stand-in tokenizer: UTF-8 bytes cut into 4-byte chunks, one id per chunk.

Why this shape: the simulator only needs (a) ~4 characters per token for ASCII code, (b) the same
text prefix giving the same token prefix (so turn 2 of a session re-uses turn 1's pages), and (c)
speed. Ids are `chunk % vocab_size`; collisions are irrelevant for caching because pages are
compared by chained hashes of whole pages, and no detokenizer is needed.

Only the last, partial chunk of a text can differ from the same chunk of a longer text that
extends it, so a page-aligned prefix match loses at most the page holding that chunk.
"""

from __future__ import annotations

import random
import sys
from array import array

KIMI_VOCAB_SIZE = 163840
_BIG_ENDIAN = sys.byteorder == "big"


def encode(text: str, vocab_size: int = KIMI_VOCAB_SIZE) -> list[int]:
    data = text.encode("utf-8")
    pad = -len(data) % 4
    if pad:
        data += b"\0" * pad
    words = array("I", data)  # 4-byte unsigned on every platform CPython supports
    if _BIG_ENDIAN:
        words.byteswap()  # ids must not depend on the host
    return [w % vocab_size for w in words]


def count_tokens(text: str) -> int:
    return (len(text.encode("utf-8")) + 3) // 4


_WORDS = (
    "def", "return", "self", "import", "class", "if", "else", "for", "in", "while", "try",
    "except", "yield", "async", "await", "None", "True", "False", "value", "result", "items",
    "config", "request", "response", "cache", "token", "page", "index", "count", "buffer",
    "=", "==", "+=", "(", ")", ":", ",", ".", "[", "]", "{", "}", "0", "1", "x", "y", "n",
)


def synthetic_text(n_tokens: int, seed: int) -> str:
    """Deterministic pseudo-code of exactly `n_tokens` tokens under `encode` (ASCII, 4n chars)."""
    if n_tokens <= 0:
        return ""
    rng = random.Random(seed)  # local generator: no global randomness
    target = 4 * n_tokens
    parts: list[str] = []
    size = 0
    indent = 0
    while size < target:
        line = "    " * indent + " ".join(rng.choices(_WORDS, k=rng.randint(3, 9))) + "\n"
        indent = (indent + rng.choice((-1, 0, 0, 1))) % 4
        parts.append(line)
        size += len(line)
    return "".join(parts)[:target]
