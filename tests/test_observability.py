"""Operators' view: Prometheus metrics after known activity, the live status page in a real headless
Chromium, and JSON log lines that carry call ids but never a token."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from atropos.api.externals import web_externals
from atropos.api.server import ToolServerSettings, create_tool_server
from atropos.logs import JsonFormatter
from atropos.slots.config import PoolConfig
from atropos.slots.pool import SlotPool
from atropos.tools.registry import ToolRegistry
from atropos.tools.web import OfflineCorpusProvider
from tests.pool_backends import make_backend

TOKEN = "observability-token-0123456789"


@pytest.fixture
async def server() -> AsyncIterator[str]:
    pool = SlotPool(make_backend("local", slots=3), PoolConfig(min_hosts=1, max_hosts=1))
    app = create_tool_server(pool, ToolServerSettings(token=TOKEN), registry=ToolRegistry.default(with_web=True),
                             externals=web_externals(OfflineCorpusProvider()), manage_pool=True)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    task = asyncio.create_task(srv.serve(sockets=[sock]))
    while not srv.started:
        await asyncio.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv.should_exit = True
    await task


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def test_metrics_count_known_activity(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as http:
        before = scrape((await http.get("/metrics")).text)
        lid = (await http.post("/v1/slots", json={"trajectory_id": "m1"})).json()["lease_id"]
        for i in range(3):
            await http.post(f"/v1/slots/{lid}/call", json={"tool": "bash", "args": {"command": f"echo {i}"}})
        await http.post(f"/v1/slots/{lid}/call", json={"tool": "bash", "args": {"command": "exit 1"}})
        await http.post("/v1/tools/web_search/invoke", json={"args": {"query": "grep"}})
        status_during = scrape((await http.get("/metrics")).text)
        await http.delete(f"/v1/slots/{lid}")
        after = scrape((await http.get("/metrics")).text)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("atropos_slot_api_calls_total", tool="bash", outcome="ok") == 3
    assert delta("atropos_slot_api_calls_total", tool="bash", outcome="error") == 1
    assert delta("atropos_external_tool_calls_total", tool="web_search", outcome="ok") == 1
    assert delta("atropos_pool_leases_total") == 1
    assert delta("atropos_pool_calls_total") == 4
    assert delta("atropos_pool_lease_wait_seconds_count") == 1
    assert status_during[("atropos_pool_slots", (("state", "leased"),))] == 1
    assert after[("atropos_pool_slots", (("state", "free"),))] == 3
    assert after[("atropos_pool_hosts", (("health", "healthy"),))] == 1
    route = (("method", "POST"), ("route", "/v1/slots/{lease_id}/call"), ("status", "200"))
    assert after[("atropos_toolserver_requests_total", route)] - before.get(("atropos_toolserver_requests_total",
                                                                              route), 0) == 4


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed (apt-get install chromium)")
async def test_status_page_in_headless_chromium(server: str, tmp_path: object) -> None:
    async with httpx.AsyncClient(base_url=server, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as http:
        lid = (await http.post("/v1/slots", json={"trajectory_id": "page-traj"})).json()["lease_id"]
        await http.post(f"/v1/slots/{lid}/call", json={"tool": "bash", "args": {"command": "true"}})
        proc = await asyncio.create_subprocess_exec(
            "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path}", "--virtual-time-budget=5000", "--dump-dom",
            f"{server}/status#token={TOKEN}", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        dom, _ = await asyncio.wait_for(proc.communicate(), 120)
        await http.delete(f"/v1/slots/{lid}")
    html = dom.decode()
    assert 'data-loaded="1"' in html, html[-2000:]
    assert '<b id="free">2</b>' in html and '<b id="leased">1</b>' in html
    assert "page-traj" in html and ">bash<" in html  # the recent call is listed
    assert TOKEN not in html.split("<script>")[0]  # the token is never rendered


async def test_json_logs_carry_ids_and_never_the_token(server: str) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("atropos.api.server")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        async with httpx.AsyncClient(base_url=server, headers={"Authorization": f"Bearer {TOKEN}"},
                                     timeout=60) as http:
            lid = (await http.post("/v1/slots", json={"trajectory_id": "log-traj"})).json()["lease_id"]
            await http.post(f"/v1/slots/{lid}/call", json={"tool": "bash", "args": {"command": "echo x"}})
            await http.delete(f"/v1/slots/{lid}")
    finally:
        logger.removeHandler(handler)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    calls = [line for line in lines if line["msg"].startswith("slot call")]
    assert calls and all(c["trajectory_id"] == "log-traj" and c["call_id"] and c["lease"] for c in calls)
    text = stream.getvalue()
    assert TOKEN not in text and lid not in text


async def test_host_metrics_after_known_activity(host) -> None:  # type: ignore[no-untyped-def]
    client = host.client()
    headers = {"Authorization": f"Bearer {host.token}"}
    async with httpx.AsyncClient(base_url=host.address, timeout=60) as http:
        assert (await http.get("/metrics")).status_code == 401  # host metrics need the token
        before = scrape((await http.get("/metrics", headers=headers)).text)
        lease = await client.lease("metrics-traj")
        from atropos.sandbox.protocol import ToolCall

        for i in range(2):
            await client.call(ToolCall(id=str(i), slot=lease.slot, lease=lease.lease, tool="bash",
                                       args={"command": "true"}))
        await client.call(ToolCall(id="x", slot=lease.slot, lease=lease.lease, tool="read_file",
                                   args={"path": "missing"}))
        await client.release(lease.slot, lease.lease)
        after = scrape((await http.get("/metrics", headers=headers)).text)
    await client.aclose()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("atropos_host_calls_total", tool="bash", outcome="ok") == 2
    assert delta("atropos_host_calls_total", tool="read_file", outcome="not_found") == 1
    assert delta("atropos_host_call_seconds_count", tool="bash") == 2
    assert delta("atropos_host_leases_total") == 1
    assert delta("atropos_host_resets_total", result="ok") == 1
