import time

import pytest

from kvrouter.loadtest.tokenizer import KIMI_VOCAB_SIZE, count_tokens, encode, synthetic_text


def test_encode_is_deterministic_and_about_four_chars_per_token():
    text = "def handler(request):\n    return cache.lookup(request.key)\n"
    ids = encode(text)
    assert ids == encode(text)
    assert len(ids) == count_tokens(text) == -(-len(text) // 4)
    assert all(0 <= i < KIMI_VOCAB_SIZE for i in ids)


def test_same_text_prefix_gives_same_token_prefix():
    turn1 = synthetic_text(500, seed=1)
    turn2 = turn1 + "\n# user: now add tests\n" + synthetic_text(200, seed=2)
    a, b = encode(turn1), encode(turn2)
    assert len(turn1) % 4 == 0  # synthetic_text is ASCII, 4 chars per token
    assert b[: len(a)] == a
    # an unaligned prefix differs at most in its last, partial chunk
    c = encode(turn1[:-1])
    assert b[: len(c) - 1] == c[:-1]


def test_non_ascii_counts_utf8_bytes():
    text = "héllo wörld ✓"
    assert count_tokens(text) == -(-len(text.encode()) // 4)
    assert len(encode(text)) == count_tokens(text)


def test_synthetic_text_has_exact_token_count_and_is_seeded():
    for n in (0, 1, 17, 1000):
        assert count_tokens(synthetic_text(n, seed=7)) == n
    assert synthetic_text(300, seed=7) == synthetic_text(300, seed=7)
    assert synthetic_text(300, seed=7) != synthetic_text(300, seed=8)
    assert "def" in synthetic_text(300, seed=3) or "return" in synthetic_text(300, seed=3)


def test_encode_400k_chars_benchmark_reports_without_asserting_time():
    text = synthetic_text(100_000, seed=0)
    t0 = time.perf_counter()
    ids = encode(text)
    elapsed = time.perf_counter() - t0
    assert len(ids) == 100_000
    print(f"encode 400k chars: {elapsed * 1e3:.1f} ms")


def test_chars_per_token_sets_the_ratio_and_keeps_prefixes():
    text = synthetic_text(3000, seed=5)  # 12,000 ASCII chars
    for ratio, expected in ((1.5, 8000), (4, 3000), (8, 1500), (2.5, 4800)):
        ids = encode(text, chars_per_token=ratio)
        assert len(ids) == count_tokens(text, ratio) == expected
        # prefix stable at any ratio: only the last, partial token of a cut text may differ
        head = encode(text[:5001], chars_per_token=ratio)
        assert ids[: len(head) - 1] == head[:-1]
        sized = synthetic_text(777, seed=3, chars_per_token=ratio)
        assert len(encode(sized, chars_per_token=ratio)) == 777
    assert encode(text) == encode(text, chars_per_token=4.0)  # the default is unchanged
    with pytest.raises(ValueError):
        count_tokens(text, 0.5)
