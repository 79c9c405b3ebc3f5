"""Deterministic stand-in tokenizer: UTF-8 bytes cut into fixed-size chunks, one id per chunk.

The chunk is ``chars_per_token`` bytes (default 4; a fractional ratio such as 1.5 alternates chunk
sizes: token ``i`` covers bytes ``[floor(i * X), floor((i + 1) * X))``), so a simulated replica can
stand for tokenizers from ~1.5 bytes per token (CJK text) to 8 (dense code or English).

Why this shape: the simulator only needs (a) ~4 characters per token for ASCII code, (b) the same
text prefix giving the same token prefix (so turn 2 of a session re-uses turn 1's pages), and (c)
speed. Ids are `chunk % vocab_size`; collisions are irrelevant for caching because pages are
compared by chained hashes of whole pages, and no detokenizer is needed.

Only the last, partial chunk of a text can differ from the same chunk of a longer text that
extends it, so a page-aligned prefix match loses at most the page holding that chunk.
"""

from __future__ import annotations

import math
import random
import sys
from array import array
from fractions import Fraction

KIMI_VOCAB_SIZE = 163840
DEFAULT_CHARS_PER_TOKEN = 4.0
_BIG_ENDIAN = sys.byteorder == "big"
_WORD_CODES = {1: "B", 2: "H", 4: "I", 8: "Q"}  # unsigned array codes of that many bytes


def check_chars_per_token(chars_per_token: float) -> Fraction:
    """The ratio as a fraction ``p / q`` (``p`` bytes make ``q`` tokens); ratios between 1 and 16
    with a period of at most 64 bytes (1.5, 2.5, 3.3, ...)."""
    if not (isinstance(chars_per_token, (int, float)) and 1.0 <= chars_per_token <= 16.0):
        raise ValueError(f"chars_per_token must be between 1 and 16, got {chars_per_token!r}")
    ratio = Fraction(chars_per_token).limit_denominator(64)
    if ratio.numerator > 64:
        raise ValueError(f"chars_per_token {chars_per_token!r}: period over 64 bytes")
    return ratio


def _words(data: bytes, width: int) -> array:
    words = array(_WORD_CODES[width], data)
    if _BIG_ENDIAN and width > 1:
        words.byteswap()  # ids must not depend on the host
    return words


def encode(text: str, vocab_size: int = KIMI_VOCAB_SIZE, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN) -> list[int]:
    ratio = check_chars_per_token(chars_per_token)
    data = text.encode("utf-8")
    period, per_period = ratio.numerator, ratio.denominator
    n_tokens = math.ceil(len(data) * per_period / period)
    pad = -len(data) % period
    if pad:
        data += b"\0" * pad
    if per_period == 1 and period in _WORD_CODES:
        return [w % vocab_size for w in _words(data, period)]
    # A fractional ratio repeats every `period` bytes: token j of a period always covers the same
    # byte columns, so each column is one strided slice (fast) and the ids are interleaved.
    ids: list[int] = [0] * (len(data) * per_period // period)
    columns = [data[c::period] for c in range(period)]
    for j in range(per_period):
        start, end = (j * period) // per_period, ((j + 1) * period) // per_period
        chunk = [0] * len(columns[0])
        for shift, col in enumerate(columns[start:end]):
            chunk = [acc | (b << (8 * shift)) for acc, b in zip(chunk, col)]
        ids[j::per_period] = [w % vocab_size for w in chunk]
    return ids[:n_tokens]


def count_tokens(text: str, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN) -> int:
    ratio = check_chars_per_token(chars_per_token)
    return math.ceil(len(text.encode("utf-8")) * ratio.denominator / ratio.numerator)


_WORDS = (
    "def", "return", "self", "import", "class", "if", "else", "for", "in", "while", "try",
    "except", "yield", "async", "await", "None", "True", "False", "value", "result", "items",
    "config", "request", "response", "cache", "token", "page", "index", "count", "buffer",
    "=", "==", "+=", "(", ")", ":", ",", ".", "[", "]", "{", "}", "0", "1", "x", "y", "n",
)


def synthetic_text(n_tokens: int, seed: int, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN) -> str:
    """Deterministic pseudo-code of exactly `n_tokens` tokens under `encode` with the same ratio
    (ASCII, ``floor(n * chars_per_token)`` chars; 4n by default)."""
    if n_tokens <= 0:
        return ""
    ratio = check_chars_per_token(chars_per_token)
    rng = random.Random(seed)  # local generator: no global randomness
    target = n_tokens * ratio.numerator // ratio.denominator
    parts: list[str] = []
    size = 0
    indent = 0
    while size < target:
        line = "    " * indent + " ".join(rng.choices(_WORDS, k=rng.randint(3, 9))) + "\n"
        indent = (indent + rng.choice((-1, 0, 0, 1))) % 4
        parts.append(line)
        size += len(line)
    return "".join(parts)[:target]
