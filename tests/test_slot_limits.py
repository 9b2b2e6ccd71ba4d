"""Per-slot caps hold for the slot as a whole (atropos/sandbox/host/isolation/cgroups.py), on local and Docker hosts.

Each attack is one a hostile policy can mount through the public API: many processes that each stay
under RLIMIT_AS, pages parked in memfds and tmpfs mounts (in no process's RSS), a fork bomb, a CPU
burner. The slot's cgroup must bound it (the kernel refuses or OOM-kills inside that slot only) while
the neighbour slot on the same host keeps working. The kernel's own counters (read on this machine,
where the engine runs) say what the slot held at its peak.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from atropos.backends.base import Backend
from atropos.errors import HostUnavailable
from atropos.sandbox.contract.cgroupfs import own_cgroups
from atropos.slots.config import PoolConfig
from atropos.slots.lease import Lease
from atropos.slots.pool import SlotPool
from tests.pool_backends import BACKENDS, DATA_ROOT, DOCKER_IMAGE, require_docker

MEM_CAP = 256 << 20
PIDS_CAP = 64
CPU_CAP = 0.3
V1 = Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists()
pytestmark = pytest.mark.skipif(not V1 and not Path("/sys/fs/cgroup/cgroup.controllers").exists(),
                                reason="no cgroup hierarchy mounted at /sys/fs/cgroup")


def make_capped_backend(kind: str, pool_id: str) -> Backend:
    if kind == "local":
        from atropos.backends.local import LocalBackend, LocalBackendConfig

        return LocalBackend(LocalBackendConfig(slots_per_host=2, pool_id=pool_id, data_root=DATA_ROOT,
                                               max_timeout_s=120, slot_memory_bytes=MEM_CAP, slot_pids=PIDS_CAP,
                                               slot_cpus=CPU_CAP))
    require_docker()
    from atropos.backends.docker import DockerBackend, DockerBackendConfig

    return DockerBackend(DockerBackendConfig(image=DOCKER_IMAGE, slots_per_host=2, pool_id=pool_id, cpus=1.0,
                                             memory_bytes=1 << 30, workspace_bytes=900 << 20,
                                             slot_workspace_bytes=400 << 20, max_timeout_s=120,
                                             slot_memory_bytes=MEM_CAP, slot_pids=PIDS_CAP, slot_cpus=CPU_CAP))


@pytest.fixture(params=BACKENDS)
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, Lease, Lease]]:
    kind = request.param
    pool_id = f"caps{kind[0]}{int(time.time() * 1000) % 10**8}"
    async with SlotPool(make_capped_backend(kind, pool_id), PoolConfig(pool_id=pool_id, min_hosts=1,
                                                                       max_hosts=1)) as pool:
        async with pool.leased("hostile") as a, pool.leased("neighbour") as b:
            assert a.host.id == b.host.id, "premise: both slots on one host"
            yield kind, a, b


def slot_cgroup(kind: str, lease: Lease, hierarchy: str) -> Path:
    """The slot's cgroup directory in a v1 hierarchy (``memory``, ``pids``, ``cpu``) of this machine."""
    name = f"slot-{lease.slot}"
    if kind == "docker":
        # the host inside names its subtree atropos-<hostname>-<pid>: the only one in its container's
        [found] = (Path("/sys/fs/cgroup") / hierarchy / "atropos" / lease.host.id / "slots").glob(f"atropos-*/{name}")
        return found
    pid = lease.host.info.labels["pid"]
    own = own_cgroups(pid)[hierarchy].lstrip("/")
    return Path("/sys/fs/cgroup") / hierarchy / own / f"atropos-{pid}" / name


def counter(path: Path, key: str | None = None) -> int:
    text = path.read_text()
    if key is None:
        return int(text)
    return next(int(v) for k, v in (line.split() for line in text.splitlines()) if k == key)


needs_v1 = pytest.mark.skipif(not V1, reason="the kernel counters read here are cgroup v1's (this machine and CI)")

HOG = ("python3 -c \"import time; b = bytearray(b'x') * (100 << 20); print('held', flush=True); "
       "time.sleep(4)\"")


