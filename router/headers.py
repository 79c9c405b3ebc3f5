"""Header hygiene for a proxy: hop-by-hop stripping (RFC 9110 section 7.6.1) and request ids."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping

from multidict import CIMultiDict

REQUEST_ID = "x-request-id"

# Connection-specific fields, plus the ones aiohttp recomputes for each hop.
_HOP_BY_HOP = frozenset(
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
        "host",
        "content-length",
    }
)


def _connection_tokens(headers: Mapping[str, str]) -> set[str]:
    value = headers.get("connection", "")
    return {t.strip().lower() for t in value.split(",") if t.strip()}


def end_to_end(headers: Mapping[str, str], extra_drop: Iterable[str] = ()) -> CIMultiDict[str]:
    """Copy only end-to-end headers, also dropping any field the Connection header names."""
    drop = _HOP_BY_HOP | _connection_tokens(headers) | {h.lower() for h in extra_drop}
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name.lower() not in drop:
            out.add(name, value)
    return out


def request_id_from(headers: Mapping[str, str]) -> str:
    """Keep a sane client-supplied id; otherwise make one."""
    rid = headers.get(REQUEST_ID, "")
    if rid and len(rid) <= 128 and rid.isprintable():
        return rid
    return uuid.uuid4().hex
