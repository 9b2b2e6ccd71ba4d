"""Workspace templates and copy-on-write forks, against real hosts (real bubblewrap, real overlayfs).

Three hosts: root with overlay forks (idmapped template layers), root forced into copy mode, and an
unprivileged (uid 1000) host whose overlays live in a user namespace (the Docker backend's case).
Content is compared with a digest computed the same way on the host and inside the slot (types,
permissions, names, symlink targets and file contents), independent of the host's own manifest.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from atropos.errors import LeaseError, TemplateBuildFailed, TemplateInUse, TemplateSourceError, UnknownTemplate
from atropos.sandbox.contract.cgroupfs import V1_CONTROLLERS, mountinfo, own_cgroups, rmdir_tree, v1_dir
from atropos.sandbox.contract.client import HostClient
from atropos.sandbox.contract.protocol import HealthInfo, TemplateInfo
from atropos.sandbox.host.workspace.mountns import read_mountinfo
from atropos.sandbox.host.workspace.trees import walk_tree
from tests.conftest import LeasedSlot, RunningHost, slot_ns_pid, slot_path, start_host, stop_host

DIGEST = ("find . -mindepth 1 -printf '%y %m %P -> %l\\n' | LC_ALL=C sort | sha256sum | cut -c1-16; "
          "find . -type f -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum | sha256sum | cut -c1-16")
SRC_ROOT = Path(f"/tmp/atropos-tpl-src-{os.getpid()}")


def is_idle(health: HealthInfo) -> bool:
    """No workspace mounts beyond each slot's (and the health slot's) capped run dir, /tmp and
    /dev/shm, and capped workspace: every fork's template layer and overlay are gone."""
    if health.mounts is None:  # no mount helper (the count is asked for: health(mounts=True))
        assert health.workspace_mode == "copy", "a host with a mount helper answered no mount count"
        return True
    return health.mounts == (3 + (1 if health.workspace_cap_bytes else 0)) * (health.slots + 1)


def host_digest(path: Path) -> str:
    return subprocess.run(["bash", "-c", DIGEST], cwd=path, capture_output=True, text=True, check=True).stdout


