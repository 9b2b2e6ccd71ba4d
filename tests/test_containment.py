"""Containment: what a slot can do to the memory filesystems it writes, to the tools that walk its
tree (archive, template snapshot, trash, pool shutdown) and to the tools' arguments.

One test per row of the containment catalogue (docs/containment.md), each attacking a real sandbox
host (real bubblewrap, real HTTP) through the public API and asserting the safe outcome. The slot
tests take the ``slot``/``host`` fixtures of tests/conftest.py, with ``host`` overridden here to run
on a local host and on a Docker container host (tests/docker_host.py); the tests that need a host
of their own (other flags, a pool's data dir) start it here.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import secrets
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import HOST_WORKSPACE_BYTES, LeasedSlot, RunningHost, start_host, stop_host, wait_until

from atropos.backends import docker_cgroups
from atropos.sandbox.contract.hostdirs import remove_tree
from atropos.sandbox.contract.protocol import VerifyRequest
from atropos.sandbox.host.config import RUN_DIR_INODES, Limits
from atropos.sandbox.host.workspace.trees import copy_tree, walk_tree
from atropos.slots.config import PoolConfig
from atropos.slots.pool import SlotPool
from tests.docker_host import host_of_kind
from tests.pool_backends import BACKENDS, make_backend

LIMITS = Limits()
DEPTH = 10_000  # far past PATH_MAX (4096) and Python's recursion limit (1000)


@pytest.fixture(scope="module", params=BACKENDS)
def host(request: pytest.FixtureRequest, host: RunningHost) -> Iterator[RunningHost]:
    """Every slot row runs against the session's local host and a Docker container host (the same
    slot count and workspace cap, per-slot cgroups delegated by the Docker backend)."""
    yield from host_of_kind(request.param, host, slot_workspace_bytes=HOST_WORKSPACE_BYTES)


async def alive_and_same_sandbox(slot: LeasedSlot, before: str) -> None:
    """The slot still answers, from the sandbox it had (its supervisor never died and was restarted)."""
    assert await sandbox_id(slot) == before, "the slot's sandbox was restarted"


async def sandbox_id(slot: LeasedSlot) -> str:
    """When the slot's sandbox started (its PID 1's start time, in ticks since boot): a restarted
    sandbox is a new PID namespace whose PID 1 started later."""
    out = await slot.sh("awk '{print $22}' /proc/1/stat")
    assert out["stdout"].strip().isdigit(), out
    return str(out["stdout"].strip())


def members(blob: bytes) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        return tar.getmembers()


def assert_safe_names(infos: list[tarfile.TarInfo]) -> None:
    for m in infos:
        parts = m.name.split("/")
        assert not m.name.startswith("/") and ".." not in parts and "." not in parts and "" not in parts, \
            f"unsafe member name {m.name[:200]!r}"
        if m.islnk():  # a hard link names another member: the same rules
            assert not m.linkname.startswith("/") and ".." not in m.linkname.split("/"), m.linkname


MAKE_DEEP = f"""
import os
os.mkdir('deep')
fd = os.open('deep', os.O_RDONLY)
for i in range({DEPTH}):
    os.mkdir('d', dir_fd=fd)
    if i % 2500 == 0:
        with open(os.open(f'f{{i}}', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), 'w') as fh:
            fh.write(f'level {{i}}')
        os.symlink('/etc', f'link{{i}}', dir_fd=fd)
    nxt = os.open('d', os.O_RDONLY, dir_fd=fd)
    os.close(fd)
    fd = nxt
print('built')
"""


# =====================================================================================================
# Row 1: millions of empty files in /tmp, /dev/shm (and the workspace, the run dir): inode caps
# =====================================================================================================
# fill(d): empty files in d until a write fails; [how many, the errno's name]
FILL_FN = r"""
import errno, os

def fill(d):
    n, err = 0, None
    try:
        while n < 2_000_000:
            os.close(os.open(f'{d}/f{n}', os.O_WRONLY | os.O_CREAT, 0o600))
            n += 1
    except OSError as exc:
        err = errno.errorcode.get(exc.errno, exc.errno)
    return [n, err]
