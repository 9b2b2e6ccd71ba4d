"""The ToolServer's OpenAPI document, complete: every status a route answers (with the one error
body shape and an example), the upload bodies and the limits. FastAPI only derives 200 and 422
from the route signatures; the rest happens in the request guard, the auth dependency and the
routes' own checks, so it is declared here, in one place."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

__all__ = ["ERROR_SCHEMA", "complete_openapi"]

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["code", "message", "status"],
        "properties": {
            "code": {"type": "string", "description": "stable, for programs (e.g. unknown_lease, path_escape)"},
            "message": {"type": "string", "description": "for people; safe to show to the model"},
            "status": {"type": "integer", "description": "the HTTP status again"},
        },
    }},
}

# status -> (when, example code, example message)
_ERRORS: dict[int, tuple[str, str, str]] = {
    400: ("the request cannot run as asked (a file the host refused: not a regular file, ...; the code is "
          "the host's: is_directory, not_regular, ...)",
          "is_directory", "HTTP 400 is_directory: data.txt: is a directory"),
    403: ("the path leaves the workspace (path_escape) or the file may not be read (permission_denied)",
          "path_escape", "HTTP 403 path_escape: ../x: path escapes the workspace"),
    401: ("missing or wrong bearer token (`Authorization: Bearer <token>`)", "unauthorized",
          "missing or wrong bearer token"),
    404: ("no such lease (released, expired after the idle timeout, or never granted), tool or file",
          "unknown_lease", "no such lease (released, expired or never granted)"),
    409: ("the lease is no longer valid on its host (lease_invalid: the slot was reset or its host replaced), "
          "or the slot is sealed and the request would run or write in it (verification_phase)",
          "lease_invalid", "lease is not valid for slot 3"),
    413: ("the request body is over the server's limit", "too_large", "request body over 33554432 bytes"),
    422: ("the body or a parameter fails validation", "invalid_request", "args: field required"),
    429: ("too many requests in progress; retry after the `Retry-After` seconds", "too_many_requests",
          "over 512 requests in progress"),
    501: ("the tool has no provider configured on this server", "not_configured",
          "web_search has no provider configured on this server"),
    503: ("no free slot in time, or the sandbox infrastructure failed (retry; never a verdict on the "
          "model)", "no_free_slot", "no free slot within 600 s"),
}


def _statuses(method: str, path: str) -> list[int]:
    if not path.startswith("/v1/"):
        return []
    statuses = [401, 422, 429]
    if method in ("put", "post"):
        statuses.append(413)
    if "{lease_id}" in path:
        statuses += [404, 409, 503]
        if path.endswith(("/files", "/archive", "/list")):
            statuses += [400, 403]
    elif path == "/v1/slots" and method == "post":
        statuses.append(503)
    elif "{name}" in path:
        statuses += [400, 404, 501, 503]
    return sorted(set(statuses))


def _error_response(status: int) -> dict[str, Any]:
    when, code, message = _ERRORS[status]
    return {"description": when, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/Error"},
        "example": {"error": {"code": code, "message": message, "status": status}}}}}


def complete_openapi(app: FastAPI, *, max_body_bytes: int, max_concurrency: int, lease_idle_s: float,
                     max_file_read_bytes: int = 8 << 20) -> None:
    """Make ``app.openapi()`` return the complete document (built once, then cached by FastAPI)."""
    limits = (f"Limits: request bodies up to {max_body_bytes} bytes (413 beyond); {max_concurrency} requests "
              f"in progress at once (429 beyond); a REST lease unused for {lease_idle_s:g} s is released (404 "
              f"after that); file reads up to {max_file_read_bytes} bytes by default. Every error has the body "
              "`{\"error\": {\"code\", \"message\", \"status\"}}`. A slot call whose tool ran and failed, or "
              "refused its arguments, is a 200 with `ok: false` (a result for the model to read), and so is a "
              "verifier program that failed; statuses other than 200 mean the request itself could not be "
              "served, one status per error code on every route (a sealed slot is 409 `verification_phase`, "
              "a path leaving the workspace 403 `path_escape`), and `error.status` is the response's status.")

    def build() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                          description=(app.description + "\n\n" if app.description else "") + limits)
        doc.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in doc.get("paths", {}).items():
            for method, op in item.items():
                if not isinstance(op, dict) or "responses" not in op:
                    continue
                statuses = _statuses(method, path)
                if statuses:
                    op["security"] = [{"bearer": []}]
                for status in statuses:
                    op["responses"][str(status)] = _error_response(status)
                if method == "put" and path.endswith("/files"):
                    op["requestBody"] = {"required": True, "description": (
                        f"the file's new content, as raw bytes (at most {max_body_bytes} bytes); the `path` "
                        "is relative to /workspace or absolute under /workspace/"),
                        "content": {"application/octet-stream": {
                            "schema": {"type": "string", "format": "binary", "maxLength": max_body_bytes}}}}
        app.openapi_schema = doc
        return doc

    app.openapi = build  # type: ignore[method-assign]
