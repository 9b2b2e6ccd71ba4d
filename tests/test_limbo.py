"""No limbo (issue 17): a client that gives up or stalls holds nothing.

Rows: a REST lease request whose client gave up while waiting (it must stop waiting and never
lease), and a request that never sends its whole head or body (the ToolServer and the sandbox
host must close it). Real uvicorn on loopback, real sockets, a real local pool.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import struct
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from conftest import RunningHost, start_host, stop_host

from atropos.api.server import ToolServerSettings, create_tool_server
from atropos.request_deadline import server_config
from atropos.slots.config import PoolConfig
from atropos.slots.lease import Lease
from atropos.slots.pool import SlotPool
from tests.pool_backends import make_backend
from tests.served import serve_on_loopback

TOKEN = "limbo-token-123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
READ_TIMEOUT_S = 1.0
WAIT_S = 60.0  # generous bound for polls on a busy machine


async def _serve(app: object, read_timeout_s: float) -> AsyncIterator[tuple[str, uvicorn.Server]]:
    config = server_config(app, read_timeout_s, log_level="warning", lifespan="on")
    async with serve_on_loopback(app, config) as (url, srv):
        yield url.removeprefix("http://"), srv


@pytest.fixture
async def one_slot_server() -> AsyncIterator[tuple[str, SlotPool]]:
    pool = SlotPool(make_backend("local", slots=1), PoolConfig(min_hosts=1, max_hosts=1))
    app = create_tool_server(pool, ToolServerSettings(token=TOKEN), manage_pool=True)
    async for addr, _ in _serve(app, READ_TIMEOUT_S):
        yield addr, pool


async def _poll(cond: object, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {WAIT_S:.0f}s: {what}"
        await asyncio.sleep(0.05)


async def test_lease_request_abandoned_by_its_client_never_leases(one_slot_server: tuple[str, SlotPool]) -> None:
    addr, pool = one_slot_server
    async with httpx.AsyncClient(base_url=f"http://{addr}", headers=AUTH, timeout=WAIT_S) as http:
        holder = (await http.post("/v1/slots", json={"trajectory_id": "holder"})).json()["lease_id"]
        # A client queues for the only slot, then gives up (closes its connection) while waiting.
        body = json.dumps({"trajectory_id": "quitter", "timeout_s": 600}).encode()
        host, port = addr.split(":")
        _, w = await asyncio.open_connection(host, int(port))
        w.write(b"POST /v1/slots HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                + f"authorization: Bearer {TOKEN}\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
        await w.drain()
        await _poll(lambda: pool.status().waiting == 1, "the quitter's request is queued")
        w.close()
        await _poll(lambda: pool.status().waiting == 0, "the abandoned request stops waiting")
        # The slot freed next goes to the next live client, at once, not to the quitter.
        assert (await http.delete(f"/v1/slots/{holder}")).status_code == 200
        got = await http.post("/v1/slots", json={"trajectory_id": "next", "timeout_s": 30})
        assert got.status_code == 200, got.text
        assert [e.trajectory_id for e in pool.audit.events if e.event == "lease"] == ["holder", "next"]
        assert (await http.delete(f"/v1/slots/{got.json()['lease_id']}")).status_code == 200


async def test_lease_granted_as_its_client_leaves_is_given_back(one_slot_server: tuple[str, SlotPool]) -> None:
    """The client leaves at the exact moment its lease is granted: the answer cannot be delivered,
    so the ToolServer gives the slot back at once instead of holding it until the idle reaper."""
    addr, pool = one_slot_server
    host, port = addr.split(":")
    _, w = await asyncio.open_connection(host, int(port))
    real_lease = pool.lease

    async def lease_then_client_leaves(*args: Any, **kw: Any) -> Lease:
        granted = await real_lease(*args, **kw)
        # the client resets its connection as the grant comes back (no FIN/close handshake to wait for)
        w.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        w.transport.abort()
        return granted

    pool.lease = lease_then_client_leaves  # type: ignore[method-assign]
    body = json.dumps({"trajectory_id": "leaver"}).encode()
    w.write(b"POST /v1/slots HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"authorization: Bearer {TOKEN}\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
    await w.drain()
    await _poll(lambda: [e.event for e in pool.audit.events] == ["lease", "release"], "the undelivered lease released")
    pool.lease = real_lease  # type: ignore[method-assign]
    await _poll(lambda: pool.status().free == 1 and pool.status().leased == 0, "the slot is free again")
    async with httpx.AsyncClient(base_url=f"http://{addr}", headers=AUTH, timeout=WAIT_S) as http:
        got = await http.post("/v1/slots", json={"trajectory_id": "next", "timeout_s": 30})
        assert got.status_code == 200, got.text
        assert (await http.delete(f"/v1/slots/{got.json()['lease_id']}")).status_code == 200


async def _closed_within(addr: str, payload: bytes) -> bytes:
    """Sends ``payload`` (an incomplete request) and returns what the server sent before closing."""
    host, port = addr.split(":")
    r, w = await asyncio.open_connection(host, int(port))
    w.write(payload)
    await w.drain()
    try:
        data = await asyncio.wait_for(r.read(), WAIT_S)  # until EOF: the server closed the connection
    except asyncio.TimeoutError:
        pytest.fail(f"connection with an incomplete request still open after {WAIT_S:.0f}s: {payload!r}")
    finally:
        w.close()
    return data


SLOW_HEAD = b"POST /v1/slots HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"  # never ends
SLOW_BODY = (b"POST /v1/slots HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
             + f"authorization: Bearer {TOKEN}\r\ncontent-length: 200\r\n\r\n".encode() + b'{"trajectory_id": ')


async def test_toolserver_closes_requests_that_never_arrive_whole(one_slot_server: tuple[str, SlotPool]) -> None:
    addr, pool = one_slot_server
    assert (await _closed_within(addr, b"")).startswith(b"HTTP/1.1 408")  # connected, sent nothing
    assert (await _closed_within(addr, SLOW_HEAD)).startswith(b"HTTP/1.1 408")
    await _closed_within(addr, SLOW_BODY)  # the handler was reading the body: it sees a disconnect
    assert pool.status().waiting == 0 and not pool.audit.events
    async with httpx.AsyncClient(base_url=f"http://{addr}", headers=AUTH, timeout=WAIT_S) as http:
        assert (await http.get("/v1/status")).status_code == 200  # whole requests are served as before


@pytest.fixture(scope="module")
def slow_host() -> Iterator[RunningHost]:
    running = start_host(Path(f"/tmp/atropos-limbo-{os.getpid()}-{secrets.token_hex(3)}"), slots=1,
                         extra=["--request-read-timeout", str(READ_TIMEOUT_S), "--no-prewarm"])
    yield running
    stop_host(running)


async def test_sandbox_host_closes_requests_that_never_arrive_whole(slow_host: RunningHost) -> None:
    addr = slow_host.address.removeprefix("http://")
    head = SLOW_HEAD.replace(b"/v1/slots", b"/lease")
    assert (await _closed_within(addr, b"")).startswith(b"HTTP/1.1 408")
    assert (await _closed_within(addr, head)).startswith(b"HTTP/1.1 408")
    body = SLOW_BODY.replace(b"/v1/slots", b"/lease").replace(TOKEN.encode(), slow_host.token.encode())
    await _closed_within(addr, body)
    client = slow_host.client()
    try:
        assert (await client.health()).ok
    finally:
        await client.aclose()



async def test_a_body_still_arriving_at_the_minimum_rate_is_not_cut(slow_host: RunningHost) -> None:
    """An image upload longer than the read deadline (a 1 GB archive takes minutes on a loaded
    machine) goes on while its body keeps coming at ``MIN_BODY_RATE`` or more: here 3 windows' worth
    at 4x that rate reaches the handler whole, which answers (400: not an archive) rather than
    losing the connection at the first deadline."""
    from atropos.request_deadline import MIN_BODY_RATE

    chunk, per_window, windows = 1 << 18, 4 * MIN_BODY_RATE * READ_TIMEOUT_S, 3
    total = int(per_window * windows)

    async def body() -> AsyncIterator[bytes]:
        sent = 0
        while sent < total:
            yield b"\0" * chunk
            sent += chunk
            await asyncio.sleep(chunk / (4 * MIN_BODY_RATE))  # 4x the minimum rate, the body over 3 windows

    async with httpx.AsyncClient(base_url=slow_host.address, timeout=WAIT_S,
                                 headers={"Authorization": f"Bearer {slow_host.token}"}) as http:
        t0 = time.monotonic()
        resp = await http.post("/v1/images", params={"reference": "limbo/slow:1"}, content=body(),
                               headers={"content-type": "application/x-tar"})
    assert time.monotonic() - t0 > 2 * READ_TIMEOUT_S  # the body took longer than the deadline
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "image_rejected", resp.text

def test_lease_audit_stays_bounded_and_still_sees_every_double_lease(tmp_path: Path) -> None:
    """An RL run leases millions of slots: the audit's memory must not grow with them, yet a double
    lease after the in-memory window rolled over is still caught, and the file keeps the full trail."""
    from atropos.slots.audit import LeaseAudit, double_leases, load

    audit = LeaseAudit(tmp_path / "audit.jsonl", keep=100)
    for i in range(5000):
        audit.record("lease", f"t{i}", "h", i % 8, i)
        audit.record("release", f"t{i}", "h", i % 8, i)
    audit.record("lease", "a", "h", 3, 1)
    audit.record("lease", "b", "h", 3, 2)  # slot 3 now held twice
    audit.close()
    assert len(audit.events) == 100 and len(audit.holders) == 1
    assert audit.double_leased == 1 and "held by a" in audit.problems[0]
    trail = load(tmp_path / "audit.jsonl")
    assert len(trail) == 10_002 and len(double_leases(trail)) == 1


def test_parsing_wire_messages_keeps_nothing_per_call() -> None:
    """Every call's result, every reset and every lease is parsed from JSON whose strings (ids,
    tokens, output) are new each time: parsing must not keep them. pydantic-core's default string
    cache did (one process-wide table), ~1 MB per process over the first few thousand trajectories
    of a soak. Checked by reference count, which holds whatever the table held before."""
    import gc
    import sys

    from atropos.api.server import SlotCallRequest
    from atropos.sandbox.contract.protocol import CallBatch, CallResult, LeaseInfo, ResetResult

    cases: list[tuple[Any, dict[str, Any], Any]] = [
        (CallResult, {"id": "@", "slot": 1, "ok": True, "result": {"stdout": "out"}}, lambda m: m.id),
        (ResetResult, {"slot": 2, "ok": True, "quarantined": False, "duration_ms": 9.5, "detail": "@"},
         lambda m: m.detail),
        (LeaseInfo, {"slot": 3, "lease": "@", "generation": 7, "trajectory_id": "t", "network": False},
         lambda m: m.lease),
        (CallBatch, {"calls": [{"id": "c", "slot": 0, "lease": "@", "tool": "bash"}]}, lambda m: m.calls[0].lease),
        (SlotCallRequest, {"tool": "bash", "args": {"command": "@"}}, lambda m: m.args["command"]),
    ]
    for model, message, pick in cases:
        value = secrets.token_hex(8)
        parsed = model.model_validate_json(json.dumps(message).replace('"@"', f'"{value}"'))
        kept = pick(parsed)
        assert kept == value
        del parsed
        gc.collect()
        # the only references left: ``kept`` and getrefcount's argument
        assert sys.getrefcount(kept) == 2, f"{model.__name__}: parsing kept a reference to a value"
