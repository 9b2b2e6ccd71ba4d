"""The sandbox host's HTTP API, spoken raw (httpx) and through the project's client.

Uses the session ``host`` for everything that leaves the host as it found it, and small private
hosts where a test needs a host option (``--max-timeout``), every slot leased, or a ruined slot.
"""

from __future__ import annotations

import io
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningHost, start_host, stop_host
from fastapi.routing import APIRoute

from atropos.backends.local import LocalBackend, LocalBackendConfig
from atropos.errors import HostUnavailable, IsolationUnavailable, LeaseError, SlotUnavailable
from atropos.sandbox.contract.hostdirs import ISOLATION_FAILED
from atropos.sandbox.contract.protocol import LEASE_HEADER, ToolCall
from atropos.sandbox.contract.tools import clamp_timeout
from atropos.sandbox.host.config import HostConfig
from atropos.sandbox.host.sandbox_host import SandboxHost, check_isolation
from atropos.sandbox.host.server import create_app
from atropos.sandbox.host.slot import Slot

BODY_LIMIT = HostConfig().max_body_bytes


def _v1_routes() -> list[tuple[str, str]]:
    """(method, path) of every API route, read from the app itself so new routes are covered."""
    app = create_app(SandboxHost(HostConfig(token="route-listing")), manage_lifecycle=False)
    routes = sorted(
        (method, route.path)
        for route in app.routes
        if isinstance(route, APIRoute)
        for method in route.methods or ()
    )
    assert routes, "no API routes found"
    # everything is versioned but the Prometheus scrape path (which needs the token too)
    assert all(path.startswith("/v1/") or path == "/metrics" for _, path in routes), routes
    return routes


V1_ROUTES = _v1_routes()


def _url(path: str, slot: int = 0) -> str:
    return path.replace("{slot}", str(slot))


@pytest.fixture
async def raw(host: RunningHost) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=host.address, headers={"Authorization": f"Bearer {host.token}"},
                                 timeout=60) as client:
        yield client


@pytest.fixture
async def anon(host: RunningHost) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=host.address, timeout=60) as client:
        yield client


async def _lease(raw: httpx.AsyncClient, trajectory: str = "api-test", **kw: Any) -> dict[str, Any]:
    resp = await raw.post("/v1/leases", json={"trajectory_id": trajectory, **kw})
    assert resp.status_code == 200, resp.text
    lease: dict[str, Any] = resp.json()
    return lease


async def _release(raw: httpx.AsyncClient, lease: dict[str, Any]) -> httpx.Response:
    return await raw.post(f"/v1/slots/{lease['slot']}/release", json={"lease": lease["lease"]})


@pytest.fixture
async def leased(raw: httpx.AsyncClient) -> AsyncIterator[dict[str, Any]]:
    """A slot leased over raw HTTP; released afterwards unless the test already did."""
    lease = await _lease(raw)
    yield lease
    await _release(raw, lease)


def _call_body(lease: dict[str, Any], tool: str, **args: Any) -> dict[str, Any]:
    return {"id": secrets.token_hex(4), "slot": lease["slot"], "lease": lease["lease"], "tool": tool, "args": args}


def _error(resp: httpx.Response, status: int, code: str) -> str:
    assert resp.status_code == status, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert err["code"] == code, err
    assert err["status"] == status
    message: str = err["message"]
    return message


def _private_data_dir(tag: str) -> Path:
    # not under pytest's tmp_path: slot uids must traverse to their workspace (see conftest)
    return Path(f"/tmp/atropos-test-{tag}-{os.getpid()}-{secrets.token_hex(3)}")


@pytest.fixture(scope="module")
def small_host() -> Iterator[RunningHost]:
    """Two slots and a 2 s maximum timeout (the clamp tests wait it out: short keeps them quick)."""
    data = _private_data_dir("api")
    running = start_host(data, slots=2, extra=["--max-timeout", "2"])
    yield running
    stop_host(running)
    shutil.rmtree(data, ignore_errors=True)


# -- authentication -----------------------------------------------------------------------------


@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer wrong-token", "Basic abc", "bearer"])
@pytest.mark.parametrize(("method", "path"), V1_ROUTES)
async def test_every_route_requires_the_token(anon: httpx.AsyncClient, host: RunningHost, method: str, path: str,
                                              authorization: str | None) -> None:
    headers = {LEASE_HEADER: "some-lease"}
    if authorization is not None:
        headers["Authorization"] = authorization.replace("abc", host.token)
    # a well-formed body where one is expected: the refusal must not depend on the body
    body = {"trajectory_id": "t", "lease": "x", "calls": [], "id": "i", "slot": 0, "tool": "bash", "args": {}}
    resp = await anon.request(method, _url(path), params={"path": "."}, headers=headers,
                              json=body if method in ("POST", "PUT") else None)
    message = _error(resp, 401, "unauthorized")
    assert host.token not in resp.text
    assert "token" in message


