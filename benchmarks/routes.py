"""The routes users take to one tool call, set up for ``call_latency``: a SlotPool lease
(``lease.bash``), ``ToolExecutor.execute`` (every AgentEnv rollout) on the same pool host, and the
ToolServer's REST ``POST /v1/slots/{lease_id}/call`` (``atropos.cli serve`` in its own process,
default settings) through two keep-alive clients: ``httpx.AsyncClient`` and the project's lean
HTTP/1.1 client (``atropos.sandbox.contract.http1``, what a non-Python framework's client costs is closer to).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import httpx

from benchmarks.common import REPO, local_pool, tree_env

Fn = Callable[[], Awaitable[None]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def pool_routes(stack: AsyncExitStack) -> dict[str, Fn]:
    """``lease.bash('true')`` and ``ToolExecutor.execute`` of bash ``true`` on one local pool host."""
    from atropos.tools.executor import AgentToolCall, ToolExecutor

    pool = local_pool(f"bench-routes-{os.getpid()}", hosts=1, slots_per_host=2)
    await pool.start()
    stack.push_async_callback(pool.stop)
    direct = await pool.lease("bench-direct")
    stack.push_async_callback(direct.release)
    executor = ToolExecutor(pool)  # default config: what AgentEnv builds
    stack.push_async_callback(executor.close)
    exec_lease = await pool.lease("bench-executor")
    stack.push_async_callback(exec_lease.release)
    executor.bind("bench-executor", exec_lease)
    call = AgentToolCall(id="c", name="bash", arguments={"command": "true"})

    async def lease_bash() -> None:
        out = await direct.bash("true")
        if out.get("exit_code") != 0:
            raise RuntimeError(f"lease.bash true failed: {out}")

    async def execute() -> None:
        out = await executor.execute("bench-executor", call)
        if not out.ok:
            raise RuntimeError(f"executor true failed: {out.content}")

    return {"bash: true (lease.bash)": lease_bash, "bash: true (ToolExecutor.execute)": execute}


async def rest_routes(stack: AsyncExitStack, root: Path, tree: Path = REPO, suffix: str = "") -> dict[str, Fn]:
    """A ToolServer (``python -m atropos.cli serve`` from ``tree``, local backend, 1 host x 2 slots,
    default log level) and one REST lease; ``true`` through httpx and through the lean client (row
    names end with ``suffix``)."""
    from atropos.sandbox.contract.http1 import ConnectionPool

    token = secrets.token_urlsafe(16)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATROPOS_SANDBOX_")}  # defaults only
    env = tree_env(tree, {**env, "ATROPOS_TOOLSERVER_TOKEN": token})
    log_path = root / f"toolserver-{port}.log"
    log_file = log_path.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "atropos.cli", "serve", "--port", str(port), "--slots-per-host", "2",
         "--min-hosts", "1", "--max-hosts", "1", "--pool-id", f"bench-rest-{os.getpid()}-{port}"],
        stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=tree)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log_file.close()

    stack.callback(stop)
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {token}"}
    client = httpx.AsyncClient(base_url=base, headers=headers, timeout=60)
    stack.push_async_callback(client.aclose)
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"ToolServer exited {proc.returncode}: {log_path.read_text()[-500:]}")
        try:
            if (await client.get("/healthz")).json().get("ok"):
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("ToolServer not ready after 120 s")
        await asyncio.sleep(0.2)
    resp = await client.post("/v1/slots", json={"trajectory_id": "bench-rest"})
    resp.raise_for_status()
    lease_id = resp.json()["lease_id"]
    path = f"/v1/slots/{lease_id}/call"
    body = json.dumps({"tool": "bash", "args": {"command": "true"}}).encode()
    lean = ConnectionPool(base, headers)
    stack.push_async_callback(lean.aclose)

    async def via_httpx() -> None:
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
        if r.status_code != 200 or not r.json()["ok"]:
            raise RuntimeError(f"REST true failed: {r.status_code} {r.text[:200]}")

    async def via_lean() -> None:
        r = await lean.request("POST", path, body, timeout=60)
        if r.status != 200 or not json.loads(r.body)["ok"]:
            raise RuntimeError(f"REST true failed: {r.status} {r.body[:200]!r}")

    via_lean.pid = proc.pid  # type: ignore[attr-defined]  # the ToolServer's, for CPU per call
    return {f"bash: true (REST, httpx keep-alive){suffix}": via_httpx,
            f"bash: true (REST, lean keep-alive){suffix}": via_lean}
