"""The ToolServer's OpenAPI document is complete (issue 20, finding 7): every status a route really
answers is declared with the one error body, the upload body and the limits are described, and
unknown routes answer in the same error shape. Requests go through the whole app (auth and size
guard included) over the ASGI transport, against a real local pool."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from atropos.api.server import ToolServerSettings, create_tool_server
from atropos.slots.config import PoolConfig
from atropos.slots.pool import SlotPool
from tests.pool_backends import make_backend

TOKEN = "openapi-token"
MAX_BODY = 1 << 20


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    pool = SlotPool(make_backend("local", slots=1), PoolConfig(min_hosts=1, max_hosts=1))
    await pool.start()
    try:
        app = create_tool_server(pool, ToolServerSettings(token=TOKEN, max_body_bytes=MAX_BODY))
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://toolserver", timeout=60) as client:
            yield client
    finally:
        await pool.stop()


def _operation(spec: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    for template, item in spec["paths"].items():
        if re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", template), path) and method.lower() in item:
            op: dict[str, Any] = item[method.lower()]
            return op
    raise AssertionError(f"{method} {path} is not in the OpenAPI document")


async def test_every_v1_operation_declares_its_errors_and_the_limits(http: httpx.AsyncClient) -> None:
    spec = (await http.get("/openapi.json")).json()
    assert str(MAX_BODY) in spec["info"]["description"] and "429" in spec["info"]["description"]
    assert spec["components"]["schemas"]["Error"]["required"] == ["error"]
    for path, item in spec["paths"].items():
        for method, op in item.items():
            if not path.startswith("/v1/"):
                continue
            declared = set(op["responses"])
            assert {"200", "401", "422", "429"} <= declared, (method, path, declared)
            if "{lease_id}" in path:
                assert {"404", "409", "503"} <= declared, (method, path)
            for status, resp in op["responses"].items():
                if status != "200" and "application/json" in resp.get("content", {}):
                    example = resp["content"]["application/json"].get("example")
                    if example is not None:
                        assert example["error"]["status"] == int(status)
    upload = spec["paths"]["/v1/slots/{lease_id}/files"]["put"]
    body = upload["requestBody"]["content"]["application/octet-stream"]["schema"]
    assert body["format"] == "binary" and body["maxLength"] == MAX_BODY
    assert "413" in upload["responses"]


async def test_what_the_server_answers_is_what_it_declares(http: httpx.AsyncClient) -> None:
    spec = (await http.get("/openapi.json")).json()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    lease = (await http.post("/v1/slots", json={"trajectory_id": "doc"}, headers=auth)).json()["lease_id"]
    cases: list[tuple[str, str, dict[str, Any]]] = [
        ("GET", "/v1/status", {}),  # 401: no token
        ("POST", "/v1/slots", {"json": {"trajectory_id": ""}, "headers": auth}),  # 422
        ("POST", "/v1/slots/nope/call", {"json": {"tool": "bash", "args": {}}, "headers": auth}),  # 404
        ("PUT", f"/v1/slots/{lease}/files", {"params": {"path": "x"}, "content": b"x" * (MAX_BODY + 1),
                                             "headers": auth}),  # 413
        ("GET", f"/v1/slots/{lease}/files", {"params": {"path": "missing"}, "headers": auth}),  # 404
        ("POST", f"/v1/slots/{lease}/call", {"json": {"tool": "no_such_tool"}, "headers": auth}),  # 404
        ("PUT", f"/v1/slots/{lease}/files", {"params": {"path": "/workspace/ok.txt"}, "content": b"ok",
                                             "headers": auth}),  # 200
    ]
    seen = set()
    for method, path, kw in cases:
        resp = await http.request(method, path, **kw)
        seen.add(resp.status_code)
        declared = _operation(spec, method, path)["responses"]
        assert str(resp.status_code) in declared, f"{method} {path} answered {resp.status_code}, declares {declared}"
        if resp.status_code != 200:
            error = resp.json()["error"]
            assert set(error) == {"code", "message", "status"} and error["status"] == resp.status_code
    assert {200, 401, 404, 413, 422} <= seen
    await http.delete(f"/v1/slots/{lease}", headers=auth)


async def test_unknown_routes_and_methods_use_the_same_error_shape(http: httpx.AsyncClient) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    missing = await http.get("/v1/no-such-route", headers=auth)
    assert missing.status_code == 404
    assert missing.json() == {"error": {"code": "not_found", "message": "Not Found", "status": 404}}
    wrong = await http.delete("/v1/status", headers=auth)
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