async def test_right_token_with_wrong_scheme_or_extra_spaces_is_refused(anon: httpx.AsyncClient,
                                                                       host: RunningHost) -> None:
    for value in (f"Token {host.token}", f"Bearer  {host.token}", f"Bearer {host.token}x", host.token):
        resp = await anon.get("/v1/slots", headers={"Authorization": value})
        _error(resp, 401, "unauthorized")
    resp = await anon.get("/v1/slots", headers={"Authorization": f"bearer {host.token}"})
    assert resp.status_code == 200  # the scheme is case-insensitive (RFC 7235)


@pytest.mark.parametrize(("method", "path"), [r for r in V1_ROUTES if r[0] == "POST"])  # the JSON-body routes
async def test_malformed_body_without_token_is_401(anon: httpx.AsyncClient, method: str, path: str) -> None:
    resp = await anon.request(method, _url(path), params={"path": "x"}, content=b"{not json",
                              headers={"content-type": "application/json", LEASE_HEADER: "x"})
    _error(resp, 401, "unauthorized")


async def test_client_raises_authentication_error(host: RunningHost) -> None:
    from atropos.sandbox.contract.client import AuthenticationError, HostClient

    async with HostClient(host.address, "wrong-token") as client:
        with pytest.raises(AuthenticationError):
            await client.health()
        with pytest.raises(AuthenticationError):
            await client.lease("t")


# -- health, slots, schema ----------------------------------------------------------------------


async def test_health(raw: httpx.AsyncClient, host: RunningHost) -> None:
    resp = await raw.get("/v1/health")
    assert resp.status_code == 200, resp.text
    info = resp.json()
    assert info["ok"] is True
    assert info["exec_ms"] > 0
    assert info["isolation"] == "bubblewrap"
    assert info["slots"] == 8
    assert info["free"] + info["leased"] + info["quarantined"] <= info["slots"]
    # the mount count reads every slot namespace's mount table: only when asked (the pool's periodic
    # check does not, so its cost does not grow with the host's other slots)
    assert info["mounts"] is None
    counted = (await raw.get("/v1/health", params={"mounts": "true"})).json()
    assert counted["ok"] is True, counted
    assert counted["mounts"] or counted["workspace_mode"] == "copy", counted  # None: no mount helper here
    async with host.client() as client:
        health = await client.health()
        assert health.ok and health.exec_ms > 0 and health.mounts is None
        assert (await client.health(mounts=True)).mounts == counted["mounts"]


async def test_slots_listing(raw: httpx.AsyncClient, leased: dict[str, Any]) -> None:
    resp = await raw.get("/v1/slots")
    assert resp.status_code == 200
    slots = {s["slot"]: s for s in resp.json()}
    assert sorted(slots) == list(range(8))
    mine = slots[leased["slot"]]
    assert mine["state"] == "leased"
    assert mine["trajectory_id"] == "api-test"
    assert mine["generation"] == leased["generation"]
    assert "lease" not in mine and leased["lease"] not in resp.text  # tokens are never listed


async def test_openapi_schema(raw: httpx.AsyncClient) -> None:
    resp = await raw.get("/openapi.json")
    assert resp.status_code == 200
    schema = json.loads(resp.content)
    assert schema["openapi"].startswith("3.")
    for method, path in V1_ROUTES:
        assert method.lower() in schema["paths"][path], (method, path)


# -- unknown slots, bad calls -------------------------------------------------------------------


async def test_unknown_slot_is_404(raw: httpx.AsyncClient) -> None:
    message = _error(await raw.post("/v1/leases", json={"trajectory_id": "t", "slot": 99}), 404, "unknown_slot")
    assert "99" in message and "0..7" in message
    _error(await raw.post("/v1/slots/99/reset", json={"lease": "x"}), 404, "unknown_slot")
    _error(await raw.post("/v1/slots/99/release", json={"lease": "x"}), 404, "unknown_slot")
    for path in ("files", "list", "stat", "archive"):
        _error(await raw.get(f"/v1/slots/99/{path}", params={"path": "a"}, headers={LEASE_HEADER: "x"}),
               404, "unknown_slot")
    _error(await raw.put("/v1/slots/99/files", params={"path": "a"}, content=b"x", headers={LEASE_HEADER: "x"}),
           404, "unknown_slot")
    # calls report it per call
    body = {"id": "c", "slot": 99, "lease": "x", "tool": "bash", "args": {"command": "true"}}
    resp = await raw.post("/v1/call", json=body)
    assert resp.status_code == 200
    result = resp.json()
    assert result["ok"] is False
    assert result["error"]["code"] == "unknown_slot" and result["error"]["status"] == 404
    resp = await raw.post("/v1/calls", json={"calls": [body]})
    line = json.loads(resp.text.splitlines()[0])
    assert line["error"]["code"] == "unknown_slot"


