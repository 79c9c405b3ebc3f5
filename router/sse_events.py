"""Cutting a relayed SSE byte stream at event boundaries: the relay forwards whole events only,
so a failure later can never leave a client with half a JSON line."""

from __future__ import annotations

# A chunk ending in one of these ends in a whole event (the common case: relayed as it is).
EVENT_ENDS = (b"\n\n", b"\r\n\r\n")


def last_event_end(data: bytes | bytearray) -> int:
    """Index just past the last complete SSE event in `data`, or 0 if there is none."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def whole_events(tail: bytearray, chunk: bytes) -> tuple[bytes, bytearray]:
    """The whole events of `tail` (bytes after the last complete event, not yet sent) followed
    by `chunk`, and the new tail. Only the new bytes (and 3 before them) are scanned for a
    boundary."""
    overlap = min(3, len(tail))
    cut = last_event_end(tail[len(tail) - overlap:] + chunk if overlap else chunk)
    if not cut:
        tail += chunk
        return b"", tail
    k = cut - overlap  # >= 1: the old tail held no complete event
    return (bytes(tail) + chunk[:k] if tail else chunk[:k]), bytearray(chunk[k:])
