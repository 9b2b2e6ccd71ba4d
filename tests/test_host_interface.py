"""One host interface, implemented by the client and served by the host (issue 37, item 5; the
pattern of SWE-ReX's runtime/abstract.py and server.py): every route of the host's app that takes
a JSON body is in ``client.BODY_ROUTES`` with the request model its server parses, and the client
sends exactly that model's JSON to it (what the client sends is what the host takes); every other
route of the host has a client method too, or is named here with who else calls it."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute

from atropos.errors import TransportError
from atropos.memstats import MemoryRequest
from atropos.sandbox.contract.client import BODY_ROUTES, HostClient
from atropos.sandbox.contract.protocol import ToolCall, VerifyRequest
from atropos.sandbox.host.config import HostConfig
from atropos.sandbox.host.sandbox_host import SandboxHost
from atropos.sandbox.host.server import create_app

# routes no HostClient method calls, and who does
NOT_THE_CLIENTS = {
    ("GET", "/metrics"): "Prometheus scrapes it (docs/usage.md)",
    ("GET", "/v1/slots/{slot}/list"): "REST file access for programs; the pool lists through the list_dir tool",
    ("GET", "/v1/slots/{slot}/stat"): "REST file access for programs; the pool stats through the stat tool",
}


def _host_routes() -> dict[tuple[str, str], APIRoute]:
    app = create_app(SandboxHost(HostConfig(token="t" * 32)), manage_lifecycle=False)
    return {(m, r.path): r for r in app.routes if isinstance(r, APIRoute) for m in r.methods}


def test_every_body_route_of_the_host_is_declared_with_the_model_its_server_parses() -> None:
    declared: dict[tuple[str, str], Any] = {}
    for key, route in _host_routes().items():
        params = route.dependant.body_params
        if params:
            assert len(params) == 1, key
            declared[key] = params[0].field_info.annotation
        else:  # a route that parses its JSON body itself (it also takes an upload): its declared schema
            body = ((route.openapi_extra or {}).get("requestBody") or {}).get("content", {})
            if "application/json" in body:
                model = BODY_ROUTES.get(key)
                assert model is not None, f"{key} takes JSON but is not in BODY_ROUTES"
                assert body["application/json"]["schema"] == model.model_json_schema(), key
                declared[key] = model
    assert declared == BODY_ROUTES


def _recording_client() -> tuple[HostClient, list[tuple[str, str, bytes]]]:
    sent: list[tuple[str, str, bytes]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append((request.method, request.url.path, request.content))
        return httpx.Response(599, content=b"recorded")  # ends the call: only the request matters here

    class Lean:  # the hot path's own connection pool (atropos/sandbox/contract/http1.py)
        async def request(self, method: str, path: str, body: bytes, **_: Any) -> Any:
            sent.append((method, path, body))
            raise TransportError("recorded")

        def stream(self, method: str, path: str, body: bytes, **_: Any) -> Any:
            sent.append((method, path, body))
            raise TransportError("recorded")

    client = HostClient("http://host.invalid", "t")
    client._http = httpx.AsyncClient(base_url=client.base_url, transport=httpx.MockTransport(handler))
    client._calls = Lean()  # type: ignore[assignment]
    return client, sent


def _calls(c: HostClient) -> list[Callable[[], Awaitable[Any]]]:
    call = ToolCall(id="c1", slot=0, lease="l", tool="bash", args={"command": "true"})

    async def archive() -> None:
        async for _ in c.template_archive("tpl"):
            pass

    async def batch() -> None:
        async for _ in c.call_batch([call, call]):
            pass

    return [
        c.health, c.slots, c.prewarm, lambda: c.memory(MemoryRequest()),
        lambda: c.lease("traj", network=True, template="tpl"), lambda: c.lease("traj", slot=1),
        lambda: c.reset(0, "l", trajectory_id="t2", network=False, image="oci:/srv/a:v1"),
        lambda: c.release(0, "l"), lambda: c.seal(0, "l"),
        lambda: c.verify(0, VerifyRequest(lease="l", program="def verify(root, args): return 1.0")),
        lambda: c.prepare_image("repo/task:1"), lambda: c.derive_image(0, "l"),
        lambda: c.upload_image(b"tar", "repo/task:1"), c.images,
        lambda: c.create_template("git", url="https://example.invalid/r.git", ref="main", depth=1),
        lambda: c.template_from_slot(0, "l", name="n"), lambda: c.upload_template(b"tar", name="n"),
        c.templates, lambda: c.template("tpl"), lambda: c.delete_template("tpl"), archive,
        lambda: c.call(call), batch,
        lambda: c.read_bytes(0, "l", "a"), lambda: c.write_bytes(0, "l", "a", b"x"), lambda: c.archive(0, "l"),
    ]


def _route_of(method: str, path: str, routes: dict[tuple[str, str], APIRoute]) -> tuple[str, str]:
    for m, template in routes:
        if m == method and re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", template), path):
            return m, template
    raise AssertionError(f"the client sent {method} {path}: no route of the host")


async def test_the_client_sends_each_route_the_model_the_host_parses() -> None:
    routes = _host_routes()
    client, sent = _recording_client()
    for make in _calls(client):
        with contextlib.suppress(Exception):  # the recorder answers nothing a client could parse
            await make()
    reached = set()
    for method, path, body in sent:
        key = _route_of(method, path, routes)
        reached.add(key)
        model = BODY_ROUTES.get(key)
        if model is None:
            continue
        if key == ("POST", "/v1/images") and not body.startswith(b"{"):
            continue  # the upload form of the route: an archive, not JSON
        if key == ("POST", "/v1/templates") and not body.startswith(b"{"):
            continue
        parsed = model.model_validate_json(body)  # what the host's server does with it
        # ...and the bytes are that model's own JSON: nothing hand-built, no field it does not declare
        assert body in (parsed.model_dump_json(exclude_none=True).encode(), parsed.model_dump_json().encode()), \
            (key, body)
    missing = set(routes) - reached - set(NOT_THE_CLIENTS)
    assert not missing, f"host routes no client method reaches: {sorted(missing)}"
    assert set(BODY_ROUTES) <= reached


def test_the_client_builds_no_request_body_by_hand() -> None:
    import inspect

    from atropos.sandbox.contract import client as module

    source = inspect.getsource(module)
    assert not re.search(r"\bjson=", source), "a request body is a model of BODY_ROUTES (client._send_model)"
    assert "json.dumps(" not in source


@pytest.mark.parametrize("bad", [{"image": "x" * 513}, {"image": ""}, {"trajectory_id": "t" * 257}])
async def test_a_bad_value_fails_in_the_client_before_the_wire(bad: dict[str, Any]) -> None:
    client, sent = _recording_client()
    with pytest.raises(ValueError):
        await client.reset(0, "l", **bad)
    assert sent == []