@pytest.mark.parametrize(("tool", "args", "fragments"), [
    ("nosuch", {}, ["unknown tool 'nosuch'", "bash", "read_file", "terminal"]),
    ("bash", {}, ["command", "Field required"]),
    ("bash", {"command": 1}, ["command", "valid string"]),
    ("bash", {"command": "true", "timeout_s": -1}, ["timeout_s", "greater than 0"]),
    ("read_file", {"path": "x", "bogus": 1}, ["bogus", "Extra inputs are not permitted"]),
    ("read_file", {"path": "x", "encoding": "latin1"}, ["encoding", "'text' or 'base64'"]),
    ("read_file", {"path": "x", "offset": -5}, ["offset", "greater than or equal to 0"]),
    ("list_dir", {"max_entries": 0}, ["max_entries"]),
    ("terminal", {"wait_ms": 10**9}, ["wait_ms"]),
    ("edit_file", {"path": "x", "old_string": "", "new_string": "y"}, ["old_string"]),
])
async def test_bad_tool_or_arguments_are_per_call_errors(raw: httpx.AsyncClient, leased: dict[str, Any], tool: str,
                                                         args: dict[str, Any], fragments: list[str]) -> None:
    resp = await raw.post("/v1/call", json=_call_body(leased, tool, **args))
    assert resp.status_code == 200, resp.text
    result = resp.json()
    assert result["ok"] is False
    assert result["error"]["code"] == "invalid_arguments"
    assert result["error"]["status"] == 422
    for fragment in fragments:
        assert fragment in result["error"]["message"], result["error"]["message"]


async def test_bad_call_in_a_batch_does_not_spoil_the_others(raw: httpx.AsyncClient, leased: dict[str, Any]) -> None:
    good = _call_body(leased, "bash", command="echo fine")
    bad = _call_body(leased, "read_file")
    resp = await raw.post("/v1/calls", json={"calls": [bad, good]})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("application/x-ndjson")
    results = {r["id"]: r for r in map(json.loads, resp.text.splitlines())}
    assert results[good["id"]]["result"]["stdout"] == "fine\n"
    assert results[bad["id"]]["error"]["code"] == "invalid_arguments"
    assert "path" in results[bad["id"]]["error"]["message"]


async def test_malformed_envelope_is_422(raw: httpx.AsyncClient, leased: dict[str, Any]) -> None:
    body = _call_body(leased, "bash", command="true")
    del body["lease"]
    assert (await raw.post("/v1/call", json=body)).status_code == 422
    assert (await raw.post("/v1/calls", json={"calls": []})).status_code == 422
    assert (await raw.post("/v1/leases", json={"trajectory_id": ""})).status_code == 422


async def test_hot_call_routes_refuse_bad_bodies_like_the_rest(raw: httpx.AsyncClient, host: RunningHost,
                                                               leased: dict[str, Any]) -> None:
    """/v1/call(s) are served raw (no FastAPI on the hot path): same auth, same 422 wording."""
    body = _call_body(leased, "bash", command="echo hi")
    async with httpx.AsyncClient(base_url=host.address, timeout=60) as anonymous:
        for path, payload in (("/v1/call", body), ("/v1/calls", {"calls": [body]})):
            _error(await anonymous.post(path, json=payload), 401, "unauthorized")
            _error(await anonymous.post(path, json=payload, headers={"Authorization": "Bearer wrong"}),
                   401, "unauthorized")
    del body["tool"]
    assert _error(await raw.post("/v1/call", json=body), 422, "invalid_request") == "body.tool: Field required"
    assert "body.calls.0.tool" in _error(await raw.post("/v1/calls", json={"calls": [body]}), 422, "invalid_request")
    _error(await raw.post("/v1/call", content=b"{oops"), 422, "invalid_request")
    _error(await raw.post("/v1/call", content=json.dumps(body).encode(), headers={"content-type": "text/plain"}),
           422, "invalid_request")
    ok = await raw.post("/v1/call", json=_call_body(leased, "bash", command="echo hi"))
    assert ok.headers["content-type"] == "application/json" and ok.json()["result"]["stdout"] == "hi\n"


# -- leases -------------------------------------------------------------------------------------


