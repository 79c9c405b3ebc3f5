"""The errors of the relay's upstream client (router/upstream_http.py): which ones are safe
to retry on another replica (nothing was sent, or nothing answered) and which are not (the
replica has the request and may still be working on it)."""

from __future__ import annotations


class UpstreamError(Exception):
    """The exchange with the replica failed."""


class UpstreamConnectError(UpstreamError):
    """No response started: refused, reset, closed early or garbled. Safe to try elsewhere."""


class UpstreamConnectTimeout(UpstreamConnectError, TimeoutError):
    """The connection was not established in time: nothing was sent. Safe to try elsewhere."""


class UpstreamBodyError(UpstreamError):
    """The response started, then the replica broke off before its end."""


class UpstreamBodyTooLarge(UpstreamError):
    """The response's body grew past the limit its reader set (`UpstreamResponse.read`)."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """The replica has the request but missed a deadline: `kind` is "header_timeout" (no headers
    in time), "idle_timeout" (a gap between body bytes too long) or "total_timeout" (the whole
    exchange). Not safe to retry: the replica may still be working on it. The connection is
    aborted, so the replica stops."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
