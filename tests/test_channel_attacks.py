"""Nobody but the two ends can reach the slot's protocol (issue 37): bubblewrap's init (PID 1 of every
sandbox) holds none of the host's pipes (its stdio is /dev/null but for bwrap's stderr, whose host end
is closed once the sandbox runs), the channel is on descriptors of the supervisor's own, and the
supervisor is non-dumpable. The attack of the issue, per backend and supervisor: code the agent left
in the warm interpreter (a user-site ``.pth``, which forks nothing) opens every ``/proc/1/fd/*`` and
``/proc/2/fd/*`` it can, writes replies for the env's next call into each and waits to read a
request; the env's next call must get its own answer and the attacker nothing of the host's.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import IMAGE_STORE, LeasedSlot, RunningHost, leased_slot, start_host, stop_host

# Run by the warm python3 at its start, between two calls (from the user site's .pth).
ATTACK = r'''
import json, os, select, struct, time
FAKE = {"ok": True, "result": {"exit_code": 0, "signal": None, "timed_out": False, "output_limited": False,
        "stdout": "INJECTED\n", "stderr": "", "stdout_bytes": 9, "stderr_bytes": 0, "stdout_truncated": False,
        "stderr_truncated": False, "duration_ms": 0.0}}
log = {"opened": [], "written": [], "read": "", "denied": []}
readers = []
own = [json.dumps({**FAKE, "seq": seq}).encode() for seq in range(1, 40)]
own = [struct.pack(">I", len(d)) + d for d in own]
for pid in ("1", "2"):
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError as exc:
        log["denied"].append(f"/proc/{pid}/fd: {exc.strerror}")
        continue
    for name in names:
        path = f"/proc/{pid}/fd/{name}"
        try:
            log["opened"].append(f"{path} -> {os.readlink(path)}")
        except OSError:
            pass
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            for frame in own:  # a reply for each of the host's next sequence numbers
                os.write(fd, frame)
            log["written"].append(path)
        except OSError as exc:
            log["denied"].append(f"{path} w: {exc.strerror}")
        try:
            readers.append(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        except OSError as exc:
            log["denied"].append(f"{path} r: {exc.strerror}")
end = time.monotonic() + 2.0
got = b""
while readers and time.monotonic() < end:  # the env's next request, if any pipe carried it
    ready, _, _ = select.select(readers, [], [], 0.1)
    for fd in ready:
        try:
            got += os.read(fd, 65536)
        except OSError:
            readers.remove(fd)
for frame in own:  # what it wrote into a pipe it also opened for reading comes back: not the host's
    got = got.replace(frame, b"")
log["read"] = got.decode("utf-8", "replace")
with open("/workspace/attack.json", "w") as fh:
    json.dump(log, fh)
'''


async def _plant(slot: LeasedSlot) -> None:
    """Through bash only (a file tool would hand a slotd sandbox to the Python supervisor)."""
    site = (await slot.sh("python3 -c 'import site; print(site.getusersitepackages())'"))["stdout"].strip()
    assert site.startswith("/workspace/"), site
    code = base64.b64encode(ATTACK.encode()).decode()
    r = await slot.sh(f"mkdir -p {site} && echo {code} | base64 -d > {site}/_atropos_attack.py"
                      f" && echo import _atropos_attack > {site}/zz_attack.pth"
                      " && echo \"the env's own answer\" > answer.txt")
    assert r["exit_code"] == 0, r


async def _attack(slot: LeasedSlot) -> dict[str, Any]:
    assert (await slot.ok("python", code="print(6 * 7)"))["stdout"] == "42\n"  # a warm python3 starts after it
    await asyncio.sleep(0.5)  # its start-up (the .pth) runs now, between calls
    for _ in range(3):  # the env's next calls: their own answers, whatever was written meanwhile
        r = await slot.ok("bash", command="cat answer.txt")
        assert r["stdout"] == "the env's own answer\n", r
    await asyncio.sleep(2.5)
    log = json.loads((await slot.sh("cat attack.json"))["stdout"])
    assert log["opened"] or log["denied"], log  # the attack ran
    assert log["read"] == "", log  # nothing of the host's: no request, no reply
    assert any(d.startswith("/proc/2/fd:") for d in log["denied"]), log  # the supervisor: non-dumpable
    for line in log["opened"]:
        if line.startswith("/proc/1/fd/"):  # init holds /dev/null, or bwrap's dead stderr pipe (fd 2)
            fd, target = line.removeprefix("/proc/1/fd/").split(" -> ")
            assert target == "/dev/null" or fd == "2" or not target.startswith("pipe:"), log
    return log


@pytest.fixture(scope="module")
def python_host() -> Iterator[RunningHost]:
    data = Path(f"/tmp/atropos-test-{os.getpid()}-{secrets.token_hex(3)}")  # slot uids traverse to it
    running = start_host(data, slots=1, extra=["--native-supervisor", "never", "--image-store", str(IMAGE_STORE)])
    yield running
    stop_host(running)


async def test_the_channel_is_out_of_reach_of_the_slot_on_slotd(host: RunningHost) -> None:
    async with leased_slot(host) as slot:
        await _plant(slot)
        log = await _attack(slot)
        assert "/proc/1/fd/0 -> /dev/null" in log["opened"] and "/proc/1/fd/1 -> /dev/null" in log["opened"], log
        procs = (await slot.sh("tr '\\0' ' ' < /proc/2/cmdline"))["stdout"]
        assert procs.startswith("/run/atropos/slotd "), procs  # slotd served throughout


async def test_the_channel_is_out_of_reach_of_the_slot_on_the_python_supervisor(python_host: RunningHost) -> None:
    async with leased_slot(python_host) as slot:
        await _plant(slot)
        log = await _attack(slot)
        assert "/proc/1/fd/0 -> /dev/null" in log["opened"] and "/proc/1/fd/1 -> /dev/null" in log["opened"], log


class _LeaseSlot:
    """A pool lease with the test slot's two calls (tests/conftest.py's LeasedSlot)."""

    def __init__(self, lease: Any) -> None:
        self.lease = lease

    async def sh(self, command: str) -> dict[str, Any]:
        return await self.lease.ok("bash", {"command": command})

    async def ok(self, tool: str, **args: Any) -> dict[str, Any]:
        return await self.lease.ok(tool, args)


@pytest.mark.docker
async def test_the_channel_is_out_of_reach_of_the_slot_on_docker() -> None:
    """On Docker the host runs as the slots' uid: before issue 37 the slot opened bwrap's init's stdio
    (the host's pipes) through /proc/1/fd and answered the env's next call. The image under test is
    ATROPOS_SANDBOX_IMAGE (build it with IMAGE_TAG=... scripts/build_image.sh)."""
    from atropos.slots.config import PoolConfig
    from atropos.slots.pool import SlotPool
    from tests.pool_backends import make_backend

    backend = make_backend("docker", slots=1)
    async with SlotPool(backend, PoolConfig(pool_id=backend.cfg.pool_id, min_hosts=1, max_hosts=1)) as pool:  # type: ignore[attr-defined]
        async with pool.leased("channel-attack") as lease:
            slot = _LeaseSlot(lease)
            await _plant(slot)  # type: ignore[arg-type]
            log = await _attack(slot)  # type: ignore[arg-type]
            assert "/proc/1/fd/0 -> /dev/null" in log["opened"], log
            assert "/proc/1/fd/1 -> /dev/null" in log["opened"], log
            # the /proc/2/fd the attack was refused is the supervisor's (slotd, or the Python one)
            procs = (await slot.sh("tr '\\0' ' ' < /proc/2/cmdline"))["stdout"]
            assert procs.startswith("/run/atropos/slotd ") or "supervisor" in procs, procs
