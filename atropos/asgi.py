"""HTTP plumbing shared by the sandbox host and the ToolServer: auth and body limits before any
parsing, one error body shape (``{"error": {"code", "message", "status"}}``) everywhere, and one
map per app from the package's errors to their answers (``ErrorMap``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from atropos.errors import AtroposSandboxError, validation_message
from atropos.sandbox.contract.hosttoken import token_matches

log = logging.getLogger(__name__)
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]
DRAIN_BYTES = 16 << 20  # overshoot of an oversized body read before answering 413
DRAIN_S = 5.0


def listening_socket(family: int, addr: tuple[Any, ...], backlog: int) -> socket.socket:
    """A bound, listening, non-inheritable TCP socket for ``uvicorn.Server.serve(sockets=...)``;
    closed again if bind or listen fails (the ``OSError`` propagates)."""
    # proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say so (else +40 ms per call)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def error_body(status: int, code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "status": status}}


def http_error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> HTTPException:
    return HTTPException(status_code=status, detail=error_body(status, code, message)["error"], headers=headers)


# An answer: status, code, extra response headers.
Answer = tuple[int, str, dict[str, str] | None]


@dataclass(frozen=True)
class ErrorMap:
    """One app's answer to every error of the package: the (status, code) of ``atropos.errors.ERRORS``
    (a ``ToolError`` its own), except where ``overrides`` says the app's contract differs, looked up
    along the error's class hierarchy like the table itself. Every route of the app answers
    through it, by the handler ``install_error_handlers`` installs."""

    overrides: Mapping[type[AtroposSandboxError], Callable[[Any], Answer]] = field(default_factory=dict)

    def answer(self, exc: AtroposSandboxError) -> Answer:
        for cls in type(exc).__mro__:
            override = self.overrides.get(cls)
            if override is not None:
                return override(exc)
        return exc.status, exc.code, None


def install_error_handlers(app: FastAPI, errors: ErrorMap | None = None) -> None:
    errors = errors or ErrorMap()

    @app.exception_handler(AtroposSandboxError)
    async def _package_error(request: Request, exc: AtroposSandboxError) -> JSONResponse:
        status, code, headers = errors.answer(exc)
        if status >= 500 and status != 503:  # not an outage the caller retries: a bug or a misconfiguration
            log.error("%s %s answered %d %s", request.method, request.url.path, status, code, exc_info=exc)
        return JSONResponse(error_body(status, code, str(exc)), status_code=status, headers=headers)

    # Starlette's own (an unknown route, a wrong method) too: one error shape for every answer
    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "error")
        detail = exc.detail if isinstance(exc.detail, dict) else error_body(exc.status_code, code, str(exc.detail))[
            "error"]
        return JSONResponse({"error": detail}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(422, "invalid_request", validation_message(exc, "request")), status_code=422)


async def send_error(send: Send, status: int, code: str, message: str,
                     extra: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_body(status, code, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """Checks the bearer token and the body size before the app reads (or parses) anything.

    ``token=None`` disables auth (development on loopback only); ``public`` paths skip it.
    """

    def __init__(self, app: ASGIApp, *, max_body: int, token: str | None, public: Iterable[str] = ()) -> None:
        self.app = app
        self.max_body = max_body
        self.token = token.encode() if token else None
        self.public = set(public)

    def _authorized(self, scope: dict[str, Any]) -> bool:
        if self.token is None or scope.get("path") in self.public:
            return True
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, presented = value.partition(b" ")
                return scheme.lower() == b"bearer" and token_matches(presented, self.token)
        return False

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self._authorized(scope):
            return await send_error(send, 401, "unauthorized", "missing or wrong bearer token",
                                  [(b"www-authenticate", b"Bearer")])
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body:
                return await _too_large(send, self.max_body)
        seen = 0
        state = {"exceeded": False, "started": False, "more": True}

        async def limited() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            state["more"] = message["type"] == "http.request" and bool(message.get("more_body"))
            if seen > self.max_body:
                state["exceeded"] = True
                return {"type": "http.disconnect"}  # the app stops reading; we answer below
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            if state["exceeded"]:
                return
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        try:
            await self.app(scope, limited, guarded_send)
        except Exception:
            if not state["exceeded"]:
                raise
        if state["exceeded"] and not state["started"]:
            # A client still sending when the connection closes sees a broken pipe, not our 413:
            # read (and drop) a bounded overshoot first. What remains unread closes the connection.
            if state["more"]:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(_drain(receive, DRAIN_BYTES), DRAIN_S)
            await _too_large(send, self.max_body, [(b"connection", b"close")])


async def _drain(receive: Receive, budget: int) -> None:
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        budget -= len(message.get("body", b""))
        if not message.get("more_body"):
            return


async def _too_large(send: Send, limit: int, extra: Iterable[tuple[bytes, bytes]] = ()) -> None:
    await send_error(send, 413, "body_too_large", f"request body over the limit of {limit} bytes", extra)
