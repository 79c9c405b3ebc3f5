"""consistent_hash: the session id on a hash ring (what most stacks do). A baseline.

Each replica owns `vnodes` points on a 64-bit ring; a request goes to the first point clockwise of
hash(session key), skipping unhealthy or already-tried replicas. Without a session id the first
prefix block stands in for it. Adding a replica remaps ~1/N of sessions; load is Poisson-uneven.
"""

from __future__ import annotations

import bisect
import hashlib
import random

from pydantic import BaseModel, ConfigDict, Field

from .domain import Capabilities, Decision, RequestSummary, Snapshot


_blake2b = hashlib.blake2b
_from_bytes = int.from_bytes


def _h(data: str) -> int:
    return _from_bytes(_blake2b(data.encode(), digest_size=8).digest(), "big")


class ConsistentHashParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    vnodes: int = Field(160, ge=1, description="Ring points per replica (smooths the key space).")


class ConsistentHash:
    name = "consistent_hash"
    capabilities = Capabilities()  # ignores session homes

    def __init__(self, params: ConsistentHashParams | None = None) -> None:
        self.params = params or ConsistentHashParams()
        self._epoch: int | None = None
        self._members: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []
        # The ring cut into 2**bits equal arcs by a hash's top bits: `_arcs[a]` is the first
        # point on arc `a` or later, so a lookup bisects only its own arc's few points (a bisect
        # of the whole ring reads ~14 points scattered through memory, cold after a decision).
        self._shift = 63
        self._arcs: list[int] = [0, 0, 0]
        # Session key -> its ring position (`bisect` of its hash) on the current ring: a
        # returning session skips the hash and the search. Bounded: emptied when full (a plain
        # dict, so a new key costs one insert), and whenever the ring changes.
        self._starts: dict[str, int] = {}

    MAX_REMEMBERED_KEYS = 65_536  # ~12 MB at most (with the keys); sessions return within minutes

    def _ring(self, snapshot: Snapshot) -> None:
        """Rebuild the ring only when membership changed (the registry's epoch says so)."""
        if snapshot.epoch is not None and snapshot.epoch == self._epoch:
            return
        members = tuple(sorted(r.id for r in snapshot.replicas))
        self._epoch = snapshot.epoch
        if members == self._members:
            return
        # Sorted by position through plain lists of ints and names, not (point, member) tuples:
        # 100 replicas make 16,000 of those, enough to set off ~20 passes of the cyclic collector
        # while the ring is built. The sort is stable and `members` is sorted, so tied points
        # keep the tuples' order (by member).
        vnodes = range(self.params.vnodes)
        hashes = [_h(f"{m}#{i}") for m in members for i in vnodes]
        owners = [m for m in members for _ in vnodes]
        order = sorted(range(len(hashes)), key=hashes.__getitem__)
        self._members = members
        self._points = [hashes[k] for k in order]
        self._owners = [owners[k] for k in order]
        bits = max(1, len(order).bit_length())
        self._shift = shift = 64 - bits
        tops = [p >> shift for p in self._points]
        self._arcs = [bisect.bisect_left(tops, a) for a in range((1 << bits) + 1)]
        self._starts.clear()  # positions on the old ring

    def decide(
        self, snapshot: Snapshot, request: RequestSummary, rng: random.Random
    ) -> Decision | None:
        # The ring holds every known replica, so a replica's health never remaps other sessions.
        self._ring(snapshot)
        session_key = request.session_key
        if session_key is not None:
            start = self._starts.get(session_key)
            if start is None:
                start = self._remember(session_key)
        elif request.prefix_blocks:
            start = self._position(request.prefix_blocks[0] & 0xFFFFFFFFFFFFFFFF)
        else:
            candidates = snapshot.candidate_views(request)
            return Decision(rng.choice(candidates).id, "no_key") if candidates else None
        n = len(self._owners)
        for step in range(n):
            owner = self._owners[(start + step) % n]
            if snapshot.usable(owner, request) is not None:
                return Decision(owner, "hash" if step == 0 else "hash_next")
        return None

    def _position(self, point: int) -> int:
        """`bisect.bisect(self._points, point)`, searched within `point`'s arc: every point
        before the arc is below `point`, every point after it above."""
        arc = point >> self._shift
        arcs = self._arcs
        return bisect.bisect(self._points, point, arcs[arc], arcs[arc + 1])

    def _remember(self, session_key: str) -> int:
        """The ring position of hash(session_key), remembered for the session's next requests."""
        start = self._position(_h(session_key))
        if len(self._starts) >= self.MAX_REMEMBERED_KEYS:
            self._starts.clear()  # rarely: the live sessions are hashed again once
        self._starts[session_key] = start
        return start