async def test_stale_lease_after_release_is_refused(raw: httpx.AsyncClient, host: RunningHost) -> None:
    lease = await _lease(raw)
    slot, token = lease["slot"], lease["lease"]
    resp = await _release(raw, lease)
    assert resp.status_code == 200 and resp.json()["ok"] is True

    resp = await raw.post("/v1/call", json=_call_body(lease, "bash", command="echo should-not-run"))
    assert resp.status_code == 200
    result = resp.json()
    assert result["ok"] is False
    assert result["error"]["code"] == "lease_invalid" and result["error"]["status"] == 409

    resp = await raw.post("/v1/calls", json={"calls": [_call_body(lease, "bash", command="true")] * 2})
    lines = [json.loads(line) for line in resp.text.splitlines()]
    assert len(lines) == 2 and all(r["error"]["code"] == "lease_invalid" for r in lines)

    hdr = {LEASE_HEADER: token}
    for path in ("files", "list", "stat", "archive"):
        message = _error(await raw.get(f"/v1/slots/{slot}/{path}", params={"path": "."}, headers=hdr),
                         409, "lease_invalid")
        assert f"slot {slot}" in message
    _error(await raw.put(f"/v1/slots/{slot}/files", params={"path": "x"}, content=b"x", headers=hdr),
           409, "lease_invalid")
    _error(await raw.post(f"/v1/slots/{slot}/reset", json={"lease": token}), 409, "lease_invalid")
    _error(await raw.post(f"/v1/slots/{slot}/release", json={"lease": token}), 409, "lease_invalid")

    async with host.client() as client:
        with pytest.raises(LeaseError):
            await client.release(slot, token)
        with pytest.raises(LeaseError):
            await client.read_bytes(slot, token, "x")
        result_obj = await client.call(ToolCall(id="c", slot=slot, lease=token, tool="bash",
                                                args={"command": "true"}))
        assert result_obj.error is not None and result_obj.error.code == "lease_invalid"


async def test_foreign_lease_is_refused(raw: httpx.AsyncClient) -> None:
    a, b = await _lease(raw, "owner-a"), await _lease(raw, "owner-b")
    try:
        wrong = {**a, "lease": b["lease"]}  # b's token on a's slot
        result = (await raw.post("/v1/call", json=_call_body(wrong, "bash", command="true"))).json()
        assert result["error"]["code"] == "lease_invalid"
        _error(await raw.post(f"/v1/slots/{a['slot']}/release", json={"lease": b["lease"]}), 409, "lease_invalid")
    finally:
        await _release(raw, a)
        await _release(raw, b)


async def test_lease_all_slots_then_one_more(small_host: RunningHost) -> None:
    async with httpx.AsyncClient(base_url=small_host.address, timeout=30,
                                 headers={"Authorization": f"Bearer {small_host.token}"}) as raw:
        leases = [await _lease(raw, f"all-{i}") for i in range(2)]
        try:
            assert sorted(lease["slot"] for lease in leases) == [0, 1]
            message = _error(await raw.post("/v1/leases", json={"trajectory_id": "one-more"}), 409, "no_free_slot")
            assert "2 leased" in message and "of 2" in message
            assert "0 quarantined" in message and "0 resetting" in message
            async with small_host.client() as client:
                with pytest.raises(SlotUnavailable, match="2 leased"):
                    await client.lease("one-more")
        finally:
            for lease in leases:
                assert (await _release(raw, lease)).status_code == 200


async def test_lease_a_specific_slot(small_host: RunningHost) -> None:
    async with small_host.client() as client:
        lease = await client.lease("specific", slot=1)
        try:
            assert lease.slot == 1
            assert lease.trajectory_id == "specific" and lease.network is False
            with pytest.raises(SlotUnavailable, match="slot 1 is leased"):
                await client.lease("again", slot=1)
            other = await client.lease("other")  # the free list still hands out slot 0
            assert other.slot == 0
            await client.release(other.slot, other.lease)
        finally:
            await client.release(lease.slot, lease.lease)


