"""The python_session tool: a persistent interpreter per lease inside the slot's sandbox, through a
real host (real bubblewrap), the pool's Lease, the ToolExecutor and the ToolServer's REST slot API.

Durations are asserted only as upper bounds that show *which* mechanism stopped the code (the
driver's interrupt at the timeout vs the host's kill after the grace period).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from conftest import LeasedSlot, RunningHost

from atropos.api.server import ToolServerSettings, create_tool_server
from atropos.sandbox.host.config import HostConfig
from atropos.slots.pool import SlotPool
from atropos.tools.executor import AgentToolCall, ToolExecutor
from atropos.tools.registry import ToolRegistry
from tests.pool_backends import local_pool

MAX_OUTPUT = 64 * 1024  # HostConfig.max_output_bytes default: kept per stream (head + tail)
GRACE = HostConfig().session_grace_s


async def py(slot: LeasedSlot, code: str, timeout_s: float | None = None, **args: Any) -> dict[str, Any]:
    result = await slot.call("python_session", timeout_s=timeout_s, code=code, **args)
    assert result.ok, result.error
    assert result.result is not None
    return result.result


def error_type(r: dict[str, Any]) -> str | None:
    return None if r["error"] is None else str(r["error"]["type"])


async def test_variables_imports_and_functions_persist(slot: LeasedSlot) -> None:
    first = await py(slot, "import math\nx = 6\ndef f(n):\n    return n * x")
    assert first["error"] is None and first["value"] is None
    assert first["session_started"] is True and first["execution_count"] == 1
    second = await py(slot, "print('x is', x)\nf(7) + math.floor(0.5)")
    assert second["stdout"] == "x is 6\n"
    assert second["value"] == "42"  # the final expression, as a notebook shows it
    assert second["session_started"] is False and second["execution_count"] == 2
    assert (await py(slot, "_ + 1"))["value"] == "43"  # `_` is the last value, like the REPL
    assert (await py(slot, "None"))["value"] is None


async def test_runs_in_the_sandbox_workspace(slot: LeasedSlot) -> None:
    await slot.sh("echo from-bash > made-by-bash.txt")
    r = await py(slot, "import os, getpass\n(os.getcwd(), open('made-by-bash.txt').read(), os.getuid(), "
                       "sorted(os.environ)[:3], os.path.exists('/root'))")
    assert r["value"] == "('/workspace', 'from-bash\\n', 1000, ['HOME', 'LANG', 'PATH'], False)"
    await py(slot, "open('made-by-session.txt', 'w').write('hi')")
    assert (await slot.ok("read_file", path="made-by-session.txt"))["content"] == "hi"
    # modules written into the workspace import as with `python3 -c`
    await slot.ok("write_file", path="helper_mod.py", content="VALUE = 'imported'\n")
    assert (await py(slot, "import helper_mod; helper_mod.VALUE"))["value"] == "'imported'"


async def test_errors_show_a_traceback_and_keep_the_session(slot: LeasedSlot) -> None:
    await py(slot, "kept = 'yes'")
    r = await py(slot, "print('before')\n\ndef g():\n    return 1 / 0\ng()")
    assert r["stdout"] == "before\n"
    assert error_type(r) == "ZeroDivisionError"
    tb = r["error"]["traceback"]
    assert "<cell" in tb and "return 1 / 0" in tb and "session.py" not in tb
    assert error_type(await py(slot, "undefined_name")) == "NameError"
    assert error_type(await py(slot, "def broken(:")) == "SyntaxError"
    assert error_type(await py(slot, "import sys; sys.exit(3)")) == "SystemExit"
    assert (await py(slot, "kept"))["value"] == "'yes'"


async def test_subprocess_output_is_captured_in_order(slot: LeasedSlot) -> None:
    r = await py(slot, "import os, subprocess\nprint('one')\nos.system('echo two; echo err-two >&2')\n"
                       "subprocess.run(['sh', '-c', 'echo three'])\nprint('four')")
    assert r["stdout"] == "one\ntwo\nthree\nfour\n"
    assert r["stderr"] == "err-two\n"
    # input() reads EOF instead of hanging
    assert error_type(await py(slot, "input()")) == "EOFError"


async def test_timeout_interrupts_and_keeps_the_session(slot: LeasedSlot) -> None:
    await py(slot, "before = 123")
    t0 = time.monotonic()
    r = await py(slot, "n = 0\nwhile True:\n    n += 1", timeout_s=1)
    assert time.monotonic() - t0 < 1 + GRACE  # interrupted by the driver, not killed by the host
    assert r["timed_out"] is True and r["restarted"] is False
    assert error_type(r) == "SessionTimeout"
    after = await py(slot, "before, n > 0")
    assert after["value"] == "(123, True)"
    # a blocking sleep and a blocking child process are interrupted too
    for code in ("import time; time.sleep(60)", "import os; os.system('sleep 60')"):
        t0 = time.monotonic()
        r = await py(slot, code, timeout_s=1)
        assert r["timed_out"] is True and r["restarted"] is False, code
        assert time.monotonic() - t0 < 1 + GRACE, code
    assert (await py(slot, "before"))["value"] == "123"
    # `except Exception` does not swallow the interrupt (it is a KeyboardInterrupt)
    r = await py(slot, "try:\n    while True: pass\nexcept Exception:\n    print('swallowed')", timeout_s=1)
    assert r["timed_out"] is True and "swallowed" not in r["stdout"]


@pytest.mark.parametrize("blocker", [
    "signal.signal(signal.SIGALRM, signal.SIG_IGN)",
    "signal.signal(signal.SIGALRM, lambda *a: None)",  # a handler that swallows the interrupt
])
async def test_code_that_ignores_the_interrupt_is_killed_and_restarted(slot: LeasedSlot, blocker: str) -> None:
    await py(slot, "state = 'old'")
    t0 = time.monotonic()
    r = await py(slot, f"import signal\n{blocker}\nwhile True: pass", timeout_s=1)
    assert time.monotonic() - t0 >= 1 + GRACE - 0.1
    assert r["restarted"] is True and r["timed_out"] is True
    assert error_type(r) == "SessionRestarted" and "variables" in r["error"]["message"]
    fresh = await py(slot, "state")
    assert error_type(fresh) == "NameError"
    assert fresh["session_started"] is True and fresh["execution_count"] == 1
    # the restarted session works normally again
    assert (await py(slot, "2 + 2"))["value"] == "4"


async def test_session_that_exits_is_restarted(slot: LeasedSlot) -> None:
    await py(slot, "gone = 1")
    r = await py(slot, "import os; os._exit(0)")
    assert r["restarted"] is True and r["timed_out"] is False
    assert error_type(await py(slot, "gone")) == "NameError"


async def test_explicit_restart(slot: LeasedSlot) -> None:
    await py(slot, "x = 1")
    r = await py(slot, "'x' in dir()", restart=True)
    assert r["value"] == "False" and r["session_started"] is True and r["execution_count"] == 1
    assert (await py(slot, "", restart=True))["error"] is None  # restart alone


async def test_output_caps_like_bash(slot: LeasedSlot) -> None:
    r = await py(slot, "print('A' * 200_000)\nimport os; os.system('head -c 100000 /dev/zero | tr \"\\\\0\" B >&2')")
    assert r["stdout_bytes"] == 200_001 and r["stdout_truncated"] is True
    assert len(r["stdout"].encode()) < MAX_OUTPUT + 200 and "bytes truncated" in r["stdout"]
    assert r["stdout"].startswith("AAAA") and r["stdout"].endswith("AAAA\n")
    assert r["stderr_bytes"] == 100_000 and r["stderr_truncated"] is True
    big = await py(slot, "'x' * 1_000_000")
    assert big["value"] is not None and len(big["value"]) < MAX_OUTPUT + 200


async def test_output_flood_is_stopped_and_the_session_kept(slot: LeasedSlot) -> None:
    await py(slot, "keep = 'me'")
    t0 = time.monotonic()
    r = await py(slot, "import os; os.system('yes')", timeout_s=60)
    assert time.monotonic() - t0 < 60
    assert r["output_limited"] is True and r["restarted"] is False
    assert r["stdout_bytes"] > 256 << 20  # HostConfig.hard_output_bytes default
    assert (await py(slot, "keep"))["value"] == "'me'"


async def test_processes_of_a_call_do_not_outlive_it(slot: LeasedSlot) -> None:
    await py(slot, "import subprocess; p = subprocess.Popen(['sleep', '300'])")
    r = await py(slot, "p.poll()")
    assert r["value"] == "-9"


async def test_two_slots_sessions_are_isolated(slot_pair: tuple[LeasedSlot, LeasedSlot]) -> None:
    a, b = slot_pair
    secret = secrets.token_hex(8)
    await py(a, f"secret = {secret!r}\nopen('secret.txt', 'w').write(secret)")
    assert error_type(await py(b, "secret")) == "NameError"
    probe = await py(b, "import glob, os\n[p for p in glob.glob('/proc/*/cmdline')] and "
                        "any(os.path.exists(p) for p in glob.glob('/proc/*/root/workspace/secret.txt'))")
    assert probe["value"] == "False"
    # Every file of /proc, /tmp and /run the slot can read holds neither A's secret nor anything of A,
    # but for the files of /proc that are not data: reading a page map or a memory file means walking
    # the whole address space (the grep would run past its timeout and check nothing), and the
    # kernel's image and log. The patterns are bracketed so that the grep's own command line (a
    # /proc file too) does not match them; the canary, which B itself writes to its /tmp, shows the
    # search reads what it should and finds what is there.
    canary = secrets.token_hex(8)
    skip = [f"--exclude={name}" for name in ("pagemap", "mem", "kcore", "kmsg", "clear_refs")]
    pattern = f"[{secret[0]}]{secret[1:]}|[{canary[0]}]{canary[1:]}"
    r = await py(b, f"import subprocess\nopen('/tmp/canary', 'w').write({canary!r})\n"
                    f"p = subprocess.run(['grep', '-rlsE', *{skip!r}, {pattern!r}, '/proc', '/tmp', '/run'], "
                    "capture_output=True, timeout=120)\nsorted(set(p.stdout.decode().split()))")
    assert r["error"] is None, r["error"]  # the grep finished: it looked everywhere it meant to
    assert r["value"] == "['/tmp/canary']" and secret not in r["stdout"]


async def test_release_and_reset_wipe_the_session(host: RunningHost) -> None:
    async with host.client() as client:
        first = await client.lease("session-a")
        a = LeasedSlot(client, first)
        await py(a, "leaked = 'from the previous trajectory'")
        info = {s.slot: s for s in await client.slots()}[first.slot]
        assert info.session_running is True
        # reset keeping the lease: a fresh session
        reset = await client.reset(first.slot, first.lease, trajectory_id="session-a2")
        assert reset.ok and reset.lease is not None
        a = LeasedSlot(client, reset.lease)
        assert error_type(await py(a, "leaked")) == "NameError"
        await py(a, "leaked = 'again'")
        await client.release(first.slot, reset.lease.lease)
        info = {s.slot: s for s in await client.slots()}[first.slot]
        assert info.session_running is False
        # the next trajectory on the same slot starts from nothing
        second = await client.lease("session-b", slot=first.slot)
        try:
            r = await py(LeasedSlot(client, second), "leaked")
            assert error_type(r) == "NameError" and r["session_started"] is True
        finally:
            await client.release(second.slot, second.lease)


# -- through the pool: Lease, ToolExecutor, REST slot API -----------------------------------------


# One pool for the three tests below (each releases what it leases; a release resets the slot), run
# in the module's event loop, where the pool's tasks live.
in_pool_loop = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool() -> AsyncIterator[SlotPool]:
    async with local_pool(2) as p:
        yield p


@in_pool_loop
async def test_lease_python_session_and_release(pool: SlotPool) -> None:
    async with pool.leased("lease-session") as lease:
        await lease.python_session("total = sum(range(10))")
        assert (await lease.python_session("total"))["value"] == "45"
        assert (await lease.python_session("", restart=True))["session_started"] is True
    async with pool.leased("lease-session-2") as lease:
        assert error_type(await lease.python_session("total")) == "NameError"


@in_pool_loop
async def test_executor_routes_python_session(pool: SlotPool) -> None:
    registry = ToolRegistry.default()
    tool = registry.get("python_session")
    assert tool is not None and tool.kind == "sandbox" and tool.toolset == "python"
    assert set(tool.parameters["properties"]) == {"code", "timeout_s", "restart"}
    executor = ToolExecutor(pool, registry)
    try:
        one = await executor.execute("ex-1", AgentToolCall(id="a", name="python_session",
                                                           arguments={"code": "y = [1, 2]\nprint('set')"}))
        assert one.ok and one.content == "set"
        two = await executor.execute("ex-1", AgentToolCall(id="b", name="python_session",
                                                           arguments={"code": "y + [3]"}))
        assert two.ok and two.content == "Out: [1, 2, 3]"
        bad = await executor.execute("ex-1", AgentToolCall(id="c", name="python_session", arguments={"code": "y[5]"}))
        assert not bad.ok and "IndexError: list index out of range" in bad.content
        slow = await executor.execute("ex-1", AgentToolCall(id="d", name="python_session",
                                                            arguments={"code": "while True: pass", "timeout_s": 1}))
        assert not slow.ok and "SessionTimeout" in slow.content
    finally:
        await executor.release_trajectory("ex-1")
        await executor.close()


@in_pool_loop
async def test_rest_slot_api_python_session(pool: SlotPool) -> None:
    app = create_tool_server(pool, ToolServerSettings(token="t0k3n"))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://toolserver",
                                 headers={"Authorization": "Bearer t0k3n"}, timeout=60) as http:
        names = {t["function"]["name"] for t in (await http.get("/v1/tools")).json()["tools"]}
        assert "python_session" in names
        lid = (await http.post("/v1/slots", json={"trajectory_id": "rest-session"})).json()["lease_id"]
        try:
            r1 = (await http.post(f"/v1/slots/{lid}/call",
                                  json={"tool": "python_session", "args": {"code": "z = 'rest'\nprint(z)"}})).json()
            assert r1["ok"] and r1["content"] == "rest"
            r2 = (await http.post(f"/v1/slots/{lid}/call",
                                  json={"tool": "python_session", "args": {"code": "z.upper()"}})).json()
            assert r2["ok"] and r2["content"] == "Out: 'REST'" and r2["result"]["value"] == "'REST'"
            bad = await http.post(f"/v1/slots/{lid}/call", json={"tool": "python_session", "args": {"cod": "1"}})
            assert bad.status_code == 200 and bad.json()["error"]["code"] == "invalid_arguments"
        finally:
            assert (await http.delete(f"/v1/slots/{lid}")).json()["released"] is True


def test_model_facing_text() -> None:
    from atropos.sandbox.contract.protocol import CallResult
    from atropos.tools.formatting import format_result

    def text(**r: Any) -> tuple[bool, str]:
        base = {"stdout": "", "stderr": "", "value": None, "error": None, "timed_out": False, "restarted": False}
        return format_result("python_session", CallResult(id="x", slot=0, ok=True, result={**base, **r}))

    assert text(stdout="hi\n", value="3") == (True, "hi\nOut: 3")
    assert text() == (True, "(no output)")
    ok, body = text(error={"type": "NameError", "message": "m", "traceback": "Traceback...\nNameError: m\n"})
    assert not ok and body == "Traceback...\nNameError: m"
    ok, body = text(timed_out=True, stdout="caught\n")
    assert not ok and "interrupted; the session is kept" in body
    ok, body = text(restarted=True, timed_out=True, error={"type": "SessionRestarted", "message": "variables lost"})
    assert not ok and body == "[session restarted: variables lost]"
