"""HTTP face of a sandbox host (FastAPI). Versioned JSON; batch results stream as NDJSON."""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from atropos import __version__, memstats, metrics
from atropos.asgi import ASGIApp, ErrorMap, Receive, RequestGuard, Send, http_error, install_error_handlers
from atropos.errors import ImageRejected, SlotUnavailable, ToolError
from atropos.fastroute import FastRoutes, LineStream, checked_by_guard, hot_post, invalid_body
from atropos.sandbox.contract.hosttoken import token_matches
from atropos.sandbox.contract.imageref import MAX_IMAGE_REFERENCE, ImageRef
from atropos.sandbox.contract.protocol import (
    LEASE_HEADER,
    CallBatch,
    CallResult,
    HealthInfo,
    ImageInfo,
    ImageRequest,
    LeaseInfo,
    LeaseRef,
    LeaseRequest,
    PrewarmResult,
    ResetRequest,
    ResetResult,
    SealResult,
    SlotInfo,
    TemplateInfo,
    TemplateRequest,
    ToolCall,
    VerifyRequest,
    VerifyResult,
)
from atropos.sandbox.host.sandbox_host import SandboxHost

log = logging.getLogger(__name__)

_error = http_error
# The host's answers: the table of atropos.errors, but "no free slot" is a 409: the state of this
# host (every slot leased), not an outage; the pool asks its next host.
HOST_ERRORS = ErrorMap({SlotUnavailable: lambda exc: (409, exc.code, None)})
TAR_TYPES = {"application/x-tar": False, "application/tar": False, "application/gzip": True,
             "application/x-gzip": True}
UPLOAD_PATHS = ("/v1/templates", "/v1/images")  # a tar body there: a template or an image archive


def create_app(host: SandboxHost, *, manage_lifecycle: bool = True) -> FastAPI:
    token = host.cfg.token.encode()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if manage_lifecycle:
            await host.start()
            await host.prewarm_all()
        try:
            yield
        finally:
            if manage_lifecycle:
                await host.stop()

    app = FastAPI(title="atropos-sandbox host", version=__version__, lifespan=lifespan)
    install_error_handlers(app, HOST_ERRORS)

    @checked_by_guard
    async def auth(authorization: str = Header("", description="Bearer <host token>")) -> None:
        """Documents the header; RequestGuard has already checked it before the body was read."""
        scheme, _, presented = authorization.partition(" ")
        if not token or scheme.lower() != "bearer" or not token_matches(presented.encode(), token):
            raise _error(401, "unauthorized", "missing or wrong bearer token")

    deps = [Depends(auth)]
    _slot_routes(app, host, deps)
    _template_routes(app, host, deps)
    _image_routes(app, host, deps)
    _file_routes(app, host, deps)
    _debug_routes(app, deps)
    return app


def _slot_or_404(host: SandboxHost, index: int) -> None:
    try:
        host.slot(index)
    except KeyError as exc:
        raise _error(404, "unknown_slot", str(exc.args[0])) from None


def _slot_routes(app: FastAPI, host: SandboxHost, deps: list[Any]) -> None:
    """Health and metrics; leasing, resetting, sealing and verifying slots; tool calls."""
    slot_or_404 = functools.partial(_slot_or_404, host)

    @app.get("/v1/health", response_model=HealthInfo, dependencies=deps)
    async def health(mounts: bool = Query(False, description="also count the workspace mounts (reads every "
                                                             "slot namespace's mount table)")) -> JSONResponse:
        info = await host.health(mounts=mounts)
        return JSONResponse(info.model_dump(), status_code=200 if info.ok else 503)

    @app.get("/metrics", dependencies=deps, response_class=Response)
    async def prometheus() -> Response:
        """Prometheus metrics of this host (needs the token like every host route)."""
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/slots", response_model=list[SlotInfo], dependencies=deps)
    async def slots() -> list[SlotInfo]:
        return host.slot_infos()

    @app.post("/v1/prewarm", response_model=PrewarmResult, status_code=202, dependencies=deps)
    async def prewarm() -> PrewarmResult:
        """Start, in the background, the sandbox of every slot that may have one and has none yet
        (idempotent; leased-with-network, busy, quarantined and sealed slots are left alone). A pool
        sends it once its fleet is up, so prewarming never competes with its hosts' start-up."""
        return host.prewarm_in_background()

    @app.post("/v1/leases", response_model=LeaseInfo, dependencies=deps)
    async def lease(req: LeaseRequest) -> LeaseInfo:
        if req.slot is not None:
            slot_or_404(req.slot)
        return await host.lease(req)

    async def _reset(slot: int, req: ResetRequest, keep: bool) -> ResetResult:
        slot_or_404(slot)
        return await host.reset(slot, req, keep=keep)

    @app.post("/v1/slots/{slot}/reset", response_model=ResetResult, dependencies=deps)
    async def reset(slot: int, req: ResetRequest) -> ResetResult:
        """Restore the slot to pristine and keep it leased to the caller under a fresh lease token."""
        return await _reset(slot, req, keep=True)

    @app.post("/v1/slots/{slot}/release", response_model=ResetResult, dependencies=deps)
    async def release(slot: int, req: LeaseRef) -> ResetResult:
        """Reset the slot and return it to the free list."""
        return await _reset(slot, ResetRequest(lease=req.lease), keep=False)

    @app.post("/v1/slots/{slot}/seal", response_model=SealResult, dependencies=deps)
    async def seal(slot: int, req: LeaseRef) -> SealResult:
        """Begin the slot's verification phase: every process of the slot is killed, and from now
        on nothing runs or writes in it (reading the workspace and verify remain) until its reset."""
        slot_or_404(slot)
        return await host.seal(slot, req.lease)

    @app.post("/v1/slots/{slot}/verify", response_model=VerifyResult, dependencies=deps)
    async def verify(slot: int, req: VerifyRequest) -> VerifyResult:
        """Seal the slot, then run a verifier program against its final workspace in a fresh,
        read-only sandbox; the verdict comes back here (see docs/verification.md)."""
        slot_or_404(slot)
        try:
            return await host.verify(slot, req)
        except ToolError as exc:  # the one ToolError verify raises: secrets over MAX_VERIFY_SECRETS
            if exc.code != ToolError.code:
                raise
            raise ToolError(str(exc), code="too_large", status=413) from None

    # the hot routes: ordinary routes with a lean handler (see atropos.fastroute)
    @hot_post(app, "/v1/calls", dependencies=deps, response_class=StreamingResponse,
              responses={200: {"content": {"application/x-ndjson": {}},
                               "description": "one CallResult JSON per line, in completion order"}})
    async def calls(batch: CallBatch) -> LineStream:
        async def lines() -> AsyncIterator[bytes]:
            async for result in host.run_calls(batch.calls):
                yield result.model_dump_json().encode() + b"\n"

        return LineStream(lines(), media_type="application/x-ndjson")

    @hot_post(app, "/v1/call", response_model=CallResult, dependencies=deps)
    async def call(call: ToolCall) -> CallResult:
        return await host.run_call(call)


