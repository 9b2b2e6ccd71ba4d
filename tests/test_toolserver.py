"""ToolServer over real HTTP (uvicorn on loopback) and in-process (ASGI transport)."""

from __future__ import annotations

import asyncio
import io
import re
import tarfile
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from atropos.api.server import InvokeResponse, ToolServerSettings, create_tool_server
from atropos.slots.config import PoolConfig
from atropos.slots.pool import SlotPool
from atropos.tools.registry import ToolRegistry
from tests.pool_backends import make_backend
from tests.served import serve_on_loopback

TOKEN = "test-token-123"


async def _echo_tool(args: dict[str, Any]) -> InvokeResponse:
    return InvokeResponse(ok=True, content=f"echo: {args.get('text', '')}")


def _registry() -> ToolRegistry:
    from atropos.tools.registry import Tool

    reg = ToolRegistry.default()
    reg.register(Tool(name="echo_external", description="echo on the server", kind="external", toolset="test",
                      parameters={"type": "object", "properties": {"text": {"type": "string"}}}))
    return reg


@pytest.fixture
async def server() -> AsyncIterator[str]:
    pool = SlotPool(make_backend("local", slots=2), PoolConfig(min_hosts=1, max_hosts=1))
    app = create_tool_server(pool, ToolServerSettings(token=TOKEN, max_body_bytes=1 << 20), registry=_registry(),
                             externals={"echo_external": _echo_tool}, manage_pool=True)
    async with serve_on_loopback(app) as (url, _):
        yield url


async def test_raw_http_client_drives_a_slot_from_lease_to_release(server: str) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=server, headers=auth, timeout=60) as http:
        tools = (await http.get("/v1/tools")).json()["tools"]
        names = {t["function"]["name"]: t for t in tools}
        assert {"bash", "read_file", "write_file", "edit_file", "terminal", "echo_external"} <= set(names)
        assert names["bash"]["function"]["parameters"]["properties"]["command"]["type"] == "string"
        assert names["bash"]["kind"] == "sandbox" and names["echo_external"]["kind"] == "external"

        lease = (await http.post("/v1/slots", json={"trajectory_id": "rest-1"})).json()
        lid = lease["lease_id"]
        out = (await http.post(f"/v1/slots/{lid}/call",
                               json={"tool": "bash", "args": {"command": "echo hi > a.txt; cat a.txt"}})).json()
        assert out["ok"] and out["content"] == "hi" and out["result"]["exit_code"] == 0
        put = await http.put(f"/v1/slots/{lid}/files", params={"path": "dir/bin.dat"}, content=bytes(range(256)))
        assert put.status_code == 200
        got = await http.get(f"/v1/slots/{lid}/files", params={"path": "dir/bin.dat"})
        assert got.content == bytes(range(256))
        listing = (await http.get(f"/v1/slots/{lid}/list", params={"path": "."})).json()
        assert {e["name"] for e in listing["entries"]} == {"a.txt", "dir"}
        archive = await http.get(f"/v1/slots/{lid}/archive")
        with tarfile.open(fileobj=io.BytesIO(archive.content), mode="r:gz") as tar:
            assert tar.extractfile("a.txt").read() == b"hi\n"  # type: ignore[union-attr]
        missing = await http.get(f"/v1/slots/{lid}/files", params={"path": "nope"})
        assert missing.status_code == 404
        # the status follows the host's error code, never words in the message (a refused path that
        # merely names "not_found" or "too_large" is a 400, not a 404 or 413)
        for name in ("/etc/not_found", "../too_large"):
            refused = await http.get(f"/v1/slots/{lid}/files", params={"path": name})
            assert refused.status_code == 403, (name, refused.text)
            assert refused.json()["error"]["code"] == "path_escape"
        assert (await http.delete(f"/v1/slots/{lid}")).json() == {"released": True}
        after = await http.post(f"/v1/slots/{lid}/call", json={"tool": "bash", "args": {"command": "true"}})
        assert after.status_code == 404 and after.json()["error"]["code"] == "unknown_lease"

        ext = await http.post("/v1/tools/echo_external/invoke", json={"args": {"text": "x"}})
        assert ext.json() == {"ok": True, "content": "echo: x", "raw": None}
        sandbox_tool = await http.post("/v1/tools/bash/invoke", json={"args": {"command": "id"}})
        assert sandbox_tool.status_code == 400 and sandbox_tool.json()["error"]["code"] == "needs_slot"