async def test_reset_keep_rotates_lease_and_empties_workspace(host: RunningHost) -> None:
    async with host.client() as client:
        lease = await client.lease("before-reset")
        await client.write_bytes(lease.slot, lease.lease, "dir/file.txt", b"dirty")
        await client.call(ToolCall(id="t", slot=lease.slot, lease=lease.lease, tool="terminal",
                                   args={"input": "export IN_TERM=1"}))
        result = await client.reset(lease.slot, lease.lease, trajectory_id="after-reset")
        assert result.ok and not result.quarantined
        new = result.lease
        assert new is not None
        try:
            assert new.slot == lease.slot
            assert new.lease != lease.lease
            assert new.generation == lease.generation + 1
            assert new.trajectory_id == "after-reset"
            with pytest.raises(LeaseError):
                await client.read_bytes(lease.slot, lease.lease, "dir/file.txt")
            listing = await client.call(ToolCall(id="l", slot=new.slot, lease=new.lease, tool="list_dir", args={}))
            assert listing.result is not None and listing.result["entries"] == []
            ls = await client.call(ToolCall(id="s", slot=new.slot, lease=new.lease, tool="bash",
                                            args={"command": "ls -A /workspace /tmp | grep -v : ; echo end"}))
            assert ls.result is not None and ls.result["stdout"].strip() == "end"
            term = await client.call(ToolCall(id="t2", slot=new.slot, lease=new.lease, tool="terminal",
                                              args={"input": "echo [$IN_TERM]"}))
            assert term.result is not None and "[]" in term.result["output"]  # a fresh terminal too
            info = {s.slot: s for s in await client.slots()}[new.slot]
            assert info.state == "leased" and info.generation == new.generation
            assert info.trajectory_id == "after-reset"
        finally:
            await client.release(new.slot, new.lease)


async def test_release_frees_the_slot(host: RunningHost) -> None:
    async with host.client() as client:
        lease = await client.lease("to-release")
        result = await client.release(lease.slot, lease.lease)
        assert result.ok and not result.quarantined and result.lease is None
        info = {s.slot: s for s in await client.slots()}[lease.slot]
        assert info.state == "free"
        assert info.generation == lease.generation + 1
        assert info.trajectory_id is None
        again = await client.lease("again", slot=lease.slot)
        assert again.generation == lease.generation + 1
        await client.release(again.slot, again.lease)


# -- timeouts -----------------------------------------------------------------------------------


async def test_timeout_above_host_maximum_is_clamped(small_host: RunningHost) -> None:
    async with small_host.client() as client:
        lease = await client.lease("clamp")
        try:
            result = await client.call(ToolCall(id="c", slot=lease.slot, lease=lease.lease, tool="bash",
                                                args={"command": "sleep 8; echo not-reached"}, timeout_s=100))
            assert result.ok, result.error
            assert any("clamped" in n and "maximum of 2s" in n and "100s" in n for n in result.notes), result.notes
            assert result.result is not None
            assert result.result["timed_out"] is True  # the clamp is applied, not just announced
            assert result.result["stdout"] == ""
            # the model-facing timeout argument is clamped the same way
            result = await client.call(ToolCall(id="d", slot=lease.slot, lease=lease.lease, tool="bash",
                                                args={"command": "echo quick", "timeout_s": 50}))
            assert result.ok and any("clamped" in n for n in result.notes), result.notes
            # a timeout within the maximum (here: equal to it) leaves no note
            result = await client.call(ToolCall(id="e", slot=lease.slot, lease=lease.lease, tool="bash",
                                                args={"command": "echo quick"}, timeout_s=2))
            assert result.ok and result.notes == []
        finally:
            await client.release(lease.slot, lease.lease)


def test_default_timeout_never_exceeds_the_maximum() -> None:
    cfg = HostConfig(max_timeout_s=5)
    assert cfg.default_timeout_s == 5
    assert clamp_timeout(None, cfg) == (5.0, [])
    assert clamp_timeout(None, HostConfig()) == (60.0, [])  # the default, when it is within the maximum
    cfg.max_timeout_s = 2  # a config changed after validation is still clamped, and says so
    timeout, notes = clamp_timeout(None, cfg)
    assert timeout == 2 and len(notes) == 1 and "clamped" in notes[0] and "2s" in notes[0]


async def test_call_without_timeout_gets_the_host_maximum_when_lower(small_host: RunningHost) -> None:
    async with small_host.client() as client:
        lease = await client.lease("default-clamp")
        try:
            t0 = time.monotonic()
            result = await client.call(ToolCall(id="n", slot=lease.slot, lease=lease.lease, tool="bash",
                                                args={"command": "sleep 30; echo not-reached"}))
            assert result.ok, result.error
            assert result.result is not None and result.result["timed_out"] is True
            assert time.monotonic() - t0 < 20  # the host's 2 s, not the 60 s default
        finally:
            await client.release(lease.slot, lease.lease)


# -- body limit ---------------------------------------------------------------------------------


async def _oversized(chunked: bool) -> Any:
    chunk = b"x" * (1 << 20)
    count = BODY_LIMIT // len(chunk) + 2
    if not chunked:
        return chunk * count

    async def stream() -> AsyncIterator[bytes]:
        for _ in range(count):
            yield chunk

    return stream()