"""
FILL = FILL_FN + "\nimport sys\nprint(*fill(sys.argv[1]))\n"


@pytest.mark.parametrize(("where", "cap"), [
    ("/tmp", LIMITS.tmp_inodes), ("/dev/shm", LIMITS.shm_inodes), ("/run/term", RUN_DIR_INODES),
    ("/workspace/fill", LIMITS.workspace_inodes),
])
async def test_c01_empty_files_meet_an_inode_cap(slot: LeasedSlot, where: str, cap: int) -> None:
    await slot.sh(f"mkdir -p {where}")
    out = await slot.ok("python", code=FILL.replace("sys.argv[1]", repr(where)), timeout_s=300)
    await slot.sh(f"find {where} -mindepth 1 -delete", timeout_s=300)
    created, err = out["stdout"].split()
    assert err == "ENOSPC", f"{where}: {created} files created without meeting a cap ({out})"
    # the root directory (and, in the workspace, the fill directory) is an inode too
    assert cap - 8 <= int(created) <= cap, f"{where}: {created} files for a cap of {cap}"
    # the cap is per filesystem and gone with the files: the slot writes again
    assert (await slot.sh(f"touch {where}/again && echo ok"))["stdout"] == "ok\n"


VERIFY_FILL = FILL_FN + r"""

def verify(ws, secrets, args):
    return {"score": 0, "filled": {d: fill(d) for d in args}}
"""


async def test_c01_the_verifiers_scratch_mounts_meet_the_same_inode_caps(slot: LeasedSlot) -> None:
    """Code a checker runs (the verification sandbox) fills /tmp and /dev/shm with empty files: the
    slot's inode caps hold there as in its working sandboxes (each inode is kernel memory)."""
    req = VerifyRequest(lease=slot.lease.lease, program=VERIFY_FILL, args=["/tmp", "/dev/shm"], timeout_s=300)
    out = await slot.client.verify(slot.lease.slot, req)
    assert out.ok and out.verdict is not None, out
    for where, cap in (("/tmp", LIMITS.tmp_inodes), ("/dev/shm", LIMITS.shm_inodes)):
        created, err = out.verdict["filled"][where]
        assert err == "ENOSPC", f"verifier {where}: {created} files created without meeting a cap"
        assert cap - 8 <= created <= cap, f"verifier {where}: {created} files for a cap of {cap}"


# =====================================================================================================
# Row 2: a unix socket (and a FIFO) in the workspace, then archive
# =====================================================================================================
async def test_c02_socket_and_fifo_in_workspace_archive_skips_and_reports_them(slot: LeasedSlot) -> None:
    before = await sandbox_id(slot)
    await slot.ok("python", code="import os, socket\nos.mkdir('a')\nopen('a/keep.txt', 'w').write('kept')\n"
                                 "socket.socket(socket.AF_UNIX).bind('a/sock')\nos.mkfifo('a/fifo')")
    out = await slot.ok("archive", path="a")
    infos = members(base64.b64decode(out["content"]))
    assert [m.name for m in infos] == ["keep.txt"]
    assert sorted((s["path"], s["reason"]) for s in out["skipped"]) == [("fifo", "fifo"), ("sock", "socket")]
    await alive_and_same_sandbox(slot, before)


