"""A slot's cgroup is made once and lives as long as its slot (atropos/sandbox/host/isolation/cgroups.py):
every reset empties it and checks it, so the next lease gets the same caps and nothing of the last;
the uid sweep (atropos/sandbox/host/isolation/uidkill.py) catches what runs as the slot's uid outside it.

Each test acts from outside, as root on the host machine, where a slot's code cannot reach: it puts a
process into a slot's cgroup behind the host's back, runs one as the slot's uid outside it, changes a
cap, or freezes a process there so SIGKILL cannot end it, then releases the slot and looks at what
the reset did.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from atropos.sandbox.contract.cgroupfs import own_cgroups
from atropos.sandbox.contract.protocol import ResetResult
from tests.conftest import LeasedSlot, RunningHost, slot_path, start_host, stop_host

CG = Path("/sys/fs/cgroup")
PIDS_CAP = 64
MEM_CAP = 256 << 20
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="placing processes into another's cgroup needs root"),
    pytest.mark.skipif(not (CG / "pids" / "cgroup.procs").exists(),
                       reason="these tests read the v1 hierarchies (pids, memory, cpu, freezer) of this machine"),
]


@pytest.fixture
def capped_host() -> Iterator[RunningHost]:
    data = Path(f"/tmp/atropos-test-cgreuse-{os.getpid()}-{secrets.token_hex(3)}")
    running = start_host(data, slots=1, extra=["--slot-pids", str(PIDS_CAP), "--slot-memory-bytes", str(MEM_CAP),
                                               "--no-prewarm"])
    yield running
    stop_host(running)


@pytest.fixture
async def slot(capped_host: RunningHost) -> AsyncIterator[LeasedSlot]:
    client = capped_host.client()
    yield LeasedSlot(client, await client.lease(f"cg-{secrets.token_hex(3)}"))
    await client.aclose()


def slot_cgroup(host: RunningHost, hierarchy: str, index: int = 0) -> Path:
    pid = str(host.proc.pid)
    return CG / hierarchy / own_cgroups(pid)[hierarchy].lstrip("/") / f"atropos-{pid}" / f"slot-{index}"


def members(host: RunningHost) -> set[int]:
    return {int(p) for p in (slot_cgroup(host, "pids") / "cgroup.procs").read_text().split()}


def caps(host: RunningHost) -> tuple[str, str]:
    return ((slot_cgroup(host, "pids") / "pids.max").read_text().strip(),
            (slot_cgroup(host, "memory") / "memory.limit_in_bytes").read_text().strip())


def place(host: RunningHost, pid: int, index: int = 0) -> None:
    """Into the slot's cgroup in every hierarchy the host uses, as the host's placer does."""
    for hierarchy in ("pids", "memory", "cpu"):
        (slot_cgroup(host, hierarchy, index) / "cgroup.procs").write_text(str(pid))


def gone(proc: subprocess.Popen[bytes], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return True
        time.sleep(0.05)
    return False


async def release(slot: LeasedSlot) -> tuple[bool, str]:
    res = await slot.client.release(slot.lease.slot, slot.lease.lease)
    return res.quarantined, res.detail


async def test_the_next_lease_gets_the_same_cgroup_empty_and_capped(capped_host: RunningHost, slot: LeasedSlot) -> None:
    out = await slot.sh("sleep 300 >/dev/null 2>&1 & echo started")
    assert out["stdout"] == "started\n", out
    directory = slot_cgroup(capped_host, "pids")
    inode = directory.stat().st_ino
    old = members(capped_host)
    assert old and caps(capped_host) == (str(PIDS_CAP), str(MEM_CAP))
    quarantined, detail = await release(slot)
    assert not quarantined, detail
    assert not members(capped_host) & old, "a process of the last lease is still in the slot's cgroup"
    again = LeasedSlot(slot.client, await slot.client.lease("next"))
    assert (await again.sh("echo fresh"))["stdout"] == "fresh\n"
    assert directory.stat().st_ino == inode, "the slot's cgroup was made again rather than reused"
    assert caps(capped_host) == (str(PIDS_CAP), str(MEM_CAP))
    assert not members(capped_host) & old


async def test_a_process_put_into_a_slots_cgroup_from_outside_dies_at_the_reset(capped_host: RunningHost,
                                                                               slot: LeasedSlot) -> None:
    """Not the slot's uid, not under its sandbox, invisible to the uid sweep: only the cgroup holds it."""
    intruder = subprocess.Popen(["sleep", "300"])
    try:
        place(capped_host, intruder.pid)
        assert intruder.pid in members(capped_host)
        quarantined, detail = await release(slot)
        assert not quarantined, detail
        assert gone(intruder), "the process in the slot's cgroup outlived the reset"
        assert intruder.returncode == -signal.SIGKILL
        again = LeasedSlot(slot.client, await slot.client.lease("next"))
        assert (await again.sh("echo fresh"))["stdout"] == "fresh\n"
    finally:
        intruder.kill()
        intruder.wait()


async def test_a_slot_whose_caps_changed_is_quarantined_at_its_reset(capped_host: RunningHost,
                                                                     slot: LeasedSlot) -> None:
    """The cgroup outlives the lease, so its caps must: a slot that would run uncapped never goes back."""
    (slot_cgroup(capped_host, "pids") / "pids.max").write_text("max")
    quarantined, detail = await release(slot)
    assert quarantined and "pids" in detail and "max" in detail, detail
    infos = await slot.client.slots()
    assert infos[0].state == "quarantined"


