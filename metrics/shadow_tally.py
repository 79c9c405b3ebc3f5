"""The shadow policies' counts between two collections of the metrics, as plain numbers.

Every decision the shadows are asked about adds to them: whether each shadow agreed, the replica
it picked and its predicted TTFT, and the live pick's predicted TTFT. Kept as attributes and a
dict keyed by replica instead of deferred counts keyed by (metric, labels) tuples, whose keys are
hashed anew on every update: on a router between two requests those are cold reads, and this is
the part of a shadow's cost that does not depend on the shadow. `RouterMetrics.flush` moves them
into the Prometheus series before every collection.
"""

from __future__ import annotations


class ShadowTally:
    """One shadow policy's counts since the last collection."""

    __slots__ = ("agrees", "disagrees", "predicted_ttft_s", "picks")

    def __init__(self) -> None:
        self.agrees = 0
        self.disagrees = 0
        self.predicted_ttft_s: float | None = None  # sum over its picks in the snapshot (None: none yet)
        self.picks: dict[str, int] = {}  # replica -> decisions it would have sent there
