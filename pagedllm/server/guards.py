"""Guards: the API key and the body-size limit, checked before any route sees a request.

Plain ASGI rather than FastAPI middleware, so a streamed response and a client's disconnect
pass through untouched. The body is read whole (up to the limit) before the app gets any of
it: a chunked body has no length to check up front, and a route must never parse half a body.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_body


def public(path: str) -> bool:
    """What needs no key: /health, and the web page and its files (``web.py``: no data in them)."""
    return path in ("/health", "/") or path.startswith("/web/")


class Guards:
    """Rejects requests without the API key (all paths but ``public`` ones; compared in constant time;
    ``Authorization: Bearer``, or on Anthropic's /v1/messages also ``x-api-key``)
    and bodies larger than ``max_body_bytes`` (by header, and by counting what arrives).
    ``on_error`` is told each status it answers (the metrics count them)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, on_error: Callable[[int], None]):
        self.app, self.api_key, self.limit, self.on_error = app, api_key, max_body_bytes, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        if self.api_key is not None and not public(scope["path"]):
            given = headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if scope["path"] == "/v1/messages":  # Anthropic's API takes the key as x-api-key
                token = token or headers.get("x-api-key", "")
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                return await self._reject(
                    scope, receive, send, 401, "missing or wrong API key", "authentication_error", "invalid_api_key"
                )
        length = headers.get("content-length")
        too_large = f"request body exceeds {self.limit} bytes"
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self._reject(scope, receive, send, 413, too_large)
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.limit:
                return await self._reject(scope, receive, send, 413, too_large)
            if not message.get("more_body"):
                break
        body: list[Message] = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def replay() -> Message:  # the body once, then the real channel (disconnects)
            return body.pop() if body else await receive()

        await self.app(scope, replay, send)

    async def _reject(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        self.on_error(status)
        await JSONResponse(error_body(message, type_, code=code), status_code=status)(scope, receive, send)