@needs_v1
async def test_many_processes_share_one_memory_cap(pair: tuple[str, Lease, Lease]) -> None:
    kind, a, b = pair
    mem = slot_cgroup(kind, a, "memory")
    assert counter(mem / "memory.limit_in_bytes") == MEM_CAP
    # five processes of 100 MiB each, every one far below RLIMIT_AS: only the slot's cap stops them
    hog = asyncio.create_task(a.bash(f"for i in 1 2 3 4 5; do {HOG} & done; wait; echo done", timeout_s=90))
    neighbour = await b.bash("python3 -c \"b = bytearray(b'x') * (150 << 20); print('neighbour ok')\"",
                             timeout_s=90)
    out = await hog
    held = out["stdout"].count("held")
    assert held < 5, f"all five 100 MiB processes ran at once in a {MEM_CAP >> 20} MiB slot: {out}"
    assert "Killed" in out["stderr"], out
    assert counter(mem / "memory.max_usage_in_bytes") <= MEM_CAP
    assert counter(mem / "memory.oom_control", "oom_kill") >= 1
    assert "neighbour ok" in neighbour["stdout"], neighbour
    assert counter(slot_cgroup(kind, b, "memory") / "memory.oom_control", "oom_kill") == 0
    assert (await a.bash("echo alive"))["stdout"] == "alive\n"


@needs_v1
async def test_memfd_pages_count_against_the_slot(pair: tuple[str, Lease, Lease]) -> None:
    kind, a, b = pair
    mem = slot_cgroup(kind, a, "memory")
    # pages in a memfd are in no process's RSS; the session keeps it between calls
    held = await a.python_session("import os\nfd = os.memfd_create('park')\n"
                                  "for _ in range(160): os.write(fd, b'x' * (1 << 20))\nprint(os.fstat(fd).st_size)")
    assert held["stdout"].strip() == str(160 << 20), held
    assert counter(mem / "memory.usage_in_bytes") >= 160 << 20, "the memfd's pages are charged to the slot"
    # what the slot holds already counts: another 160 MiB does not fit next to it. The kernel's OOM
    # killer picks its victim among the slot's processes (all at oom_score_adj 1000): the writer (or
    # the supervisor running it), or the session holding the first memfd, whose pages then go
    out = await a.bash("python3 -c \"import os\nfd = os.memfd_create('more')\n"
                       "for _ in range(160): os.write(fd, b'x' * (1 << 20))\nprint('filled')\"", timeout_s=90)
    if "filled" in out["stdout"]:
        held = await a.python_session("print(os.fstat(fd).st_size)")
        assert held.session_started and held.error, ("both 160 MiB memfds were held at once", out, held)
    assert counter(mem / "memory.max_usage_in_bytes") <= MEM_CAP
    neighbour = await b.bash("python3 -c \"import os\nfd = os.memfd_create('n')\n"
                             "for _ in range(160): os.write(fd, b'x' * (1 << 20))\nprint('neighbour ok')\"")
    assert "neighbour ok" in neighbour["stdout"], neighbour


@needs_v1
async def test_tmpfs_pages_count_against_the_slot(pair: tuple[str, Lease, Lease]) -> None:
    kind, a, b = pair
    mem = slot_cgroup(kind, a, "memory")
    # each write fits its own tmpfs (/tmp 256 MiB, /dev/shm 64 MiB, the workspace's cap); together
    # they exceed the slot's memory
    out = await a.bash("head -c 60M /dev/zero > /dev/shm/s; head -c 120M /dev/zero > /tmp/t; "
                       "head -c 120M /dev/zero > w; sync; du -scb /dev/shm/s /tmp/t w 2>/dev/null | tail -1",
                       timeout_s=90)
    stored = int(out["stdout"].split()[0]) if out["stdout"].strip() else 0
    assert stored < 300 << 20, f"the slot stored {stored} bytes in tmpfs with a {MEM_CAP} byte cap: {out}"
    assert counter(mem / "memory.max_usage_in_bytes") <= MEM_CAP
    neighbour = await b.bash("head -c 200M /dev/zero > w && du -b w | cut -f1", timeout_s=90)
    assert neighbour["stdout"].strip() == str(200 << 20), neighbour
    # a reset gives the pages back: the workspace and the sandbox's tmpfs mounts are gone
    await a.reset()
    assert counter(mem / "memory.usage_in_bytes") < 100 << 20
    assert (await a.bash("echo alive"))["stdout"] == "alive\n"


FORKS = """
import os, time
pids = []
try:
    for _ in range({n}):
        pid = os.fork()
        if pid == 0:
            time.sleep(20)
            os._exit(0)
        pids.append(pid)
except OSError as exc:
    print('refused', exc.errno)
print('forked', len(pids), flush=True)
for p in pids:
    os.kill(p, 9)
"""


@needs_v1
async def test_fork_bomb_is_contained_per_slot(pair: tuple[str, Lease, Lease]) -> None:
    kind, a, b = pair
    pids = slot_cgroup(kind, a, "pids")
    assert counter(pids / "pids.max") == PIDS_CAP
    bomb = await a.ok("python", {"code": FORKS.format(n=500)}, timeout_s=90)
    forked = int(bomb["stdout"].split("forked")[1].split()[0])
    assert "refused" in bomb["stdout"] and forked < PIDS_CAP, bomb
    assert counter(pids / "pids.events", "max") >= 1, "the slot's cgroup refused the forks"
    # the neighbour's processes are its own: 40 at once is fine there
    neighbour = await b.ok("python", {"code": FORKS.format(n=40)}, timeout_s=90)
    assert "forked 40" in neighbour["stdout"] and "refused" not in neighbour["stdout"], neighbour
    assert (await a.bash("echo alive"))["stdout"] == "alive\n"