# =====================================================================================================
# Row 3: a 10,000-deep tree: archive, snapshot, trash, pool shutdown, uncapped trash
# =====================================================================================================
@pytest.mark.timeout(900)  # 10,000 directories made, copied and removed on a shared, loaded disk
async def test_c03_deep_tree_archive_and_snapshot(slot: LeasedSlot, host: RunningHost) -> None:
    before = await sandbox_id(slot)
    assert (await slot.ok("python", code=MAKE_DEEP, timeout_s=300))["stdout"] == "built\n"
    out = await asyncio.wait_for(slot.call("archive", path="deep"), 300)
    if not out.ok:  # a clean refusal is the only other acceptable outcome
        assert out.error is not None and out.error.code == "too_large", out.error
    else:
        assert out.result is not None
        infos = members(base64.b64decode(out.result["content"]))
        assert_safe_names(infos)
        dirs = [m for m in infos if m.isdir()]
        links = [m for m in infos if m.issym()]
        assert len(dirs) == DEPTH and len(links) == DEPTH // 2500 and all(m.linkname == "/etc" for m in links)
        deepest = max(infos, key=lambda m: m.name.count("/"))
        assert deepest.name.count("/") == DEPTH - 1
    await alive_and_same_sandbox(slot, before)

    # snapshot: a template of the slot's tree, the slot continues as a fork of it
    info = await asyncio.wait_for(slot.client.template_from_slot(slot.lease.slot, slot.lease.lease), 600)
    assert info.dirs == DEPTH + 1 and info.files == DEPTH // 2500 and info.others == DEPTH // 2500
    walk = await slot.ok("python", timeout_s=300, code="import os\nfd = os.open('deep', os.O_RDONLY)\nn = 0\n"
                         "while True:\n    try:\n        nxt = os.open('d', os.O_RDONLY, dir_fd=fd)\n"
                         "    except FileNotFoundError:\n        break\n    os.close(fd)\n    fd = nxt\n    n += 1\n"
                         "print(n)")
    assert walk["stdout"] == f"{DEPTH}\n"
    # the template is deleted once nothing uses it: its tree goes to the trash, which empties
    reset = await slot.client.reset(slot.lease.slot, slot.lease.lease)
    slot.lease = reset.lease
    await slot.client.delete_template(info.id)
    trash = host.data_dir / "trash"  # a container's, through /proc/<pid>/root
    assert trash.is_dir(), f"premise: the host's trash is visible from here ({trash})"
    assert await wait_until(lambda: not any(trash.iterdir()), 300, 0.1, in_thread=True), \
        f"trash not emptied: {list(trash.iterdir())}"


