"""A slot's cgroup is made once and lives as long as its slot (atropos/sandbox/host/isolation/cgroups.py):
every reset empties it and checks it, so the next lease gets the same caps and nothing of the last.

Each test acts from outside, as root on the host machine, where a slot's code cannot reach: it puts a
process into a slot's cgroup behind the host's back, changes a cap, or freezes a process there so
SIGKILL cannot end it, then releases the slot and looks at what the reset did.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from atropos.sandbox.contract.cgroupfs import own_cgroups
from tests.conftest import LeasedSlot, RunningHost, start_host, stop_host

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


def slot_cgroup(host: RunningHost, hierarchy: str) -> Path:
    pid = str(host.proc.pid)
    return CG / hierarchy / own_cgroups(pid)[hierarchy].lstrip("/") / f"atropos-{pid}" / "slot-0"


def members(host: RunningHost) -> set[int]:
    return {int(p) for p in (slot_cgroup(host, "pids") / "cgroup.procs").read_text().split()}


def caps(host: RunningHost) -> tuple[str, str]:
    return ((slot_cgroup(host, "pids") / "pids.max").read_text().strip(),
            (slot_cgroup(host, "memory") / "memory.limit_in_bytes").read_text().strip())


def place(host: RunningHost, pid: int) -> None:
    """Into the slot's cgroup in every hierarchy the host uses, as the host's placer does."""
    for hierarchy in ("pids", "memory", "cpu"):
        (slot_cgroup(host, hierarchy) / "cgroup.procs").write_text(str(pid))


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
        for _ in range(50):
            try:
                freezer.rmdir()
                break
            except OSError:
                time.sleep(0.1)
