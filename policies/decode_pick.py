"""The decode half of a prefill/decode-disaggregated request: which decode server runs it.

A decode server holds no reusable prefix (the prompt's KV arrives from the prefill server), so
only load and KV room matter: the fewest requests (polled running + queued, or this router's own
in-flight count, whichever is larger), then the lowest KV usage (the request's whole context must
fit next to the running ones), then uniformly at random. Pure: snapshot in, decision out.
"""

from __future__ import annotations

import random

from .domain import Decision, Snapshot


def kv_usage(view) -> float:  # noqa: ANN001 - a ReplicaView
    """Fraction of the KV pool in use; unknown counts as empty (its in-flight count still loads it)."""
    if view.token_usage is not None:
        return view.token_usage
    if view.num_used_tokens is not None and view.max_total_num_tokens:
        return view.num_used_tokens / view.max_total_num_tokens
    return 0.0


def pick_decode(
    snapshot: Snapshot, exclude: frozenset[str], rng: random.Random
) -> Decision | None:
    """The healthy decode server, not in `exclude`, with the least load and then KV usage."""
    candidates = [v for v in snapshot.replicas if v.healthy and v.id not in exclude]
    if not candidates:
        return None
    best = min((v.load, round(kv_usage(v), 2)) for v in candidates)
    ties = [v for v in candidates if (v.load, round(kv_usage(v), 2)) == best]
    return Decision(rng.choice(ties).id, "decode_least_load")
