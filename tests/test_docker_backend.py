"""Docker backend specifics: the container's isolation options as the engine reports them, and no
container leaked by a host start that is cancelled half way, the host token in no environment, command
line or file. Needs an engine (always in CI)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import LeasedSlot

from atropos.errors import AuthenticationError
from atropos.sandbox.contract.client import HostClient
from atropos.sandbox.contract.hosttoken import token_verifier
from atropos.sandbox.contract.launch import HOST_TOKEN_ENV
from atropos.slots.config import PoolConfig
from atropos.slots.pool import SlotPool
from tests import test_image_roots as image_roots
from tests.pool_backends import make_backend
from tests.task_images import docker_run

pytestmark = pytest.mark.docker


def _labelled(pool_id: str) -> list[str]:
    from atropos.backends.docker import LABEL_POOL

    out = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={LABEL_POOL}={pool_id}"],
                         capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.split()


def _proc_status(pid: str) -> dict[str, str] | None:
    """/proc/<pid>/status of a container process as seen from this (the engine's) machine."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            return {k: v.strip() for k, _, v in (line.partition(":") for line in fh)}
    except OSError:
        return None


async def test_pool_container_runs_with_the_isolation_options() -> None:
    from atropos.backends.docker import CONTAINER_PORT, LABEL_BOOT, LABEL_HOST, LABEL_OWNER, LABEL_POOL, boot_id

    backend = make_backend("docker", slots=2)
    pool_id = backend.cfg.pool_id  # type: ignore[attr-defined]
    async with SlotPool(backend, PoolConfig(pool_id=pool_id, min_hosts=1, max_hosts=1)) as pool:
        async with pool.leased("inspected") as lease:
            # a slot sandbox (bwrap + supervisor) and its call are running when we look
            call = asyncio.create_task(lease.bash("sleep 2"))
            await asyncio.sleep(0.5)
            container: Any = await asyncio.to_thread(backend.client.containers.get, lease.host.id)  # type: ignore[attr-defined]
            attrs, hc = container.attrs, container.attrs["HostConfig"]

            assert hc["Privileged"] is False
            assert hc["CapDrop"] == ["ALL"] and not hc.get("CapAdd")
            assert attrs["Config"]["User"] == "1000:1000"
            opts = hc["SecurityOpt"]
            assert "no-new-privileges" in opts
            assert any(o.startswith("seccomp=") and "unconfined" not in o for o in opts), "the shipped profile"
            assert hc["ReadonlyRootfs"] is True and hc["Init"] is True
            # limits set
            assert hc["PidsLimit"] and hc["PidsLimit"] > 0
            assert hc["Memory"] > 0 and hc["MemorySwap"] == hc["Memory"]
            assert hc["NanoCpus"] > 0
            # per-slot caps: the container in its budget cgroup, the slots' subtree mounted beside it
            from atropos.backends.docker_cgroups import CONTAINER_CGROUP_DIR

            assert hc["CgroupParent"] == f"/atropos/{lease.host.id}"
            mounts = {m["Destination"]: m for m in attrs["Mounts"]}
            cg_mounts = [m for d, m in mounts.items() if d.startswith(CONTAINER_CGROUP_DIR)]
            assert cg_mounts and all(m["RW"] and f"/atropos/{lease.host.id}/slots" in m["Source"] for m in cg_mounts)
            cmd = attrs["Config"]["Cmd"]
            assert f"--cgroup-dir={CONTAINER_CGROUP_DIR}" in cmd and "--unsafe-no-cgroups" not in cmd
            # the API port: published, and on loopback only (configured and as actually bound)
            bindings = hc["PortBindings"][f"{CONTAINER_PORT}/tcp"]
            assert bindings and all(b["HostIp"] == "127.0.0.1" for b in bindings)
            published = attrs["NetworkSettings"]["Ports"][f"{CONTAINER_PORT}/tcp"]
            assert published and all(b["HostIp"] == "127.0.0.1" for b in published)
            assert all(not v for k, v in attrs["NetworkSettings"]["Ports"].items() if k != f"{CONTAINER_PORT}/tcp")
            labels = attrs["Config"]["Labels"]
            assert labels[LABEL_POOL] == pool_id and labels[LABEL_HOST] == lease.host.id
            assert labels[LABEL_OWNER] == str(os.getpid()) and labels[LABEL_BOOT] == boot_id()

            # Every process in the container, real/effective/saved/fs ids alike: none is uid or gid 0
            # (systempaths=unconfined is only safe that way, isolation.md 4.4).
            top = await asyncio.to_thread(container.top, ps_args="-eo pid,ruid,euid,suid,fuid,rgid,egid,sgid,fgid,args")
            titles, procs = top["Titles"], top["Processes"]
            # the slot's sandbox is in the table (its supervisor: slotd, or the Python one)
            assert any("supervisor.py" in p[-1] or p[-1].startswith("/run/atropos/slotd") for p in procs), procs
            for proc in procs:
                ids = dict(zip(titles, proc, strict=True))
                zero = [t for t in titles[1:-1] if ids[t] == "0"]
                assert not zero, f"{ids['COMMAND']} runs with {zero} = 0"
            # Where /proc of the engine's machine is ours to read: no capability left to any process
            # in the container's own user namespace (bwrap's inner namespaces hold caps over nothing).
            statuses = {p[0]: _proc_status(p[0]) for p in procs}
            if all(statuses.values()):
                init_ns = os.readlink(f"/proc/{procs[0][0]}/ns/user")
                for pid, st in statuses.items():
                    assert st is not None
                    assert all(v != "0" for v in st["Uid"].split() + st["Gid"].split()), (pid, st["Uid"])
                    assert st["NoNewPrivs"] == "1", pid
                    if os.readlink(f"/proc/{pid}/ns/user") == init_ns:
                        assert int(st["CapEff"], 16) == 0 and int(st["CapPrm"], 16) == 0, (pid, st["CapEff"])
            await call


@pytest.mark.parametrize("cancel_when", ["during create", "after create"])
async def test_a_cancelled_host_start_leaks_no_container(cancel_when: str) -> None:
    backend = make_backend("docker", slots=1)
    pool_id = backend.cfg.pool_id  # type: ignore[attr-defined]
    real: Callable[[str, str], Any] = backend._create  # type: ignore[attr-defined]
    created = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow_create(host_id: str, token: str) -> Any:
        # The engine is slow (a loaded machine): the cancel lands while the thread still works.
        if cancel_when == "during create":
            loop.call_soon_threadsafe(created.set)
            time.sleep(0.5)
            return real(host_id, token)
        container = real(host_id, token)
        loop.call_soon_threadsafe(created.set)
        time.sleep(0.5)
        return container

    backend._create = slow_create  # type: ignore[attr-defined]
    try:
        start = asyncio.create_task(backend.start_host())
        await asyncio.wait_for(created.wait(), 60)
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        # Whatever the engine thread went on to make must be gone, not just forgotten: wait past
        # the thread's end before looking.
        await asyncio.sleep(1.5)
        assert _labelled(pool_id) == []
        assert not backend._mine  # type: ignore[attr-defined]
    finally:
        await backend.close()
        leftovers = _labelled(pool_id)
        if leftovers:
            subprocess.run(["docker", "rm", "-f", *leftovers], capture_output=True, timeout=60)
    assert leftovers == []


def _files_holding(root: Path, needle: bytes, max_bytes: int = 1 << 20) -> list[str]:
    """Regular files under ``root`` (not followed into links) whose first ``max_bytes`` hold ``needle``."""
    found = []
    for path in root.rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file() and not path.is_symlink() and needle in path.read_bytes()[:max_bytes]:
                found.append(str(path))
    return found


async def test_the_host_token_is_in_no_environment_command_line_or_file() -> None:
    """Issue 27: the token reaches the container's host on its stdin, so it is in no environment
    block (``docker inspect``, /proc/<pid>/environ of docker-init, tini, the host and every slot
    process), on no command line and in no file of the container or of the engine's record of it,
    and the host serves with it. Issue 37: what the container gets is only the token's verifier
    (atropos/sandbox/contract/hosttoken.py), which no request can present; the verifier itself is
    looked for as well (as the token, had it leaked). Read from this machine, as root (inside the
    container even root could not: every capability is dropped and the host is non-dumpable)."""
    backend = make_backend("docker", slots=1)
    info = await backend.start_host()
    try:
        container: Any = await asyncio.to_thread(backend.client.containers.get, info.id)  # type: ignore[attr-defined]
        verifier = token_verifier(info.token)
        assert verifier != info.token and verifier.startswith("sha256:")
        async with HostClient(info.address, verifier) as held:  # what the container holds is no token
            with pytest.raises(AuthenticationError):
                await held.lease("verifier-probe")
        for token in (info.token.encode(), verifier.encode()):
            await _holds_no(container, info, token)
    finally:
        await backend.stop_host(info.id)
        await backend.close()


async def _holds_no(container: Any, info: Any, token: bytes) -> None:
    """``token`` is in no environment block, command line, log or file of ``container``, and its
    host serves calls."""
    config = container.attrs["Config"]
    text = token.decode()
    assert not any(HOST_TOKEN_ENV in e or text in e for e in config["Env"] or []), config["Env"]
    assert "--token-stdin" in config["Cmd"] and not any(text in a for a in config["Cmd"])
    assert config["Tty"] is False, "a terminal would echo the token into the container's log"
    assert text not in (await asyncio.to_thread(container.logs)).decode(errors="replace")

    async with HostClient(info.address, info.token) as client:
        slot = LeasedSlot(client, await client.lease("token-probe"))
        # a call succeeds (the host got its token), and its slot's processes run while we look
        assert (await slot.sh("echo ok"))["stdout"] == "ok\n"
        call = asyncio.create_task(slot.sh("sleep 2"))
        await asyncio.sleep(0.5)
        top = await asyncio.to_thread(container.top, ps_args="-eo pid,args")
        procs = {int(p[0]): p[-1] for p in top["Processes"]}
        assert any("atropos.sandbox" in a for a in procs.values()) and any("bwrap" in a for a in procs.values())
        read = 0
        for pid, args in procs.items():
            for what in ("environ", "cmdline"):
                try:
                    block = Path(f"/proc/{pid}/{what}").read_bytes()
                except FileNotFoundError:  # gone since `top`
                    continue
                except PermissionError:
                    pytest.skip("needs root on the engine's machine to read the container's processes")
                read += 1
                assert token not in block and HOST_TOKEN_ENV.encode() not in block, (pid, what, args)
        assert read >= 2 * 4, procs  # docker-init, tini, the host, its slot's sandbox at least
        await call
        await client.release(slot.lease.slot, slot.lease.lease)

    # no file of the container (its tmpfs mounts: the rest is the read-only image)...
    host_pid = next(pid for pid, args in procs.items() if "atropos.sandbox" in args and "tini" not in args)
    root = Path(f"/proc/{host_pid}/root")
    for mount in ("tmp", "slots"):
        assert _files_holding(root / mount, token) == [], mount
    # ...nor the engine's own record of the container (its config as the engine stores it)
    record = Path(f"/var/lib/docker/containers/{container.id}")
    if record.is_dir():
        assert _files_holding(record, token) == []


# -- task images ------------------------------------------------------------------------------------
roots_image = image_roots.roots_image  # the fixture: a root-owned /testbed, WorkingDir, Env, a whiteout


async def test_an_image_rooted_slot_on_a_docker_host_behaves_as_docker_run(task_image: Any, roots_image: str) -> None:
    """docs/task-images.md, "On the Ray and Docker backends": the container's host (uid 1000, no
    capability, no engine socket) gets the image from the pool's engine (its export streamed to the
    host) and unpacks it in a user namespace of its own; a slot leased with ``image=`` shows what
    ``docker run`` of that image shows: whiteouts and opaque directories across layers, and a
    root-owned ``/testbed`` as root's."""
    layered = task_image("layered")
    backend: Any = make_backend("docker", slots=2)
    api = backend.client.api
    exports: list[str] = []
    real_export = api.get_image

    def export(reference: str, *args: Any, **kw: Any) -> Any:  # the engine's real export, counted
        exports.append(reference)
        return real_export(reference, *args, **kw)

    api.get_image = export

    async def same_as_docker_run(lease: Any, ref: str, commands: list[str]) -> None:
        for command in commands:
            code, want, _ = docker_run(ref, command)
            result = await lease.bash(command)
            assert (result["exit_code"], result["stdout"]) == (code, want), (ref, command)

    async with SlotPool(backend, PoolConfig(pool_id=backend.cfg.pool_id, min_hosts=1, max_hosts=1,
                                            acquire_timeout_s=300)) as pool:
        a, b = await pool.lease_many(["img-a", "img-b"], image=layered)
        assert exports == [layered], "one shipment for the group's host"
        try:
            await same_as_docker_run(a, layered, image_roots.COMMON + image_roots.PER_IMAGE["layered"])
            await a.bash("echo only-a > /work/kept")  # the slots' roots are apart
            assert (await b.bash("cat /work/kept"))["stdout"] == "keep\n"
        finally:
            for lease in (a, b):
                await lease.release()
        async with pool.leased("img-roots", image=roots_image) as lease:
            await same_as_docker_run(lease, roots_image, [c for c in image_roots.COMMANDS if c != "id"])
        host = next(iter(pool.hosts.values()))
        engine_id = (await asyncio.to_thread(api.inspect_image, layered))["Id"]
        assert (layered, engine_id) in [(i.reference, i.id) for i in await host.client.images()]
        # a later lease finds it there under the engine's current id: nothing is shipped again
        async with pool.leased("img-c", image=layered) as c:
            assert (await c.bash("cat /work/kept"))["stdout"] == "keep\n"
        assert exports == [layered, roots_image]


async def test_the_image_store_on_an_operator_volume_outlives_the_containers(task_image: Any, tmp_path: Path) -> None:
    """``DockerBackendConfig.image_volume``: the hosts' layer store in a directory of the machine
    (not the container's tmpfs): an image shipped to one container's host is there after the
    container is gone, owned by the containers' uid, and a later pool's host serves it from there."""
    small = task_image("nopython")
    volume = tmp_path / "images"
    volume.mkdir()
    os.chown(volume, 1000, 1000)
    for round_ in range(2):
        backend: Any = make_backend("docker", slots=1)
        backend.cfg.image_volume = str(volume)
        async with SlotPool(backend, PoolConfig(pool_id=backend.cfg.pool_id, min_hosts=1, max_hosts=1,
                                                acquire_timeout_s=300)) as pool:
            async with pool.leased(f"vol-{round_}", image=small) as lease:
                out = await lease.bash("busybox true && echo ok")
                assert out["stdout"] == "ok\n", out
        layers = list((volume / "layers").iterdir())
        assert layers and all(p.stat().st_uid == 1000 for p in layers)
        assert list((volume / "images").glob("*.json"))


async def test_a_group_setup_on_a_docker_host_becomes_an_image_within_the_budget(roots_image: str,
                                                                                 tmp_path: Path) -> None:
    """docs/task-images.md, "A group's setup, once", on the Docker backend: the container's host
    (uid 1000, no capability) makes the setup slot's root an image of its own (the kernel's
    whiteouts copied in a user namespace of its own, the files its uid as the store's are); the
    other rollout of the group starts from it and its reset goes back to it; the derived layer is
    charged to the store's budget: a setup that wrote past it is refused (``image_over_budget``) and
    the slot keeps its root."""
    from atropos.errors import ImageOverBudget

    backend: Any = make_backend("docker", slots=2)
    volume = tmp_path / "images"  # on disk: the 160 MiB copy refused below is not the container's memory
    volume.mkdir()
    os.chown(volume, 1000, 1000)
    backend.cfg.image_volume = str(volume)
    backend.cfg.image_store_bytes = 320 << 20  # room for the image (~200 MiB unpacked), not for 160 MiB more
    listing = ("find / -xdev \\( -path /proc -o -path /tmp -o -path /dev \\) -prune -o -printf '%p %u %m\\n' "
               "| sort | md5sum")
    async with SlotPool(backend, PoolConfig(pool_id=backend.cfg.pool_id, min_hosts=1, max_hosts=1,
                                            acquire_timeout_s=300)) as pool:
        setup, rollout = await pool.lease_many(["derive-a", "derive-b"], image=roots_image)
        try:
            await setup.bash("echo setup > /testbed/setup.txt; rm /testbed/a.txt; mv /testbed/tests /testbed/t2; "
                             "rm -rf /opt/tool && mkdir /opt/tool && echo new > /opt/tool/only; "
                             "chmod 4711 /testbed/setup.txt")
            want = (await setup.bash(listing))["stdout"]
            derived = await setup.derive_image()
            assert derived.startswith("derived:")
            assert (await setup.bash(listing))["stdout"] == want  # the setup's slot continues on it
            await rollout.reset(image=derived)
            assert (await rollout.bash(listing))["stdout"] == want
            out = await rollout.bash("cat /testbed/setup.txt; ls /opt/tool; test -e /testbed/a.txt; echo $?; "
                                     "stat -c '%U %a' /testbed/setup.txt")
            assert out["stdout"] == "setup\nonly\n1\nroot 4711\n", out
            await rollout.bash("rm -rf /testbed")
            await rollout.reset(image=derived)
            assert (await rollout.bash(listing))["stdout"] == want
            host = next(iter(pool.hosts.values()))
            held = {i.reference: i for i in await host.client.images()}
            assert derived in held and held[derived].layers == held[roots_image].layers + 1

            await setup.bash("head -c 167772160 /dev/urandom > /testbed/big.bin")
            with pytest.raises(ImageOverBudget, match="budget"):
                await setup.derive_image()
            out = await setup.bash("ls -s --block-size=1M /testbed/big.bin; cat /testbed/setup.txt")
            assert out["stdout"] == "160 /testbed/big.bin\nsetup\n", out  # its root is untouched
        finally:
            for lease in (setup, rollout):
                await lease.release()