BURN = """
import os, time
t0 = time.monotonic()
kids = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        while time.monotonic() - t0 < 4:
            pass
        os._exit(0)
    kids.append(pid)
for k in kids:
    os.waitpid(k, 0)
c = os.times()
print((c.children_user + c.children_system) / (time.monotonic() - t0))
"""


@needs_v1
async def test_cpu_quota_holds_for_the_slot_as_a_whole(pair: tuple[str, Lease, Lease]) -> None:
    kind, a, _ = pair
    cpu = slot_cgroup(kind, a, "cpu")
    assert counter(cpu / "cpu.cfs_quota_us") == int(CPU_CAP * counter(cpu / "cpu.cfs_period_us"))
    out = await a.ok("python", {"code": BURN}, timeout_s=90)
    used = float(out["stdout"])
    # two busy processes: the quota is a ceiling for both together (the kernel throttles the
    # cgroup), whatever else the machine does; one period of slack for the edges
    assert used <= CPU_CAP + 0.1, f"the slot used {used:.2f} CPUs with a {CPU_CAP} CPU quota"
    if used >= 0.8 * CPU_CAP:  # it reached its quota (a loaded machine may give it less anyway)
        assert counter(cpu / "cpu.stat", "nr_throttled") >= 1


async def test_every_process_of_a_slot_runs_in_its_cgroup(pair: tuple[str, Lease, Lease]) -> None:
    """Placed before bwrap runs: bwrap, the sandbox's init, the supervisor and what the call forks."""
    kind, a, b = pair
    call = asyncio.create_task(a.bash("sleep 7 & sleep 7 & wait", timeout_s=60))
    hierarchy = "pids" if V1 else ""
    members: list[int] = []
    for _ in range(100):
        members = [int(p) for p in (slot_cgroup(kind, a, hierarchy) / "cgroup.procs").read_text().split()]
        if sum(_comm(p) == "sleep" for p in members) == 2:
            break
        await asyncio.sleep(0.1)
    comms = [_comm(p) for p in members]
    assert comms.count("sleep") == 2 and "bwrap" in comms, comms
    # and nothing the host runs besides its sandboxes: the host itself stays outside
    host_pid = int(a.host.info.labels["pid"]) if kind == "local" else None
    assert host_pid not in members
    neighbours = (slot_cgroup(kind, b, hierarchy) / "cgroup.procs").read_text().split()
    assert not set(neighbours) & {str(p) for p in members}
    await call


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _run_host(*extra: str) -> tuple[dict[str, object], str]:
    import json
    import os
    import secrets
    import shutil
    import subprocess
    import sys

    # not under pytest's tmp_path: slot uids must traverse to their workspace (see conftest)
    data = Path(f"/tmp/atropos-test-caps-{os.getpid()}-{secrets.token_hex(3)}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "atropos.sandbox", "--port", "0", "--slots", "1", "--data-dir", str(data),
         "--workspace-bytes", "0", "--no-prewarm", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "ATROPOS_SANDBOX_TOKEN": "t"},
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline() or b"{}")
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=60)
        shutil.rmtree(data, ignore_errors=True)
    return ready, stderr.decode()


def test_host_without_a_writable_cgroup_refuses_to_start(tmp_path: Path) -> None:
    not_a_cgroup = tmp_path / "cg"
    not_a_cgroup.mkdir()
    ready, stderr = _run_host("--cgroup-dir", str(not_a_cgroup))
    assert ready == {}, "the host started without per-slot caps"
    assert "error: isolation unavailable:" in stderr and "--unsafe-no-cgroups" in stderr, stderr


def test_unsafe_no_cgroups_starts_with_a_loud_warning() -> None:
    ready, stderr = _run_host("--unsafe-no-cgroups")
    assert ready.get("event") == "ready" and ready.get("slot_cgroups") == "none", (ready, stderr)
    warnings = [line for line in stderr.splitlines() if "UNSAFE" in line]
    assert warnings and "WITHOUT per-slot cgroups" in warnings[0], stderr


def test_default_host_runs_every_slot_in_a_capped_cgroup() -> None:
    ready, stderr = _run_host()
    assert ready.get("slot_cgroups") in ("v1", "v2"), (ready, stderr)


