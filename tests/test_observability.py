"""Operators' view: Prometheus metrics after known activity, the live status page in a real headless
Chromium, and JSON log lines that carry call ids but never a token."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from atropos.api.externals import web_externals
from atropos.api.server import ToolServerSettings, create_tool_server
from atropos.logs import JsonFormatter, RedactingFormatter, call_fields, redact
from atropos.progress import GroupProgress
from atropos.sandbox.contract.client import HostClient
from atropos.sandbox.contract.protocol import ToolCall
from atropos.slots.config import PoolConfig
from atropos.slots.pool import PoolStatus, SlotPool
from atropos.tools.registry import ToolRegistry
from atropos.tools.web import OfflineCorpusProvider
from tests.pool_backends import make_backend
from tests.served import serve_on_loopback

TOKEN = "observability-token-0123456789"


@dataclass
class Served:
    url: str
    pool: SlotPool
    app: Any


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    pool = SlotPool(make_backend("local", slots=3), PoolConfig(min_hosts=1, max_hosts=1))
    app = create_tool_server(pool, ToolServerSettings(token=TOKEN), registry=ToolRegistry.default(with_web=True),
                             externals=web_externals(OfflineCorpusProvider()), manage_pool=True)
    async with serve_on_loopback(app) as (url, _):
        yield Served(url, pool, app)


@pytest.fixture
def server(served: Served) -> str:
    return served.url


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def test_metrics_count_known_activity(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url, headers={"Authorization": f"Bearer {TOKEN}"},
                                 timeout=60) as http:
        before = scrape((await http.get("/metrics")).text)
        lid = (await http.post("/v1/slots", json={"trajectory_id": "m1"})).json()["lease_id"]
        for i in range(3):
            await http.post(f"/v1/slots/{lid}/call", json={"tool": "bash", "args": {"command": f"echo {i}"}})
        await http.post(f"/v1/slots/{lid}/call", json={"tool": "bash", "args": {"command": "exit 1"}})
        await http.post(f"/v1/slots/{lid}/call", json={"tool": "bash", "args": {"cmd": "no such argument"}})
        made_up = await http.post(f"/v1/slots/{lid}/call", json={"tool": "made_up_tool", "args": {}})
        assert made_up.status_code == 404
        await http.post("/v1/tools/web_search/invoke", json={"args": {"query": "grep"}})
        bad = await http.post("/v1/tools/web_search/invoke", json={"args": {"max_results": "many"}})
        assert bad.status_code == 422
        status_during = scrape((await http.get("/metrics")).text)
        # a lease the pool ended behind the REST client's back: the host refuses it (409)
        stale = (await http.post("/v1/slots", json={"trajectory_id": "m2"})).json()["lease_id"]
        await served.pool.release(served.app.fastapi.state.rest_leases[stale].lease)
        refused = await http.post(f"/v1/slots/{stale}/call", json={"tool": "bash", "args": {"command": "true"}})
        assert refused.status_code == 409
        await http.delete(f"/v1/slots/{stale}")
        await http.delete(f"/v1/slots/{lid}")
        after = scrape((await http.get("/metrics")).text)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("atropos_slot_api_calls_total", tool="bash", outcome="ok") == 3
    assert delta("atropos_slot_api_calls_total", tool="bash", outcome="error") == 1
    assert delta("atropos_slot_api_calls_total", tool="bash", outcome="invalid_arguments") == 1
    assert delta("atropos_slot_api_calls_total", tool="bash", outcome="lease_invalid") == 1
    # a client's made-up tool name never becomes a label value (unbounded series)
    assert delta("atropos_slot_api_calls_total", tool="unknown", outcome="unknown_tool") == 1
    assert not any("made_up_tool" in str(labels) for _name, labels in after)
    assert delta("atropos_external_tool_calls_total", tool="web_search", outcome="ok") == 1
    assert delta("atropos_external_tool_calls_total", tool="web_search", outcome="invalid_arguments") == 1
    assert delta("atropos_pool_leases_total") == 2
    assert delta("atropos_pool_calls_total") == 5
    assert delta("atropos_pool_lease_wait_seconds_count") == 2
    assert status_during[("atropos_pool_slots", (("state", "leased"),))] == 1
    assert after[("atropos_pool_slots", (("state", "free"),))] == 3
    assert after[("atropos_pool_hosts", (("health", "healthy"),))] == 1
    (host_id,) = served.pool.hosts
    assert after[("atropos_pool_host_up", (("host", host_id),))] == 1
    route = (("method", "POST"), ("route", "/v1/slots/{lease_id}/call"), ("status", "200"))
    assert after[("atropos_toolserver_requests_total", route)] - before.get(("atropos_toolserver_requests_total",
                                                                              route), 0) == 5
    # scaling and quarantine counters appear as soon as PoolStatus carries them
    for name in ("scale_ups", "scale_downs", "quarantines"):
        if name in PoolStatus.model_fields:
            assert after[(f"atropos_pool_{name}_total", ())] == getattr(served.pool.status(), name)
        else:
            assert (f"atropos_pool_{name}_total", ()) not in after


async def test_two_toolservers_in_one_process_each_expose_their_own_pool() -> None:
    """Each app owns its pool's collector: no "Duplicated timeseries" when a second one is built,
    and each /metrics shows its own pool (pools not started: status() of an empty pool)."""
    apps = []
    for slots, public in ((2, True), (5, False)):
        pool = SlotPool(make_backend("local", slots=slots), PoolConfig(min_hosts=0, max_hosts=1, pool_id=f"m{slots}"))
        apps.append(create_tool_server(pool, ToolServerSettings(token=TOKEN, public_metrics=public)))
    texts = []
    for app in apps:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ts") as http:
            anonymous = await http.get("/metrics")
            texts.append((await http.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})).text)
            assert anonymous.status_code == (200 if app is apps[0] else 401)
    for text in texts:
        families = [f.name for f in text_string_to_metric_families(text)]
        assert families.count("atropos_pool_slots") == 1 and "atropos_toolserver_requests" in families


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or (
        "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None)


async def test_status_page_in_headless_chromium(server: str, tmp_path: Path) -> None:
    browser = chromium()
    if browser is None:
        if os.environ.get("CI") == "true":  # scripts/test.sh installs it: its absence is a broken setup
            pytest.fail("chromium is missing in CI (scripts/test.sh installs it)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    async with httpx.AsyncClient(base_url=server, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as http:
        lid = (await http.post("/v1/slots", json={"trajectory_id": "page-traj"})).json()["lease_id"]
        for _ in range(3):
            await http.post(f"/v1/slots/{lid}/call", json={"tool": "bash", "args": {"command": "true"}})
        expected = (await http.get("/v1/status")).json()
        proc = await asyncio.create_subprocess_exec(
            browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path}", "--virtual-time-budget=5000", "--dump-dom",
            f"{server}/status#token={TOKEN}", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        dom, _ = await asyncio.wait_for(proc.communicate(), 120)
        await http.delete(f"/v1/slots/{lid}")
    html = dom.decode()
    assert 'data-loaded="1"' in html, html[-2000:]
    assert '<b id="free">2</b>' in html and '<b id="leased">1</b>' in html
    assert expected["calls_total"] == 3 and f'<b id="calls">{expected["calls_total"]}</b>' in html
    for counter in ("scale_ups", "quarantines", "lost_hosts"):
        if counter in expected:
            assert f'<b id="{counter}">{expected[counter]}</b>' in html, counter
    (host,) = expected["hosts"]
    row = html.split('<table id="hosts">')[1].split("</table>")[0]
    assert f"<td>{host['id']}</td>" in row and '<td class="ok">ok</td>' in row, row
    assert "<td>2</td><td>1</td><td>0</td>" in row  # free, leased, quarantined of that host
    assert "page-traj" in html and ">bash<" in html  # the recent calls are listed
    assert TOKEN not in html.split("<script>")[0]  # the token is never rendered


async def test_json_logs_carry_ids_and_never_a_secret(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything logged in this process while a REST client works (root logger, JSON lines), and
    a real host's stderr: ids on every call line, no host token, host lease token, REST lease id
    or ToolServer token anywhere."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    # as atropos.logs.configure does: this test's own client would log its request URLs (REST lease ids)
    monkeypatch.setattr(logging.getLogger("httpx"), "level", logging.WARNING)
    monkeypatch.setenv("ATROPOS_TOOLSERVER_TOKEN", TOKEN)  # inherited by hosts started from here on
    secrets_seen: list[str] = [TOKEN]
    try:
        async with httpx.AsyncClient(base_url=served.url, headers={"Authorization": f"Bearer {TOKEN}"},
                                     timeout=60) as http:
            lid = (await http.post("/v1/slots", json={"trajectory_id": "log-traj"})).json()["lease_id"]
            held = served.app.fastapi.state.rest_leases[lid].lease
            secrets_seen += [lid, held.token, held.host.info.token]
            await http.post(f"/v1/slots/{lid}/call", json={"tool": "bash", "args": {"command": "echo x"}})
            await http.post(f"/v1/slots/{lid}/call", json={"tool": "read_file", "args": {"path": "missing"}})
            await http.post("/v1/tools/web_search/invoke", json={"args": {"query": "tar"}})
            await http.delete(f"/v1/slots/{lid}")
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    calls = [line for line in lines if line["msg"].startswith("slot call")]
    assert len(calls) == 2 and all(c["trajectory_id"] == "log-traj" and c["call_id"] and c["lease"] and
                                   c["tool"] and c["host"] and "slot" in c and c["outcome"] for c in calls)
    assert {c["outcome"] for c in calls} == {"ok", "not_found"}
    lifecycle = [line for line in lines if line["msg"] in ("slot leased", "slot released")]
    assert len(lifecycle) == 2 and all(line["trajectory_id"] == "log-traj" and line["lease"] == calls[0]["lease"]
                                       for line in lifecycle)
    assert any(line["msg"] == "external call web_search ok" and line["tool"] == "web_search" for line in lines)
    text = stream.getvalue()
    for secret in secrets_seen:
        assert secret not in text
    host_logs = "".join(p.read_text() for p in Path(served.pool.backend.root).glob("*.log"))  # type: ignore[attr-defined]
    assert host_logs, "the local backend keeps each host's stderr in a log file"
    for secret in secrets_seen:
        assert secret not in host_logs


def test_real_host_logs_json_lines_without_its_tokens(tmp_path: Path) -> None:
    """``python -m atropos.sandbox --log-json``: every stderr line is a JSON object; neither the
    host token nor a lease token nor the ToolServer token (in its environment) is in any line."""
    token, ts_token = secrets.token_urlsafe(16), "toolserver-token-in-env-0123456789"
    env = {**os.environ, "ATROPOS_SANDBOX_TOKEN": token, "ATROPOS_TOOLSERVER_TOKEN": ts_token}
    stderr_path = tmp_path / "host.stderr"
    data = Path(f"/tmp/atropos-obs-{os.getpid()}-{secrets.token_hex(3)}")
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "atropos.sandbox", "--port", "0", "--slots", "1",
                                 "--data-dir", str(data), "--log-json", "--log-level", "DEBUG"],
                                stdout=subprocess.PIPE, stderr=err, env=env)
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())

        async def work() -> list[str]:
            client = HostClient(f"http://127.0.0.1:{ready['port']}", token)
            try:
                lease = await client.lease("host-log-traj")
                result = await client.call(ToolCall(id="c1", slot=lease.slot, lease=lease.lease, tool="bash",
                                                    args={"command": "echo ok"}, trajectory_id="host-log-traj"))
                assert result.ok
                await client.release(lease.slot, lease.lease)
                return [lease.lease]
            finally:
                await client.aclose()

        lease_tokens = asyncio.run(work())
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(data, ignore_errors=True)
    text = stderr_path.read_text()
    # Log records are JSON; anything else is the interpreter's own output at exit (e.g. an
    # "Exception ignored in ..." warning), which no formatter sees.
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert lines and all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)
    assert any("host-log-traj" in json.dumps(line) for line in lines)  # the lease line names the trajectory
    for secret in (token, ts_token, *lease_tokens):
        assert secret not in text


def test_redact_catches_credentials_in_their_usual_spellings() -> None:
    secret = "s3cr3tVALUE_0123456789"
    for text in (f"Authorization: Bearer {secret}", f"authorization: Basic {secret}", f"X-Api-Key: {secret}",
                 f"x-api-key={secret}", f"api_key={secret}", f"url?api-key={secret}&q=1", f'{{"api_key": "{secret}"}}',
                 f"ATROPOS_TOOLSERVER_TOKEN={secret}", f"token: {secret}", f"password={secret}",
                 f"{{'token': '{secret}'}}"):
        assert secret not in redact(text), text
        assert "[redacted]" in redact(text)
    assert redact("lease slot=3 generation=2 trajectory=abc") == "lease slot=3 generation=2 trajectory=abc"
    record = logging.LogRecord("t", logging.INFO, __file__, 1, "sent %s", (f"Bearer {secret}",), None)
    assert secret not in RedactingFormatter("%(message)s").format(record)
    assert secret not in JsonFormatter().format(record)
    assert call_fields(trajectory_id="t", lease=None, call_id="c") == {"trajectory_id": "t", "call_id": "c"}
    with pytest.raises(ValueError):
        call_fields(trajectory="typo")


def test_group_progress_lines(capsys: pytest.CaptureFixture[str]) -> None:
    now = [100.0]
    progress = GroupProgress(total_groups=4, clock=lambda: now[0])
    now[0] = 110.0
    first = progress.group_done(rollouts=8, tool_calls=50)
    now[0] = 120.0
    second = progress.group_done(rollouts=16, tool_calls=150)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "[atropos-sandbox] group 1/4  rollouts 8  tool calls 50  5.0 calls/s  elapsed 10s  eta 30s",
        "[atropos-sandbox] group 2/4  rollouts 16  tool calls 150  7.5 calls/s  elapsed 20s  eta 20s",
    ]
    assert (first.groups_done, second.calls_per_s, second.eta_s) == (1, 7.5, 20.0)
    open_ended = GroupProgress(stream=io.StringIO(), clock=lambda: now[0])
    now[0] = 3720.0
    assert open_ended.group_done(rollouts=1, tool_calls=0, total_groups=None).line() == \
        "[atropos-sandbox] group 1  rollouts 1  tool calls 0  0.0 calls/s  elapsed 1h00m"
    late = GroupProgress(clock=lambda: now[0], stream=io.StringIO())
    assert late.group_done(rollouts=2, tool_calls=4, total_groups=10).total_groups == 10


async def test_host_metrics_after_known_activity(host) -> None:  # type: ignore[no-untyped-def]
    client = host.client()
    headers = {"Authorization": f"Bearer {host.token}"}
    async with httpx.AsyncClient(base_url=host.address, timeout=60) as http:
        assert (await http.get("/metrics")).status_code == 401  # host metrics need the token
        before = scrape((await http.get("/metrics", headers=headers)).text)
        lease = await client.lease("metrics-traj")
        from atropos.sandbox.contract.protocol import ToolCall

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