def _debug_routes(app: FastAPI, deps: list[Any]) -> None:
    """This host process's memory (issue 40), for a soak or an operator holding the host token: a
    slot's code has no token (the host's API is the pool's; docs/security.md), so it cannot reach
    this, nor start tracing, which slows every allocation of the host."""

    one_at_a_time = asyncio.Lock()  # the baselines it starts and diffs are per process

    @app.post("/v1/debug/memory", response_model=memstats.MemoryReport, dependencies=deps)
    async def memory(req: memstats.MemoryRequest) -> memstats.MemoryReport:
        # a report that walks every live object (``types``) or diffs tracemalloc snapshots takes
        # tens to hundreds of ms: in a thread, the host's calls go on between its bytecodes
        async with one_at_a_time:
            out = await asyncio.to_thread(memstats.report, req)
        out.asyncio_tasks = len(asyncio.all_tasks())  # the loop's, which the thread cannot see
        return out


def _template_routes(app: FastAPI, host: SandboxHost, deps: list[Any]) -> None:
    """Templates: made from a slot or a source, listed, deleted, shipped as tar streams."""
    slot_or_404 = functools.partial(_slot_or_404, host)

    @app.post("/v1/templates", response_model=TemplateInfo, dependencies=deps, openapi_extra={
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": TemplateRequest.model_json_schema()},
            "application/x-tar": {"schema": {"type": "string", "format": "binary"}},
            "application/gzip": {"schema": {"type": "string", "format": "binary"}}}}})
    async def create_template(request: Request, name: str = Query("", max_length=128)) -> TemplateInfo:
        """Make a template from a leased slot (it continues as a fork of it), an allowed host
        directory, a git repository, or an uploaded tar archive (the body itself)."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype in TAR_TYPES:
            return await host.upload_template(request.stream(), name, gzip=TAR_TYPES[ctype])
        try:
            req = TemplateRequest.model_validate_json(await request.body())
        except ValidationError as exc:  # answered like every route's bad body (atropos.asgi)
            raise invalid_body(exc.errors()) from None
        if req.source == "slot" and req.slot is not None:
            slot_or_404(req.slot)
        return await host.create_template(req)

    @app.get("/v1/templates", response_model=list[TemplateInfo], dependencies=deps)
    async def templates() -> list[TemplateInfo]:
        return host.templates()

    @app.get("/v1/templates/{template_id}", response_model=TemplateInfo, dependencies=deps)
    async def template(template_id: str) -> TemplateInfo:
        return host.template(template_id).info()

    @app.delete("/v1/templates/{template_id}", dependencies=deps)
    async def delete_template(template_id: str) -> dict[str, Any]:
        """Delete a template; refused (409 template_in_use) while any slot is built on it."""
        host.delete_template(template_id)
        return {"deleted": template_id}

    @app.get("/v1/templates/{template_id}/archive", dependencies=deps, response_class=StreamingResponse,
             responses={200: {"content": {"application/x-tar": {}}}})
    async def template_archive(template_id: str) -> StreamingResponse:
        """The template as a POSIX tar stream: upload it to another host to use it there."""
        return StreamingResponse(host.template_archive(template_id), media_type="application/x-tar")


def _image_routes(app: FastAPI, host: SandboxHost, deps: list[Any]) -> None:
    """Task images (docs/task-images.md): imported into the host's layer store ahead of use, listed."""

    @app.post("/v1/images", response_model=ImageInfo, dependencies=deps, openapi_extra={
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": ImageRequest.model_json_schema()},
            "application/x-tar": {"schema": {"type": "string", "format": "binary"}}}}})
    async def prepare_image(request: Request, reference: str = Query("", max_length=MAX_IMAGE_REFERENCE)) -> ImageInfo:
        """Import an image into the host's layer store now: from its engine (a JSON body naming it),
        or from an uploaded ``docker save`` archive (the body itself, ``reference`` its name)."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype == "application/x-tar":
            if not reference:
                raise ImageRejected("an uploaded image archive needs ?reference=NAME")
            return await host.upload_image(request.stream(), ImageRef.parse(reference))
        try:
            req = ImageRequest.model_validate_json(await request.body())
        except ValidationError as exc:  # answered like every route's bad body (atropos.asgi)
            raise invalid_body(exc.errors()) from None
        return await host.prepare_image(req.reference)

    @app.post("/v1/slots/{slot}/image", response_model=ImageInfo, dependencies=deps)
    async def derive_image(slot: int, req: LeaseRef) -> ImageInfo:
        """A new image of the leased slot's root as it is now (after a group's setup); the slot
        continues as a fresh root of it. Its reference serves any lease on this machine's hosts."""
        _slot_or_404(host, slot)
        return await host.derive_image(slot, req.lease)

    @app.get("/v1/images", response_model=list[ImageInfo], dependencies=deps)
    async def images() -> list[ImageInfo]:
        return host.held_images()


