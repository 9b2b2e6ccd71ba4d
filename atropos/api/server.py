"""ToolServer: external tools (secrets and internet stay here) and the REST slot API.

Any agent framework, in any language, can lease a slot, call sandbox tools on it, read files
and release it over plain HTTP. Every route needs the bearer token except ``/healthz``, the API docs,
the ``/status`` page shell (it fetches its data with the token from the URL fragment) and, unless
``public_metrics`` is off, ``/metrics`` (see ``atropos.metrics`` for why). A server started without a
token (``allow_no_auth``, loopback development only) opens everything.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.routing import BaseRoute, Match

from atropos import __version__, metrics
from atropos.api.disconnect import release_undelivered, unless_disconnected
from atropos.api.docs import PUBLIC as DOCS_PUBLIC
from atropos.api.docs import serve_docs
from atropos.api.openapi import complete_openapi
from atropos.asgi import (
    ASGIApp,
    ErrorMap,
    Receive,
    RequestGuard,
    Send,
    http_error,
    install_error_handlers,
    send_error,
)
from atropos.errors import (
    ClientGone,
    InfrastructureError,
    LeaseError,
    SlotSealed,
    SlotUnavailable,
    ToolError,
    validation_message,
)
from atropos.fastroute import FastRoutes, checked_by_guard, hot_post
from atropos.logs import call_fields
from atropos.sandbox.contract.imageref import ImageRef
from atropos.sandbox.contract.protocol import SealResult, VerifyResult, VerifySpec, Wire
from atropos.sandbox.contract.tools import PROGRAM_ONLY
from atropos.slots.lease import Lease
from atropos.slots.pool import PoolStatus, SlotPool
from atropos.slots.results import WriteResult
from atropos.tools.formatting import format_result
from atropos.tools.registry import ToolRegistry

log = logging.getLogger(__name__)


def fingerprint(secret: str) -> str:
    """A stable, non-reversible handle for logs: lease ids are bearer secrets and never logged whole."""
    return hashlib.sha256(secret.encode()).hexdigest()[:12]


STATUS_PAGE = resources.files("atropos.api").joinpath("static/status.html").read_text()


class ToolServerSettings(BaseModel):
    token: str | None = Field(None, repr=False, description="bearer token; None only with allow_no_auth")
    allow_no_auth: bool = Field(False, description="DEVELOPMENT: no token (refused unless bound to loopback)")
    max_body_bytes: int = Field(32 << 20, ge=1024)
    max_concurrency: int = Field(512, ge=1, description="requests in progress at once; more get 429")
    rest_lease_idle_s: float = Field(1800.0, gt=0, description="REST leases unused this long are released")
    public_metrics: bool = Field(True, description="/metrics without the token (it holds no secret or id; "
                                                   "see atropos.metrics)")


class Body(BaseModel):
    """A request body of the API: a field it does not declare is refused (422), never ignored (a
    misspelt ``restore`` or ``timeout_s`` would otherwise verify or wait other than asked)."""

    model_config = ConfigDict(extra="forbid")


class InvokeRequest(Body):
    args: dict[str, Any] = Field(default_factory=dict)


class InvokeResponse(BaseModel):
    ok: bool
    content: str
    raw: dict[str, Any] | None = None


class SlotLeaseRequest(Body):
    trajectory_id: str = Field(min_length=1, max_length=256)
    network: bool = False
    image: ImageRef | None = Field(None, description="the slot's / is a fresh root of this task image "
                                                     "(docs/task-images.md)")
    timeout_s: float | None = Field(None, gt=0, le=3600, description="how long to wait for a free slot")


class SlotLeaseResponse(BaseModel):
    lease_id: str = Field(description="secret handle of this lease; pass it in later calls")
    trajectory_id: str
    network: bool


class SlotCallRequest(Wire):
    model_config = ConfigDict(cache_strings="keys", extra="forbid")  # Wire's, and a Body's refusal

    tool: str = Field(min_length=1, max_length=128)
    args: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float | None = Field(None, gt=0, le=3600)


class SlotCallResponse(BaseModel):
    ok: bool
    content: str = Field(description="the result as the model would read it")
    result: dict[str, Any] | None = Field(None, description="the structured result")
    error: dict[str, Any] | None = None
    duration_ms: float


class SlotVerifyRequest(VerifySpec):
    """A verifier program for the slot's final workspace (see docs/verification.md): every field
    ``Lease.verify`` takes, ``restore`` included (``VerifySpec``)."""

    model_config = ConfigDict(cache_strings="keys", extra="forbid")


class ReleaseResponse(BaseModel):
    released: bool


class _RestLease:
    def __init__(self, lease: Lease, lease_id: str) -> None:
        self.lease = lease
        self.fingerprint = fingerprint(lease_id)  # the lease id's handle in logs, computed once
        self.last_used = time.monotonic()


_error = http_error


# The ToolServer's answers: the table of atropos.errors (a file the host refused answers the host's
# code and status, one status per code), with a retry hint when no slot was free.
TOOLSERVER_ERRORS = ErrorMap({SlotUnavailable: lambda exc: (503, exc.code, {"Retry-After": "5"})})
GRANTED = "atropos_granted_lease"  # scope["state"] key: the lease id a POST /v1/slots granted


ExternalHandler = Any  # async (args: dict) -> InvokeResponse


class _ToolServer:
    """The state behind the routes: the pool, the REST leases and the recent calls."""

    def __init__(self, pool: SlotPool, settings: ToolServerSettings, registry: ToolRegistry,
                 externals: dict[str, ExternalHandler], manage_pool: bool) -> None:
        self.pool = pool
        self.settings = settings
        self.registry = registry
        self.externals = externals
        self.manage_pool = manage_pool
        self.token = (settings.token or "").encode()
        self.leases: dict[str, _RestLease] = {}
        self.gate = asyncio.Semaphore(settings.max_concurrency)
        self.recent: deque[dict[str, Any]] = deque(maxlen=100)
        self.pool_metrics = metrics.pool_registry(pool)  # this app's own: see atropos.metrics

    @staticmethod
    @checked_by_guard
    async def auth(authorization: str = Header("", description="Bearer <token>")) -> None:
        """Documents the header; the app's RequestGuard has checked it before any route runs."""

    async def reap_idle(self) -> None:
        idle_s = self.settings.rest_lease_idle_s
        while True:
            await asyncio.sleep(min(60.0, idle_s / 2))
            now = time.monotonic()
            for lease_id, held in list(self.leases.items()):
                if now - held.last_used > idle_s:
                    self.leases.pop(lease_id, None)
                    await self.pool.release(held.lease)

    @asynccontextmanager
    async def lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        if self.manage_pool:
            await self.pool.start()
        reaper = asyncio.create_task(self.reap_idle())
        try:
            yield
        finally:
            reaper.cancel()
            for held in list(self.leases.values()):
                await self.pool.release(held.lease)
            self.leases.clear()
            if self.manage_pool:
                await self.pool.stop()

    def held_entry(self, lease_id: str) -> _RestLease:
        entry = self.leases.get(lease_id)
        if entry is None:
            raise _error(404, "unknown_lease", "no such lease (released, expired or never granted)")
        entry.last_used = time.monotonic()
        return entry

    def held(self, lease_id: str) -> Lease:
        return self.held_entry(lease_id).lease

    async def grant(self, req: SlotLeaseRequest, request: Request) -> SlotLeaseResponse:
        try:
            with metrics.LEASE_WAIT_SECONDS.time():
                # A client that gave up while queued stops waiting: no slot is ever leased to nobody.
                lease = await unless_disconnected(
                    request, self.pool.lease(req.trajectory_id, req.timeout_s, network=req.network, image=req.image),
                    undo=self.pool.release)
        except ClientGone:
            log.info("lease request abandoned by its client", extra=call_fields(trajectory_id=req.trajectory_id))
            raise
        lease_id = secrets.token_urlsafe(24)
        entry = self.leases[lease_id] = _RestLease(lease, lease_id)
        request.scope.setdefault("state", {})[GRANTED] = lease_id  # for release_undelivered
        log.info("slot leased", extra=call_fields(trajectory_id=req.trajectory_id, lease=entry.fingerprint,
                                                  slot=lease.slot, host=lease.host.id))
        return SlotLeaseResponse(lease_id=lease_id, trajectory_id=req.trajectory_id, network=req.network)

    async def release(self, lease_id: str, why: str = "slot released") -> bool:
        entry = self.leases.pop(lease_id, None)
        if entry is None:
            return False
        await self.pool.release(entry.lease)
        log.info(why, extra=call_fields(trajectory_id=entry.lease.trajectory_id, lease=entry.fingerprint,
                                        slot=entry.lease.slot, host=entry.lease.host.id))
        return True

    async def release_undelivered(self, scope: dict[str, Any]) -> None:
        lease_id = scope.get("state", {}).get(GRANTED)
        if lease_id is not None:
            await self.release(lease_id, "slot released: its client left before the lease reached it")

    async def slot_call(self, lease_id: str, req: SlotCallRequest) -> SlotCallResponse:
        entry = self.held_entry(lease_id)
        lease = entry.lease
        label, counted = req.tool, None  # what SLOT_CALLS counts; an unexpected exception counts nothing
        try:
            tool = self.registry.get(req.tool)
            if (tool is None or tool.kind != "sandbox") and req.tool not in PROGRAM_ONLY:
                label, counted = metrics.UNKNOWN_TOOL, "unknown_tool"
                raise _error(404, "unknown_tool", f"no sandbox tool named {req.tool!r}")
            ids = call_fields(trajectory_id=lease.trajectory_id, lease=entry.fingerprint, tool=req.tool,
                              slot=lease.slot, host=lease.host.id)
            try:
                result = await lease.call(req.tool, req.args, timeout_s=req.timeout_s)
            except LeaseError:
                counted = "lease_invalid"
                log.warning("slot call %s refused: lease invalid", req.tool, extra={**ids, "outcome": counted})
                raise
            except InfrastructureError as exc:
                counted = "infrastructure"
                log.warning("slot call %s failed: %s", req.tool, exc, extra={**ids, "outcome": counted})
                raise
            if result.error is not None and result.error.code == SlotSealed.code:
                # the slot's state refuses the request (not the tool's own failure): 409, as on every route
                counted = "verification_phase"
                raise SlotSealed(result.error.message)
            ok, content = format_result(req.tool, result)
            outcome = "ok" if ok else (result.error.code if result.error else "failed")
            # "error" = the tool ran and failed (exit 1, file missing); arguments the tool refused are their
            # own outcome: a model sending bad calls is a different problem from commands that fail.
            counted = "ok" if ok else "invalid_arguments" if outcome == "invalid_arguments" else "error"
            log.info("slot call %s %s in %.1f ms", req.tool, outcome, result.duration_ms,
                     extra={**ids, "call_id": result.id, "outcome": outcome})
            self.recent.append({"ts": time.time(), "trajectory_id": lease.trajectory_id, "tool": req.tool,
                                "outcome": outcome, "duration_ms": result.duration_ms})
            return SlotCallResponse(ok=ok, content=content, result=result.result,
                                    error=result.error.model_dump() if result.error else None,
                                    duration_ms=result.duration_ms)
        finally:
            if counted is not None:
                metrics.SLOT_CALLS.labels(label, counted).inc()

    async def invoke(self, name: str, req: InvokeRequest) -> InvokeResponse:
        tool = self.registry.get(name)
        if tool is None:
            raise _error(404, "unknown_tool", f"no tool named {name!r}")
        if tool.kind == "sandbox":
            raise _error(400, "needs_slot", f"{name} runs in a slot: lease one and use /v1/slots/{{lease_id}}/call")
        handler = self.externals.get(name)
        if handler is None:
            raise _error(501, "not_configured", f"{name} has no provider configured on this server")
        outcome = "error"  # an unexpected exception: the 500 handler answers, the count says so
        try:
            result: InvokeResponse = await handler(req.args)
            outcome = "ok" if result.ok else "failed"
            return result
        except (ValidationError, ToolError) as exc:  # what the model asked an external tool cannot run as asked
            outcome = "invalid_arguments"
            message = validation_message(exc) if isinstance(exc, ValidationError) else str(exc)
            raise _error(422, "invalid_arguments", message) from None
        except InfrastructureError:
            outcome = "infrastructure"
            raise  # 503 through the app's error map
        finally:
            metrics.EXTERNAL_CALLS.labels(name, outcome).inc()
            log.info("external call %s %s", name, outcome, extra=call_fields(tool=name, outcome=outcome))


