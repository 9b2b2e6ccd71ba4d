"""Raw ASGI plumbing for the hot routes (a host's ``/v1/call(s)``, the ToolServer's slot call).

FastAPI's routing, dependency resolution, response-model re-validation and middleware cost a few
hundred microseconds per request: more than a warm ``true`` call itself. The hot routes are
served by small ASGI handlers built from these helpers, behind the same ``RequestGuard`` (token and
body limit checked first), while their FastAPI declarations stay in the app for the OpenAPI schema.
Bodies are validated by the same pydantic models, errors keep the one error body shape of
``atropos.asgi`` and the statuses FastAPI would answer (422 ``invalid_request`` for a bad body).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.message
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from atropos.asgi import ASGIApp, Receive, Send, error_body

M = TypeVar("M", bound=BaseModel)
JSON = (b"content-type", b"application/json")


class BadBody(Exception):
    """The body is not the route's model (answered 422 ``invalid_request``)."""


class Disconnected(Exception):
    """The client went away before its body arrived."""


def _json_content_type(scope: dict[str, Any]) -> bool:
    for name, value in scope.get("headers", []):
        if name == b"content-type":
            if value == b"application/json":
                return True
            message = email.message.Message()
            message["content-type"] = value.decode("latin-1")
            subtype = message.get_content_subtype()
            return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))
    return True  # like FastAPI: no content type, the body is read as JSON


async def read_model(scope: dict[str, Any], receive: Receive, model: type[M]) -> M:
    """The request body as ``model`` (BadBody with FastAPI's ``body.<field>: <message>`` wording)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    if not _json_content_type(scope):
        raise BadBody("body: expected an application/json body")
    try:
        return model.model_validate_json(b"".join(chunks))
    except ValidationError as exc:
        raise BadBody("; ".join(f"{'.'.join(str(p) for p in ('body', *err['loc']))}: {err['msg']}"
                                for err in exc.errors())) from None


def body_route(model: type[M], handle: Callable[[dict[str, Any], Receive, Send, M], Awaitable[None]]) -> ASGIApp:
    """A raw route whose body is ``model``: ``handle(scope, receive, send, body)`` runs once the body
    is whole and valid; a bad body is answered 422 ``invalid_request``, a client gone before its
    body arrived is answered nothing."""

    async def route(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        try:
            body = await read_model(scope, receive, model)
        except BadBody as exc:
            return await send_error(send, 422, "invalid_request", str(exc))
        except Disconnected:
            return
        await handle(scope, receive, send, body)

    return route


async def send_json(send: Send, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [JSON, (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, status: int, code: str, message: str,
                     headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    await send_json(send, status, json.dumps(error_body(status, code, message)).encode(), headers)


async def until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def stream_lines(receive: Receive, send: Send, lines: AsyncIterator[bytes], media_type: bytes) -> None:
    """Stream ``lines`` as a chunked 200 response; stop it when the client disconnects (the
    cancellation reaches the work behind ``lines``), as Starlette's StreamingResponse does."""

    async def pump() -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", media_type)]})
        async for line in lines:
            await send({"type": "http.response.body", "body": line, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    streaming = asyncio.ensure_future(pump())
    watcher = asyncio.ensure_future(until_disconnect(receive))
    try:
        await asyncio.wait({streaming, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        streaming.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        with contextlib.suppress(asyncio.CancelledError):
            await streaming