def make_source(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("VALUE = 1\n")
    (root / "pkg" / "sub" / "data.txt").write_text("data\n" * 100)
    (root / "run.sh").write_text("#!/bin/sh\necho run\n")
    os.chmod(root / "run.sh", 0o755)
    (root / "empty").mkdir()
    (root / "ro").mkdir()
    (root / "ro" / "f").write_text("read-only dir\n")
    os.chmod(root / "ro", 0o555)
    os.symlink("pkg/sub/data.txt", root / "link")
    os.symlink("/usr/bin/python3", root / "abs")
    (root / "with space.txt").write_text("s\n")
    (root / "ünïcödé.txt").write_text("u\n")
    (root / "big.bin").write_bytes(os.urandom(1 << 20))
    return root


@pytest.fixture(scope="module")
def source() -> Iterator[Path]:
    SRC_ROOT.mkdir(mode=0o755)
    src = make_source(SRC_ROOT / "tree")
    yield src
    os.chmod(src / "ro", 0o755)
    shutil.rmtree(SRC_ROOT, ignore_errors=True)


def _data_dir(tag: str) -> Path:
    return Path(f"/tmp/atropos-tpl-{tag}-{os.getpid()}-{secrets.token_hex(3)}")


@pytest.fixture(scope="module")
def ov_host(source: Path) -> Iterator[RunningHost]:
    h = start_host(_data_dir("ov"), slots=8, extra=["--template-source-dir", str(SRC_ROOT)])
    yield h
    stop_host(h)
    shutil.rmtree(h.data_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def copy_host(source: Path) -> Iterator[RunningHost]:
    h = start_host(_data_dir("copy"), slots=4, extra=["--template-source-dir", str(SRC_ROOT), "--workspace-mode",
                                                      "copy"])
    yield h
    stop_host(h)
    shutil.rmtree(h.data_dir, ignore_errors=True)


def start_unprivileged_host(data_dir: Path, slots: int, extra: list[str]) -> RunningHost:
    token = secrets.token_urlsafe(16)
    proc = subprocess.Popen(
        ["setpriv", "--reuid", "1000", "--regid", "1000", "--clear-groups", "--", sys.executable, "-m",
         "atropos.sandbox", "--port", "0", "--slots", str(slots), "--data-dir", str(data_dir), "--log-level",
         "WARNING", *extra],
        stdout=subprocess.PIPE, env={**os.environ, "ATROPOS_SANDBOX_TOKEN": token},
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        pytest.skip(f"an unprivileged host cannot start here (exit {proc.returncode})")
    return RunningHost(f"http://127.0.0.1:{json.loads(line)['port']}", token, proc, data_dir)


@pytest.fixture(scope="module")
def userns_host(source: Path) -> Iterator[RunningHost]:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root (to start a host as uid 1000) and setpriv")
    # An unprivileged host needs a cgroup subtree delegated to it for its slots' caps (it refuses
    # to start without one), as a container host gets one from the Docker backend: made here by root.
    cgroup_dir, made = delegated_cgroup_dir(Path(tempfile.mkdtemp(prefix="atropos-cg-")), 1000)
    try:
        h = start_unprivileged_host(_data_dir("userns"), 4, ["--template-source-dir", str(SRC_ROOT),
                                                             "--cgroup-dir", str(cgroup_dir)])
        yield h
        stop_host(h)
        subprocess.run(["rm", "-rf", str(h.data_dir)], check=False)
    finally:
        for d in made:
            rmdir_tree(d)
        shutil.rmtree(cgroup_dir, ignore_errors=True)


def delegated_cgroup_dir(where: Path, uid: int) -> tuple[Path, list[Path]]:
    """A ``--cgroup-dir`` for a host running as ``uid``: on cgroup v1 one directory per controller
    (memory, pids, cpu) owned by ``uid``, linked from ``where``. Returns it and the cgroups made."""
    base = {c: v1_dir(mountinfo(), own_cgroups(), c) for c in V1_CONTROLLERS}
    if not all(base.values()):
        pytest.skip("no cgroup v1 hierarchies to delegate from (this test delegates the v1 way)")
    made = []
    for c, parent in base.items():
        assert parent is not None
        d = parent / f"atropos-test-delegated-{os.getpid()}"
        d.mkdir(exist_ok=True)
        for f in (d, d / "cgroup.procs", d / "tasks"):
            os.chown(f, uid, uid)
        (where / c).symlink_to(d)
        made.append(d)
    os.chmod(where, 0o755)  # under /tmp: uid 1000 must reach it (pytest's own tmp dirs are 0700)
    return where, made


@pytest.fixture
async def client(ov_host: RunningHost) -> AsyncIterator[HostClient]:
    c = ov_host.client()
    yield c
    await c.aclose()


async def digest_in(slot: LeasedSlot, path: str = ".") -> str:
    out = await slot.sh(f"cd {path} && {{ {DIGEST}; }}")
    assert out["exit_code"] == 0, out
    return str(out["stdout"])


async def fork(c: HostClient, template: str, name: str) -> LeasedSlot:
    return LeasedSlot(c, await c.lease(name, template=template))


async def release(*slots: LeasedSlot) -> None:
    for s in slots:
        await s.client.release(s.lease.slot, s.lease.lease)


async def reset_to(s: LeasedSlot, template: str | None) -> tuple[LeasedSlot, Any]:
    result = await s.client.reset(s.lease.slot, s.lease.lease, template=template)
    assert result.ok, result.detail
    assert result.lease is not None
    return LeasedSlot(s.client, result.lease), result




# -- forks ---------------------------------------------------------------------------------------
async def test_forks_are_isolated_and_the_template_never_changes(client: HostClient, source: Path,
                                                                ov_host: RunningHost) -> None:
    expected = host_digest(source)
    health = await client.health()
    assert health.workspace_mode == "overlay", health.workspace_detail
    t = await client.create_template("dir", path=str(source), name="src")
    assert (t.files, t.others) == (7, 2)
    forks = [await fork(client, t.id, f"iso-{i}") for i in range(3)]
    try:
        infos = {s.slot: s for s in await client.slots()}
        for s in forks:
            assert infos[s.lease.slot].workspace == "overlay" and infos[s.lease.slot].template == t.id
            assert await digest_in(s) == expected
            who = await s.sh("stat -c %U pkg/__init__.py ro && id -un")
            assert who["stdout"].split() == ["sandbox"] * 3  # the agent owns what it sees
        for i, s in enumerate(forks):
            out = await s.sh(f"echo fork-{i} > mine.txt && echo changed-{i} >> pkg/__init__.py && rm big.bin && "
                             f"chmod u+w ro && echo w > ro/new && mv pkg/sub pkg/moved && ./run.sh")
            assert out["exit_code"] == 0 and out["stdout"] == "run\n", out
        for i, s in enumerate(forks):
            listing = (await s.sh("cat mine.txt; tail -1 pkg/__init__.py; ls; ls pkg"))["stdout"].split()
            assert listing[:2] == [f"fork-{i}", f"changed-{i}"]
            assert "big.bin" not in listing and "moved" in listing
        # the template is untouched, on disk and in a fresh fork
        tree = ov_host.data_dir / "templates" / t.id / "tree"
        assert host_digest(tree) == expected
        assert walk_tree(tree).tree_hash == t.tree_hash
        fresh = await fork(client, t.id, "iso-fresh")
        assert await digest_in(fresh) == expected
        forks.append(fresh)
    finally:
        await release(*forks)
    await client.delete_template(t.id)


async def test_reset_restores_the_template_exactly_and_is_verified(client: HostClient, source: Path) -> None:
    expected = host_digest(source)
    t = await client.create_template("dir", path=str(source))
    s = await fork(client, t.id, "reset")
    try:
        generation = s.lease.generation
        for _ in range(3):
            dirty = await s.sh(
                "echo x >> pkg/__init__.py; : > pkg/sub/data.txt; rm -rf empty ro/f 2>/dev/null; chmod 700 pkg; "
                "mkdir -p many && for i in $(seq 1000); do echo $i > many/f$i; done; ln -sfn / escape; "
                "mv pkg pkg2; rmdir empty 2>/dev/null; rm -rf ro; mkdir ro; "
                "(while true; do echo bg >> background.txt; sleep 0.01; done) >/dev/null 2>&1 &")
            assert dirty["exit_code"] == 0, dirty
            assert await digest_in(s) != expected
            s, result = await reset_to(s, t.id)
            assert result.template == t.id
            assert "empty upper layer" in result.verified and "no process" in result.verified
            assert result.lease.generation > generation
            generation = result.lease.generation
            assert await digest_in(s) == expected
            await asyncio.sleep(0.1)  # the background writer of the old lease is dead
            assert await digest_in(s) == expected
        # and back to an empty workspace
        s, result = await reset_to(s, None)
        assert (await s.ok("list_dir", path="."))["entries"] == []
        assert result.template is None
        assert (await client.slots())[s.lease.slot].workspace == "plain"
    finally:
        await release(s)
    await client.delete_template(t.id)


async def test_template_from_a_slot_after_setup(client: HostClient) -> None:
    setup = LeasedSlot(client, await client.lease("setup"))
    others: list[LeasedSlot] = []
    try:
        await setup.sh("mkdir -p proj/src && for i in $(seq 50); do echo $i > proj/src/m$i.py; done && "
                       "git -C proj init -q && git -C proj add -A && "
                       "git -C proj -c user.email=a@b -c user.name=a commit -qm init && echo ok")
        before = await digest_in(setup)
        t = await client.template_from_slot(setup.lease.slot, setup.lease.lease, name="after-setup")
        assert t.source == "slot" and t.users == [setup.lease.slot] and t.files > 50
        # same lease, same content, now a fork of its own snapshot
        assert await digest_in(setup) == before
        assert (await client.slots())[setup.lease.slot].workspace == "overlay"
        await setup.sh("echo private > proj/private.txt")
        others = [await fork(client, t.id, f"member-{i}") for i in range(3)]
        for o in others:
            assert await digest_in(o) == before
            status = await o.sh("git -C proj status --porcelain && git -C proj log --oneline | wc -l")
            assert status["stdout"] == "1\n"
        # a snapshot of a fork is a (full) copy of its merged view
        t2 = await client.template_from_slot(setup.lease.slot, setup.lease.lease, name="fork-of-fork")
        assert t2.files == t.files + 1
        assert (await setup.sh("cat proj/private.txt"))["stdout"] == "private\n"
        assert (await client.template(t.id)).users == sorted(o.lease.slot for o in others)
    finally:
        await release(setup, *others)
    for tid in (t.id, t2.id):
        await client.delete_template(tid)


async def test_templates_are_immutable_while_in_use(client: HostClient, source: Path, ov_host: RunningHost) -> None:
    t = await client.create_template("dir", path=str(source))
    s = await fork(client, t.id, "immutable")
    tree = ov_host.data_dir / "templates" / t.id / "tree"
    try:
        with pytest.raises(TemplateInUse):
            await client.delete_template(t.id)
        assert [x.id for x in await client.templates()].count(t.id) == 1
        # the store is private to the host user: no slot uid can even reach it...
        store = ov_host.data_dir / "templates"
        st = os.stat(store)
        assert st.st_uid == 0 and st.st_mode & 0o777 == 0o700
        slot_uid = os.stat(slot_path(ov_host.data_dir, s.lease.slot, "ov/upper")).st_uid
        assert slot_uid >= 1000 and os.stat(tree / "pkg" / "__init__.py").st_uid not in (0, slot_uid)
        probe = subprocess.run(["setpriv", f"--reuid={slot_uid}", f"--regid={slot_uid}", "--clear-groups", "cat",
                                str(tree / "pkg" / "__init__.py")], capture_output=True, text=True)
        assert probe.returncode != 0 and "Permission denied" in probe.stderr
        # ...nor see it from inside its sandbox; its view of the template is a read-only, idmapped layer
        out = await s.sh(f"ls {tree} 2>&1; touch /proc/self/x 2>&1; true")
        assert "No such file" in out["stdout"]
        mounts = [m for m in read_mountinfo(slot_ns_pid(ov_host.data_dir, s.lease.slot)) if m.mountpoint.endswith(
            f"/slots/{s.lease.slot}/ov/lower")]
        assert len(mounts) == 1 and {"ro", "idmapped", "nosuid", "nodev"} <= set(mounts[0].options.split(","))
        # writes through the fork never reach it
        await s.sh("for f in $(find . -type f); do echo tamper >> \"$f\"; done; rm -rf pkg")
        assert walk_tree(tree).tree_hash == t.tree_hash
    finally:
        await release(s)
    await client.delete_template(t.id)
    with pytest.raises(UnknownTemplate):
        await client.template(t.id)
    with pytest.raises(UnknownTemplate):
        await client.lease("late", template=t.id)
    assert not tree.exists()


# -- sources -------------------------------------------------------------------------------------
async def test_tar_roundtrip_git_source_and_refusals(client: HostClient, source: Path, tmp_path: Path,
                                                     ov_host: RunningHost) -> None:
    t = await client.create_template("dir", path=str(source))
    data = b"".join([chunk async for chunk in client.template_archive(t.id)])
    copy = await client.upload_template(data, name="shipped")
    assert copy.tree_hash == t.tree_hash and copy.source == "tar"
    gz = subprocess.run(["tar", "-czf", "-", "-C", str(source), "."], capture_output=True, check=True).stdout
    assert (await client.upload_template(gz, gzip=True)).files == t.files
    s = await fork(client, copy.id, "from-tar")
    try:
        assert await digest_in(s) == host_digest(source)
    finally:
        await release(s)
    with pytest.raises(TemplateBuildFailed):
        await client.upload_template(b"this is not a tar archive" * 100)
    evil = tmp_path / "evil.tar"
    subprocess.run(["tar", "-cf", str(evil), "-P", "--transform=s,^,../../,", "-C", str(source), "link"], check=True)
    with pytest.raises(TemplateBuildFailed, match=r"contains '\.\.'"):
        await client.upload_template(evil.read_bytes())
    assert not (ov_host.data_dir / "templates" / "link").exists() and not (ov_host.data_dir / "link").exists()
    with pytest.raises(TemplateSourceError):
        await client.create_template("dir", path="/etc")
    with pytest.raises(TemplateSourceError):
        await client.create_template("git", url="ssh://example.com/repo.git")

    repo = SRC_ROOT / "repo"
    _git_repo(repo)
    g = await client.create_template("git", url=str(repo), ref="v1", name="repo@v1")
    s = await fork(client, g.id, "from-git")
    try:
        out = await s.sh("git log --oneline | wc -l; cat version; git status --porcelain | wc -l")
        assert out["stdout"].split() == ["1", "1", "0"]
    finally:
        await release(s)
    head = await client.create_template("git", url=f"file://{repo}", depth=1)
    assert head.files > 0
    for x in await client.templates():
        await client.delete_template(x.id)
    assert await client.templates() == []


def _git_repo(repo: Path, commits: int = 2) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    repo.mkdir(parents=True)
    run = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, env=env, capture_output=True,  # noqa: E731
                                    text=True).stdout
    run("init", "-q", "-b", "main")
    for i in range(1, commits + 1):
        (repo / "version").write_text(f"{i}\n")
        (repo / "src").mkdir(exist_ok=True)
        (repo / "src" / f"mod{i}.py").write_text(f"X = {i}\n")
        run("add", "-A")
        run("commit", "-qm", f"v{i}")
        run("tag", f"v{i}")
    return run("rev-parse", "HEAD").strip()


async def test_unknown_template_on_reset_does_no_harm(client: HostClient) -> None:
    s = LeasedSlot(client, await client.lease("unknown"))
    try:
        await s.sh("echo keep > keep.txt")
        with pytest.raises(UnknownTemplate):
            await client.reset(s.lease.slot, s.lease.lease, template="tpl-doesnotexist")
        assert (await s.sh("cat keep.txt"))["stdout"] == "keep\n"  # lease and files intact
    finally:
        await release(s)


# -- leaks ---------------------------------------------------------------------------------------
def _tree_pids(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                ppid = int(Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _disk(path: Path) -> tuple[int, int]:
    """(allocated bytes of files and symlinks, number of entries) under path."""
    used = entries = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            entries += 1
            if name in filenames:
                used += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return used, entries


async def _settled(c: HostClient, data_dir: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        infos = await c.slots()
        # the mount trash: a reset's old mounts, unmounted in the background
        trash = [*(data_dir / "trash").iterdir(), *(data_dir / "mtrash").iterdir()]
        if not trash and all(i.sandbox_running or i.state != "free" for i in infos):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"host did not settle: trash {list((data_dir / 'trash').iterdir())}")


@pytest.mark.parametrize("cycles", [int(os.environ.get("ATROPOS_RESET_CYCLES", "300"))])
async def test_many_reset_cycles_leave_no_mount_process_or_file(source: Path, cycles: int) -> None:
    h = start_host(_data_dir("leak"), slots=2, extra=["--template-source-dir", str(SRC_ROOT)])
    c = h.client()
    try:
        t = await c.create_template("dir", path=str(source))
        # both slots once first: each slot's mounts get a namespace (a process of the mount helper) on
        # the slot's first use, kept for the host's life; the cycles below may use either slot
        for s in [LeasedSlot(c, await c.lease("leak")) for _ in range(2)]:
            s, _ = await reset_to(s, t.id)
            s, _ = await reset_to(s, None)
            await c.release(s.lease.slot, s.lease.lease)
        await _settled(c, h.data_dir)
        mine = os.path.realpath(h.data_dir) + "/"
        host_mounts = sum(m.mountpoint.startswith(mine) for m in read_mountinfo())  # others' mounts come and go
        procs = len(_tree_pids(h.proc.pid))
        disk = _disk(h.data_dir)
        assert is_idle(await c.health(mounts=True))
        # the pool's periodic check does not ask: no read of every slot namespace's mount table
        assert (await c.health()).mounts is None
        s = LeasedSlot(c, await c.lease("leak"))
        for i in range(cycles):
            if i % 3 == 0:
                await s.sh("mkdir -p w && for i in $(seq 20); do echo $i > w/f$i; done; echo x >> pkg/__init__.py; "
                           "sleep 300 & true" if i % 2 else "echo y > y")
            s, _ = await reset_to(s, t.id if i % 2 == 0 else None)
        assert is_idle(await c.health(mounts=True))  # the last reset was to an empty workspace
        await c.release(s.lease.slot, s.lease.lease)
        await _settled(c, h.data_dir)
        health = await c.health(mounts=True)
        assert health.ok and health.quarantined == 0 and is_idle(health)
        # a root host never mounts in its own namespace
        assert sum(m.mountpoint.startswith(mine) for m in read_mountinfo()) == host_mounts == 0
        assert len(_tree_pids(h.proc.pid)) == procs
        used, entries = _disk(h.data_dir)
        assert entries == disk[1], "files or directories were left behind"
        assert used <= disk[0] + (64 << 10), f"disk usage grew from {disk[0]} to {used} bytes"
    finally:
        await c.aclose()
        stop_host(h)
        shutil.rmtree(h.data_dir, ignore_errors=True)


# -- fallback and unprivileged hosts -------------------------------------------------------------
async def _fork_roundtrip(c: HostClient, source: Path, kind: str) -> TemplateInfo:
    expected = host_digest(source)
    t = await c.create_template("dir", path=str(source))
    a, b = await fork(c, t.id, "a"), await fork(c, t.id, "b")
    try:
        infos = {i.slot: i for i in await c.slots()}
        assert infos[a.lease.slot].workspace == kind
        await a.sh("echo only-a > only-a && rm -rf pkg")
        assert (await b.sh("ls"))["stdout"].split().count("only-a") == 0
        assert await digest_in(b) == expected
        a, result = await reset_to(a, t.id)
        assert await digest_in(a) == expected
        if kind == "copy":
            assert "manifest hash" in result.verified
    finally:
        await release(a, b)
    return t


async def test_copy_mode_fallback(copy_host: RunningHost, source: Path) -> None:
    async with copy_host.client() as c:
        health = await c.health(mounts=True)
        assert health.workspace_mode == "copy" and "forced" in health.workspace_detail and is_idle(health)
        t = await _fork_roundtrip(c, source, "copy")
        await c.delete_template(t.id)


async def test_unprivileged_host_forks_in_a_user_namespace(userns_host: RunningHost, source: Path) -> None:
    async with userns_host.client() as c:
        health = await c.health()
        assert health.workspace_mode == "overlay", health.workspace_detail
        assert "user+mount namespace" in health.workspace_detail
        t = await _fork_roundtrip(c, source, "overlay")
        # snapshot of a plain slot, then of a fork, in userns mode
        s = LeasedSlot(c, await c.lease("snap"))
        try:
            await s.sh("mkdir d && echo 1 > d/f && chmod 500 d")
            t2 = await c.template_from_slot(s.lease.slot, s.lease.lease)
            await s.sh("chmod 700 d && echo 2 > d/g")
            t3 = await c.template_from_slot(s.lease.slot, s.lease.lease)
            assert (t2.files, t3.files) == (1, 2)
        finally:
            await release(s)
        for tid in (t.id, t2.id, t3.id):
            await c.delete_template(tid)
        assert is_idle(await c.health(mounts=True))
    # an unprivileged host can still delete what its slots made read-only
    deadline = time.monotonic() + 30
    while list((userns_host.data_dir / "trash").iterdir()) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert list((userns_host.data_dir / "trash").iterdir()) == []


# -- pool: a GRPO group from one prepared git repository ------------------------------------------
async def test_group_of_8_forked_from_a_prepared_git_repo_across_two_hosts(tmp_path: Path) -> None:
    from atropos.slots.audit import double_leases
    from atropos.slots.config import PoolConfig
    from atropos.slots.pool import SlotPool
    from tests.pool_backends import make_backend

    repo = tmp_path / "repo"
    head = _git_repo(repo, commits=3)
    bundle = tmp_path / "repo.bundle"
    subprocess.run(["git", "-C", str(repo), "bundle", "create", "-q", str(bundle), "--all"], check=True)
    cfg = PoolConfig(min_hosts=2, max_hosts=2, acquire_timeout_s=60, health_interval_s=1)
    async with SlotPool(make_backend("local", slots=4), cfg) as pool:
        leases = await pool.lease_many([f"g-{i}" for i in range(8)], colocate=True)
        assert len({lease.host.id for lease in leases}) == 2  # 8 rollouts, 4 slots per host
        setup = leases[0]
        await setup.write_bytes("repo.bundle", bundle.read_bytes())
        out = await setup.bash("git clone -q repo.bundle repo && rm repo.bundle && git -C repo rev-parse HEAD")
        assert out["stdout"].strip() == head
        template = await pool.template_from_lease(setup, name="group")
        await asyncio.gather(*(pool.fork(lease, template) for lease in leases[1:]))
        assert len(template.copies) == 2  # shipped to the second host, verified by its tree hash

        async def rollout(i: int) -> tuple[str, str]:
            lease = leases[i]
            state = await lease.bash("cd repo && git rev-parse HEAD && git status --porcelain | wc -l")
            await lease.bash(f"cd repo && echo {i} > mine && git add mine && "
                             f"git -c user.email=r@r -c user.name=r commit -qm rollout-{i}")
            log = await lease.bash("cd repo && git log --format=%s | head -2 && ls")
            return state["stdout"], log["stdout"]

        results = await asyncio.gather(*(rollout(i) for i in range(8)))
        for i, (state, log) in enumerate(results):
            assert state.split() == [head, "0"]
            assert log.split()[:2] == [f"rollout-{i}", "v3"]  # only its own commit on top
        for lease in leases:
            await lease.release()
        await pool.delete_template(template)
        for host in pool.hosts.values():
            assert await host.client.templates() == []
            health = await host.client.health(mounts=True)
            assert is_idle(health) and health.quarantined == 0
        assert double_leases(pool.audit.events) == []

        # lease_many with a template: the pool forks every slot itself, preferring the holders
        t2 = await pool.upload_template(
            subprocess.run(["tar", "-cf", "-", "-C", str(repo), "."], capture_output=True, check=True).stdout)
        group = await pool.lease_many(["x0", "x1", "x2"], template=t2)
        assert {lease.host.id for lease in group} == set(t2.copies)  # colocated on the holder
        for lease in group:
            assert (await lease.bash("cat version"))["stdout"] == "3\n"
            await lease.release()
        with pytest.raises(LeaseError):
            await group[0].bash("true")
        await pool.delete_template(t2)


# -- AgentEnv: setup_group_workspace once, then G forks --------------------------------------------
async def test_agent_env_group_setup_runs_once_and_every_rollout_gets_a_fork(tmp_path: Path) -> None:
    pytest.importorskip("atroposlib")
    from atroposlib.envs.base import APIServerConfig

    from atropos.agent.model import default_gguf_path, ensure_tokenizer_dir
    from atropos.envs.agent_env import AgentEnv, AgentEnvConfig
    from atropos.testing import by_turn, scripted_server, tool_call

    if not default_gguf_path().exists():
        pytest.skip("the model file is missing: run `python3 scripts/model_server.py ensure --model-only`")
    repo = tmp_path / "repo"
    head = _git_repo(repo, commits=2)
    bundle = tmp_path / "repo.bundle"
    subprocess.run(["git", "-C", str(repo), "bundle", "create", "-q", str(bundle), "--all"], check=True)
    item = {"bundle": bundle.read_bytes(), "head": head}

    commit = ("cd repo && cat ../trajectory > mine && git add mine && "
              "git -c user.email=a@b -c user.name=a commit -qm mine && git log --oneline | wc -l")

    Policy = scripted_server(by_turn(tool_call("bash", command=commit), "Committed."))

    class GitRepoEnv(AgentEnv):
        server_cls = Policy
        group_setups = 0

        async def get_next_item(self) -> Any:
            return item

        def build_task(self, item: Any) -> str:
            return "Commit a file named `mine` holding your trajectory id to the repository in `repo`."

        async def setup_group_workspace(self, item: Any, *, trajectory_id: str, exec_tool: Any,
                                        lease: Any) -> dict[str, Any]:
            self.group_setups += 1
            await lease.write_bytes("repo.bundle", item["bundle"])
            out = await lease.bash("git clone -q repo.bundle repo && rm repo.bundle && git -C repo rev-parse HEAD")
            assert out["stdout"].strip() == item["head"]
            return {}

        async def setup_trajectory_workspace(self, item: Any, *, trajectory_id: str, exec_tool: Any,
                                             lease: Any) -> dict[str, Any]:
            await lease.write_file("trajectory", trajectory_id)
            return {}

        async def verify_and_score_trajectory(self, item: Any, final_response: str, *, trajectory_id: str,
                                              exec_tool: Any, lease: Any, agent_result: Any
                                              ) -> tuple[float, dict[str, Any]]:
            # the slot is sealed by now: the checks run in its verification sandbox (read-only workspace)
            result = await lease.verify(
                "import subprocess\ndef verify(ws, secrets, args):\n"
                "    return {'score': 0.0, 'out': subprocess.run(['bash', '-c', args], cwd=ws, capture_output=True,"
                " text=True).stdout}\n",
                args="cd repo && git rev-parse HEAD~1 && git log --oneline | wc -l && cat mine && echo && "
                     "git --no-optional-locks status --porcelain | wc -l && ls")
            assert result.ok and result.verdict is not None, result
            out = str(result.verdict["out"])
            lines = out.split()
            ok = lines[:5] == [item["head"], "3", trajectory_id, "0", "mine"] and lines[5:] == ["src", "version"]
            return (1.0 if ok else 0.0), {"out": out}

    cfg = AgentEnvConfig(tokenizer_name=str(ensure_tokenizer_dir()), group_size=8, use_wandb=False, wandb_name="t",
                         slots_per_host=8, max_hosts=1, agent_max_steps=3, enabled_toolsets=["shell", "files"],
                         ensure_scores_are_not_same=False, tool_batch_window_ms=5)
    servers = [APIServerConfig(model_name="s", base_url="http://127.0.0.1:9/v1", api_key="x", health_check=False)]
    env = GitRepoEnv(cfg, servers, slurm=False, testing=False)
    env.index = 0
    await env.setup_sandbox()
    try:
        group, backlog = await env.collect_trajectories(item)
        assert backlog == [] and group is not None
        assert group["scores"] == [1.0] * 8
        assert env.group_setups == 1 and env.stats["group_setups"] == 1
        assert env.pool is not None and env.pool.status().leased == 0
        for host in env.pool.hosts.values():
            assert await host.client.templates() == []  # the group's template is gone with the group
            assert is_idle(await host.client.health(mounts=True))
    finally:
        await env.shutdown_sandbox()


# -- a fork's sandbox is as confined as any other ----------------------------------------------------
FORK_ESCAPES = ["unshare -Ur id", "unshare -m true", "mount -t tmpfs none /tmp", "mount --bind /usr /workspace",
                "umount /workspace", "mknod /workspace/mem c 1 1", "nsenter -t 1 -m true",
                "printf x > /proc/sys/kernel/core_pattern", "chroot / true"]


async def _confined(s: LeasedSlot) -> None:
    out = await s.sh("id -u; grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs)' /proc/self/status; "
                     "tr '\\0' '\\n' < /proc/1/environ | grep -c . ; ps -e --no-headers | wc -l")
    lines = out["stdout"].split("\n")
    assert lines[0] == "1000", out
    assert [line.split()[1] for line in lines[1:5]] == ["0000000000000000"] * 3 + ["1"], out
    assert int(lines[5]) == 0 and int(lines[6]) <= 6, out  # empty env of pid 1; only its own processes
    for cmd in FORK_ESCAPES:
        res = await s.sh(f"{cmd}; echo rc=$?")
        assert "rc=0" not in res["stdout"], f"{cmd!r} succeeded in a fork: {res}"
    res = await s.sh("ls /run/atropos; grep -c ' /workspace ' /proc/self/mountinfo")
    assert res["stdout"].split()[-1] == "1"


@pytest.mark.parametrize("which", ["ov_host", "userns_host"])
async def test_fork_sandboxes_stay_confined(which: str, source: Path, request: pytest.FixtureRequest) -> None:
    h: RunningHost = request.getfixturevalue(which)
    async with h.client() as c:
        t = await c.create_template("dir", path=str(source))
        s = await fork(c, t.id, "confined")
        try:
            await _confined(s)
            s, _ = await reset_to(s, t.id)
            await _confined(s)
        finally:
            await release(s)
        await c.delete_template(t.id)


@pytest.mark.docker
async def test_docker_host_forks_in_a_user_namespace() -> None:
    """The Docker backend's host runs as uid 1000 without capabilities: forks still are overlays."""
    from atropos.slots.config import PoolConfig
    from atropos.slots.pool import SlotPool
    from tests.pool_backends import make_backend

    async with SlotPool(make_backend("docker", slots=4), PoolConfig(min_hosts=1, max_hosts=1)) as pool:
        host = next(iter(pool.hosts.values()))
        health = await host.client.health()
        assert health.workspace_mode == "overlay", health.workspace_detail
        setup, *others = await pool.lease_many(["d0", "d1", "d2"], colocate=True)
        await setup.bash("mkdir -p proj/sub && echo v1 > proj/file && echo x > proj/sub/x")
        template = await pool.template_from_lease(setup)
        await asyncio.gather(*(pool.fork(lease, template) for lease in others))
        await others[0].bash("echo mine > proj/mine && rm -r proj/sub")
        seen = await others[1].bash("ls proj; cat proj/file")
        assert seen["stdout"].split() == ["file", "sub", "v1"]
        await others[0].reset(template)
        assert (await others[0].bash("ls proj"))["stdout"].split() == ["file", "sub"]
        for lease in (setup, *others):
            await lease.release()
        await pool.delete_template(template)
        health = await host.client.health(mounts=True)
        assert is_idle(health) and health.templates == 0
