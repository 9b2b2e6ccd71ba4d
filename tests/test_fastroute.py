"""The hot routes (issue 26): a host's ``/v1/call(s)`` and the ToolServer's slot call are ordinary
routes of their app's one route table, served by ``atropos.fastroute.FastRoute``'s lean handler
behind the same guard, middleware and error handlers as every other route (they were declared
twice: a FastAPI route for the schema and a raw twin that re-implemented the gate, the metrics
and the error answers)."""

from __future__ import annotations

import httpx
import pytest
from fastapi import Depends, FastAPI, Header
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field

from atropos.api.server import ToolServerSettings, create_tool_server
from atropos.asgi import install_error_handlers
from atropos.errors import LeaseError
from atropos.fastroute import FastRoute, FastRoutes, checked_by_guard, hot_post
from atropos.sandbox.host.config import HostConfig
from atropos.sandbox.host.sandbox_host import SandboxHost
from atropos.sandbox.host.server import create_app


class Echo(BaseModel):
    text: str = Field(min_length=1)


def _routes(app: FastAPI) -> dict[tuple[str, str], APIRoute]:
    return {(method, r.path): r for r in app.routes if isinstance(r, APIRoute) for method in r.methods}


def test_the_hot_routes_are_routes_of_their_apps_one_table() -> None:
    host_app = create_app(SandboxHost(HostConfig(token="t" * 32)), manage_lifecycle=False)
    host_routes = _routes(host_app)
    assert isinstance(host_routes["POST", "/v1/call"], FastRoute)
    assert isinstance(host_routes["POST", "/v1/calls"], FastRoute)
    toolserver = create_tool_server(None, ToolServerSettings(token="t"))  # type: ignore[arg-type]
    assert isinstance(_routes(toolserver.fastapi)["POST", "/v1/slots/{lease_id}/call"], FastRoute)


def test_a_fast_route_refuses_a_dependency_it_would_not_run() -> None:
    async def checks_something(x_key: str = Header("")) -> None:
        raise AssertionError("never runs in a FastRoute")

    async def endpoint(body: Echo) -> Echo:
        return body

    with pytest.raises(TypeError, match="checked_by_guard"):
        hot_post(FastAPI(), "/echo", dependencies=[Depends(checks_something)])(endpoint)
    hot_post(FastAPI(), "/echo", dependencies=[Depends(checked_by_guard(checks_something))])(endpoint)


@pytest.mark.parametrize("front", ["FastRoutes", "the app's own router"])
async def test_a_fast_route_answers_through_the_apps_error_handlers(front: str) -> None:
    """Served ahead of the middleware stack (``FastRoutes``, as the servers do) or by FastAPI's own
    router, a FastRoute answers alike: its model, 422 for a bad body, the app's handler's answer
    for a package error."""
    app = FastAPI()
    install_error_handlers(app)

    @hot_post(app, "/echo/{name}", response_model=Echo)
    async def echo(name: str, body: Echo) -> Echo:
        if name == "stale":
            raise LeaseError("stale lease")
        return Echo(text=f"{name}:{body.text}")

    served = FastRoutes(app) if front == "FastRoutes" else app
    transport = httpx.ASGITransport(app=served)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        ok = await http.post("/echo/a", json={"text": "hi"})
        assert ok.status_code == 200 and ok.json() == {"text": "a:hi"}
        assert ok.headers["content-type"] == "application/json"
        bad = await http.post("/echo/a", json={"text": ""})
        assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_request"
        assert bad.json()["error"]["message"].startswith("body.text: String should have at least 1 character")
        typed = await http.post("/echo/a", content=b'{"text": "x"}', headers={"content-type": "text/plain"})
        assert typed.json()["error"] == {"code": "invalid_request", "status": 422,
                                         "message": "body: expected an application/json body"}
        stale = await http.post("/echo/stale", json={"text": "x"})
        assert stale.status_code == 409 and stale.json()["error"]["code"] == "lease_invalid"
        spec = (await http.get("/openapi.json")).json()
        assert spec["paths"]["/echo/{name}"]["post"]["requestBody"]["content"]["application/json"]["schema"][
            "$ref"].endswith("/Echo")