async def test_auth_and_validation_errors(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, timeout=30) as http:
        for method, path in [("GET", "/v1/tools"), ("POST", "/v1/slots"), ("GET", "/v1/status"),
                             ("POST", "/v1/tools/echo_external/invoke"), ("DELETE", "/v1/slots/x")]:
            resp = await http.request(method, path)
            assert resp.status_code == 401, path
            resp = await http.request(method, path, headers={"Authorization": "Bearer wrong"})
            assert resp.status_code == 401, path
            assert resp.json()["error"]["message"] == "missing or wrong bearer token"
        assert (await http.get("/healthz")).json()["ok"] is True
        http.headers["Authorization"] = f"Bearer {TOKEN}"
        bad = await http.post("/v1/slots", json={"trajectory_id": ""})
        assert bad.status_code == 422
        big = await http.post("/v1/tools/echo_external/invoke", content=b"x" * (2 << 20))
        assert big.status_code == 413 and str(1 << 20) in big.json()["error"]["message"]
        unknown = await http.post("/v1/tools/nope/invoke", json={"args": {}})
        assert unknown.status_code == 404
        lease = (await http.post("/v1/slots", json={"trajectory_id": "v"})).json()["lease_id"]
        bad_args = (await http.post(f"/v1/slots/{lease}/call", json={"tool": "bash", "args": {"cmd": "x"}})).json()
        assert bad_args["ok"] is False and bad_args["error"]["code"] == "invalid_arguments"
        assert "command" in bad_args["error"]["message"]
        await http.delete(f"/v1/slots/{lease}")
        docs = await http.get("/docs")
        assert docs.status_code == 200
        spec = (await http.get("/openapi.json")).json()
        assert "/v1/slots/{lease_id}/call" in spec["paths"]


async def test_in_process_asgi_mode() -> None:
    pool = SlotPool(make_backend("local", slots=1), PoolConfig(min_hosts=1, max_hosts=1))
    await pool.start()
    try:
        app = create_tool_server(pool, ToolServerSettings(token=TOKEN))
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://toolserver",
                                     headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            lid = (await http.post("/v1/slots", json={"trajectory_id": "inproc"})).json()["lease_id"]
            out = (await http.post(f"/v1/slots/{lid}/call", json={"tool": "python",
                                                                    "args": {"code": "print(6*7)"}})).json()
            assert out["content"] == "42"
            await http.delete(f"/v1/slots/{lid}")
    finally:
        await pool.stop()


def test_refuses_to_run_without_a_token_unless_told() -> None:
    with pytest.raises(ValueError):
        create_tool_server(None, ToolServerSettings())  # type: ignore[arg-type]


