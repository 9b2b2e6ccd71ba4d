"""Hot routes (a host's ``/v1/call(s)``, the ToolServer's slot call) as ordinary routes of their app.

FastAPI's per-request machinery (dependency resolution, the body parsed to a dict then validated,
the response re-validated through ``response_model`` and encoded again) costs a few hundred
microseconds: more than a warm ``true`` call itself. A ``FastRoute`` is declared like any route
(``hot_post``), sits in the app's one route table (so the OpenAPI schema, the app's middleware,
its error handlers and its ``RequestGuard`` are the ones every route has), and only its handler is
lean: the body is validated straight from its bytes by the same pydantic model, the endpoint's
model is written by ``model_dump_json``. A bad body raises FastAPI's ``RequestValidationError``
(answered 422 ``invalid_request`` by the app's handler in ``atropos.asgi``, as for any route).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.message
import inspect
import typing
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from atropos.asgi import Receive, Send
from atropos.errors import ClientGone

GUARDED = "atropos_checked_by_request_guard"  # attribute of a dependency that only documents a header


def checked_by_guard(dependency: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a dependency as documentation only: the app's ``RequestGuard`` has already done its check
    (the bearer token) before any route runs, so a ``FastRoute`` may leave it out."""
    setattr(dependency, GUARDED, True)
    return dependency


def _json_content_type(request: Request) -> bool:
    value = request.headers.get("content-type")
    if value is None or value == "application/json":
        return True  # like FastAPI: no content type, the body is read as JSON
    message = email.message.Message()
    message["content-type"] = value
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _invalid(problems: list[Any]) -> RequestValidationError:
    return RequestValidationError([{**p, "loc": ("body", *p.get("loc", ()))} for p in problems])


class FastRoute(APIRoute):
    """An ``APIRoute`` whose endpoint takes ``str`` path parameters and one pydantic body, and returns
    a pydantic model or a ``Response``. Its dependencies must be ``checked_by_guard`` (they are in
    the schema and not run per request)."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        hints = typing.get_type_hints(endpoint)
        self.body_name, self.body_model = "", BaseModel
        self.path_names: list[str] = []
        for name in inspect.signature(endpoint).parameters:
            hint = hints.get(name)
            if isinstance(hint, type) and issubclass(hint, BaseModel):
                self.body_name, self.body_model = name, hint
            elif hint is str:
                self.path_names.append(name)
            else:
                raise TypeError(f"FastRoute {path}: parameter {name} is neither a str path parameter nor the body")
        super().__init__(path, endpoint, **kwargs)
        for dep in self.dependant.dependencies:
            if not getattr(dep.call, GUARDED, False):
                raise TypeError(f"FastRoute {path}: dependency {dep.call} would not run (see checked_by_guard)")

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint, body_name, model, path_names = self.endpoint, self.body_name, self.body_model, self.path_names

        async def handle(request: Request) -> Response:
            kwargs: dict[str, Any] = {name: request.path_params[name] for name in path_names}
            if body_name:
                try:
                    raw = await request.body()
                except ClientDisconnect:  # answered 499 to nobody (or the guard's 413 when over the limit)
                    raise ClientGone("the client left before its request body arrived") from None
                if not _json_content_type(request):
                    raise _invalid([{"loc": (), "msg": "expected an application/json body", "type": "content_type"}])
                try:
                    kwargs[body_name] = model.model_validate_json(raw)
                except ValidationError as exc:
                    raise _invalid(list(exc.errors())) from None
            result = await endpoint(**kwargs)
            if isinstance(result, Response):
                return result
            return Response(result.model_dump_json(), media_type="application/json")

        return handle


def hot_post(app: FastAPI, path: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``@app.post(path, **kwargs)`` served by a ``FastRoute``."""

    def register(endpoint: Callable[..., Any]) -> Callable[..., Any]:
        app.router.add_api_route(path, endpoint, methods=["POST"], route_class_override=FastRoute, **kwargs)
        return endpoint

    return register


class LineStream(Response):
    """A chunked 200 of ``lines``, stopped when the client disconnects (the cancellation reaches the
    work behind ``lines``) whatever the server's ASGI version: a batch's calls end with their client."""

    def __init__(self, lines: AsyncIterator[bytes], media_type: str) -> None:
        super().__init__(media_type=media_type)
        self.lines = lines

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:  # type: ignore[override]
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", (self.media_type or "").encode())]})
            async for line in self.lines:
                await send({"type": "http.response.body", "body": line, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        streaming = asyncio.ensure_future(pump())
        watcher = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait({streaming, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            streaming.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            with contextlib.suppress(asyncio.CancelledError):
                await streaming


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
