"""A cancelled call must not leak into the slot's next call, nor keep running.

A call is cancelled when the client of a streamed batch (``/v1/calls``) disconnects, or when an
in-process caller gives up. The supervisor (or the python_session driver) is still running it then,
and its reply used to be read as the answer to the *next* request on the slot. Real bubblewrap
throughout: an in-process host for direct cancellation, and the session host over HTTP.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningHost, slot_path

from atropos.sandbox.contract.protocol import CallResult, LeaseInfo, LeaseRequest, ToolCall
from atropos.sandbox.host.config import HostConfig, Limits
from atropos.sandbox.host.isolation.sandbox_process import SandboxDied, SandboxProcess
from atropos.sandbox.host.sandbox_host import SandboxHost


@pytest.fixture
async def inproc() -> AsyncIterator[SandboxHost]:
    # not under pytest's tmp_path: slot uids must traverse to their workspace (see conftest)
    data = Path(f"/tmp/atropos-test-cancel-{os.getpid()}-{secrets.token_hex(3)}")
    host = SandboxHost(HostConfig(token=secrets.token_urlsafe(8), data_dir=data, slots=1,
                                  limits=Limits(workspace_bytes=64 << 20)))
    await host.start()
    try:
        yield host
    finally:
        await host.stop()
        shutil.rmtree(data, ignore_errors=True)


def _call(lease: LeaseInfo, tool: str, **args: Any) -> ToolCall:
    return ToolCall(id=secrets.token_hex(4), slot=lease.slot, lease=lease.lease, tool=tool, args=args)


def _unique_sleep() -> str:
    """A sleep whose argument names it among every process of the machine."""
    return f"1.5{secrets.randbelow(10**6):06d}"


def _processes_with_arg(arg: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if arg.encode() in Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0"):
                    found.append(int(name))
            except OSError:
                continue
    return found


async def _wait_for_file(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared: the call did not start"
        await asyncio.sleep(0.02)


async def _assert_gone(ws: Path, late: str, sleep_arg: str, not_before: float) -> None:
    """By the time the cancelled call would have finished, nothing of it ran on."""
    await asyncio.sleep(max(0.0, not_before - time.monotonic()))
    assert not (ws / late).exists(), "the cancelled call kept running and finished its work"
    assert _processes_with_arg(sleep_arg) == [], "processes of the cancelled call are still running"


async def test_cancelled_bash_call_does_not_answer_the_next_one(inproc: SandboxHost) -> None:
    lease = await inproc.lease(LeaseRequest(trajectory_id="cancel-bash"))
    ws = slot_path(inproc.cfg.data_dir, lease.slot)
    assert (await inproc.run_call(_call(lease, "bash", command="true"))).ok  # sandbox warm
    arg = _unique_sleep()
    t0 = time.monotonic()
    task = asyncio.create_task(inproc.run_call(
        _call(lease, "bash", command=f"touch started; sleep {arg}; echo A; touch late")))
    await _wait_for_file(ws / "started")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    result = await inproc.run_call(_call(lease, "bash", command="echo B"))
    assert result.ok, result.error
    assert result.result is not None and result.result["stdout"] == "B\n"  # its own output, not 'A\n'
    # and the slot stays in step afterwards
    for word in ("C", "D"):
        later = await inproc.run_call(_call(lease, "bash", command=f"echo {word}"))
        assert later.result is not None and later.result["stdout"] == f"{word}\n"
    await _assert_gone(ws, "late", arg, t0 + 2.5)


async def test_cancelled_python_session_call_does_not_answer_the_next_one(inproc: SandboxHost) -> None:
    lease = await inproc.lease(LeaseRequest(trajectory_id="cancel-session"))
    ws = slot_path(inproc.cfg.data_dir, lease.slot)
    first = await inproc.run_call(_call(lease, "python_session", code="x = 41"))
    assert first.ok and first.result is not None and first.result["session_started"]
    arg = _unique_sleep()
    code = ("import subprocess\nopen('started', 'w').close()\n"
            f"subprocess.run(['sleep', '{arg}'])\nprint('A')\nopen('late', 'w').close()\n")
    t0 = time.monotonic()
    task = asyncio.create_task(inproc.run_call(_call(lease, "python_session", code=code)))
    await _wait_for_file(ws / "started")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    result = await inproc.run_call(_call(lease, "python_session", code="print('B')"))
    assert result.ok, result.error
    assert result.result is not None
    assert result.result["stdout"] == "B\n"
    # the interrupted session could not be kept: the result says the session is a new one
    assert result.result["session_started"] is True
    again = await inproc.run_call(_call(lease, "python_session", code="y = 2\nprint(y * 21)"))
    assert again.result is not None and again.result["stdout"] == "42\n"
    await _assert_gone(ws, "late", arg, t0 + 2.5)


async def test_reply_out_of_step_with_its_request_kills_the_sandbox(tmp_path: Path) -> None:
    """The sequence check behind the fix: a reply that does not carry its request's number is
    never taken as its answer (a plain process standing in for the supervisor)."""
    script = tmp_path / "liar.py"
    script.write_text(
        "import json, os, struct, sys\n"
        "F = struct.Struct('>I')\n"
        "rfd, wfd = int(sys.argv[-3]), int(sys.argv[-2])  # the channel, as the host passes it\n"
        "def send(obj):\n"
        "    data = json.dumps(obj).encode(); os.write(wfd, F.pack(len(data)) + data)\n"
        "send({'ok': True, 'result': {'ready': True}})\n"
        "req_in = os.fdopen(rfd, 'rb')\n"
        "while True:\n"
        "    head = req_in.read(4)\n"
        "    if len(head) < 4: break\n"
        "    req = json.loads(req_in.read(F.unpack(head)[0]))\n"
        "    send({'ok': True, 'result': {'answer': 'stale'}, 'seq': req['seq'] - 1})\n"
    )
    proc = await SandboxProcess.start([sys.executable, str(script)], uid=None, seccomp_path=None,
                                      label="liar", echoes_seq=True)
    with pytest.raises(SandboxDied, match="out of step"):
        await proc.request({"op": "ping"}, 5)
    assert not proc.alive


# -- over HTTP: a client that disconnects from a streamed batch -----------------------------------


async def test_client_disconnect_mid_stream_cancels_the_call_cleanly(host: RunningHost) -> None:
    headers = {"Authorization": f"Bearer {host.token}"}
    async with httpx.AsyncClient(base_url=host.address, headers=headers, timeout=60) as raw:
        resp = await raw.post("/v1/leases", json={"trajectory_id": "disconnect"})
        assert resp.status_code == 200, resp.text
        lease = resp.json()
        try:
            ws = slot_path(host.data_dir, lease["slot"])

            def body(command: str) -> dict[str, Any]:
                return {"id": secrets.token_hex(4), "slot": lease["slot"], "lease": lease["lease"],
                        "tool": "bash", "args": {"command": command}}

            assert (await raw.post("/v1/call", json=body("true"))).json()["ok"]  # sandbox warm
            arg = _unique_sleep()
            t0 = time.monotonic()
            # its own connection, dropped mid-stream: the host sees the client go away
            async with httpx.AsyncClient(base_url=host.address, headers=headers, timeout=60) as doomed:
                calls = {"calls": [body(f"touch started; sleep {arg}; echo A; touch late")]}
                async with doomed.stream("POST", "/v1/calls", json=calls) as stream:
                    assert stream.status_code == 200
                    await _wait_for_file(ws / "started")
                # leaving the block unread closes the connection

            resp = await raw.post("/v1/call", json=body("echo B"))
            result = CallResult.model_validate(resp.json())
            assert result.ok, result.error
            assert result.result is not None and result.result["stdout"] == "B\n"
            lines = []
            async with raw.stream("POST", "/v1/calls", json={"calls": [body("echo C"), body("echo D")]}) as stream:
                async for line in stream.aiter_lines():
                    if line.strip():
                        lines.append(CallResult.model_validate_json(line))
            assert [r.result["stdout"] for r in lines if r.result is not None] == ["C\n", "D\n"]
            await _assert_gone(ws, "late", arg, t0 + 2.5)
        finally:
            await raw.post(f"/v1/slots/{lease['slot']}/release", json={"lease": lease["lease"]})
