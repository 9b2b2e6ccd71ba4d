"""`atropos-sandbox serve`'s own secrets: the ToolServer token comes from a private file (--token-file),
and the serve process is non-dumpable, so another process of the same user can read neither its
environment (where $ATROPOS_TOOLSERVER_TOKEN may still arrive) nor its memory (every host token).

The attack needs a user without CAP_SYS_PTRACE (root with it reads any process): serve, the thief and
a control process all run as root with every capability dropped (setpriv), which is a same-user
neighbour exactly. serve runs with no host (--min-hosts 0): the secrets at stake here are its own."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port, start_host, stop_host, wait_for_http

REPO = Path(__file__).resolve().parents[1]
TOKEN = "serve-secret-" + "x" * 30


NO_CAPS = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--"]


def _serve(tmp_path: Path, extra: list[str], env: dict[str, str],
           prefix: list[str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ATROPOS_SANDBOX_", "ATROPOS_TOOLSERVER_"))}
    proc = subprocess.Popen(
        [*(prefix or []), sys.executable, "-m", "atropos.cli", "serve", "--port", str(port), "--min-hosts", "0",
         *extra],
        env={**base, "XDG_CACHE_HOME": str(tmp_path / "cache"), "HOME": str(tmp_path), **env}, cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(url + "/healthz", proc, timeout=120)
    except AssertionError:
        proc.kill()
        raise AssertionError(proc.communicate()[1].decode()[-3000:]) from None
    return proc, url


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_serve_reads_its_token_from_a_private_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    proc, url = _serve(tmp_path, ["--token-file", str(token_file)], {})
    try:
        assert httpx.get(url + "/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        assert httpx.get(url + "/v1/status").status_code == 401
        assert token_file.read_text().strip() == TOKEN  # kept: `pool up`'s clients read it too
    finally:
        _stop(proc)
    token_file.chmod(0o644)
    refused = subprocess.run([sys.executable, "-m", "atropos.cli", "serve", "--token-file", str(token_file)],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert refused.returncode == 2 and "chmod 600" in refused.stderr, refused.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv(1) to run serve and the thief as a capability-less same user")
def test_a_same_user_process_cannot_read_serves_environment_or_memory(tmp_path: Path) -> None:
    env = {"ATROPOS_TOOLSERVER_TOKEN": TOKEN}
    proc, _url = _serve(tmp_path, [], env, prefix=NO_CAPS)
    # the control: a dumpable process of the same user with the same environment
    control = subprocess.Popen([*NO_CAPS, "sleep", "60"], env={**os.environ, **env})
    try:
        time.sleep(0.5)
        thief = ("import sys\n"
                 "for pid in sys.argv[1:]:\n"
                 "    for what in ('environ', 'mem'):\n"
                 "        try:\n"
                 "            data = open(f'/proc/{pid}/' + what, 'rb').read(1 << 16) if what == 'environ' else "
                 "open(f'/proc/{pid}/mem', 'rb').read(1)\n"
                 "            print(pid, what, 'READ', b'" + TOKEN + "' in data)\n"
                 "        except OSError as e:\n"
                 "            print(pid, what, 'DENIED', e.errno)\n")
        r = subprocess.run([*NO_CAPS, sys.executable, "-c", thief, str(proc.pid), str(control.pid)],
                           capture_output=True, text=True, timeout=60)
        lines = r.stdout.splitlines()
        assert f"{control.pid} environ READ True" in lines, r.stdout + r.stderr  # the attack works...
        assert f"{proc.pid} environ DENIED 13" in lines, r.stdout + r.stderr  # ...not against serve
        assert f"{proc.pid} mem DENIED 13" in lines, r.stdout + r.stderr
    finally:
        control.kill()
        _stop(proc)


async def test_a_host_start_cancelled_before_it_is_known_leaves_no_process(tmp_path: Path) -> None:
    """A pool stopping while a host starts cancels the start while it waits for the host's first line:
    the process, which no backend holds yet, is killed rather than left running (an orphan)."""
    import asyncio

    from atropos.sandbox.contract.launch import HostLaunch, start_host_process

    pid_file = tmp_path / "pid"
    fake = tmp_path / "fake-python"
    fake.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 600\n")  # says nothing, ever
    fake.chmod(0o755)
    launch = HostLaunch(slots=1, data_dir=str(tmp_path / "data"))
    with open(tmp_path / "log", "wb") as log:
        start = asyncio.create_task(start_host_process(launch, "t0ken", log, python=str(fake)))
        for _ in range(600):
            if pid_file.exists() and pid_file.read_text().strip():
                break
            await asyncio.sleep(0.05)
        pid = int(pid_file.read_text())
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
    for _ in range(600):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            break  # gone (reaped)
        if state == "Z":
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError(f"the host process {pid} of a cancelled start still runs")


async def test_the_host_token_waits_until_the_host_is_non_dumpable(tmp_path: Path) -> None:
    """The pidfd_getfd route: a host's stdin pipe holds its token only after the host said it is
    non-dumpable. A 'host' that never says so (here a script that just drains its stdin) gets nothing,
    and the real host says so as its very first line (then the ready line follows as before)."""
    from atropos.sandbox.contract.launch import UNDUMPABLE_LINE, HostLaunch, start_host_process

    got = tmp_path / "stdin-received"
    fake = tmp_path / "fake-python"
    fake.write_text(f"#!/bin/sh\ncat > {got}\n")
    fake.chmod(0o755)
    launch = HostLaunch(slots=1, data_dir=str(tmp_path / "data"))
    with open(tmp_path / "log", "wb") as log:
        proc = await start_host_process(launch, "the-host-token", log, python=str(fake), undumpable_timeout_s=2)
    await proc.wait()
    assert got.read_bytes() == b""  # the pipe was closed with no token on it

    first = subprocess.run([sys.executable, "-c", "import sys; from atropos.sandbox.host.main import main; "
                            "main(['--token-stdin', '--port', '0', '--slots', '1', '--data-dir', sys.argv[1]])",
                            str(tmp_path / "real")], input=b"", capture_output=True, timeout=120)
    assert first.stdout.decode().startswith(UNDUMPABLE_LINE), (first.stdout, first.stderr[-2000:])


POOL_SCRIPT = """
import asyncio, sys
from atropos.backends.base import Backend, HostInfo
from atropos.slots.config import PoolConfig
from atropos.slots.pool import SlotPool

