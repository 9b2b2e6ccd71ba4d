"""Hot routes (a host's ``/v1/call(s)``, the ToolServer's slot call) as ordinary routes of their app.

FastAPI's per-request machinery costs a few hundred microseconds: more than a warm ``true`` call
itself. Per route: dependency resolution, the body parsed to a dict then validated, the response
re-validated through ``response_model`` and encoded again; per app: a stack of middleware
(telemetry, body limits, exit stacks, error catching) around a router that tries every route in
turn. A ``FastRoute`` is declared like any route (``hot_post``) and sits in the app's one route
table (the OpenAPI schema, the exception handlers and the ``RequestGuard`` are the ones every
route has); its handler is lean: the body is validated straight from its bytes by the same
pydantic model, the endpoint's model is written by ``model_dump_json``, and a bad body raises
FastAPI's ``RequestValidationError`` (422 ``invalid_request`` from the app's handler in
``atropos.asgi``, as for any route). ``FastRoutes``, the app's front, hands a request that one of
those routes matches straight to it, with the app's own exception handlers, ahead of the
middleware stack: same route objects, same error answers, nothing declared twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.message
import inspect
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, MutableMapping
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from atropos.asgi import Receive, Send
from atropos.errors import ClientGone

GUARDED = "atropos_checked_by_request_guard"  # attribute of a dependency that only documents a header


def checked_by_guard(dependency: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a dependency as documentation only: the app's ``RequestGuard`` has already done its check
    (the bearer token) before any route runs, so a ``FastRoute`` may leave it out."""
    setattr(dependency, GUARDED, True)
    return dependency


def _json_content_type(value: str | None) -> bool:
    if value is None or value == "application/json":
        return True  # like FastAPI: no content type, the body is read as JSON
    message = email.message.Message()
    message["content-type"] = value
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def invalid_body(problems: list[Any]) -> RequestValidationError:
    """A body's validation problems as FastAPI's error (answered 422 ``invalid_request`` by the app's
    handler, ``atropos.asgi``), located under ``body`` as FastAPI locates them."""
    return RequestValidationError([{**p, "loc": ("body", *p.get("loc", ()))} for p in problems])


async def _read_body(receive: Callable[[], Awaitable[Any]]) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":  # answered 499 to nobody (or the guard's 413 when over the limit)
            raise ClientGone("the client left before its request body arrived")
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


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

    def _arguments(self, path_params: dict[str, Any], content_type: str | None, raw: bytes) -> dict[str, Any]:
        kwargs: dict[str, Any] = {name: path_params[name] for name in self.path_names}
        if self.body_name:
            if not _json_content_type(content_type):
                raise invalid_body([{"loc": (), "msg": "expected an application/json body", "type": "content_type"}])
            try:
                kwargs[self.body_name] = self.body_model.model_validate_json(raw)
            except ValidationError as exc:
                raise invalid_body(list(exc.errors())) from None
        return kwargs

    async def run(self, scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]]) -> Any:
        """The endpoint's result for this request (read from ``receive``); raises what it raises."""
        content_type = None
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_type = value.decode("latin-1")
        raw = await _read_body(receive) if self.body_name else b""
        return await self.endpoint(**self._arguments(scope.get("path_params", {}), content_type, raw))

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        # Served through FastAPI's own router (an app used without its FastRoutes front): the same run.
        async def handle(request: Request) -> Response:
            try:
                result = await self.run(request.scope, request.receive)
            except ClientDisconnect:
                raise ClientGone("the client left before its request body arrived") from None
            return result if isinstance(result, Response) else _json(result)

        return handle


def _json(result: BaseModel) -> Response:
    return Response(result.model_dump_json(), media_type="application/json")


class FastRoutes:
    """``app`` (FastAPI's) whose ``FastRoute`` s are served ahead of its middleware stack: a request
    one of them matches runs that route, and what it raises is answered by the exception handler
    the app installed for it (``atropos.asgi.install_error_handlers``: the one error translation);
    every other request goes to ``app``. An exception no handler takes reaches the server (uvicorn
    answers 500), as it would through the app's error middleware."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.routes = [r for r in app.router.routes if isinstance(r, FastRoute)]

    def _handler(self, exc: Exception) -> Callable[..., Any] | None:
        handlers = self.app.exception_handlers
        if isinstance(exc, HTTPException) and exc.status_code in handlers:
            return handlers[exc.status_code]
        return next((handlers[cls] for cls in type(exc).__mro__ if cls in handlers), None)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for route in self.routes:
                # the route's own pattern and methods (its full ``matches`` is the router's, with a
                # mount's root_path: a request that does not match here is served by the app's router)
                found = route.path_regex.fullmatch(scope["path"])
                if found is not None and scope["method"] in route.methods:  # type: ignore[operator]
                    scope["path_params"] = {k: route.param_convertors[k].convert(v)
                                            for k, v in found.groupdict().items()}
                    scope["route"], scope["endpoint"] = route, route.endpoint
                    return await self._serve(route, scope, receive, send)
        await self.app(scope, receive, send)  # type: ignore[arg-type]

    async def _serve(self, route: FastRoute, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        try:
            result = await route.run(scope, receive)
        except Exception as exc:
            handler = self._handler(exc)
            if handler is None:
                raise
            result = await handler(Request(scope, receive), exc)
        if isinstance(result, Response):
            return await result(scope, receive, send)  # type: ignore[arg-type]
        body = result.model_dump_json().encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


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