def create_tool_server(
    pool: SlotPool,
    settings: ToolServerSettings,
    *,
    registry: ToolRegistry | None = None,
    externals: dict[str, ExternalHandler] | None = None,
    manage_pool: bool = False,
) -> Any:
    """Build the ASGI app. With ``manage_pool`` the app starts and stops the pool in its lifespan."""
    if not settings.token and not settings.allow_no_auth:
        raise ValueError("the ToolServer needs a token (or allow_no_auth for loopback development)")
    server = _ToolServer(pool, settings, registry or ToolRegistry.default(), externals or {}, manage_pool)
    # /docs from this server's own files (atropos.api.docs); ReDoc has no packaged copy: off
    app = FastAPI(title="atropos-sandbox ToolServer", version=__version__, lifespan=server.lifespan,
                  docs_url=None, redoc_url=None)
    serve_docs(app)
    app.state.pool = pool
    app.state.rest_leases = server.leases
    install_error_handlers(app, TOOLSERVER_ERRORS)
    deps = [Depends(server.auth)]
    _pool_routes(app, server, deps)
    _slot_routes(app, server, deps)
    _file_routes(app, server, deps)
    complete_openapi(app, max_body_bytes=settings.max_body_bytes, max_concurrency=settings.max_concurrency,
                     lease_idle_s=settings.rest_lease_idle_s)
    return _dispatch(app, server)


