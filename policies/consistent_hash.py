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


def _h(data: str) -> int:
    return int.from_bytes(hashlib.blake2b(data.encode(), digest_size=8).digest(), "big")


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

    def _ring(self, snapshot: Snapshot) -> None:
        """Rebuild the ring only when membership changed (the registry's epoch says so)."""
        if snapshot.epoch is not None and snapshot.epoch == self._epoch:
            return
        members = tuple(sorted(r.id for r in snapshot.replicas))
        self._epoch = snapshot.epoch
        if members == self._members:
            return
        ring = sorted((_h(f"{m}#{i}"), m) for m in members for i in range(self.params.vnodes))
        self._members = members
        self._points = [p for p, _ in ring]
        self._owners = [m for _, m in ring]

    def decide(
        self, snapshot: Snapshot, request: RequestSummary, rng: random.Random
    ) -> Decision | None:
        # The ring holds every known replica, so a replica's health never remaps other sessions.
        self._ring(snapshot)
        if request.session_key is not None:
            key = _h(request.session_key)
        elif request.prefix_blocks:
            key = request.prefix_blocks[0] & 0xFFFFFFFFFFFFFFFF
        else:
            candidates = snapshot.candidate_views(request)
            return Decision(rng.choice(candidates).id, "no_key") if candidates else None
        start = bisect.bisect(self._points, key)
        n = len(self._owners)
        for step in range(n):
            owner = self._owners[(start + step) % n]
            if snapshot.usable(owner, request) is not None:
                return Decision(owner, "hash" if step == 0 else "hash_next")
        return None