def _oversized_targets(lease: dict[str, Any]) -> list[tuple[str, str, dict[str, str]]]:
    return [
        ("POST", "/v1/call", {"content-type": "application/json"}),
        ("POST", "/v1/calls", {"content-type": "application/json"}),
        ("PUT", f"/v1/slots/{lease['slot']}/files?path=big.bin", {LEASE_HEADER: lease["lease"]}),
    ]


async def test_oversized_body_with_content_length_is_413(host: RunningHost, leased: dict[str, Any]) -> None:
    for method, url, headers in _oversized_targets(leased):
        # a fresh connection each time: the host may close one it did not read to the end
        async with httpx.AsyncClient(base_url=host.address, timeout=60,
                                     headers={"Authorization": f"Bearer {host.token}"}) as raw:
            resp = await raw.request(method, url, content=await _oversized(chunked=False), headers=headers)
            message = _error(resp, 413, "body_too_large")
            assert str(BODY_LIMIT) in message, (url, message)
    async with host.client() as client:
        health = await client.health()
        assert health.ok


@pytest.mark.parametrize("target", [0, 1, 2], ids=["call", "calls", "put-file"])
async def test_oversized_chunked_body_is_413(host: RunningHost, leased: dict[str, Any], target: int) -> None:
    method, url, headers = _oversized_targets(leased)[target]
    async with httpx.AsyncClient(base_url=host.address, timeout=60,
                                 headers={"Authorization": f"Bearer {host.token}"}) as raw:
        resp = await raw.request(method, url, content=await _oversized(chunked=True), headers=headers)
        assert "content-length" not in {k.lower() for k in resp.request.headers}
        message = _error(resp, 413, "body_too_large")
        assert str(BODY_LIMIT) in message


async def test_chunked_body_under_the_limit_is_accepted(raw: httpx.AsyncClient, leased: dict[str, Any]) -> None:
    data = bytes(range(256)) * 4096  # 1 MiB

    async def stream() -> AsyncIterator[bytes]:
        for i in range(0, len(data), 64 << 10):
            yield data[i : i + (64 << 10)]

    resp = await raw.put(f"/v1/slots/{leased['slot']}/files", params={"path": "chunked.bin"}, content=stream(),
                         headers={LEASE_HEADER: leased["lease"]})
    assert resp.status_code == 200, resp.text
    assert resp.json()["bytes_written"] == len(data)


# -- raw file endpoints -------------------------------------------------------------------------


async def test_raw_file_endpoints(raw: httpx.AsyncClient, leased: dict[str, Any], host: RunningHost) -> None:
    slot, hdr = leased["slot"], {LEASE_HEADER: leased["lease"]}
    data = bytes(range(256)) * 3
    resp = await raw.put(f"/v1/slots/{slot}/files", params={"path": "sub/dir/all.bin"}, content=data, headers=hdr)
    assert resp.status_code == 200, resp.text
    assert resp.json()["bytes_written"] == len(data)

    resp = await raw.get(f"/v1/slots/{slot}/files", params={"path": "sub/dir/all.bin"}, headers=hdr)
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/octet-stream"
    assert resp.content == data

    resp = await raw.get(f"/v1/slots/{slot}/list", params={"path": "sub/dir"}, headers=hdr)
    assert resp.status_code == 200
    assert resp.json()["entries"] == [{"name": "all.bin", "type": "file", "size": len(data)}]
    resp = await raw.get(f"/v1/slots/{slot}/list", headers=hdr)  # path defaults to the workspace
    assert [e["name"] for e in resp.json()["entries"]] == ["sub"]

    resp = await raw.get(f"/v1/slots/{slot}/stat", params={"path": "sub/dir/all.bin"}, headers=hdr)
    assert resp.status_code == 200
    assert resp.json()["type"] == "file" and resp.json()["size"] == len(data)

    resp = await raw.get(f"/v1/slots/{slot}/archive", headers=hdr)
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/gzip"
    with tarfile.open(fileobj=io.BytesIO(resp.content), mode="r:gz") as tar:
        fh = tar.extractfile("sub/dir/all.bin")
        assert fh is not None and fh.read() == data

    # tool errors keep their status
    _error(await raw.get(f"/v1/slots/{slot}/files", params={"path": "missing"}, headers=hdr), 404, "not_found")
    _error(await raw.get(f"/v1/slots/{slot}/files", params={"path": "sub"}, headers=hdr), 400, "is_directory")

    # the same through the client
    async with host.client() as client:
        await client.write_bytes(slot, leased["lease"], "c.bin", b"\x00client\xff")
        assert await client.read_bytes(slot, leased["lease"], "c.bin") == b"\x00client\xff"
        archive = await client.archive(slot, leased["lease"], "sub")
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
            assert "dir/all.bin" in tar.getnames()