async def test_external_calls_are_counted_by_their_real_outcome() -> None:
    """ok, a provider's ok=False, refused arguments, a provider outage (503) and a crash (500) each
    count under their own outcome; before, every invocation that returned counted as ok."""
    from prometheus_client.parser import text_string_to_metric_families

    from atropos.errors import InfrastructureError, ToolInputError

    async def flaky(args: dict[str, Any]) -> InvokeResponse:
        mode = args.get("text")
        if mode == "refuse":
            raise ToolInputError("text must not be 'refuse'")
        if mode == "outage":
            raise InfrastructureError("provider down")
        if mode == "crash":
            raise RuntimeError("bug")
        return InvokeResponse(ok=mode != "fail", content=str(mode))

    pool = SlotPool(make_backend("local", slots=1), PoolConfig(min_hosts=0, max_hosts=1))
    app = create_tool_server(pool, ToolServerSettings(token=TOKEN), registry=_registry(),
                             externals={"echo_external": flaky})

    def counts(text: str) -> dict[str, float]:
        return {s.labels["outcome"]: s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.name == "atropos_external_tool_calls_total"
                and s.labels.get("tool") == "echo_external"}

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://ts",
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        before = counts((await http.get("/metrics")).text)
        statuses = {}
        for mode in ("x", "fail", "refuse", "outage", "crash"):
            resp = await http.post("/v1/tools/echo_external/invoke", json={"args": {"text": mode}})
            statuses[mode] = resp.status_code
        after = counts((await http.get("/metrics")).text)
    assert statuses == {"x": 200, "fail": 200, "refuse": 422, "outage": 503, "crash": 500}
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta == {"ok": 1, "failed": 1, "invalid_arguments": 1, "infrastructure": 1, "error": 1}


async def test_slot_call_route_answers_like_its_schema_says() -> None:
    """The slot call is the hot route (a lean handler, atropos.fastroute): over real HTTP it checks the
    token and body limit first, refuses bad bodies with 422 invalid_request, answers 404/409/429 in
    the one error shape, returns what its OpenAPI schema documents, and is counted per route."""
    from atropos.api.server import SlotCallResponse

    pool = SlotPool(make_backend("local", slots=2), PoolConfig(min_hosts=1, max_hosts=1))
    app = create_tool_server(pool, ToolServerSettings(token=TOKEN, max_body_bytes=4096, max_concurrency=1),
                             manage_pool=True)
    async with serve_on_loopback(app) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            body = {"tool": "bash", "args": {"command": "echo ok"}}
            assert (await http.post("/v1/slots/x/call", json=body)).status_code == 401
            wrong = await http.post("/v1/slots/x/call", json=body, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "unauthorized"
            http.headers["Authorization"] = f"Bearer {TOKEN}"
            lid = (await http.post("/v1/slots", json={"trajectory_id": "raw"})).json()["lease_id"]
            call = f"/v1/slots/{lid}/call"

            ok = await http.post(call, json=body)
            assert ok.status_code == 200 and ok.headers["content-type"] == "application/json"
            assert SlotCallResponse.model_validate(ok.json()).content == "ok"
            for bad, headers in ((b'{"args": {}}', {}), (b"{not json", {}), (b'{"tool": ""}', {}),
                                 (b'{"tool": "bash"}', {"content-type": "text/plain"})):
                resp = await http.post(call, content=bad, headers={"content-type": "application/json", **headers})
                assert resp.status_code == 422, bad
                assert resp.json()["error"]["code"] == "invalid_request" and resp.json()["error"]["status"] == 422
            missing = (await http.post(call, content=b'{"args": {}}')).json()["error"]["message"]
            assert missing == "body.tool: Field required"
            big = await http.post(call, content=b"x" * 8192)
            assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"
            unknown = await http.post("/v1/slots/nope/call", json=body)
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_lease"
            made_up = await http.post(call, json={"tool": "made_up"})
            assert made_up.status_code == 404 and made_up.json()["error"]["code"] == "unknown_tool"

            served = app.fastapi.state.pool
            calls_before = served._calls_total
            slow = asyncio.create_task(http.post(call, json={"tool": "bash", "args": {"command": "sleep 3"}}))
            while served._calls_total == calls_before:  # the slow call is running: it holds the only place
                await asyncio.sleep(0.01)
            busy = await http.post(call, json=body)
            assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["code"] == "too_many_requests"
            assert (await slow).json()["ok"] is True

            spec = (await http.get("/openapi.json")).json()
            op = spec["paths"]["/v1/slots/{lease_id}/call"]["post"]
            assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("SlotCallRequest")
            assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
                "SlotCallResponse")
            metrics_text = (await http.get("/metrics")).text
            assert 'route="/v1/slots/{lease_id}/call",status="429"' in metrics_text.replace(
                'method="POST",', "")
            await http.delete(f"/v1/slots/{lid}")


