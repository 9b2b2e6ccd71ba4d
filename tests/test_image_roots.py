"""Slots whose root is a task image (docs/task-images.md), on a real host, real bubblewrap and a
real Docker engine: every image here is built locally from the project's base image, and what a
slot shows is compared with ``docker run`` of the same image."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from atropos.sandbox.contract.imageref import ImageRef
from atropos.sandbox.contract.protocol import VerifyRequest
from atropos.sandbox.host.workspace.mountns import read_mountinfo
from tests.conftest import IMAGE_STORE, LeasedSlot, RunningHost, slot_ns_pid, start_host, stop_host, wait_until
from tests.task_images import docker_run

BASE = "atropos-sandbox-base:bookworm"
STORE = IMAGE_STORE
DOCKERFILE = f"""FROM {BASE}
RUN mkdir -p /testbed/tests /opt/tool/bin && printf 'original\\n' > /testbed/a.txt \\
 && printf 'def test_ok():\\n    assert True\\n' > /testbed/tests/test_x.py \\
 && printf '#!/bin/sh\\necho tool-from-image\\n' > /opt/tool/bin/imgtool && chmod 755 /opt/tool/bin/imgtool \\
 && rm /etc/issue.net
ENV TASK_NAME=image-roots PATH=/opt/tool/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
WORKDIR /testbed
"""


def _docker_ok() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "image", "inspect", BASE], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _docker_ok(), reason=f"needs the Docker engine with {BASE} "
                                                          "(scripts/build_image.sh builds it)")




def built(name: str, dockerfile: str, tmp_path_factory: pytest.TempPathFactory, files: dict[str, str] | None = None
          ) -> str:
    """``atropos-test/NAME:<hash of its recipe>``, built here unless the engine has it."""
    key = hashlib.sha256((dockerfile + repr(sorted((files or {}).items()))).encode()).hexdigest()[:12]
    tag = f"atropos-test/{name}:{key}"
    if subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode != 0:
        ctx = tmp_path_factory.mktemp(name)
        (ctx / "Dockerfile").write_text(dockerfile)
        for path, text in (files or {}).items():
            (ctx / path).write_text(text)
        subprocess.run(["docker", "build", "-q", "-t", tag, str(ctx)], check=True, capture_output=True, timeout=600)
    return tag


@pytest.fixture(scope="module")
def roots_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    return built("image-roots", DOCKERFILE, tmp_path_factory)


@pytest.fixture(scope="module")
def image_host() -> Iterator[RunningHost]:
    data = Path(f"/tmp/atropos-img-{os.getpid()}-{secrets.token_hex(3)}")
    running = start_host(data, slots=4, extra=["--workspace-bytes", str(256 << 20), "--image-store", str(STORE),
                                               "--native-supervisor", "always"])
    yield running
    stop_host(running)


@contextlib.asynccontextmanager
async def image_slot(host: RunningHost, image: str) -> AsyncIterator[LeasedSlot]:
    client = host.client()
    lease = await client.lease(f"img-{secrets.token_hex(4)}")
    try:
        result = await client.reset(lease.slot, lease.lease, image=image)
        assert result.ok, result.detail
        assert result.lease is not None
        assert "fresh root of image" in result.verified
        leased = LeasedSlot(client, result.lease)
        lease = result.lease
        try:
            yield leased
        finally:
            lease = leased.lease  # the test may have reset it to a new token
    finally:
        try:
            await client.release(lease.slot, lease.lease)
        finally:
            await client.aclose()


def _cmdline(pid: str) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


COMMANDS = [
    "id",
    "pwd",
    'echo "$HOME|$PATH|$TASK_NAME"',
    "cat /testbed/a.txt /etc/debian_version",
    "ls /",
    "stat -c '%U:%G %a %n' / /etc /etc/passwd /testbed /testbed/a.txt /opt/tool/bin/imgtool",
    "imgtool; command -v imgtool",
    "test -e /etc/issue.net; echo deleted=$?",
    "python3 -c 'import sys; print(sys.version_info[:2], sys.prefix)'",
    "umask; ulimit -c",
    "touch /etc/new && rm /etc/passwd && echo root-may-write-anywhere",
]


async def test_tools_behave_as_in_docker_run(image_host: RunningHost, roots_image: str) -> None:
    async with image_slot(image_host, roots_image) as slot:
        for command in COMMANDS:
            result = await slot.sh(command)
            code, want, _ = docker_run(roots_image, command)
            assert (result["exit_code"], result["stdout"]) == (code, want), command


async def test_an_image_slot_runs_commands_with_slotd(image_host: RunningHost, roots_image: str) -> None:
    """The compiled supervisor (docs/native-supervisor.md) serves an image root too: static, it needs
    nothing of the image; the commands start in the image's WorkingDir as docker run's do."""
    async with image_slot(image_host, roots_image) as slot:
        await slot.sh("true")
        out = await slot.sh("tr '\\0' ' ' < /proc/2/cmdline; echo; pwd")
        cmdline, cwd = out["stdout"].splitlines()
        assert re.fullmatch(r"/\.atropos/lib/slotd \d+ \d+ \d+", cmdline.strip()) and cwd == "/testbed", out
        # the file tools are slotd's own (no hand-over to the Python supervisor): the same slotd serves on
        assert (await slot.ok("read_file", path="a.txt"))["content"] == "original\n"
        assert (await slot.sh("tr '\\0' ' ' < /proc/2/cmdline"))["stdout"].strip() == cmdline.strip()


async def test_file_tools_see_the_same_root(image_host: RunningHost, roots_image: str) -> None:
    async with image_slot(image_host, roots_image) as slot:
        assert (await slot.ok("read_file", path="/testbed/a.txt"))["content"] == "original\n"
        assert (await slot.ok("read_file", path="a.txt"))["content"] == "original\n"  # at WorkingDir
        written = await slot.ok("write_file", path="rel/b.txt", content="from the file tool\n")
        assert written["path"] == "/testbed/rel/b.txt"
        assert (await slot.sh("cat /testbed/rel/b.txt"))["stdout"] == "from the file tool\n"
        await slot.sh("printf 'from bash\\n' > /etc/motd")
        assert (await slot.ok("read_file", path="/etc/motd"))["content"] == "from bash\n"
        names = {e["name"] for e in (await slot.ok("list_dir", path="/"))["entries"]}
        assert {"etc", "usr", "testbed"} <= names


async def test_reset_restores_the_image_exactly(image_host: RunningHost, roots_image: str) -> None:
    client = image_host.client()
    lease = await client.lease("img-reset")
    try:
        first = await client.reset(lease.slot, lease.lease, image=roots_image)
        assert first.ok and first.lease is not None
        slot = LeasedSlot(client, first.lease)
        before = (await slot.sh("find / -xdev -path /proc -prune -o -print 2>/dev/null | sort | md5sum"))["stdout"]
        await slot.sh("rm -rf /testbed /usr/share/doc; echo x > /etc/planted; mkdir /newdir; "
                      "chmod 700 /etc; ln -sfn / /opt/tool/bin/imgtool")
        second = await client.reset(lease.slot, first.lease.lease, image=roots_image)
        assert second.ok and second.lease is not None, second.detail
        slot = LeasedSlot(client, second.lease)
        after = (await slot.sh("find / -xdev -path /proc -prune -o -print 2>/dev/null | sort | md5sum"))["stdout"]
        assert after == before
        assert (await slot.sh("cat /testbed/a.txt; stat -c %a /etc; imgtool"))["stdout"] == \
            "original\n755\ntool-from-image\n"
        lease = second.lease
    finally:
        await client.release(lease.slot, lease.lease)
        await client.aclose()


async def test_root_inside_is_an_unprivileged_uid_outside(image_host: RunningHost, roots_image: str) -> None:
    async with image_slot(image_host, roots_image) as slot:
        marker = f"4.{secrets.randbelow(10**6):06d}"
        running = asyncio.create_task(slot.sh(f"id -u > /tmp/uid; sleep {marker}"))
        pids: list[str] = []

        def found() -> bool:
            pids[:] = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p) == ["sleep", marker]]
            return len(pids) == 1

        await wait_until(found, timeout=30)
        host_uids = {line.split()[1] for line in Path(f"/proc/{pids[0]}/status").read_text().splitlines()
                     if line.startswith("Uid:")}
        assert (await slot.sh("cat /tmp/uid"))["stdout"] == "0\n"  # root inside
        assert "0" not in host_uids and len(host_uids) == 1, host_uids  # a slot uid outside
        await running
        # what the slot's root may not do: the helpers, the mount points, mounting, raising limits
        for attempt in ("touch /.atropos/lib/x", "rm -rf /.atropos", "mv /.atropos /elsewhere", "rmdir /tmp",
                        "mv /tmp /tmp2", "mount -t tmpfs none /mnt", "umount /tmp", "rm -rf /dev",
                        "echo 1 > /proc/sys/kernel/ns_last_pid", "touch /.atropos/usr/bin/planted",
                        "unshare -U true"):
            result = await slot.sh(attempt + " 2>/dev/null")
            assert result["exit_code"] != 0, attempt
        # a later sandbox of the same slot (a python_session, a terminal) still starts
        await slot.sh("ln -sfn /etc /run/planted; rm -rf /var/tmp; ln -s / /var/tmp")
        out = await slot.ok("python_session", code="import os; print(os.getuid(), os.getcwd())")
        assert out["stdout"].strip() == "0 /testbed"


async def test_writes_are_capped(image_host: RunningHost, roots_image: str) -> None:
    async with image_slot(image_host, roots_image) as slot:
        result = await slot.sh("dd if=/dev/zero of=/big bs=1M count=400 2>&1; df -B1M / | tail -1")
        assert "No space left on device" in result["stdout"]
        assert (await slot.sh("rm /big && echo freed"))["stdout"] == "freed\n"


async def test_terminal_runs_on_the_image(image_host: RunningHost, roots_image: str) -> None:
    async with image_slot(image_host, roots_image) as slot:
        out = await slot.ok("terminal", input="pwd; echo $TASK_NAME; imgtool", wait_ms=5000)
        screen = str(out)
        assert "/testbed" in screen and "image-roots" in screen and "tool-from-image" in screen


VERIFIER = """
def verify(workspace, secrets, args):
    import os
    def read(p):
        p = os.path.join(ROOT, p.lstrip("/"))  # the slot's root, as the runner sees it
        try:
            return "L:" + os.readlink(p) if os.path.islink(p) else open(p).read()
        except OSError as exc:
            return "missing:" + type(exc).__name__
    return {"score": 1.0, "cwd": os.getcwd(), "workspace": workspace, "root": ROOT,
            "files": {p: read(p) for p in args}}