async def test_raw_file_endpoints_need_the_lease_header(raw: httpx.AsyncClient, leased: dict[str, Any]) -> None:
    slot = leased["slot"]
    for path in ("files", "list", "stat", "archive"):
        resp = await raw.get(f"/v1/slots/{slot}/{path}", params={"path": "."})
        assert resp.status_code == 422, (path, resp.text)
        assert LEASE_HEADER in resp.text
    resp = await raw.put(f"/v1/slots/{slot}/files", params={"path": "x"}, content=b"x")
    assert resp.status_code == 422
    # nothing was written
    resp = await raw.get(f"/v1/slots/{slot}/list", headers={LEASE_HEADER: leased["lease"]})
    assert resp.json()["entries"] == []


async def test_raw_file_read_limits(raw: httpx.AsyncClient, leased: dict[str, Any]) -> None:
    body = _call_body(leased, "bash", command="head -c 9M /dev/zero > huge.bin")
    assert (await raw.post("/v1/call", json=body)).json()["ok"]
    resp = await raw.get(f"/v1/slots/{leased['slot']}/files", params={"path": "huge.bin"},
                         headers={LEASE_HEADER: leased["lease"]})
    message = _error(resp, 413, "too_large")
    assert str(HostConfig().max_read_bytes) in message


# -- quarantine ---------------------------------------------------------------------------------


async def test_failed_reset_quarantines_the_slot_for_good(tmp_path: Path) -> None:
    data = _private_data_dir("quarantine")
    # an uncapped workspace is a directory on disk, moved to the trash by a reset (a capped one is a
    # mount in the helper's namespace, which a mount in the host's own cannot disturb)
    running = start_host(data, slots=2, extra=["--workspace-bytes", "0"])
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    mounted: Path | None = None
    try:
        async with running.client() as client:
            lease = await client.lease("doomed", slot=0)
            await client.write_bytes(0, lease.lease, "f.txt", b"x")
            ws = data / "slots" / "0" / "ws"
            # a mount point cannot be renamed (EBUSY): the reset cannot move the workspace aside
            subprocess.run(["mount", "--bind", str(blocker), str(ws)], check=True, capture_output=True)
            mounted = ws
            result = await client.reset(0, lease.lease)
            assert result.ok is False
            assert result.quarantined is True
            assert result.lease is None
            assert "busy" in result.detail.lower()

            infos = {s.slot: s for s in await client.slots()}
            assert infos[0].state == "quarantined"
            assert "reset failed" in infos[0].detail
            health = await client.health()
            assert health.quarantined == 1 and health.free == 1

            # the old lease is dead, the slot cannot be leased by number or from the free list
            with pytest.raises(LeaseError):
                await client.read_bytes(0, lease.lease, "f.txt")
            with pytest.raises(SlotUnavailable, match="quarantined"):
                await client.lease("by-number", slot=0)
            for i in range(3):
                other = await client.lease(f"other-{i}")
                assert other.slot == 1
                with pytest.raises(SlotUnavailable, match="1 quarantined"):
                    await client.lease("none-left")
                await client.release(other.slot, other.lease)

            # even once the cause is gone, a quarantined slot does not come back by itself
            subprocess.run(["umount", str(ws)], check=True, capture_output=True)
            mounted = None
            assert {s.slot: s for s in await client.slots()}[0].state == "quarantined"
            other = await client.lease("after-umount")
            assert other.slot == 1
            await client.release(other.slot, other.lease)
    finally:
        if mounted is not None:
            subprocess.run(["umount", "-l", str(mounted)], capture_output=True)
        stop_host(running)
        shutil.rmtree(data, ignore_errors=True)


async def _plain_slot(tag: str, uid: int | None) -> Slot:
    """A slot on its own (no host, no sandbox): enough to drive a reset of a plain workspace."""
    root = _private_data_dir(tag)
    root.mkdir(mode=0o711)
    slot = Slot(0, HostConfig(token="t", data_dir=root), root, uid=uid, seccomp_path=None)
    await slot.prepare()
    slot.grant("trajectory", network=False)
    return slot


async def test_unexpected_error_during_reset_quarantines_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    slot = await _plain_slot("reset-bug", uid=None)
    try:
        async def broken(template: object, image: object = None) -> None:
            raise ValueError("the helper answered nonsense")

        monkeypatch.setattr(slot.ws, "build", broken)
        ok, detail = await slot.reset()
        assert ok is False
        assert slot.state == "quarantined"  # not stuck in "resetting": neither free nor reported
        assert slot.lease_token is None
        assert "ValueError" in detail and "nonsense" in detail and slot.info().detail == detail
    finally:
        shutil.rmtree(slot.dir.parent.parent, ignore_errors=True)


