"""Page keys of segment prompts: a cache shared by many sessions gives each the keys a cache of
its own would, including the pages of a shared system prompt it hashes only once."""

from __future__ import annotations

from kvrouter.loadtest.segment_keys import SegmentKeyCache
from kvrouter.loadtest.turn_request import Segment

PAGE = 16


def prompt(session: str, system_tokens: int, turns: int) -> list[Segment]:
    segments = [Segment("system", system_tokens, "system/x", shared=True),
                Segment("user", 37, f"{session}/repo")]
    for t in range(turns):
        segments.append(Segment("user", 5 + 11 * t, f"{session}/t{t}"))
        segments.append(Segment("assistant", 23, f"{session}/t{t}/reply"))
    return segments


def test_a_shared_cache_gives_every_session_its_own_keys():
    for system_tokens in (3 * PAGE, 3 * PAGE + 7, PAGE - 1):
        shared = SegmentKeyCache(PAGE, namespace="n")
        for i in range(4):
            session = f"s{i}"
            for turns in (1, 3, 2):  # grows, then a shorter prompt (a retried turn)
                segments = prompt(session, system_tokens, turns)
                expected = SegmentKeyCache(PAGE, namespace="n").keys(session, segments)
                assert shared.keys(session, segments) == expected
            shared.forget(session)
        # the system prompt's whole pages are the same in every session
        keys = [shared.keys(f"s{i}", prompt(f"s{i}", system_tokens, 1)) for i in range(2)]
        n = system_tokens // PAGE
        assert keys[0][:n] == keys[1][:n] and keys[0][n] != keys[1][n]


def test_an_unshared_first_segment_is_not_reused_across_sessions():
    cache = SegmentKeyCache(PAGE)
    a = cache.keys("a", [Segment("user", 4 * PAGE, "a/own")])
    b = cache.keys("b", [Segment("user", 4 * PAGE, "b/own")])
    assert not set(a) & set(b)
