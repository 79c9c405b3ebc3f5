"""What a trace holds, and the cache-hit rate it allows.

:func:`reuse_bound` gives the trace's own hit-rate bound with an infinite cache, on the same page
keys as the simulator, to compare each policy's ``cache_hit_rate`` against; :func:`trace_summary`
counts sessions, requests, tokens and think times. Both read the nominal schedule (the trace's own
clock, no service time) without advancing the sessions.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from .segment_keys import SegmentKeyCache
from .turn_request import TurnRequest
from .workload import quantile

__all__ = ["nominal_requests", "reuse_bound", "trace_summary"]


def _schedule(session: Any) -> list[tuple[float, TurnRequest]]:
    """Nominal (offset, request) list of any session, without advancing it."""
    planned = getattr(session, "planned", None)
    if callable(planned):
        return planned()
    s = copy.deepcopy(session)  # a generic closed-loop session: step a copy, zero service time
    out: list[tuple[float, TurnRequest]] = []
    t = 0.0
    batch = s.next_requests(None)
    while batch:
        t += batch[0].think_time_s
        out.extend((t, r) for r in batch)
        batch = s.next_requests([r.expected_output_tokens for r in batch])
    return out


def nominal_requests(arrivals: Iterable[tuple[float, Any]]) -> list[tuple[str, bool, TurnRequest]]:
    """Every request of every session as (session id, last of its session?, request), in nominal
    start order: session start + the trace's own offsets, no service time."""
    events = []
    for si, (at, session) in enumerate(arrivals):
        for ri, (offset, req) in enumerate(_schedule(session)):
            events.append((at + offset, si, ri, session.session_id, req))
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    last = {e[3]: i for i, e in enumerate(events)}
    return [(e[3], last[e[3]] == i, e[4]) for i, e in enumerate(events)]


def reuse_bound(arrivals: Iterable[tuple[float, Any]], page_size: int) -> float:
    """The trace's own cache-hit bound: the fraction of prompt tokens in whole pages already seen
    in an earlier request (infinite cache, requests in nominal start order), on the page keys the
    simulator uses. Output pages are not counted (their keys are unique; see
    :mod:`kvrouter.loadtest.trace_session`)."""
    keys = SegmentKeyCache(page_size, namespace="reuse-bound")
    seen: set[int] = set()
    hit = total = 0
    for sid, last, req in nominal_requests(arrivals):
        pages = keys.keys(sid, req.segments)
        hit += sum(1 for k in pages if k in seen)
        seen.update(pages)
        total += req.prompt_tokens
        if last:
            keys.forget(sid)
    return hit * page_size / total if total else 0.0


def trace_summary(arrivals: Iterable[tuple[float, Any]]) -> dict[str, float]:
    """Sessions, requests, token counts and think times of a trace (nominal schedule)."""
    arrivals = list(arrivals)
    prompts: list[int] = []
    outs: list[int] = []
    thinks: list[float] = []
    for _, session in arrivals:
        for _, req in _schedule(session):
            prompts.append(req.prompt_tokens)
            outs.append(req.expected_output_tokens)
            if req.turn_index > 0:
                thinks.append(req.think_time_s)

    return {
        "sessions": len(arrivals),
        "requests": len(prompts),
        "prompt_tokens": sum(prompts),
        "output_tokens": sum(outs),
        "input_p50": quantile(prompts, 0.5),
        "input_p90": quantile(prompts, 0.9),
        "input_max": max(prompts, default=0),
        "output_p50": quantile(outs, 0.5),
        "think_p50_s": quantile(thinks, 0.5),
        "last_arrival_s": max((a for a, _ in arrivals), default=0.0),
    }