async def test_a_process_that_survives_sigkill_in_the_slots_cgroup_quarantines_the_slot(
        capped_host: RunningHost, slot: LeasedSlot) -> None:
    """A v1-frozen process does not die of SIGKILL until it is thawed: the reset's kill loop gives up
    (after its deadline) and the slot is quarantined, never leased beside the survivor."""
    freezer = CG / "freezer" / f"atropos-test-{os.getpid()}-{secrets.token_hex(3)}"
    if not (CG / "freezer" / "cgroup.procs").exists():
        pytest.skip("no v1 freezer hierarchy to hold a process through SIGKILL")
    freezer.mkdir()
    survivor = subprocess.Popen(["sleep", "300"])
    try:
        (freezer / "cgroup.procs").write_text(str(survivor.pid))
        place(capped_host, survivor.pid)
        (freezer / "freezer.state").write_text("FROZEN")
        quarantined, detail = await release(slot)
        assert quarantined and str(survivor.pid) in detail, detail
        infos = await slot.client.slots()
        assert infos[0].state == "quarantined"
    finally:
        (freezer / "freezer.state").write_text("THAWED")
        survivor.kill()
        survivor.wait()
        _remove_cgroup(freezer)


async def test_a_non_dumpable_process_of_the_slot_uid_outside_its_cgroup_dies_at_the_reset(
        capped_host: RunningHost, slot: LeasedSlot) -> None:
    """Not in the slot's cgroup, not under its sandbox: only the uid sweep holds it. It made itself
    non-dumpable, so its /proc files read as root's: the sweep must still see the slot's uid."""
    uid = slot_path(capped_host.data_dir, slot.lease.slot).stat().st_uid
    assert uid != 0
    code = "import ctypes, time; ctypes.CDLL(None).prctl(4, 0, 0, 0, 0); time.sleep(300)"  # PR_SET_DUMPABLE 0
    intruder = subprocess.Popen(["/usr/bin/python3", "-c", code], user=uid, group=uid, extra_groups=[])
    try:
        for _ in range(100):  # until the prctl has run
            if os.stat(f"/proc/{intruder.pid}/status").st_uid == 0:
                break
            time.sleep(0.05)
        assert os.stat(f"/proc/{intruder.pid}/status").st_uid == 0, "the intruder did not become non-dumpable"
        assert intruder.pid not in members(capped_host)
        quarantined, detail = await release(slot)
        assert not quarantined, detail
        assert gone(intruder), "a process of the slot's uid outlived the reset"
        assert intruder.returncode == -signal.SIGKILL
    finally:
        intruder.kill()
        intruder.wait()


async def test_a_slot_whose_processes_are_slow_to_die_holds_up_no_other_slots_reset() -> None:
    """A group of slots released at once: those whose cgroup still holds a process (here frozen, so
    SIGKILL cannot end it until it is thawed) are waited for without holding up the others. The
    wait used to hold one of the host's few worker threads each (as many as the event loop's
    default executor has, 4 + cores), so the uid sweep of every other reset queued behind them
    until they gave up. The slots waited for reset cleanly once their processes die."""
    if not (CG / "freezer" / "cgroup.procs").exists():
        pytest.skip("no v1 freezer hierarchy to hold a process through SIGKILL")
    slow = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor: every worker thread
    data = Path(f"/tmp/atropos-test-cgslow-{os.getpid()}-{secrets.token_hex(3)}")
    host = start_host(data, slots=slow + 1, extra=["--slot-pids", str(PIDS_CAP), "--no-prewarm"])
    client = host.client()
    freezer = CG / "freezer" / f"atropos-test-{os.getpid()}-{secrets.token_hex(3)}"
    freezer.mkdir()
    survivors: list[subprocess.Popen[bytes]] = []
    held: list[asyncio.Task[ResetResult]] = []
    try:
        leases = [await client.lease(f"group-{i}") for i in range(slow + 1)]
        for lease in leases[:slow]:
            survivor = subprocess.Popen(["sleep", "300"])
            survivors.append(survivor)
            (freezer / "cgroup.procs").write_text(str(survivor.pid))
            place(host, survivor.pid, lease.slot)
        (freezer / "freezer.state").write_text("FROZEN")
        held += [asyncio.create_task(client.release(lease.slot, lease.lease)) for lease in leases[:slow]]
        free = asyncio.create_task(client.release(leases[-1].slot, leases[-1].lease))
        done, _ = await asyncio.wait([*held, free], return_when=asyncio.FIRST_COMPLETED)
        assert done == {free}, "a reset waited for other slots' processes to die"
        assert not free.result().quarantined, free.result().detail
        assert all(s.poll() is None for s in survivors)  # still frozen: the others are still waiting
        (freezer / "freezer.state").write_text("THAWED")
        for result in await asyncio.gather(*held):
            assert not result.quarantined, result.detail
        assert all(gone(s) for s in survivors)
        assert all(s.returncode == -signal.SIGKILL for s in survivors)
    finally:
        (freezer / "freezer.state").write_text("THAWED")
        for task in held:
            task.cancel()
        for survivor in survivors:
            survivor.kill()
            survivor.wait()
        await client.aclose()
        stop_host(host)
        _remove_cgroup(freezer)


def _remove_cgroup(path: Path) -> None:
    """rmdir a cgroup once the kernel has let go of its last (killed, thawed) task."""
    for _ in range(50):
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.1)