class OneHost(Backend):
    # a host the test started (a host needs capabilities this process has not): its token arrives
    # on stdin, as a backend's own would be made here
    def __init__(self, address, token):
        self.address, self.token = address, token
    async def start_host(self):
        return HostInfo(id="one", address=self.address, token=self.token, slots=1)
    async def stop_host(self, host_id):
        pass
    async def alive(self, host_id):
        return True
    async def close(self):
        pass

async def main():
    backend = OneHost(sys.argv[1], sys.stdin.readline().strip())
    async with SlotPool(backend, PoolConfig(min_hosts=1, max_hosts=1)) as pool:
        async with pool.leased("probe") as lease:  # the pool holds and uses the token
            await lease.bash("true")
        print("ready", flush=True)
        await asyncio.sleep(300)

asyncio.run(main())
"""

MEMORY_THIEF = """
import re, sys
pid, token = sys.argv[1], sys.argv[2].encode()
try:
    maps = open(f"/proc/{pid}/maps").read().splitlines()
    mem = open(f"/proc/{pid}/mem", "rb", 0)
except OSError as exc:
    print("DENIED", exc.errno); sys.exit()
hit = False
for line in maps:
    f = line.split()
    if not f[1].startswith("rw"):
        continue
    a, b = (int(x, 16) for x in f[0].split("-"))
    try:
        mem.seek(a); hit = hit or token in mem.read(b - a)
    except (OSError, ValueError, OverflowError):
        pass
print("READ", hit)
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv(1) to run the pool and the thief as a capability-less same user")
@pytest.mark.parametrize("opt_out", [False, True])
def test_a_pool_holding_host_tokens_is_non_dumpable_unless_opted_out(tmp_path: Path, opt_out: bool) -> None:
    """The pool's process (a trainer's, with the Python API) holds every host token: from start()
    on it is non-dumpable, so a same-user process without CAP_SYS_PTRACE cannot read its memory.
    ATROPOS_POOL_DUMPABLE=1 (PoolConfig.dumpable) leaves it dumpable for ptrace/py-spy, and then the
    same thief finds the token: the attack is real."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATROPOS_")}
    if opt_out:
        env["ATROPOS_POOL_DUMPABLE"] = "1"
    # under /tmp as conftest's hosts (pytest's tmp_path is not traversable by the slots' uids)
    host = start_host(Path(f"/tmp/atropos-test-{os.getpid()}-{secrets.token_hex(3)}"), slots=1)
    pool = subprocess.Popen([*NO_CAPS, sys.executable, "-c", POOL_SCRIPT, host.address], cwd=REPO, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert pool.stdin is not None and pool.stdout is not None and pool.stderr is not None
        pool.stdin.write(host.token.encode() + b"\n")
        pool.stdin.close()
        if pool.stdout.readline() != b"ready\n":
            pool.wait(30)
            raise AssertionError(pool.stderr.read().decode()[-3000:])
        r = subprocess.run([*NO_CAPS, sys.executable, "-c", MEMORY_THIEF, str(pool.pid), host.token],
                           capture_output=True, text=True, timeout=120)
        assert r.stdout.split() == (["READ", "True"] if opt_out else ["DENIED", "13"]), r.stdout + r.stderr
    finally:
        pool.terminate()
        try:
            pool.wait(30)
        except subprocess.TimeoutExpired:
            pool.kill()
            pool.wait()
        stop_host(host)


async def test_a_host_holds_only_its_tokens_verifier(tmp_path: Path) -> None:
    """A host a backend starts is given the token's verifier (hosttoken.py): the pool's token is
    accepted, the verifier itself (all the host, or a Ray actor relaying it, ever held) is not."""
    from atropos.backends.local import LocalBackend, LocalBackendConfig
    from atropos.sandbox.contract.hosttoken import VERIFIER_PREFIX, token_verifier

    data = Path(f"/tmp/atropos-test-{os.getpid()}-{secrets.token_hex(3)}")
    backend = LocalBackend(LocalBackendConfig(slots_per_host=1, prewarm=False, pool_id="verifier-check",
                                              data_root=data))
    info = await backend.start_host()
    try:
        verifier = token_verifier(info.token)
        async with httpx.AsyncClient(base_url=info.address) as client:
            for presented, status in ((info.token, 200), (verifier, 401), (verifier[len(VERIFIER_PREFIX):], 401),
                                      (info.token + "x", 401)):
                got = await client.get("/v1/slots", headers={"Authorization": f"Bearer {presented}"})
                assert got.status_code == status, (presented == info.token, got.text)
    finally:
        await backend.stop_host(info.id)
        await backend.close()
        shutil.rmtree(data, ignore_errors=True)
