"""Header hygiene for a proxy: hop-by-hop stripping (RFC 9110 section 7.6.1) and request ids."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping, Set as AbstractSet

from multidict import CIMultiDict, CIMultiDictProxy

REQUEST_ID = "x-request-id"

# Connection-specific fields, plus the ones aiohttp recomputes for each hop.
_HOP_BY_HOP: frozenset[str] = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",  # the router answers 100-continue itself and sends replicas whole bodies
        "host",
        "content-length",
    }
)


def _connection_tokens(headers: Mapping[str, str]) -> set[str]:
    """The names every Connection field line lists (repeated lines are one list)."""
    getall = getattr(headers, "getall", None)
    values = getall("connection", ()) if getall is not None else (headers.get("connection", ""),)
    return {t.strip().lower() for value in values for t in value.split(",") if t.strip()}


class _DropSet(frozenset):  # type: ignore[type-arg]
    """A `drop_set` result: known to hold the hop-by-hop names, lower-cased."""


def drop_set(extra_drop: Iterable[str] = ()) -> frozenset[str]:
    """The hop-by-hop names plus `extra_drop`, lower-cased: build once, pass to `end_to_end`."""
    return _DropSet(_HOP_BY_HOP | {h.lower() for h in extra_drop})


def end_to_end(
    headers: Mapping[str, str], extra_drop: Iterable[str] | frozenset[str] = (),
    names: AbstractSet[str] | None = None,
) -> CIMultiDict[str]:
    """Copy only end-to-end headers, also dropping any field the Connection header names.
    `extra_drop` may be a `drop_set(...)` built once (the per-request fast path). `names`: the
    lower-cased names `headers` holds, when the parser already has them (the data port's
    requests, the replicas' responses): which to drop is then a plain set intersection."""
    # Only a `drop_set` result is used as it is: any other set of names (a plain frozenset
    # too) is added to the hop-by-hop names, which are never forwarded.
    drop = extra_drop if isinstance(extra_drop, _DropSet) else drop_set(extra_drop)
    if ("connection" in names) if names is not None else ("connection" in headers):
        drop = drop | _connection_tokens(headers)
    if not isinstance(headers, (CIMultiDict, CIMultiDictProxy)):
        return CIMultiDict([(k, v) for k, v in headers.items() if k.lower() not in drop])
    # A C-level copy, then the few dropped names deleted. Without `names`, a case-insensitive
    # key view's intersection with `drop` finds them in C (unlike a Python filter over every
    # header), at about four times the cost of the set intersection.
    kept = CIMultiDict(headers)
    for name in (names & drop) if names is not None else (headers.keys() & drop):
        del kept[name]
    return kept


def field_lines(items: Iterable[tuple[str, str]]) -> str:
    """"Name: value" lines, each ending in CRLF, of header `items` (str names and values). Joined
    by C calls alone: a Python-level format per field (an f-string in a comprehension) costs
    about twice the instructions, and every request formats two heads."""
    lines = "\r\n".join(map(": ".join, items))
    return lines + "\r\n" if lines else lines


# Request ids: 128 random bits per process, then a counter (unique, cheap: no syscall per request).
_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count()


def _reseed() -> None:  # a forked worker must not repeat its parent's ids
    global _ID_PREFIX, _ID_COUNTER
    _ID_PREFIX, _ID_COUNTER = os.urandom(8).hex(), itertools.count()


os.register_at_fork(after_in_child=_reseed)


def new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


def request_id_from(headers: Mapping[str, str]) -> str:
    """Keep a sane client-supplied id; otherwise make one."""
    rid = headers.get(REQUEST_ID, "")
    if rid and len(rid) <= 128 and rid.isprintable():
        return rid
    return new_request_id()
