"""OpenAI-shaped JSON error responses: {"error": {"message", "type", "code"}}."""

from __future__ import annotations

import orjson
from aiohttp import web


def error_body(message: str, type_: str, code: int | str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "code": code}})


def error_response(
    status: int, message: str, type_: str, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(message, type_, status),
        content_type="application/json",
        headers=headers,
    )


def sse_error_event(message: str, code: int = 502) -> bytes:
    """The event a stream ends with when its upstream fails after the first byte."""
    payload = error_body(message, "upstream_error", code)
    return b"data: " + payload + b"\n\ndata: [DONE]\n\n"
