"""The edge's aiohttp runner: what aiohttp answers by itself is OpenAI-shaped JSON too.

A request aiohttp cannot parse (a malformed request line or header, a header
line over 8 KiB, a bad chunk size) never reaches the app or its error
middleware: aiohttp's protocol handler answers it with a plain-text page, as
it does an exception that escapes every handler (500). Clients of an
OpenAI-compatible API parse `{"error": {...}}` on every 4xx/5xx, so this runner's
connections answer those with the same JSON the app sends (the connection is
still closed after, as aiohttp does: its framing is no longer known).
"""
from __future__ import annotations

import logging
from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from .openai_protocol import APIError

log = logging.getLogger("pdserve.edge")


class _JSONErrorHandler(RequestHandler):
    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:
            # Part of an answer went out already: nothing more can be sent (as aiohttp).
            raise ConnectionError("an answer was sent already; cannot send an error after it")
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            # The detail of an internal error is a traceback: logged, never sent.
            error = APIError(status, HTTPStatus(status).phrase, type="server_error",
                             code="internal_error" if status == 500 else None)
        else:
            # A client's malformed bytes are the client's problem, not an error of the edge.
            log.debug("malformed request from %s: %s", request.remote, exc)
            error = APIError(status, _first_line(message) or HTTPStatus(status).phrase,
                             code="malformed_http")
        resp = web.json_response(error.body(), status=status)
        resp.force_close()
        return resp


class _JSONErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JSONErrorHandler(self, loop=self._loop, **self._kwargs)


class EdgeRunner(web.AppRunner):
    """web.AppRunner whose connections answer unparseable requests with JSON errors."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # The app's own server, with the one method that makes a connection's handler
        # overridden; nothing else about it changes.
        server.__class__ = _JSONErrorServer
        return server


def _first_line(message: str | None) -> str:
    """aiohttp's parse errors are 'reason:\\n\\n  bytes\\n  ^': the reason alone."""
    return (message or "").strip().split("\n", 1)[0].strip().rstrip(":")[:200]
