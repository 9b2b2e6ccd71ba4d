"""Async client of one sandbox host (httpx, keep-alive). The pool and the executor use this."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Sequence
from typing import Any, NoReturn

import httpx
from pydantic import BaseModel

from atropos.errors import (
    AtroposSandboxError,
    AuthenticationError,
    HostUnavailable,
    ImageOverBudget,
    ImageRejected,
    InfrastructureError,
    LeaseError,
    PathEscapeError,
    SlotSealed,
    SlotUnavailable,
    TemplateBuildFailed,
    TemplateInUse,
    TemplateSourceError,
    ToolError,
    ToolInputError,
    TransportError,
    UnknownTemplate,
    WorkspaceError,
)
from atropos.memstats import MemoryReport, MemoryRequest
from atropos.sandbox.contract.http1 import IDLE_TTL_S, ConnectionPool
from atropos.sandbox.contract.imageref import ImageRef
from atropos.sandbox.contract.protocol import (
    DEFAULT_MAX_TIMEOUT_S,
    LEASE_HEADER,
    CallBatch,
    CallResult,
    CallTimeouts,
    HealthInfo,
    ImageInfo,
    ImageRequest,
    LeaseInfo,
    LeaseRef,
    LeaseRequest,
    MaxTimeoutS,
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

# Past a call's own timeout: the host kills it, collects its output and answers within this.
CALL_ANSWER_GRACE_S = 30.0

# The host's error codes this side raises as the class the host raised (atropos.errors.ERRORS).
_BY_CODE: dict[str, type[AtroposSandboxError]] = {cls.code: cls for cls in (
    LeaseError, SlotSealed, SlotUnavailable, UnknownTemplate, TemplateInUse, TemplateSourceError,
    TemplateBuildFailed, WorkspaceError, PathEscapeError, ImageRejected, ImageOverBudget)}


# The host's interface: every route that takes a JSON body, with the request model its server parses
# and this client sends (the client builds that model, never a dict of its own: a field the host
# adds or bounds is one edit, and a bad value fails here, before the wire). tests/test_host_interface.py
# holds both sides to this table: every such route of the host's app is in it with the same model, and
# every entry has a client method that sends an instance of that model.
BODY_ROUTES: dict[tuple[str, str], type[BaseModel]] = {
    ("POST", "/v1/leases"): LeaseRequest,
    ("POST", "/v1/slots/{slot}/reset"): ResetRequest,
    ("POST", "/v1/slots/{slot}/release"): LeaseRef,
    ("POST", "/v1/slots/{slot}/seal"): LeaseRef,
    ("POST", "/v1/slots/{slot}/verify"): VerifyRequest,
    ("POST", "/v1/slots/{slot}/image"): LeaseRef,
    ("POST", "/v1/images"): ImageRequest,
    ("POST", "/v1/templates"): TemplateRequest,
    ("POST", "/v1/call"): ToolCall,
    ("POST", "/v1/calls"): CallBatch,
    ("POST", "/v1/debug/memory"): MemoryRequest,
}


class HostClient:
    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        max_timeout_s: MaxTimeoutS = DEFAULT_MAX_TIMEOUT_S,
        connect_timeout_s: float = 5.0,
        max_connections: int = 256,
        log: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # Where the host's own log is (a file on this machine, or how to read it: HostInfo.log): every
        # failure of this host names it, and a host's unexplained 500 quotes its last lines.
        self.log = log
        self.where = f"{self.base_url} (host log: {log})" if log else self.base_url
        # What the host may take per call, until it says (every health reply carries its limits).
        self.timeouts = CallTimeouts(max_timeout_s=max_timeout_s)
        self._connect_timeout = connect_timeout_s
        auth = {"Authorization": f"Bearer {token}"}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=auth,
            timeout=httpx.Timeout(30.0, connect=connect_timeout_s),
            # idle connections kept as long as the lean client keeps its own: with httpx's 5 s a pool probing
            # every 5 s reconnected to every host at each probe, 100 connects at once (benchmarks/README.md)
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                                keepalive_expiry=IDLE_TTL_S),
        )
        # Tool calls, the hot path, skip httpx (see http1.py for the measured why).
        self._calls = ConnectionPool(self.base_url, auth, connect_timeout_s=connect_timeout_s)

    async def aclose(self) -> None:
        await self._calls.aclose()
        await self._http.aclose()

    async def __aenter__(self) -> HostClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def max_timeout_s(self) -> float:
        return self.timeouts.max_timeout_s

    def read_deadline(self, timeout_s: float | None) -> float:
        """How long to wait for the answer to a call with this timeout: as long as the host may run
        it (its own clamp, from the limits it declared) plus the time to kill it and answer."""
        t = self.timeouts
        return min(timeout_s or t.default_timeout_s, t.max_timeout_s) + CALL_ANSWER_GRACE_S

    # -- plumbing --------------------------------------------------------------------------
    def _timeout(self, seconds: float) -> httpx.Timeout:
        return httpx.Timeout(seconds, connect=self._connect_timeout)

    async def _send(self, method: str, url: str, *, timeout: float = 30.0, **kw: Any) -> httpx.Response:
        try:
            resp = await self._http.request(method, url, timeout=self._timeout(timeout), **kw)
        except httpx.TransportError as exc:
            raise HostUnavailable(f"{self.where}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 400:
            _raise_for(resp.status_code, resp.content, self.where, self.log)
        return resp

    async def _send_model(self, path: str, req: BaseModel, *, timeout: float = 30.0) -> httpx.Response:
        """POST the request model ``req`` (``BODY_ROUTES``) as the host's server parses it."""
        return await self._send("POST", path, content=req.model_dump_json(exclude_none=True).encode(),
                                headers={"content-type": "application/json"}, timeout=timeout)

    async def _post_lean(self, path: str, req: BaseModel, *, timeout: float) -> bytes:
        """POST the request model ``req`` through the lean client: the slot cycle's routes (a pool's
        release is a reset), which a GRPO group ending together sends 16 at a time from one event loop
        (httpx's ~1.7 ms each queued them). ``timeout`` bounds the whole exchange."""
        try:
            resp = await self._calls.request("POST", path, req.model_dump_json(exclude_none=True).encode(),
                                             timeout=timeout)
        except TransportError as exc:
            raise HostUnavailable(f"{self.where}: {exc}") from exc
        if resp.status >= 400:
            _raise_for(resp.status, resp.body, self.where, self.log)
        return resp.body

    # -- API -------------------------------------------------------------------------------
    async def health(self, timeout: float = 10.0, *, mounts: bool = False) -> HealthInfo:
        """The host's health; ``mounts``: with its workspace mount count (a read of every slot
        namespace's mount table, which the pool's periodic check does not need)."""
        try:
            resp = await self._http.get("/v1/health", params={"mounts": "true"} if mounts else None,
                                        timeout=self._timeout(timeout))
        except httpx.TransportError as exc:
            raise HostUnavailable(f"{self.where}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code == 401:
            _raise_for(resp.status_code, resp.content, self.where, self.log)
        if resp.status_code not in (200, 503):
            raise HostUnavailable(f"{self.where}: health answered {resp.status_code}")
        info = HealthInfo.model_validate_json(resp.content)
        if info.timeouts is not None:  # the host's own limits, not this client's assumption
            self.timeouts = info.timeouts
        return info

    async def memory(self, req: MemoryRequest | None = None, *, timeout: float = 120.0) -> MemoryReport:
        """The host process's memory (``POST /v1/debug/memory``; atropos/memstats.py): RSS, malloc's
        view, optionally live objects by type and the traced heap's growth by allocation site."""
        resp = await self._send_model("/v1/debug/memory", req or MemoryRequest(), timeout=timeout)
        return MemoryReport.model_validate_json(resp.content)

    async def slots(self) -> list[SlotInfo]:
        resp = await self._send("GET", "/v1/slots")
        return [SlotInfo.model_validate(s) for s in resp.json()]

    async def prewarm(self, timeout: float = 10.0) -> PrewarmResult:
        """Ask the host to start its slots' sandboxes in the background (``POST /v1/prewarm``);
        returns at once with how many it starts. Idempotent."""
        resp = await self._send("POST", "/v1/prewarm", timeout=timeout)
        return PrewarmResult.model_validate_json(resp.content)

    async def lease(self, trajectory_id: str, *, network: bool = False, slot: int | None = None,
                    template: str | None = None) -> LeaseInfo:
        req = LeaseRequest(trajectory_id=trajectory_id, network=network, slot=slot, template=template)
        # lean: a pool's start leases every slot of its hosts (10,000 on a fleet of 100 x 100), and httpx
        # spent ~5.7 ms of the pool's CPU on each under load (benchmarks/README.md, pool shards)
        return LeaseInfo.model_validate_json(await self._post_lean("/v1/leases", req, timeout=120 if template else 30))

    async def reset(self, slot: int, lease: str, *, trajectory_id: str | None = None,
                    network: bool | None = None, template: str | None = None,
                    image: str | ImageRef | None = None, keep_if_fresh: bool = False) -> ResetResult:
        """Reset a leased slot (kept leased under a new token): to empty, to a fresh fork of ``template``,
        or to a fresh root of the task image ``image`` (imported on the host first if need be);
        ``keep_if_fresh``: not if its root is a fresh root of what ``image`` names now."""
        # the host's own request model (contract/protocol.py): what it takes is what we send
        body = ResetRequest(lease=lease, trajectory_id=trajectory_id, network=network, template=template, image=image,
                            keep_if_fresh=keep_if_fresh or None)  # absent unless asked (a request as before)
        return ResetResult.model_validate_json(await self._post_lean(
            f"/v1/slots/{slot}/reset", body, timeout=900 if image else 120))

    async def seal(self, slot: int, lease: str) -> SealResult:
        """Begin the slot's verification phase (every process of it killed; no more commands)."""
        resp = await self._send_model(f"/v1/slots/{slot}/seal", LeaseRef(lease=lease), timeout=120)
        return SealResult.model_validate_json(resp.content)

    async def verify(self, slot: int, req: VerifyRequest) -> VerifyResult:
        """Seal the slot and run a verifier program against its final workspace."""
        resp = await self._send_model(f"/v1/slots/{slot}/verify", req, timeout=req.timeout_s + 120)
        return VerifyResult.model_validate_json(resp.content)

    # -- task images -----------------------------------------------------------------------
    async def prepare_image(self, reference: str | ImageRef, *, timeout: float = 900) -> ImageInfo:
        """Import a task image into the host's layer store now (docs/task-images.md)."""
        resp = await self._send_model("/v1/images", ImageRequest(reference=reference), timeout=timeout)
        return ImageInfo.model_validate_json(resp.content)

    async def derive_image(self, slot: int, lease: str, *, timeout: float = 900) -> ImageInfo:
        """A new image of a leased image-rooted slot's root as it is now; the slot continues on it."""
        resp = await self._send_model(f"/v1/slots/{slot}/image", LeaseRef(lease=lease), timeout=timeout)
        return ImageInfo.model_validate_json(resp.content)

    async def upload_image(self, data: bytes | AsyncIterable[bytes], reference: str | ImageRef, *,
                           timeout: float = 3600) -> ImageInfo:
        """Import a ``docker save`` archive (bytes or a stream of chunks, e.g. the Engine API's
        ``GET /images/{name}/get``) into the host's layer store under ``reference``: how a host
        with no engine of its own gets an image."""
        resp = await self._send("POST", "/v1/images", params={"reference": ImageRef.parse(reference)}, content=data,
                                timeout=timeout, headers={"content-type": "application/x-tar"})
        return ImageInfo.model_validate_json(resp.content)

    async def images(self) -> list[ImageInfo]:
        resp = await self._send("GET", "/v1/images")
        return [ImageInfo.model_validate(i) for i in resp.json()]

    # -- templates -------------------------------------------------------------------------
    async def create_template(self, source: str, *, name: str = "", timeout: float = 3600,
                              **fields: Any) -> TemplateInfo:
        """source="slot" (slot=, lease=), "dir" (path=) or "git" (url=, ref=, depth=)."""
        req = TemplateRequest(source=source, name=name, **{k: v for k, v in fields.items() if v is not None})
        resp = await self._send_model("/v1/templates", req, timeout=timeout)
        return TemplateInfo.model_validate_json(resp.content)

    async def template_from_slot(self, slot: int, lease: str, *, name: str = "") -> TemplateInfo:
        """Snapshot a leased slot; it stays leased (same token) as a fork of the new template."""
        return await self.create_template("slot", name=name, slot=slot, lease=lease)

    async def upload_template(self, data: bytes | AsyncIterable[bytes], *, name: str = "", gzip: bool = False,
                              timeout: float = 3600) -> TemplateInfo:
        """Make a template from a tar archive (bytes or a stream of chunks, e.g. another host's archive)."""
        ctype = "application/gzip" if gzip else "application/x-tar"
        resp = await self._send("POST", "/v1/templates", params={"name": name}, content=data, timeout=timeout,
                                headers={"content-type": ctype})
        return TemplateInfo.model_validate_json(resp.content)

    async def templates(self) -> list[TemplateInfo]:
        resp = await self._send("GET", "/v1/templates")
        return [TemplateInfo.model_validate(t) for t in resp.json()]

    async def template(self, template_id: str) -> TemplateInfo:
        resp = await self._send("GET", f"/v1/templates/{template_id}")
        return TemplateInfo.model_validate_json(resp.content)

    async def delete_template(self, template_id: str) -> None:
        await self._send("DELETE", f"/v1/templates/{template_id}")

    async def template_archive(self, template_id: str, *, timeout: float = 3600) -> AsyncGenerator[bytes, None]:
        """Stream a template as an uncompressed tar (chunks as they arrive)."""
        try:
            async with self._http.stream("GET", f"/v1/templates/{template_id}/archive",
                                         timeout=self._timeout(timeout)) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    _raise_for(resp.status_code, resp.content, self.where, self.log)
                async for chunk in resp.aiter_raw():
                    yield chunk
        except httpx.TransportError as exc:
            raise HostUnavailable(f"{self.where}: {type(exc).__name__}: {exc}") from exc

    async def release(self, slot: int, lease: str) -> ResetResult:
        return ResetResult.model_validate_json(
            await self._post_lean(f"/v1/slots/{slot}/release", LeaseRef(lease=lease), timeout=120))

    async def call(self, call: ToolCall) -> CallResult:
        timeout = self.read_deadline(call.timeout_s)
        try:
            resp = await self._calls.request("POST", "/v1/call", call.model_dump_json().encode(), timeout=timeout)
        except TransportError as exc:
            raise HostUnavailable(f"{self.where}: {exc}") from exc
        if resp.status >= 400:
            _raise_for(resp.status, resp.body, self.where, self.log)
        return CallResult.model_validate_json(resp.body)

    async def call_batch(self, calls: Sequence[ToolCall]) -> AsyncIterator[CallResult]:
        """Send calls in one request; yield each result as the host finishes it."""
        timeout = max(self.read_deadline(c.timeout_s) for c in calls)
        body = CallBatch(calls=list(calls)).model_dump_json(exclude_none=True).encode()
        try:
            async with self._calls.stream("POST", "/v1/calls", body, timeout=timeout) as resp:
                if resp.status >= 400:
                    _raise_for(resp.status, await resp.read(), self.where, self.log)
                pending = b""
                async for chunk in resp.chunks():
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        if line:
                            yield CallResult.model_validate_json(line)
                if pending.strip():
                    yield CallResult.model_validate_json(pending)
        except TransportError as exc:
            raise HostUnavailable(f"{self.where}: {exc}") from exc

    async def read_bytes(self, slot: int, lease: str, path: str) -> bytes:
        resp = await self._send("GET", f"/v1/slots/{slot}/files", params={"path": path},
                                headers={LEASE_HEADER: lease})
        return resp.content

    async def write_bytes(self, slot: int, lease: str, path: str, data: bytes) -> dict[str, Any]:
        resp = await self._send("PUT", f"/v1/slots/{slot}/files", params={"path": path}, content=data,
                                headers={LEASE_HEADER: lease})
        result: dict[str, Any] = resp.json()
        return result

    async def archive(self, slot: int, lease: str, path: str = ".") -> bytes:
        resp = await self._send("GET", f"/v1/slots/{slot}/archive", params={"path": path},
                                headers={LEASE_HEADER: lease}, timeout=120)
        return resp.content


def _log_tail(log: str | None, lines: int = 12, limit: int = 1500) -> str:
    """The last lines of a host log that is a file on this machine ("" otherwise), for a 500 the host
    explained nowhere else."""
    if not log or not log.startswith("/"):
        return ""
    try:
        with open(log, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 16384))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    tail = "\n".join(text.strip().splitlines()[-lines:])[-limit:]
    return f"\n--- last lines of {log} ---\n{tail}" if tail else ""


def _raise_for(status: int, body: bytes, where: str, log: str | None = None) -> NoReturn:
    text = body.decode("utf-8", "replace")
    try:
        err = json.loads(body).get("error", {})
        code, message = str(err.get("code", "")), str(err.get("message", text))
    except (ValueError, AttributeError):
        code, message = "", text
    if status == 401:
        raise AuthenticationError(f"{where}: {message}")
    known = _BY_CODE.get(code)
    if known is not None and issubclass(known, ToolError):
        raise known(f"HTTP {status} {code}: {message}", code=code, status=status)
    if known is not None:  # the platform's errors, and an image a host refused, name the host
        raise known(f"{where}: {message}" if issubclass(known, (InfrastructureError, ImageRejected)) else message)
    if status >= 500:
        raise HostUnavailable(f"{where}: HTTP {status}: {message}{_log_tail(log)}")
    raise ToolInputError(f"HTTP {status} {code}: {message}", code=code or "tool_error", status=status)
