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


def test_sim_bound_refuses_a_page_of_partial_bytes() -> None:
    with pytest.raises(ValueError, match="whole number of bytes"):
        bound.sim_bound([TURN_1], 1.3, "tiny")  # 16 tokens x 13/10 bytes


@pytest.mark.parametrize("cpt", [1.5, 4.0, 8.0])
def test_mini_bound_by_hand(cpt: float) -> None:
    texts = [mini_replica.prompt_text("chat", {"messages": m}).encode() for m in (TURN_1, TURN_2)]
    page_bytes = round(32 * cpt)
    tokens = [math.ceil(len(t) / cpt) for t in texts]
    expected = (len(texts[0]) // page_bytes) * 32 / sum(tokens)
    assert bound.mini_bound([TURN_1, TURN_2], cpt) == pytest.approx(expected)