async def _docker_host_output(**config: object) -> tuple[dict[str, object], str]:
    """Start one Docker host (DockerBackendConfig fields ``config``): its ready line and its log, or
    ({}, the start's error, which carries the container's log) when it did not start."""
    import json

    backend = make_capped_backend("docker", f"capsd{int(time.time() * 1000) % 10**8}")
    for name, value in config.items():
        setattr(backend.cfg, name, value)  # type: ignore[attr-defined]
    try:
        try:
            info = await backend.start_host()
        except HostUnavailable as exc:
            return {}, str(exc)
        container = await asyncio.to_thread(backend.client.containers.get, info.id)  # type: ignore[attr-defined]
        out = (await asyncio.to_thread(container.logs, stdout=True, stderr=False)).decode()
        err = (await asyncio.to_thread(container.logs, stdout=False, stderr=True)).decode()
        # the host's first line says it is non-dumpable (before its token is sent: launch.py), then ready
        events = [json.loads(line) for line in out.splitlines() if line.strip()]
        return next((e for e in events if e.get("event") != "undumpable"), {}), err
    finally:
        await backend.close()


@pytest.mark.docker
async def test_docker_host_without_a_delegated_cgroup_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A container whose host gets no writable cgroup (the backend delegates none, and does not say
    --unsafe-no-cgroups): Docker mounts the container's own cgroup read-only, so the host refuses."""
    from atropos.backends.docker import DockerBackend

    monkeypatch.setattr(DockerBackend, "_slot_cgroup_args", lambda self, host_id: (None, {}))
    ready, err = await _docker_host_output()
    assert ready == {}, "the host started without per-slot caps"
    assert "isolation unavailable:" in err and "--unsafe-no-cgroups" in err, err


@pytest.mark.docker
async def test_docker_unsafe_no_cgroups_starts_with_a_loud_warning() -> None:
    ready, err = await _docker_host_output(slot_cgroups=False)
    assert ready.get("event") == "ready" and ready.get("slot_cgroups") == "none", (ready, err)
    warnings = [line for line in err.splitlines() if "UNSAFE" in line]
    assert warnings and "WITHOUT per-slot cgroups" in warnings[0], err


@pytest.mark.docker
async def test_default_docker_host_runs_every_slot_in_a_capped_cgroup() -> None:
    ready, err = await _docker_host_output()
    assert ready.get("slot_cgroups") in ("v1", "v2"), (ready, err)


UNIFIED = Path("/sys/fs/cgroup/unified")


@pytest.mark.skipif(not (UNIFIED / "cgroup.procs").exists(), reason="no hybrid cgroup v2 hierarchy here")
def test_v2_placement_and_kill_on_a_real_unified_hierarchy() -> None:
    """What can be had of v2 on a v1 machine: the hybrid's unified hierarchy (no controllers bound
    to it, so no limits): placement before exec, cgroup.kill, and removal are v2's own."""
    import os
    import subprocess

    from atropos.sandbox.host.isolation.cgroups import SlotCgroup

    d = UNIFIED / f"atropos-test-{os.getpid()}"
    d.mkdir()
    if not (d / "cgroup.kill").exists():
        d.rmdir()
        pytest.skip("kernel without cgroup.kill (before 5.14)")
    cg = SlotCgroup("t", 2, {"": d})
    try:
        proc = subprocess.Popen([*cg.launcher(), "/bin/sh", "-c", "sleep 60 & sleep 60 & wait"])
        members: list[int] = []
        for _ in range(100):
            members = cg.pids()
            if len(members) == 3:
                break
            time.sleep(0.05)
        assert proc.pid in members and len(members) == 3, members
        for pid in members:
            assert own_cgroups(str(pid))[""] == f"/{d.name}"
        assert cg.kill() == []
        proc.wait(10)
        assert cg.pids() == []
    finally:
        cg.remove()
    assert not d.exists()


@needs_v1
def test_hosts_sweeping_the_same_stale_cgroups_at_once_never_fail_their_start() -> None:
    """Hosts that start together (a pool replacing killed hosts) sweep the same leftovers of dead
    hosts; a cgroup removed under one sweep by another must not fail that host's start."""
    import subprocess
    import threading

    from atropos.sandbox.contract.cgroupfs import mountinfo, remove_stale, v1_dir

    base = v1_dir(mountinfo(), own_cgroups(), "pids")
    assert base is not None
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer exists (a host SIGKILLed earlier)
    errors: list[BaseException] = []
    for _ in range(20):
        stale = base / f"atropos-{dead.pid}"
        for i in range(8):
            (stale / f"slot-{i}").mkdir(parents=True, exist_ok=True)

        def sweep() -> None:
            try:
                remove_stale(base)
            except BaseException as exc:  # any escape is the failure under test
                errors.append(exc)

        threads = [threading.Thread(target=sweep) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not stale.exists()
    assert errors == []
