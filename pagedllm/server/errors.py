"""The server's errors, as OpenAI's error body with the status that says whose fault it was.

Engine errors are mapped by their typed fields (``RequestRejected.param/.code/.status``,
``RequestOutput.error_kind``), never by their message text, so rewording a message can never
turn a client's mistake into a 500 or a server fault into a 400.
"""

from __future__ import annotations

from ..errors import RequestRejected
from ..outputs import RequestOutput


class APIError(Exception):
    """Raised by a handler; the app answers it as ``error_body`` with ``status`` and ``headers``."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def unavailable(message: str, retry_after_s: int = 1) -> APIError:
    """503: this server cannot take the request now (shutting down, or its engine failed); the
    client should retry, here after ``retry_after_s`` or on another server."""
    return APIError(503, message, "server_error", headers={"Retry-After": str(retry_after_s)})


def rejected(e: RequestRejected) -> APIError:
    """A request the engine refused before queueing it: the client's fault, naming the field."""
    return APIError(e.status, e.message, param=e.param, code=e.code)


def failed(out: RequestOutput) -> APIError:
    """A request that ended in error: refused when the engine thread added it ("rejected") is the
    client's 400; non-finite logits, an undecodable output or a failed engine are the server's 500."""
    message = out.error or "request failed"
    if out.error_kind == "rejected":
        return APIError(400, message)
    if out.error_kind == "shutdown":
        return unavailable(message)
    return APIError(500, message, "server_error")
