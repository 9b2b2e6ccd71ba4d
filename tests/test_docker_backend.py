"""Docker backend specifics: the container's isolation options as the engine reports them, and no
container leaked by a host start that is cancelled half way. Needs an engine (always in CI)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest

from atropos.slots.config import PoolConfig
from atropos.slots.pool import SlotPool
from tests.pool_backends import make_backend

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
            assert any("supervisor.py" in p[-1] for p in procs), procs  # the slot's sandbox is in the table
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