def _file_routes(app: FastAPI, host: SandboxHost, deps: list[Any]) -> None:
    """A leased slot's workspace as files (the lease token in a header): read, write, list, stat, archive."""
    slot_or_404 = functools.partial(_slot_or_404, host)

    async def file_call(slot: int, lease: str, tool: str, args: dict[str, Any]) -> dict[str, Any]:
        slot_or_404(slot)
        result = await host.run_call(ToolCall(id=tool, slot=slot, lease=lease, tool=tool, args=args))
        if not result.ok:
            assert result.error is not None
            raise _error(result.error.status, result.error.code, result.error.message)
        assert result.result is not None
        return result.result

    lease_header = Header(..., alias=LEASE_HEADER, min_length=1, max_length=256)

    @app.get("/v1/slots/{slot}/files", dependencies=deps, response_class=Response,
             responses={200: {"content": {"application/octet-stream": {}}}})
    async def read_file(slot: int, path: str = Query(..., min_length=1, max_length=4096),
                        lease: str = lease_header) -> Response:
        out = await file_call(slot, lease, "read_file", {"path": path, "encoding": "base64"})
        return Response(base64.b64decode(out["content"]), media_type="application/octet-stream")

    @app.put("/v1/slots/{slot}/files", dependencies=deps)
    async def write_file(request: Request, slot: int, path: str = Query(..., min_length=1, max_length=4096),
                         lease: str = lease_header) -> dict[str, Any]:
        data = await request.body()
        return await file_call(slot, lease, "write_file",
                               {"path": path, "content": base64.b64encode(data).decode(), "encoding": "base64"})

    @app.get("/v1/slots/{slot}/list", dependencies=deps)
    async def list_dir(slot: int, path: str = Query(".", min_length=1, max_length=4096),
                       lease: str = lease_header) -> dict[str, Any]:
        return await file_call(slot, lease, "list_dir", {"path": path})

    @app.get("/v1/slots/{slot}/stat", dependencies=deps)
    async def stat(slot: int, path: str = Query(..., min_length=1, max_length=4096),
                   lease: str = lease_header) -> dict[str, Any]:
        return await file_call(slot, lease, "stat", {"path": path})

    @app.get("/v1/slots/{slot}/archive", dependencies=deps, response_class=Response,
             responses={200: {"content": {"application/gzip": {}}}})
    async def archive(slot: int, path: str = Query(".", min_length=1, max_length=4096),
                      lease: str = lease_header) -> Response:
        out = await file_call(slot, lease, "archive", {"path": path})
        return Response(base64.b64decode(out["content"]), media_type="application/gzip")


def wrap(app: FastAPI, host: SandboxHost) -> ASGIApp:
    """Auth and body limit first, for every path (docs included: a host is not a public service).

    Template tar and image archive uploads get their own, larger body limit (``max_template_bytes``)."""
    default = RequestGuard(FastRoutes(app), max_body=host.cfg.max_body_bytes, token=host.cfg.token)
    upload = RequestGuard(app, max_body=host.cfg.max_template_bytes, token=host.cfg.token)  # type: ignore[arg-type]

    async def route(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST" and scope.get("path") in UPLOAD_PATHS:
            for key, value in scope.get("headers", []):
                if key == b"content-type" and value.split(b";")[0].strip().lower().decode() in TAR_TYPES:
                    return await upload(scope, receive, send)
        return await default(scope, receive, send)

    return route