@pytest.mark.parametrize("into_empty", [False, True])
async def test_c03_copy_of_a_deep_tree_is_exact(into_empty: bool) -> None:
    """What template snapshots and copy-mode forks do with a slot's tree: cp -a gives up past
    PATH_MAX, the descriptor-relative copy takes over; the manifest hashes match."""
    # on a tmpfs: a journalled disk spends most of this test on mkdir and rmdir
    tmp_path = Path(f"/dev/shm/atropos-contain-{os.getpid()}-{secrets.token_hex(3)}")
    tmp_path.mkdir()
    src = tmp_path / "src"
    src.mkdir()
    fd = os.open(src, os.O_RDONLY)
    for i in range(DEPTH // 2):
        os.mkdir("d", 0o750 if i % 7 else 0o700, dir_fd=fd)
        if i % 1000 == 0:
            os.symlink("../../..", f"up{i}", dir_fd=fd)
            os.mkfifo(f"fifo{i}", dir_fd=fd)
            with open(os.open(f"f{i}", os.O_WRONLY | os.O_CREAT, 0o640, dir_fd=fd), "w") as fh:
                fh.write(str(i) * i)
        nxt = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(fd)
    dst = tmp_path / "dst"
    if into_empty:
        dst.mkdir()
    await copy_tree(src, dst, into_empty=into_empty, timeout=600)
    a, b = await asyncio.gather(asyncio.to_thread(walk_tree, src), asyncio.to_thread(walk_tree, dst))
    assert a.dirs == DEPTH // 2 and a.others == 2 * (DEPTH // 2 // 1000)
    assert a == b
    for tree in (src, dst):
        await asyncio.to_thread(remove_tree, tree)
    assert os.listdir(tmp_path) == []
    tmp_path.rmdir()


@pytest.fixture(scope="module", params=BACKENDS)
def uncapped_host(request: pytest.FixtureRequest) -> Any:
    if request.param == "docker":
        pytest.skip("does not apply to a Docker host: its slots always have a capped tmpfs workspace "
                    "(DockerBackendConfig.slot_workspace_bytes >= 1 MiB), never one on the data dir's disk")
    data = Path(f"/tmp/atropos-contain-{os.getpid()}-{secrets.token_hex(3)}")
    running = start_host(data, slots=1, extra=["--workspace-bytes", "0", "--no-prewarm"])
    yield running
    stop_host(running)


@pytest.mark.timeout(900)  # 10,000 directories made, copied and removed on a shared, loaded disk
async def test_c03_uncapped_host_empties_its_trash_of_a_deep_tree(uncapped_host: RunningHost) -> None:
    async with uncapped_host.client() as client:
        lease = await client.lease("deep-uncapped")
        slot = LeasedSlot(client, lease)
        assert (await slot.ok("python", code=MAKE_DEEP, timeout_s=300))["stdout"] == "built\n"
        ws = uncapped_host.data_dir / "slots" / str(lease.slot) / "ws"
        assert (ws / "deep" / "d").is_dir(), "premise: an uncapped workspace lives on the data dir's disk"
        await client.release(lease.slot, lease.lease)
    trash = uncapped_host.data_dir / "trash"
    assert await wait_until(lambda: not any(trash.iterdir()), 300, 0.1, in_thread=True), \
        f"trash not emptied: {list(trash.iterdir())}"


@pytest.mark.timeout(900)  # 10,000 directories made, copied and removed on a shared, loaded disk
@pytest.mark.parametrize("kind", BACKENDS)
async def test_c03_pool_shutdown_removes_a_data_dir_holding_a_deep_tree(kind: str) -> None:
    """Local: the host's data dir (the tree on its disk) goes. Docker: the container (its data dir is
    the container's tmpfs) and its slot cgroup subtree on this machine go."""
    backend = make_backend(kind, slots=1)
    if kind == "local":
        backend.cfg.slot_workspace_bytes = 0  # type: ignore[attr-defined]  # the tree on the data dir's disk
    async with SlotPool(backend, PoolConfig(min_hosts=1, max_hosts=1)) as pool:
        async with pool.leased("deep-shutdown") as lease:
            assert (await lease.ok("python", {"code": MAKE_DEEP}, timeout_s=300))["stdout"] == "built\n"
            host_id = lease.host.id
            if kind == "local":
                data_dirs = list(backend._dirs.values())  # type: ignore[attr-defined]
                assert len(data_dirs) == 1 and data_dirs[0].is_dir()
                deep = list(data_dirs[0].glob("slots/*/ws/deep"))
                assert deep, "premise: the deep tree is on the data dir's disk"
            else:
                assert host_id in await backend.list_hosts()
                assert docker_cgroups.existing(host_id) is not None, "premise: the container's slot cgroups"
    if kind == "local":
        assert not data_dirs[0].exists(), f"pool shutdown left {data_dirs[0]}"
    else:
        assert host_id not in await backend.list_hosts(), f"pool shutdown left container {host_id}"
        assert docker_cgroups.existing(host_id) is None, f"pool shutdown left the cgroups of {host_id}"


async def test_a_process_beside_a_local_pool_cannot_find_the_host_token() -> None:
    """A process of the pool's user (not its child) scans every /proc/*/environ, /proc/*/cmdline and
    the pool's files for the host token and calls the host API with what it found: refused."""
    import json
    import subprocess
    import sys

    backend = make_backend("local", slots=1)
    async with SlotPool(backend, PoolConfig(min_hosts=1, max_hosts=1)) as pool:
        host = next(iter(pool.hosts.values()))
        root = backend.root  # type: ignore[attr-defined]
        thief = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "tests.token_theft", host.info.address, str(root)],
            capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent, env={})
        report = json.loads(thief.stdout)
        assert report["read"]["environ"] > 0 and report["read"]["files"] > 0, report["read"]
        assert report["accepted"] == [] and host.info.token not in report["candidates"], report["accepted"]
        async with pool.leased("still-serves") as lease:
            assert (await lease.bash("echo ok"))["stdout"] == "ok\n"


# =====================================================================================================
# Row 4: symlinks swapped and files shrinking during archive
# =====================================================================================================
RACER = r"""
import os, threading
os.makedirs('race/d/sub', exist_ok=True)
open('race/d/sub/inner.txt', 'w').write('inner')
def swap():
    while True:
        try:
            os.rename('race/d', 'race/real')
            os.symlink('/', 'race/d')
            os.rename('race/d', 'race/gone')
            os.unlink('race/gone')
            os.rename('race/real', 'race/d')
        except OSError:
            pass
def shrink():
    while True:
        with open('race/shrinking', 'wb') as fh:
            fh.write(b'x' * (1 << 20))
        with open('race/shrinking', 'wb'):
            pass
for f in (swap, shrink):
    threading.Thread(target=f, daemon=True).start()
"""