def _statuses_agree(resp: httpx.Response) -> None:
    """A refusal's body says the response's status, and its message names no other HTTP status."""
    error = resp.json()["error"]
    assert error["status"] == resp.status_code, resp.text
    for named in re.findall(r"HTTP (\d{3})", error["message"]):
        assert int(named) == resp.status_code, resp.text


async def test_one_status_per_error_code_on_every_rest_route(server: str) -> None:
    """Issue 28, item 5: the same refusal answers the same status whichever route met it. A tool's
    own failure (the read_file tool refusing a path, a verifier program failing) is an observation:
    200 with ok:false. Anything else answers the status of its code on every route: a sealed slot
    is 409 verification_phase on /call as on PUT /files, a path escape 403 path_escape from the
    file routes; and each error body's status is the response's."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=server, headers=auth, timeout=120) as http:
        lid = (await http.post("/v1/slots", json={"trajectory_id": "status-rule"})).json()["lease_id"]
        call = f"/v1/slots/{lid}/call"
        await http.put(f"/v1/slots/{lid}/files", params={"path": "a.txt"}, content=b"a")

        tool = await http.post(call, json={"tool": "read_file", "args": {"path": "../etc/passwd"}})
        assert tool.status_code == 200 and tool.json()["ok"] is False
        assert tool.json()["error"]["code"] == "path_escape"
        for route in ("files", "list", "archive"):
            escape = await http.get(f"/v1/slots/{lid}/{route}", params={"path": "../etc"})
            assert (escape.status_code, escape.json()["error"]["code"]) == (403, "path_escape"), (route, escape.text)
            _statuses_agree(escape)
        missing = await http.get(f"/v1/slots/{lid}/files", params={"path": "nope.txt"})
        assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")
        _statuses_agree(missing)

        failing = await http.post(f"/v1/slots/{lid}/verify", json={
            "program": "def verify(workspace, secrets, args):\n    raise ValueError('no')\n"})
        assert failing.status_code == 200 and failing.json()["ok"] is False  # sealed the slot too
        assert failing.json()["error"]["status"] != 200, failing.text  # a failure, not a success status

        for refused in (await http.post(call, json={"tool": "write_file", "args": {"path": "b", "content": "x"}}),
                        await http.post(call, json={"tool": "bash", "args": {"command": "true"}}),
                        await http.put(f"/v1/slots/{lid}/files", params={"path": "b"}, content=b"x")):
            assert (refused.status_code, refused.json()["error"]["code"]) == (409, "verification_phase"), \
                refused.text
            _statuses_agree(refused)
        reading = await http.post(call, json={"tool": "read_file", "args": {"path": "a.txt"}})
        assert reading.status_code == 200 and reading.json()["content"] == "a"  # reading stays allowed
        await http.delete(f"/v1/slots/{lid}")


async def test_docs_load_from_the_toolserver_itself(server: str) -> None:
    """Issue 28, item 6: /docs works without the internet: the page names no external URL and every
    script, style sheet and icon it references is served by the ToolServer (no token needed)."""
    async with httpx.AsyncClient(base_url=server, timeout=60) as http:
        page = await http.get("/docs")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", page.text), "an external URL in /docs"
        refs = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text)
        assert {"/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css"} <= set(refs), refs
        for ref in refs:
            got = await http.get(ref)
            assert got.status_code == 200 and got.content, ref
        bundle = await http.get("/docs/assets/swagger-ui-bundle.js")
        assert "SwaggerUIBundle" in bundle.text and "javascript" in bundle.headers["content-type"]
        assert "openapi.json" in page.text and (await http.get("/openapi.json")).status_code == 200
        assert "Apache License" in (await http.get("/docs/assets/LICENSE")).text
        other = await http.get("/docs/assets/__init__.py", headers={"Authorization": f"Bearer {TOKEN}"})
        assert other.status_code == 404  # only the page's files are served from the package's folder


def _body_routes() -> list[tuple[str, str, type[Any]]]:
    """Every route of the ToolServer whose request has a JSON body: (method, path, its model)."""
    from fastapi.routing import APIRoute
    from pydantic import BaseModel

    from atropos.fastroute import FastRoute

    pool = SlotPool(make_backend("local", slots=1), PoolConfig(min_hosts=1, max_hosts=1))
    app = create_tool_server(pool, ToolServerSettings(token=TOKEN), registry=_registry(),
                             externals={"echo_external": _echo_tool}).fastapi  # type: ignore[attr-defined]
    out = []
    for route in app.routes:
        if isinstance(route, FastRoute):
            model: Any = route.body_model if route.body_name else None
        elif isinstance(route, APIRoute) and route.body_field is not None:
            model = route.body_field.field_info.annotation
        else:
            continue
        if isinstance(model, type) and issubclass(model, BaseModel):
            for method in route.methods:
                out.append((method, route.path, model))
    return out


def test_every_request_body_of_the_api_refuses_fields_it_does_not_declare() -> None:
    routes = _body_routes()
    assert {p for _, p, _ in routes} >= {"/v1/slots", "/v1/slots/{lease_id}/call", "/v1/slots/{lease_id}/verify",
                                         "/v1/tools/{name}/invoke"}
    for method, path, model in routes:
        assert model.model_config.get("extra") == "forbid", (method, path, model.__name__)


async def test_unknown_fields_are_refused_with_422_on_every_route(server: str) -> None:
    """A misspelt field (``restroe``, ``timeout``) is an error the client sees, never a request
    served other than it asked."""
    valid = {"/v1/slots": {"trajectory_id": "extra"}, "/v1/slots/{lease_id}/call": {"tool": "bash", "args": {}},
             "/v1/slots/{lease_id}/verify": {"program": "def verify(w, s, a):\n    return 1"},
             "/v1/tools/{name}/invoke": {"args": {"text": "x"}}}
    async with httpx.AsyncClient(base_url=server, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as http:
        lease = (await http.post("/v1/slots", json={"trajectory_id": "extra-fields"})).json()["lease_id"]
        try:
            for method, path, _model in _body_routes():
                url = path.replace("{lease_id}", lease).replace("{name}", "echo_external")
                for unknown in ({"restroe": ["/x"]}, {"timeout": 5}):
                    resp = await http.request(method, url, json={**valid[path], **unknown})
                    assert resp.status_code == 422, (path, unknown, resp.text)
                    err = resp.json()["error"]
                    assert err["code"] == "invalid_request" and next(iter(unknown)) in err["message"], (path, err)
            # the slot was never touched: it still runs commands (no verify sealed it)
            out = (await http.post(f"/v1/slots/{lease}/call", json={"tool": "bash", "args": {"command": "echo ok"}}))
            assert out.json()["content"] == "ok"
        finally:
            await http.delete(f"/v1/slots/{lease}")


def test_the_rest_verify_body_takes_every_field_lease_verify_takes() -> None:
    import inspect

    from atropos.api.server import SlotVerifyRequest
    from atropos.slots.lease import Lease

    params = [n for n, p in inspect.signature(Lease.verify).parameters.items() if n != "self"]
    assert set(params) == set(SlotVerifyRequest.model_fields), (params, list(SlotVerifyRequest.model_fields))
    for name, field in SlotVerifyRequest.model_fields.items():  # and the same defaults
        default = inspect.signature(Lease.verify).parameters[name].default
        if default is not inspect.Parameter.empty:
            made = field.get_default(call_default_factory=True)
            assert made == default or (default is None and made == {}) or (tuple(made) == default if
                                                                          isinstance(made, list) else False), name
