"""OpenAI-shaped JSON for requests aiohttp's HTTP parser refuses before any route or middleware
runs (bad request line, invalid header bytes, oversized headers): aiohttp answers those with a
plain-text body from `RequestHandler.handle_error`, which is the one place to change it."""

from __future__ import annotations

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from .errors import error_response

_KINDS = {413: "request_too_large", 431: "request_too_large", 500: "internal_error", 504: "timeout"}


class _JSONErrorRequestHandler(RequestHandler):
    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises if a response already started
        if status == 504:
            text = "request timed out"
        elif status >= 500:
            text = "internal router error"  # aiohttp's text may carry a traceback: never sent
        else:
            text = f"malformed HTTP request: {(message or 'bad request').strip()[:300]}"
        response = error_response(status, text, _KINDS.get(status, "invalid_request_error"))
        response.force_close()  # the parser's state is unknown after a protocol error
        return response


class _JSONErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JSONErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class JSONErrorAppRunner(web.AppRunner):
    """An AppRunner whose connections answer protocol-level errors as JSON too."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JSONErrorServer  # same state; only the handler factory differs
        return server