async def test_reset_verified_says_only_what_was_checked() -> None:
    slot = await _plain_slot("verified-nonroot", uid=None)
    try:
        assert await slot.reset() == (True, "")
        # a non-root host has no per-slot uid: nothing was swept by uid, and nothing owned by one
        assert "uid" not in slot.last_verified.replace("no per-slot uid", "").replace("no uid sweep", "")
        assert "no uid sweep" in slot.last_verified
    finally:
        shutil.rmtree(slot.dir.parent.parent, ignore_errors=True)
    if os.geteuid() != 0:
        return
    slot = await _plain_slot("verified-root", uid=3_900_000 + os.getpid() % 1000)  # a uid nobody uses
    try:
        assert await slot.reset() == (True, "")
        assert "owned by the slot uid" in slot.last_verified and "no process of the slot uid" in slot.last_verified
    finally:
        shutil.rmtree(slot.dir.parent.parent, ignore_errors=True)


# -- starting: fail closed, and say why ---------------------------------------------------------


def test_check_isolation_without_bwrap_fails_closed_saying_what_to_install() -> None:
    with pytest.raises(IsolationUnavailable) as info:
        check_isolation(HostConfig(bwrap="/nonexistent/bwrap"))
    message = str(info.value)
    assert "/nonexistent/bwrap" in message and "apt-get install bubblewrap" in message


async def test_host_start_without_bwrap_marks_the_isolation_failure(tmp_path: Path) -> None:
    host = SandboxHost(HostConfig(token="t", data_dir=tmp_path / "data", bwrap="/nonexistent/bwrap"))
    with pytest.raises(IsolationUnavailable) as info:
        await host.start()
    assert str(info.value).startswith(ISOLATION_FAILED)
    assert "apt-get install bubblewrap" in str(info.value)
    assert not (tmp_path / "data").exists()  # it refused before touching anything


def test_unsafe_no_isolation_warns_loudly() -> None:
    data = _private_data_dir("unsafe")
    proc = subprocess.Popen(
        [sys.executable, "-m", "atropos.sandbox", "--port", "0", "--slots", "1", "--data-dir", str(data),
         "--unsafe-no-isolation", "--workspace-bytes", "0", "--no-prewarm"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "ATROPOS_SANDBOX_TOKEN": "t"},
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline() or b"{}")
        assert ready.get("isolation") == "none", ready
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
        shutil.rmtree(data, ignore_errors=True)
    warnings = [line for line in stderr.decode().splitlines() if "UNSAFE" in line]
    assert warnings, stderr.decode()
    assert "WARNING" in warnings[0] or logging.getLevelName(logging.WARNING) in warnings[0]
    assert "WITHOUT isolation" in warnings[0] and "untrusted" in warnings[0]


def _local_backend(tag: str, **kw: Any) -> LocalBackend:
    return LocalBackend(LocalBackendConfig(slots_per_host=1, prewarm=False, pool_id=tag,
                                           data_root=_private_data_dir(tag), **kw))


async def test_local_backend_port_in_use_is_a_start_error_naming_the_port() -> None:
    backend = _local_backend("busy")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        backend.cfg.port = port
        try:
            with pytest.raises(HostUnavailable) as info:
                await backend.start_host()
        finally:
            await backend.close()
            shutil.rmtree(backend.cfg.data_root, ignore_errors=True)
    message = str(info.value)
    assert f"port {port}" in message and "in use" in message  # not misreported as missing isolation


async def test_local_backend_without_bwrap_is_isolation_unavailable(tmp_path: Path) -> None:
    # The backend's interpreter setting runs the real host, whose configured bwrap does not exist.
    launcher = tmp_path / "python-without-bwrap"
    launcher.write_text(
        "#!/bin/sh\n"
        f"exec {sys.executable} -c 'import functools, sys\n"
        "from atropos.sandbox.host import main as m\n"
        "m.HostConfig = functools.partial(m.HostConfig, bwrap=\"/nonexistent/bwrap\")\n"
        "m.main(sys.argv[3:])' \"$@\"\n"
    )
    launcher.chmod(0o755)
    backend = _local_backend("nobwrap", python=str(launcher))
    try:
        with pytest.raises(IsolationUnavailable) as info:
            await backend.start_host()
    finally:
        await backend.close()
        shutil.rmtree(backend.cfg.data_root, ignore_errors=True)
    message = str(info.value)
    assert message.startswith(ISOLATION_FAILED)
    assert "bubblewrap not found at /nonexistent/bwrap" in message and "apt-get install bubblewrap" in message
