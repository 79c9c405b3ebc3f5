"""The reuse bound in a replica's own units (benchmarks/replica_bound.py), checked by hand."""

from __future__ import annotations

import math

import pytest

from kvrouter.loadtest.sim_prompt import render_chat

from .benchmark_modules import load_benchmark

bound = load_benchmark("replica_bound")
mini_replica = load_benchmark("mini_replica")

SYSTEM = {"role": "system", "content": "s" * 1000}
TURN_1 = [SYSTEM, {"role": "user", "content": "u" * 700}]
TURN_2 = [*TURN_1, {"role": "assistant", "content": "a" * 300}, {"role": "user", "content": "v" * 500}]


def test_page_bound_counts_whole_leading_pages_seen_before() -> None:
    pages = [b"A" * 10 + b"B" * 10 + b"C" * 5, b"A" * 10 + b"B" * 10 + b"D" * 10, b"X" * 10]
    # 10-byte pages, a token per byte: 0 of 25; 2 pages (20 of 30); 0 of 10
    assert bound.page_bound(pages, 10, 10, lambda t: t, lambda n: n) == pytest.approx(20 / 65)
    # a page equal to one seen before but after a different page is not a hit
    assert bound.page_bound([b"A" * 20, b"B" * 10 + b"A" * 10], 10, 10, lambda t: t, lambda n: n) == 0
    # the cap on reusable pages: a prompt seen whole may take one page less
    assert bound.page_bound([b"A" * 20, b"A" * 20], 10, 10, lambda t: max(t - 1, 0) // 10, lambda n: n) \
        == pytest.approx(10 / 40)


@pytest.mark.parametrize("cpt", [1.5, 4.0, 8.0])
def test_sim_bound_by_hand(cpt: float) -> None:
    first, second = (len(render_chat(m).encode()) for m in (TURN_1, TURN_2))
    page_bytes = int(64 * cpt)
    tokens = [math.ceil(n / cpt) for n in (first, second)]
    # turn 2 reuses the whole pages of turn 1's rendering (its text is a prefix of turn 2's)
    expected = (first // page_bytes) * 64 / sum(tokens)
    assert bound.sim_bound([TURN_1, TURN_2], cpt, "kimi-k2.6-b200-tp4") == pytest.approx(expected)


def test_pages_of_a_fractional_byte_count_cut_as_the_tokenizer_does() -> None:
    """At 1.3 bytes a token a 16-token page is 20.8 bytes: pages end at bytes 20, 41, 62, ...,
    where the tokenizer's 16th, 32nd, 48th token ends."""
    from fractions import Fraction

    from kvrouter.loadtest import tokenizer

    ids = tokenizer.encode("x" * 100, chars_per_token=1.3)
    ends = [math.floor((i + 1) * Fraction(13, 10)) for i in range(len(ids))]
    assert [ends[16 * j - 1] for j in (1, 2, 3)] == [20, 41, 62]
    data = [b"a" * 41 + b"b" * 30, b"a" * 41 + b"c" * 30]  # two pages shared, the third differs
    tokens = lambda n: math.ceil(n * 10 / 13)  # noqa: E731
    assert bound.page_bound(data, Fraction(208, 10), 16, lambda t: t, tokens) \
        == pytest.approx(32 / (2 * tokens(71)))
    assert 0 < bound.sim_bound([TURN_1, TURN_2], 1.3, "tiny") < 1


@pytest.mark.parametrize("cpt", [1.5, 4.0, 8.0])
def test_mini_bound_by_hand(cpt: float) -> None:
    texts = [mini_replica.prompt_text("chat", {"messages": m}).encode() for m in (TURN_1, TURN_2)]
    page_bytes = round(32 * cpt)
    tokens = [math.ceil(len(t) / cpt) for t in texts]
    expected = (len(texts[0]) // page_bytes) * 32 / sum(tokens)
    assert bound.mini_bound([TURN_1, TURN_2], cpt) == pytest.approx(expected)
