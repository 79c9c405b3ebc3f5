"""Page keys of a session's prompts built from workload segments, without rendering text.

A page covers `page_size` positions of the concatenated segments; its key chains the previous
page's key with the (segment key, start, end) pieces it covers, so equal segment keys give equal
pages (the shared system prompt is shared across sessions) and an edited segment changes every
page from it on. Keys are cached per session and extended turn by turn: a turn that only appends
hashes its new pages alone. The pages inside a leading segment marked `shared` (the system prompt,
the same in every session) are hashed once per cache, not once per session.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

from .turn_request import Segment


_MASK = (1 << 64) - 1
_TWO64 = 1 << 64
_MAX_SHARED = 4096  # shared leading segments whose page keys are kept (a trace may have many)
_LO_HI = (1 << 32) + 1  # lo * _LO_HI + page == (lo << 32) | (lo + page) while lo + page < 2**32


@lru_cache(maxsize=1 << 16)
def _segment_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def _mix(h: int, v: int) -> int:
    """splitmix64-style mixing: deterministic across processes and ~20x cheaper than a digest."""
    h = (h ^ v) * 0x9E3779B97F4A7C15 & _MASK
    h = (h ^ (h >> 31)) * 0xBF58476D1CE4E5B9 & _MASK
    return h ^ (h >> 29)


def _chain(parent: int, pieces: list[tuple[str, int, int]]) -> int:
    h = parent & _MASK
    for key, lo, hi in pieces:
        h = _mix(_mix(h, _segment_hash(key)), (lo << 32) | hi)
    return h - (1 << 64) if h >> 63 else h  # signed, like SGLang's published block hashes


class SegmentKeyCache:
    """Per-session page keys; `keys(session, segments)` reuses the common prefix of the last call."""

    def __init__(self, page_size: int, namespace: str = "") -> None:
        self.page_size = page_size
        self.root = _chain(0, [(namespace, 0, 0)])
        self._last: dict[str, tuple[list[str], list[int], list[int]]] = {}
        # (key, tokens) of a shared leading segment -> the keys of its whole pages
        self._shared: dict[tuple[str, int], list[int]] = {}

    def forget(self, session: str) -> None:
        self._last.pop(session, None)

    def keys(self, session: str, segments: Sequence[Segment]) -> list[int]:
        """Keys of every whole page of `segments` (a prompt, or a prompt and its reply)."""
        names = [s.key for s in segments]
        sizes = [s.tokens for s in segments]
        reuse_pages = 0
        last = self._last.get(session)
        if last is not None:
            old_names, old_sizes, old_keys = last
            same_tokens = 0
            for a, b, sa, sb in zip(names, old_names, sizes, old_sizes):
                if a != b or sa != sb:
                    break
                same_tokens += sa
            reuse_pages = min(same_tokens // self.page_size, len(old_keys))
            keys = old_keys[:reuse_pages]
        else:
            keys = []
        first = segments[0] if segments else None
        shared = None
        if first is not None and first.shared:
            shared_id = (names[0], sizes[0])
            shared = self._shared.get(shared_id)
            if shared is not None and len(shared) > reuse_pages:
                # A page inside the first segment depends on it alone: same keys in any session.
                keys = list(shared)
                reuse_pages = len(shared)
        total = sum(sizes)
        page = self.page_size
        parent = keys[-1] if keys else self.root
        mask, two64 = _MASK, _TWO64
        append = keys.append
        seg, seg_start = 0, 0  # index of the segment holding position `pos`, and where it starts
        pos = reuse_pages * page
        while seg < len(segments) and seg_start + sizes[seg] <= pos:
            seg_start += sizes[seg]
            seg += 1
        # Hash only the segments that new pages can touch (a turn that appends reuses the rest).
        seg_hashes = [0] * seg + [_segment_hash(n) for n in names[seg:]]
        while pos + page <= total:
            seg_end = seg_start + sizes[seg]
            if pos + page <= seg_end:
                # Fast path: a run of whole pages inside one segment (most of any prompt). A page
                # at segment offset lo mixes in (lo << 32) | (lo + page) = lo * (2**32 + 1) + page,
                # stepped directly; `u` is the previous key unsigned.
                h0 = seg_hashes[seg]
                n = (seg_end - pos) // page
                lo = pos - seg_start
                u = parent & mask
                for v in range(lo * _LO_HI + page, (lo + n * page) * _LO_HI + page, page * _LO_HI):
                    h = (u ^ h0) * 0x9E3779B97F4A7C15 & mask
                    h = (h ^ (h >> 29) ^ v) * 0xBF58476D1CE4E5B9 & mask
                    u = h ^ (h >> 32)
                    append(u - two64 if u >> 63 else u)
                if n:
                    parent = keys[-1]
                pos += n * page
                if pos == seg_end:
                    seg_start, seg = seg_end, seg + 1
                continue
            end = pos + page
            pieces: list[tuple[str, int, int]] = []
            s, s_start = seg, seg_start
            while s < len(segments) and s_start < end:
                lo, hi = max(pos, s_start), min(end, s_start + sizes[s])
                if hi > lo:
                    pieces.append((names[s], lo - s_start, hi - s_start))
                if s_start + sizes[s] <= end:
                    s_start += sizes[s]
                    s += 1
                else:
                    break
            parent = _chain(parent, pieces)
            keys.append(parent)
            pos = end
            seg, seg_start = s, s_start
        if first is not None and first.shared and shared is None and len(self._shared) < _MAX_SHARED:
            self._shared[shared_id] = keys[: sizes[0] // page]
        self._last[session] = (names, sizes, keys)
        return keys
