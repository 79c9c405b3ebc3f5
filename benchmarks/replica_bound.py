"""The infinite-cache reuse bound in a replica's own units: its rendered prompt, tokens and pages.

The trace's bound (`kvrouter.loadtest.trace_stats.reuse_bound`) counts trace tokens in the
trace's 64-token pages. The hit rate a live run reports is the replicas' cached tokens over their
prompt tokens: each replica renders the chat messages its own way, counts its own tokens and
reuses whole pages of its own size only. At 8 bytes per token a 64-token page is 512 bytes of text,
so the partial page at the end of every prompt that no cache can reuse is larger than the trace's.
A point's hit rate is judged against the bound of the replicas that served it: the fraction of
their prompt tokens in whole pages already seen in an earlier request, every request in nominal
start order through one infinite cache.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import Any

import mini_replica

from kvrouter.loadtest import tokenizer
from kvrouter.loadtest.profiles import load_profile
from kvrouter.loadtest.sim_prompt import render_chat
from kvrouter.loadtest.trace_stats import nominal_requests


def page_bound(prompts: Iterable[bytes], page_bytes: Fraction, page_tokens: int,
               reusable_pages: Callable[[int], int], tokens: Callable[[int], int]) -> float:
    """Cached over prompt tokens with one infinite cache of pages of `page_tokens` tokens, each
    named by its whole prefix. Page j holds bytes [floor(j x page_bytes), floor((j + 1) x
    page_bytes)) (whole pages only), so a fractional bytes-per-page cuts as the tokenizer does.
    `tokens(n)` is the token count of an n-byte prompt and `reusable_pages(t)` the most pages a
    t-token prompt may take from the cache."""
    num, den = page_bytes.numerator, page_bytes.denominator
    seen: set[bytes] = set()
    hit = total = 0
    for data in prompts:
        keys, key, start, j = [], b"", 0, 1
        while (end := j * num // den) <= len(data):
            key = hashlib.blake2b(key + data[start:end], digest_size=16).digest()
            keys.append(key)
            start, j = end, j + 1
        n_tokens = tokens(len(data))
        limit = min(len(keys), reusable_pages(n_tokens))
        pages = 0
        while pages < limit and keys[pages] in seen:
            pages += 1
        hit += min(pages * page_tokens, n_tokens)
        total += n_tokens
        seen.update(keys)
    return hit / total if total else 0.0


def sim_bound(messages: Iterable[list[dict[str, Any]]], chars_per_token: float, profile: str) -> float:
    """`kvrouter sim-replica`: ChatML rendering, `loadtest/tokenizer` (token i covers bytes
    [floor(i x cpt), floor((i + 1) x cpt))), the profile's page size; a prompt never takes its
    last token from the cache (the engine computes at least one)."""
    ratio = tokenizer.check_chars_per_token(chars_per_token)
    page = load_profile(profile).page_size
    return page_bound((render_chat(m).encode() for m in messages), page * ratio, page,
                      lambda t: max(t - 1, 0) // page,
                      lambda n: math.ceil(n * ratio.denominator / ratio.numerator))


def mini_bound(messages: Iterable[list[dict[str, Any]]], chars_per_token: float,
               page_tokens: int = mini_replica.DEFAULT_PAGE_TOKENS) -> float:
    """`benchmarks/mini_replica.py`: its own rendering, `round(page_tokens x chars_per_token)`
    bytes a page."""
    page_bytes = Fraction(max(1, round(page_tokens * chars_per_token)))
    return page_bound((mini_replica.prompt_text("chat", {"messages": m}).encode() for m in messages),
                      page_bytes, page_tokens, lambda t: t,
                      lambda n: math.ceil(n / chars_per_token))


def replica_reuse_bound(arrivals: Iterable[tuple[float, Any]], kind: str, chars_per_token: float,
                        profile: str) -> float:
    """The bound of a live sweep point: replica `kind` ("sim" or "mini") at `chars_per_token`.
    Each request's messages are made as its prompt is hashed (not all held at once)."""
    messages = (req.messages for _, _, req in nominal_requests(arrivals))
    if kind == "sim":
        return sim_bound(messages, chars_per_token, profile)
    return mini_bound(messages, chars_per_token)