"""


async def test_verify_restores_paths_from_the_image(image_host: RunningHost, roots_image: str) -> None:
    async with image_slot(image_host, roots_image) as slot:
        await slot.sh("printf 'def test_ok():\\n    assert False\\n' > tests/test_x.py; rm a.txt; "
                      "printf 'import pytest\\n' > conftest.py; echo agent > /tmp/kept-out")
        await slot.sh("mv tests tests.orig && mkdir /tmp/fake && ln -s /tmp/fake tests && echo x > /tmp/fake/new")
        paths = ["/testbed/tests", "/testbed/a.txt", "/testbed/conftest.py"]
        result = await slot.client.verify(slot.lease.slot, VerifyRequest(
            lease=slot.lease.lease, program=VERIFIER, restore=paths,
            args=["/testbed/tests/test_x.py", "/testbed/a.txt", "/testbed/conftest.py", "/testbed/tests/new"]))
        assert result.ok, result.error
        assert result.verdict is not None
        # the runner's own root is the host's: the slot's root is a directory of it
        assert result.verdict["root"] == "/run/checked"
        assert result.verdict["cwd"] == result.verdict["workspace"] == "/run/checked/testbed"
        assert result.verdict["files"] == {
            "/testbed/tests/test_x.py": "def test_ok():\n    assert True\n",
            "/testbed/a.txt": "original\n",
            "/testbed/conftest.py": "missing:FileNotFoundError",
            "/testbed/tests/new": "missing:FileNotFoundError",
        }


# Everything of the root a slot may show the next lease: each path's type, mode, owner, size, mtime,
# link target, and the contents of the files the attacks below write (the mount points the helper
# makes fresh in every root, and /proc, /dev, /sys, left out).
FINGERPRINT = ("find / -xdev -mindepth 1 \\( -path /proc -o -path /dev -o -path /tmp -o -path /sys "
               "-o -path /.atropos \\) -prune -o -printf '%p %y %m %U:%G %s %T@ %l\\n' | sort | md5sum; "
               "find /.atropos/image -printf '%p %y %m %U:%G %s %T@ %l\\n' | sort | md5sum; "
               "cat /testbed/a.txt /etc/debian_version /.atropos/image/testbed/a.txt | md5sum; "
               "md5sum /bin/true /usr/bin/python3 /etc/passwd; ls -a /tmp /testbed /opt/tool/bin; "
               "python3 -c 'import os; print(sorted(os.listxattr(\"/testbed/a.txt\")), "
               "sorted(os.listxattr(\"/testbed\")))'")
# Every way a slot's root (uid 0 inside) writes to its root, and the ways it tries to write past it.
WRITES = [
    "echo planted >> /testbed/a.txt", ": > /etc/debian_version", "cp /bin/false /bin/true",
    "rm -rf /usr/share/doc", "rm -rf /opt/tool/bin && mkdir /opt/tool/bin && echo x > /opt/tool/bin/imgtool",
    "mv /testbed /testbed.moved && mkdir /testbed && echo new > /testbed/a.txt", "chmod 777 /etc",
    "chown 1234:1234 /etc/hostname", "touch -d 2001-01-01 /etc/passwd", "ln /etc/passwd /etc/passwd.hl",
    "mkfifo /fifo", "ln -s /.atropos/image /img", "echo x > /tmp/left",
    "python3 -c 'import os; os.setxattr(\"/testbed/a.txt\", \"user.planted\", b\"1\")'",
    "python3 -c 'import os; os.setxattr(\"/testbed\", \"trusted.overlay.opaque\", b\"y\")'",
    "echo x > /.atropos/image/testbed/a.txt", "touch /.atropos/image/planted", "rm -f /.atropos/image/etc/passwd",
    "mount -o remount,rw /.atropos/image", "mount -o remount,rw /", "umount -l /.atropos/image",
    "python3 -c 'import os; os.setxattr(\"/.atropos/image/etc\", \"user.planted\", b\"1\")'",
    "(exec 3>>/etc/hosts; sleep 300) > /dev/null 2>&1 &",
]


def _held_mounts(pid: int) -> set[int]:
    """The mount ids behind the fds process ``pid`` holds (a slot namespace's kept layers)."""
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
                if line.startswith("mnt_id:"):
                    held.add(int(line.split()[1]))
    return held


async def test_kept_layers_carry_no_write_to_the_next_lease_or_the_verifier(image_host: RunningHost,
                                                                            roots_image: str) -> None:
    """A slot keeps its clones of an image's layers across its resets to that image (mounthelper's
    KeptLayers): whatever the slot writes, the next lease of the same image on the same slot, and a
    verifier restoring from the image, see the image as it is."""
    client = image_host.client()
    lease = await client.lease("img-kept")
    try:
        first = await client.reset(lease.slot, lease.lease, image=roots_image)
        assert first.ok and first.lease is not None, first.detail
        lease = first.lease
        slot = LeasedSlot(client, lease)
        before = await slot.sh(FINGERPRINT)
        assert before["exit_code"] == 0, before
        ns_pid = slot_ns_pid(image_host.data_dir, lease.slot)
        held = _held_mounts(ns_pid)
        # premise: the layers are detached mounts the namespace holds, in no mount table
        assert held, "no kept layers"
        table = read_mountinfo(ns_pid)
        assert not {m.mount_id for m in table} & held
        root = [m for m in table if m.mountpoint.endswith(f"/slots/{lease.slot}/root")]
        assert len(root) == 1 and "lowerdir+=" in root[0].super_options, root
        for command in WRITES:
            await slot.sh(command)
        changed = await slot.sh(FINGERPRINT)
        assert changed["stdout"] != before["stdout"]  # premise: the writes took where they could
        assert (await slot.sh("cat /.atropos/image/testbed/a.txt"))["stdout"] == "original\n"
        result = await client.verify(lease.slot, VerifyRequest(
            lease=lease.lease, program=VERIFIER, restore=["/testbed", "/etc/passwd"],
            args=["/testbed/a.txt", "/etc/passwd.hl", "/testbed.moved/a.txt"]))
        assert result.ok and result.verdict is not None, result.error
        assert result.verdict["files"]["/testbed/a.txt"] == "original\n"
        second = await client.reset(lease.slot, lease.lease, image=roots_image)
        assert second.ok and second.lease is not None, second.detail
        assert "fresh root of image" in second.verified
        lease = second.lease
        slot = LeasedSlot(client, lease)
        assert _held_mounts(ns_pid) == held  # the same clones: kept, not made again
        after = await slot.sh(FINGERPRINT)
        assert (after["exit_code"], after["stdout"], after["stderr"]) == \
            (before["exit_code"], before["stdout"], before["stderr"])
        assert (await slot.sh("cat /testbed/a.txt; stat -c '%a %U' /etc; test -e /fifo; echo $?"))["stdout"] == \
            "original\n755 root\n1\n"
        # the slot's root on the default root again: the image's layers are no longer held
        third = await client.reset(lease.slot, lease.lease)
        assert third.ok and third.lease is not None, third.detail
        lease = third.lease
        now = _held_mounts(ns_pid)  # its other fds (its socket, the namespace it was made from) stay
        assert now < held and len(held - now) > 2, (held, now)  # a clone per layer and the pristine overlay
    finally:
        await client.release(lease.slot, lease.lease)
        await client.aclose()


async def test_restore_refuses_a_slot_without_an_image(image_host: RunningHost) -> None:
    client = image_host.client()
    lease = await client.lease("no-image")
    try:
        result = await client.verify(lease.slot, VerifyRequest(lease=lease.lease, program=VERIFIER, args=[],
                                                                 restore=["/workspace/x"]))
        assert not result.ok and result.error is not None and "image" in result.error.message
    finally:
        await client.release(lease.slot, lease.lease)
        await client.aclose()


async def test_images_share_layers_and_are_listed(image_host: RunningHost, roots_image: str) -> None:
    client = image_host.client()
    try:
        base = await client.prepare_image(BASE)
        task = await client.prepare_image(roots_image)
        assert task.layers == base.layers + 1  # the task image is the base plus its one RUN layer
        held = {i.reference: i for i in await client.images()}
        assert {BASE, roots_image} <= set(held)
        layers = sorted(p.name for p in (STORE / "layers").iterdir())
        assert len(layers) == len(set(layers))  # the base layer once, whatever uses it
    finally:
        await client.aclose()


async def test_an_unknown_image_is_a_clear_error_and_costs_the_lease_nothing(image_host: RunningHost) -> None:
    client = image_host.client()
    lease = await client.lease("unknown-image")
    try:
        with pytest.raises(Exception) as info:
            await client.reset(lease.slot, lease.lease, image="atropos-test/no-such-image:never")
        assert "no-such-image" in str(info.value)
        # the lease is untouched: its token still works
        slot = LeasedSlot(client, lease)
        assert (await slot.sh("echo still"))["stdout"] == "still\n"
    finally:
        await client.release(lease.slot, lease.lease)
        await client.aclose()


async def test_slots_of_one_image_share_its_layers_not_their_writes(image_host: RunningHost, roots_image: str) -> None:
    async with image_slot(image_host, roots_image) as a, image_slot(image_host, roots_image) as b:
        await a.sh("echo from-a > /testbed/a.txt; touch /etc/only-in-a")
        assert (await b.sh("cat /testbed/a.txt; test -e /etc/only-in-a; echo $?"))["stdout"] == "original\n1\n"
        # the layers are the store's, once: both roots are overlays over the same lower dirs
        infos = {s.slot: s for s in await a.client.slots()}
        assert infos[a.lease.slot].image == infos[b.lease.slot].image == roots_image
        assert infos[a.lease.slot].workspace == "image"


# Each test image (tests/task_images.py) against docker run of it: what every image shows, and what
# that image is for.
# (`id -u; id -g`, not `id`: docker gives root the supplementary group 0, a slot none: an unprivileged
# user namespace cannot set groups; docs/task-images.md lists the differences)
COMMON = ["id -u; id -g; pwd; ls /", "env | sort | grep -v -e '^HOSTNAME=' -e '^_='", "echo hi > /made && cat /made"]
PER_IMAGE = {
    "pyenv": ["command -v python; python -c 'import sys; print(sys.prefix, sys.version_info[:2])'",
              "stat -c '%U:%G %a %n' /testbed /testbed/.git; git -C /testbed log --oneline | wc -l",
              "cd /testbed && python -m pytest -q -p no:cacheprovider 2>&1 | tail -1 | sed 's/ in .*//'"],
    "syspkg": ["dpkg -l | tail -n +6 | wc -l; ls /usr/bin | md5sum"],
    "nopython": ["command -v python3 python; echo $?", "busybox true && ls /bin | head -5"],
    "layered": ["find /work | sort; cat /work/replaced/* 2>&1; test -e /etc/issue; echo $?"],
    "musl": ["ls /lib; musl-hello"],
}


@pytest.mark.parametrize("name", sorted(PER_IMAGE))
async def test_each_test_image_behaves_as_in_docker_run(image_host: RunningHost, task_image: Any, name: str) -> None:
    ref = task_image(name)
    async with image_slot(image_host, ref) as slot:
        for command in COMMON + PER_IMAGE[name]:
            result = await slot.sh(command)
            code, want, _ = docker_run(ref, command)
            assert (result["exit_code"], result["stdout"]) == (code, want), (name, command)
        # the file tools need nothing of the image (they run on the host's interpreter)
        await slot.ok("write_file", path="/probe/file.txt", content="tools\n")
        assert (await slot.ok("read_file", path="/probe/file.txt"))["content"] == "tools\n"


HOSTILE = f"""FROM {BASE}
RUN rm -rf /tmp && ln -s /etc /tmp && ln -s / /.atropos && ln -s /proc/1/root /p1 && ln -s / /escape \\
 && mkdir -p /run && ln -s /etc/shadow /run/term \\
 && cp /usr/bin/id /usr/local/bin/suid-id && chmod 4755 /usr/local/bin/suid-id
"""


@pytest.fixture(scope="module")
def hostile_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    return built("image-roots-hostile", HOSTILE, tmp_path_factory)


async def test_a_hostile_image_gets_nothing(image_host: RunningHost, hostile_image: str) -> None:
    """Symlinks where the sandbox mounts its own things (/tmp, /.atropos; /dev cannot be replaced in
    a docker build, and takes the same path in the mount helper), links out of the
    root and a setuid binary: the slot still gets its own capped /tmp, its own /dev and helpers,
    every link resolves inside the slot, and setuid changes no uid outside."""
    async with image_slot(image_host, hostile_image) as slot:
        out = await slot.sh("stat -c '%F %a' /tmp /dev /.atropos; df -B1 --output=fstype /tmp | tail -1; "
                            "ls /.atropos; test -c /dev/null && echo devnull")
        assert out["stdout"] == "directory 1777\ndirectory 755\ndirectory 755\ntmpfs\nimage\nlib\nterm\nusr\ndevnull\n"
        # links out of the root land in the slot's own root
        both = (await slot.sh("ls -a /escape/ | md5sum; ls -a / | md5sum"))["stdout"].splitlines()
        assert len(both) == 2 and both[0] == both[1]
        assert (await slot.sh("cat /p1/etc/debian_version"))["stdout"] == \
            (await slot.sh("cat /etc/debian_version"))["stdout"]
        assert (await slot.ok("read_file", path="/escape/etc/debian_version"))["content"] == \
            (await slot.sh("cat /etc/debian_version"))["stdout"]
        # setuid: mounted nosuid, and root inside is the slot's uid outside anyway
        assert (await slot.sh("stat -c %a /usr/local/bin/suid-id; suid-id -u"))["stdout"] == "4755\n0\n"
        assert (await slot.sh("findmnt -no OPTIONS / | tr , '\\n' | grep -x nosuid"))["stdout"] == "nosuid\n"


async def test_through_the_pool_prepare_lease_a_group_and_release(roots_image: str) -> None:
    """pool.prepare_images, pool.leased(image=), a group on one image (colocated on the host that
    holds it), and a release that gives the next lease the default root again."""
    from atropos.backends.local import LocalBackend, LocalBackendConfig
    from atropos.slots.config import PoolConfig
    from atropos.slots.pool import SlotPool

    data = Path(f"/tmp/atropos-img-pool-{os.getpid()}-{secrets.token_hex(3)}")  # slot uids traverse it
    backend = LocalBackend(LocalBackendConfig(slots_per_host=3, data_root=data, pool_id="img",
                                              prewarm=False, image_store=STORE))
    try:
        await _pool_walk(SlotPool(backend, PoolConfig(pool_id="img", min_hosts=2, max_hosts=2)), roots_image)
    finally:
        shutil.rmtree(data, ignore_errors=True)


async def _pool_walk(pool: Any, roots_image: str) -> None:
    async with pool:
        prepared = await pool.prepare_images([roots_image])
        assert len(prepared) == 2 and all(infos[0].reference == roots_image for infos in prepared.values())
        async with pool.leased("one", image=roots_image) as lease:
            assert lease.image == roots_image
            out = await lease.call("bash", {"command": "pwd; cat a.txt; echo changed > a.txt"})
            assert out.result is not None and out.result["stdout"] == "/testbed\noriginal\n"
            first = lease.host
        # released onto a fresh root of the same image: the next lease of it takes that slot as it is
        await wait_until(lambda: roots_image in first.roots.values(), timeout=60)
        kept = {(h.id, slot): gen for h in pool.hosts.values() for slot, _, gen in h.free if slot in h.roots}
        async with pool.leased("two", image=roots_image) as lease:
            assert kept.get((lease.host.id, lease.slot)) == lease.generation  # no reset on the lease path
            out = await lease.call("bash", {"command": "cat a.txt"})
            assert out.result is not None and out.result["stdout"] == "original\n"
        group = await pool.lease_many(["g0", "g1", "g2"], image=roots_image)
        try:
            assert len({lease.host.id for lease in group}) == 1  # colocated: one host holds them all
            outs = await asyncio.gather(*(g.call("bash", {"command": "echo $TASK_NAME"}) for g in group))
            assert [o.result["stdout"] for o in outs if o.result] == ["image-roots\n"] * 3
        finally:
            await asyncio.gather(*(pool.release(g) for g in group))
        async with pool.leased("after") as lease:  # a released slot is back on the default root
            out = await lease.call("bash", {"command": "pwd; test -e /testbed; echo $?"})
            assert out.result is not None and out.result["stdout"] == "/workspace\n1\n"


async def test_the_store_keeps_its_budget_and_never_evicts_an_image_in_use(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, task_image: Any) -> None:
    """Two hosts share a store: past its budget, the least recently used image no host holds goes
    (with the layers only it had); one a host holds stays; an evicted image is imported again."""
    from atropos.sandbox.host.images.host_images import HostImages

    small = task_image("nopython")  # a few MB: the test unpacks it into a store of its own
    refs = [built(f"budget-{name}", f"FROM {small}\nCOPY f /{name}\n", tmp_path_factory, {"f": name * 4096})
            for name in ("a", "b")]
    store = tmp_path / "store"
    one, two = HostImages(store, budget_bytes=1 << 40), HostImages(store, budget_bytes=1 << 40)
    a = await one.get(ImageRef.parse(refs[0]))  # host one holds a
    # room for b's own layer beside a (an import may not pass the budget less what images in use hold)
    two.budget_bytes = one.disk_bytes() + (1 << 20)
    b = await two.get(ImageRef.parse(refs[1]))  # host two imports b
    two.budget_bytes = 1  # now over budget: only what no host holds may go
    assert all(p.is_dir() for p in (*a.lowers, *b.lowers))
    a.last_used -= 10_000  # host one has not used a for a long while, and no slot is on it
    one._drop_idle()
    two.trim()
    assert not a.lowers[-1].exists()  # a's own layer is gone
    assert all(p.is_dir() for p in b.lowers)  # b is held by host two, with the base both share
    again = await one.get(ImageRef.parse(refs[0]))
    assert all(p.is_dir() for p in again.lowers)  # imported again on its next use


async def test_a_group_setup_becomes_an_image_every_rollout_starts_from(image_host: RunningHost,
                                                                       roots_image: str) -> None:
    """The setup's writes, deletions and renames (whiteouts, opaque and redirected dirs in the slot's
    writable layer) become one more layer: a fresh slot on the derived image sees exactly the root
    the setup left, owned as it was, and its reset goes back to that, not to the original image."""
    async with image_slot(image_host, roots_image) as setup:
        await setup.sh("echo setup > /testbed/setup.txt; rm /testbed/a.txt; mv /testbed/tests /testbed/t2; "
                       "rm -rf /opt/tool && mkdir /opt/tool && echo new > /opt/tool/only; "
                       "chmod 4711 /testbed/setup.txt")
        listing = ("find / -xdev \\( -path /proc -o -path /tmp -o -path /dev \\) -prune -o -printf '%p %u %m\\n' "
                   "| sort | md5sum")
        want = (await setup.sh(listing))["stdout"]
        info = await setup.client.derive_image(setup.lease.slot, setup.lease.lease)
        assert info.reference.startswith("derived:") and info.layers == 3
        assert (await setup.sh(listing))["stdout"] == want  # the setup's own slot continues on it
        async with image_slot(image_host, info.reference) as rollout:
            assert (await rollout.sh(listing))["stdout"] == want
            assert (await rollout.sh("cat /testbed/setup.txt; ls /opt/tool; test -e /testbed/a.txt; echo $?"))[
                "stdout"] == "setup\nonly\n1\n"
            await rollout.sh("rm -rf /testbed")
            again = await rollout.client.reset(rollout.lease.slot, rollout.lease.lease, image=info.reference)
            assert again.ok and again.lease is not None
            rollout.lease = again.lease
            assert (await rollout.sh(listing))["stdout"] == want


async def test_agent_env_on_image_items_with_a_group_setup(roots_image: str) -> None:
    """An AgentEnv whose items name an image: every rollout's slot is that image's root (relative
    paths at its WorkingDir), the group's setup runs once and the others start from its derived
    image, and verification runs on the same root."""
    pytest.importorskip("atroposlib")
    from atroposlib.envs.base import APIServerConfig

    from atropos.agent.model import ensure_tokenizer_dir
    from atropos.envs.agent_env import AgentEnv, AgentEnvConfig
    from atropos.testing import by_turn, scripted_server, tool_call

    item = {"image": roots_image}
    Policy = scripted_server(by_turn(tool_call("bash", command="cat setup.txt > seen && echo $TASK_NAME >> seen"),
                                     "Done."))

    class ImageGroupEnv(AgentEnv):
        server_cls = Policy
        group_setups = 0

        async def get_next_item(self) -> Any:
            return item

        def build_task(self, item: Any) -> str:
            return "Copy setup.txt to seen."

        def images_to_prepare(self) -> list[str]:
            return [roots_image]

        async def setup_group_workspace(self, item: Any, *, trajectory_id: str, exec_tool: Any,
                                        lease: Any) -> dict[str, Any]:
            self.group_setups += 1
            await lease.bash("echo once > /testbed/setup.txt && rm /testbed/a.txt")
            return {}

        async def verify_and_score_trajectory(self, item: Any, final_response: str, *, trajectory_id: str,
                                              exec_tool: Any, lease: Any, agent_result: Any
                                              ) -> tuple[float, dict[str, Any]]:
            result = await lease.verify(
                "import os\ndef verify(ws, secrets, args):\n"
                "    return {'score': float(open('seen').read() == 'once\\nimage-roots\\n'"
                " and not os.path.exists('a.txt') and os.getcwd() == ROOT + '/testbed')}\n")
            assert result.ok and result.verdict is not None, result
            return float(result.verdict["score"]), {}

    cfg = AgentEnvConfig(tokenizer_name=str(ensure_tokenizer_dir()), group_size=4, use_wandb=False, wandb_name="t",
                         slots_per_host=4, max_hosts=1, agent_max_steps=3, enabled_toolsets=["shell", "files"],
                         ensure_scores_are_not_same=False, tool_batch_window_ms=5)
    servers = [APIServerConfig(model_name="s", base_url="http://127.0.0.1:9/v1", api_key="x", health_check=False)]
    env = ImageGroupEnv(cfg, servers, slurm=False, testing=False)
    env.index = 0
    await env.setup_sandbox()
    try:
        assert env.pool is not None
        assert [h.images for h in env.pool.status().hosts] == [[roots_image]]  # prepared at the start
        group, backlog = await env.collect_trajectories(item)
        assert backlog == [] and group is not None
        assert group["scores"] == [1.0] * 4
        assert env.group_setups == 1 and env.stats["group_setups"] == 1
    finally:
        await env.shutdown_sandbox()


USER_IMAGE = f"""FROM {BASE}
RUN useradd -m -u 1234 -U agent && mkdir /work && chown agent:agent /work && echo mine > /work/f
USER agent
WORKDIR /work
"""


async def test_an_image_user_other_than_root(image_host: RunningHost, tmp_path_factory: pytest.TempPathFactory) -> None:
    """``USER agent``: the slot runs as that uid and group inside (its files its own, root's not
    writable), with its home, as docker run does; outside it is still the slot's uid. (Files of the
    image's root show as nobody to it: one uid is mapped; docs/task-images.md.)"""
    tag = built("image-roots-user", USER_IMAGE, tmp_path_factory)
    async with image_slot(image_host, tag) as slot:
        for command in ["id -u; id -g; id -un; echo $HOME; pwd", "echo more >> /work/f && cat /work/f",
                        "touch /etc/x 2>/dev/null; echo $?", "stat -c '%U %a' /work /home/agent",
                        "cat /etc/shadow > /dev/null 2>&1; echo $?"]:
            result = await slot.sh(command)
            code, want, _ = docker_run(tag, command)
            assert (result["exit_code"], result["stdout"]) == (code, want), command


async def test_restore_of_whole_system_dirs_keeps_what_is_untouched(image_host: RunningHost, roots_image: str) -> None:
    """/etc and /usr/bin hold files of groups the slot does not map (shadow): the slot cannot
    change them, and a restore of the whole directory leaves them be while undoing every change."""
    async with image_slot(image_host, roots_image) as slot:
        await slot.sh("echo forged > /etc/motd; printf '#!/bin/sh\\necho fake\\n' > /usr/bin/pytest; "
                      "chmod 755 /usr/bin/pytest; rm /usr/bin/yes")
        program = ("import os, hashlib\ndef verify(ws, secrets, args):\n"
                   "    return {'score': 1.0, 'motd': open(ROOT + '/etc/motd').read()[:40], "
                   "'pytest': os.path.exists(ROOT + '/usr/bin/pytest'), "
                   "'yes': os.path.exists(ROOT + '/usr/bin/yes')}\n")
        result = await slot.client.verify(slot.lease.slot, VerifyRequest(
            lease=slot.lease.lease, program=program, restore=["/etc", "/usr/bin"]))
        assert result.ok, result.error
        assert result.verdict is not None
        _, motd, _ = docker_run(roots_image, "head -c 40 /etc/motd")
        assert result.verdict == {"score": 1.0, "motd": motd, "pytest": False, "yes": True}


def _tree(root: Path) -> dict[str, tuple[object, ...]]:
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            opaque = None
            if os.path.isdir(path) and not os.path.islink(path):
                try:
                    opaque = os.getxattr(path, "trusted.overlay.opaque", follow_symlinks=False)
                except OSError:
                    opaque = None
            out[os.path.relpath(path, root)] = (
                st.st_mode, st.st_uid, st.st_gid, st.st_size if not os.path.isdir(path) else 0,
                os.readlink(path) if os.path.islink(path) else None, st.st_rdev, opaque)
    return out


@pytest.mark.parametrize("name", ["layered", "pyenv"])
def test_layers_copied_from_the_engine_equal_the_exported_ones(tmp_path: Path, task_image: Any, name: str) -> None:
    """Where the engine on this machine has the image unpacked, only the missing layers are copied
    from its layer dirs (no export of the whole image); the store ends up exactly as the export
    would make it: whiteouts, opaque dirs, owners, modes, links."""
    from atropos.sandbox.host.images.layer_store import LayerStore
    from atropos.sandbox.host.images.sources import import_from_docker, import_from_engine_dirs

    ref = task_image(name)
    copied, exported = LayerStore(tmp_path / "copied"), LayerStore(tmp_path / "exported")
    got = import_from_engine_dirs(copied, ref)
    if got is None:
        pytest.skip("the engine here does not keep overlay2 layer dirs this process can read")
    want = import_from_docker(exported, ref)
    assert got.config == want.config and got.unpacked == want.unpacked
    for a, b in zip(got.layers, want.layers, strict=True):
        assert _tree(Path(a)) == _tree(Path(b)), a


async def test_a_derived_image_counts_against_the_budget_and_goes_once_unused(tmp_path: Path,
                                                                              task_image: Any) -> None:
    """docs/task-images.md, "Where images live": a derived image's layer is charged to the store's
    budget (one past what the images in use leave is refused, and leaves nothing), and once no host
    uses it, it is evicted like any image (its parent, in use, stays); its reference then says so."""
    from atropos.errors import ImageOverBudget, ImageRejected
    from atropos.sandbox.host.images.host_images import HostImages

    store = tmp_path / "store"
    images = HostImages(store, budget_bytes=1 << 40)
    parent = await images.get(ImageRef.parse(task_image("nopython")))
    upper = tmp_path / "upper"  # what a slot's writable layer holds after a group's setup
    upper.mkdir()
    (upper / "setup.txt").write_bytes(os.urandom(1 << 20))
    images.budget_bytes = images.disk_bytes() + (4 << 20)
    derived = await asyncio.to_thread(images.derive, parent, upper, None, frozenset())
    assert derived.lowers[:-1] == parent.lowers and (derived.lowers[-1] / "setup.txt").stat().st_size == 1 << 20
    (upper / "big.bin").write_bytes(os.urandom(8 << 20))  # past what the held images leave
    before = sorted(p.name for p in (store / "layers").iterdir())
    with pytest.raises(ImageOverBudget, match="budget"):
        await asyncio.to_thread(images.derive, parent, upper, None, frozenset())
    assert sorted(p.name for p in (store / "layers").iterdir()) == before
    assert not list((store / "tmp").glob("derive-*"))  # nothing left of the refused copy
    images.budget_bytes = images.disk_bytes() - 1  # over budget now: what no host uses may go
    images.trim()
    assert derived.lowers[-1].is_dir()  # still in use: it stays
    images.images[derived.image_id].last_used -= 10_000  # unused for long, no slot on it
    images._drop_idle()
    images.trim()
    assert not derived.lowers[-1].exists() and all(p.is_dir() for p in parent.lowers)
    with pytest.raises(ImageRejected, match="no longer in the image store"):
        await images.get(ImageRef.parse(derived.image_id))