async def test_c04_archive_during_symlink_swaps_and_shrinking_files(slot: LeasedSlot) -> None:
    await slot.ok("python_session", code=RACER)  # keeps running between calls, in its own sandbox
    try:
        outcomes: dict[str, int] = {}
        for _ in range(20):
            r = await asyncio.wait_for(slot.call("archive", path="race"), 120)
            if not r.ok:
                assert r.error is not None and r.error.code == "changed_during_archive", r.error
                outcomes["changed"] = outcomes.get("changed", 0) + 1
                continue
            assert r.result is not None
            infos = members(base64.b64decode(r.result["content"]))
            assert_safe_names(infos)
            names = {m.name for m in infos}
            # nothing from the sandbox root: a followed link would bring usr/, etc/, proc/
            assert names <= {"d", "d/sub", "d/sub/inner.txt", "real", "real/sub", "real/sub/inner.txt", "gone",
                             "shrinking"}, sorted(names)[:20]
            for m in infos:
                assert not m.isreg() or m.name == "shrinking" or m.size == len("inner"), m.name
                if m.name in ("d", "gone") and m.issym():
                    assert m.linkname == "/"
            outcomes["ok"] = outcomes.get("ok", 0) + 1
            if names & {"real", "gone"} or any(m.issym() for m in infos) or r.result["skipped"]:
                outcomes["raced"] = outcomes.get("raced", 0) + 1
        assert outcomes.get("ok", 0) + outcomes.get("changed", 0) == 20
        # premise: the walks really met the racer (a swap in progress, a change, a skipped entry)
        assert outcomes.get("raced", 0) + outcomes.get("changed", 0) > 0, outcomes
        print(f"archive outcomes under the racer: {outcomes}")
    finally:
        await slot.ok("python_session", code="", restart=True)


# =====================================================================================================
# Row 5: read_file at offset 10**20 (and other out-of-range numbers)
# =====================================================================================================
@pytest.mark.parametrize("args", [
    {"offset": 10**20}, {"offset": (1 << 63) - 1}, {"offset": 1 << 63}, {"limit": 10**20},
    {"offset": 10**20, "limit": 10**20}, {"offset": 5, "limit": 1},
])
async def test_c05_read_file_offsets_are_tool_errors(slot: LeasedSlot, args: dict[str, int]) -> None:
    before = await sandbox_id(slot)
    await slot.ok("write_file", path="small.txt", content="0123456789")
    r = await asyncio.wait_for(slot.call("read_file", path="small.txt", **args), 60)
    if r.ok:
        assert r.result is not None
        assert r.result["content"] == "0123456789"[args.get("offset", 0):][:args.get("limit") or None]
    else:
        assert r.error is not None and r.error.status < 500, r.error
        assert r.error.code in ("invalid_arguments", "too_large"), r.error
    await alive_and_same_sandbox(slot, before)


# =====================================================================================================
# Row 6: the terminal's socket and log replaced from inside the slot
# =====================================================================================================
@pytest.mark.parametrize("plant", [
    "mkdir -p /run/term/tmux.sock/x", "mkfifo /run/term/tmux.sock", "ln -s /etc /run/term/tmux.sock",
])
async def test_c06_odd_file_at_terminal_socket_before_first_use(slot: LeasedSlot, plant: str) -> None:
    await slot.sh(plant)
    r = await asyncio.wait_for(slot.call("terminal", input="echo hello-$((6*7))", wait_ms=5000), 60)
    assert r.ok, r.error
    assert r.result is not None and "hello-42" in r.result["output"]


async def test_c06_terminal_socket_replaced_while_running(slot: LeasedSlot) -> None:
    first = await slot.ok("terminal", input="echo one-$((1+1))", wait_ms=5000)
    assert "one-2" in first["output"]
    # from the session sandbox (an exec call's processes die with the call; this one is gone as well)
    await slot.ok("python_session", code="import os\nos.unlink('/run/term/tmux.sock')\nos.mkdir('/run/term/tmux.sock')")
    r = await asyncio.wait_for(slot.call("terminal", input="echo two-$((1+2))", wait_ms=5000), 60)
    assert r.ok, r.error
    assert r.result is not None and "two-3" in r.result["output"]


async def test_c06_fifo_in_place_of_the_terminal_log_does_not_hang(slot: LeasedSlot) -> None:
    await slot.ok("terminal", input="true", wait_ms=2000)
    await slot.sh("rm -f /run/term/terminal.log && mkfifo /run/term/terminal.log")
    r = await asyncio.wait_for(slot.call("terminal", input="echo after", wait_ms=2000), 60)
    assert r.ok or (r.error is not None and r.error.status < 500), r.error
    assert (await slot.sh("echo still"))["stdout"] == "still\n"