class _Gate:
    """Every route's concurrency limit (429 over it) and request metrics, in the app's front (so the
    hot routes served ahead of FastAPI's middleware have them too; see atropos.fastroute)."""

    def __init__(self, app: ASGIApp, server: _ToolServer, routes: list[BaseRoute]) -> None:
        self.app, self.gate, self.limit, self.routes = app, server.gate, server.settings.max_concurrency, routes

    def _route_path(self, scope: dict[str, Any]) -> str:
        route = scope.get("route")  # set by the router; a request refused before routing is matched here
        if route is None:
            route = next((r for r in self.routes if r.matches(scope)[0] == Match.FULL), None)
        return str(getattr(route, "path", "unmatched"))

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 499  # nothing answered: the client left first

        async def counted(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self.gate.locked():
                return await send_error(counted, 429, "too_many_requests", f"over {self.limit} requests in progress",
                                        [(b"retry-after", b"1")])
            async with self.gate:
                await self.app(scope, receive, counted)
        except Exception:
            status = 500
            raise
        finally:
            path = self._route_path(scope)
            metrics.API_REQUESTS.labels(scope["method"], path, str(status)).inc()
            metrics.API_SECONDS.labels(path).observe(time.perf_counter() - t0)


def _pool_routes(app: FastAPI, server: _ToolServer, deps: list[Any]) -> None:
    """Health, the tool list, external tools, the pool's status and metrics, the status page."""
    pool, registry = server.pool, server.registry

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        status = pool.status()
        return {"ok": bool(status.hosts), "hosts": len(status.hosts), "version": __version__}

    @app.get("/v1/tools", dependencies=deps)
    async def tools() -> dict[str, Any]:
        return {"tools": [{**registry.get(n).openai_schema(), "kind": registry.get(n).kind,  # type: ignore[union-attr]
                           "toolset": registry.get(n).toolset} for n in registry.names()]}  # type: ignore[union-attr]

    @app.post("/v1/tools/{name}/invoke", response_model=InvokeResponse, dependencies=deps)
    async def invoke(name: str, req: InvokeRequest) -> InvokeResponse:
        return await server.invoke(name, req)

    @app.get("/v1/status", response_model=PoolStatus, dependencies=deps)
    async def status() -> PoolStatus:
        return pool.status()

    @app.get("/v1/recent-calls", dependencies=deps)
    async def recent_calls() -> dict[str, Any]:
        return {"calls": list(server.recent)}

    @app.get("/metrics", response_class=Response, dependencies=[] if server.settings.public_metrics else deps)
    async def prometheus() -> Response:
        body, content_type = metrics.exposition(server.pool_metrics)
        return Response(body, media_type=content_type)

    @app.get("/status", response_class=HTMLResponse)
    async def status_page() -> HTMLResponse:
        """Live pool view; open /status#token=<token> (the fragment never reaches the server)."""
        return HTMLResponse(STATUS_PAGE)


def _slot_routes(app: FastAPI, server: _ToolServer, deps: list[Any]) -> None:
    """Lease a slot, call a tool in it, seal and verify it, release it."""

    @app.post("/v1/slots", response_model=SlotLeaseResponse, dependencies=deps)
    async def lease_slot(req: SlotLeaseRequest, request: Request) -> SlotLeaseResponse:
        """Lease a slot (waiting up to ``timeout_s`` for a free one). A client that leaves before the
        answer reaches it holds nothing: the slot is given back."""
        return await server.grant(req, request)

    @hot_post(app, "/v1/slots/{lease_id}/call", response_model=SlotCallResponse, dependencies=deps)
    async def slot_call(lease_id: str, req: SlotCallRequest) -> SlotCallResponse:
        """Run one sandbox tool in the leased slot (the hot route: see atropos.fastroute)."""
        return await server.slot_call(lease_id, req)

    @app.post("/v1/slots/{lease_id}/seal", response_model=SealResult, dependencies=deps)
    async def seal(lease_id: str) -> SealResult:
        """End the agent's part of the lease: every process of the slot is killed and nothing runs
        or writes in it again (reading files and verify remain) until it is released."""
        lease = server.held(lease_id)
        result = await lease.seal()
        return result if result is not None else SealResult(slot=lease.slot, separation="already sealed")

    @app.post("/v1/slots/{lease_id}/verify", response_model=VerifyResult, dependencies=deps)
    async def verify(lease_id: str, req: SlotVerifyRequest) -> VerifyResult:
        """Seal the slot and run a verifier program against its final workspace in a fresh,
        read-only sandbox; the verdict comes back in this response (see docs/verification.md)."""
        entry = server.held_entry(lease_id)
        result = await entry.lease.verify(req.program, secrets=req.secrets, args=req.args, timeout_s=req.timeout_s,
                                          restore=req.restore)
        log.info("slot verified: ok=%s score=%s", result.ok, result.score,
                 extra=call_fields(trajectory_id=entry.lease.trajectory_id, lease=entry.fingerprint,
                                   slot=entry.lease.slot, host=entry.lease.host.id))
        return result

    @app.delete("/v1/slots/{lease_id}", response_model=ReleaseResponse, dependencies=deps)
    async def release(lease_id: str) -> ReleaseResponse:
        if not await server.release(lease_id):
            raise _error(404, "unknown_lease", "no such lease (released, expired or never granted)")
        return ReleaseResponse(released=True)


def _file_routes(app: FastAPI, server: _ToolServer, deps: list[Any]) -> None:
    """The leased slot's workspace as files: read, write, list, archive."""
    held = server.held

    @app.get("/v1/slots/{lease_id}/files", dependencies=deps, response_class=Response,
             responses={200: {"content": {"application/octet-stream": {}}}})
    async def read_file(lease_id: str, path: str = Query(..., min_length=1, max_length=4096)) -> Response:
        return Response(await held(lease_id).read_bytes(path), media_type="application/octet-stream")

    @app.put("/v1/slots/{lease_id}/files", response_model=WriteResult, dependencies=deps)
    async def write_file(request: Request, lease_id: str,
                         path: str = Query(..., min_length=1, max_length=4096)) -> WriteResult:
        lease = held(lease_id)
        return await lease.write_bytes(path, await request.body())

    @app.get("/v1/slots/{lease_id}/list", dependencies=deps)
    async def list_dir(lease_id: str, path: str = Query(".", min_length=1, max_length=4096)) -> dict[str, Any]:
        return await held(lease_id).ok("list_dir", {"path": path})

    @app.get("/v1/slots/{lease_id}/archive", dependencies=deps, response_class=Response,
             responses={200: {"content": {"application/gzip": {}}}})
    async def archive(lease_id: str, path: str = Query(".", min_length=1, max_length=4096)) -> Response:
        return Response(await held(lease_id).archive(path), media_type="application/gzip")


def _dispatch(app: FastAPI, server: _ToolServer) -> ASGIApp:
    """The app's front: the guard, the gate, the lease route's delivery check, the hot routes."""
    settings = server.settings
    # Docs stay readable without a token (they hold no secret); everything else needs it.
    public = {"/healthz", "/status", *DOCS_PUBLIC}
    if settings.public_metrics:
        public.add("/metrics")
    gated = _Gate(FastRoutes(app), server, app.router.routes)
    guard = RequestGuard(gated, max_body=settings.max_body_bytes, token=settings.token or None, public=public)
    leasing = release_undelivered(guard, server.release_undelivered)

    async def route(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST" and scope.get("path") == "/v1/slots":
            return await leasing(scope, receive, send)
        return await guard(scope, receive, send)

    route.fastapi = app  # type: ignore[attr-defined]
    return route

