"""Each slot's mounts in a mount namespace of its own (host/workspace/mounthelper.py, SlotNamespace).

The arrangement exists so that a sandbox's start does not grow with its host (bubblewrap walks the
mount table of the namespace it starts in); it must also never give a slot a way to another slot's
mounts. Attacked here from inside a slot and from a slot's uid on the host."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import RunningHost, helper_pid, leased_slot, slot_ns_pid

from atropos.sandbox.host.workspace.mountns import read_mountinfo

IS_ROOT = os.geteuid() == 0
requires_root = pytest.mark.skipif(not IS_ROOT, reason="per-slot uids exist only when the host runs as root")


def _slots_dir(host: RunningHost) -> str:
    return os.path.realpath(host.data_dir / "slots") + "/"


async def test_a_slots_namespace_holds_only_its_own_mounts(host: RunningHost) -> None:
    async with leased_slot(host) as a, leased_slot(host) as b:
        await a.sh("echo a > f"), await b.sh("echo b > f")
        ia, ib = a.lease.slot, b.lease.slot
        slots = _slots_dir(host)
        pa, pb = slot_ns_pid(host.data_dir, ia), slot_ns_pid(host.data_dir, ib)
        assert pa != pb
        mine, theirs = f"{slots}{ia}/", f"{slots}{ib}/"
        in_a = [m.mountpoint for m in read_mountinfo(pa) if m.mountpoint.startswith(slots)]
        in_b = [m.mountpoint for m in read_mountinfo(pb) if m.mountpoint.startswith(slots)]
        # premise: both slots have mounts (capped workspace, run dir, /tmp, /dev/shm), each in its own
        assert any(p.startswith(mine) for p in in_a) and any(p.startswith(theirs) for p in in_b), (in_a, in_b)
        assert all(p.startswith(mine) for p in in_a), in_a
        assert all(p.startswith(theirs) for p in in_b), in_b
        # the helper's own namespace holds no slot's mounts either: nothing a sandbox started there
        # could walk
        assert not [m for m in read_mountinfo(helper_pid(host.data_dir)) if m.mountpoint.startswith(slots)]
        # a slot's namespace is the host's mounts plus its own: its size does not follow the host's
        base = len([m for m in read_mountinfo(pa) if not m.mountpoint.startswith(slots)])
        assert base <= len(read_mountinfo("self")) + 2, base
        # from inside: the sandbox's table names no other slot's path (its own bind sources are its)
        out = await a.sh("cat /proc/self/mountinfo")
        others = [line for line in out["stdout"].splitlines() if "/slots/" in line and f"/slots/{ia}/" not in line]
        assert not others and f"/slots/{ib}/" not in out["stdout"], others


async def test_a_slot_reaches_no_other_mount_namespace_from_inside(host: RunningHost) -> None:
    async with leased_slot(host) as a, leased_slot(host) as b:
        await b.sh("true")
        # every process a slot can see is in its own sandbox's mount namespace: the namespace holder
        # of its slot, of another slot and the helper are not in its PID namespace
        out = await a.sh("own=$(readlink /proc/self/ns/mnt); n=0; for p in /proc/[0-9]*; do "
                         "m=$(readlink $p/ns/mnt 2>/dev/null) || continue; n=$((n+1)); "
                         "[ \"$m\" = \"$own\" ] || echo OTHER:$p:$m; done; echo seen=$n")
        assert "OTHER:" not in out["stdout"] and "seen=" in out["stdout"], out["stdout"]
        assert int(out["stdout"].rsplit("seen=", 1)[1]) >= 1
        helper = helper_pid(host.data_dir)
        holder_b = slot_ns_pid(host.data_dir, b.lease.slot)
        for pid in (helper, holder_b, 1):
            out = await a.sh(f"nsenter --mount=/proc/{pid}/ns/mnt ls / 2>&1; echo rc=$?")
            assert "rc=0" not in out["stdout"], (pid, out)


@requires_root
async def test_a_slot_uid_cannot_enter_another_slots_namespace(host: RunningHost) -> None:
    async with leased_slot(host) as a, leased_slot(host) as b:
        await a.sh("true"), await b.sh("echo secret > s")
        ia, ib = a.lease.slot, b.lease.slot
        holder_b = slot_ns_pid(host.data_dir, ib)
        inside = f"{os.path.realpath(host.data_dir)}/slots/{ib}/ws/s"  # as b's namespace names it
        ws_b = Path(f"/proc/{holder_b}/root{inside}")
        assert ws_b.read_text() == "secret\n", "premise: b's file is in b's namespace"
        data = os.path.realpath(host.data_dir)
        uid_a = os.stat(f"/proc/{slot_ns_pid(host.data_dir, ia)}/root{data}/slots/{ia}/ws").st_uid
        assert uid_a >= 1000, "premise: slot a runs as a uid of its own"
        for pid in (holder_b, slot_ns_pid(host.data_dir, ia), helper_pid(host.data_dir)):
            r = subprocess.run(["setpriv", f"--reuid={uid_a}", f"--regid={uid_a}", "--clear-groups",
                                "nsenter", f"--mount=/proc/{pid}/ns/mnt", "cat", inside],
                               capture_output=True, text=True)
            assert r.returncode != 0 and "secret" not in r.stdout, (pid, r)
            r = subprocess.run(["setpriv", f"--reuid={uid_a}", f"--regid={uid_a}", "--clear-groups",
                                "cat", str(ws_b)], capture_output=True, text=True)
            assert r.returncode != 0 and "secret" not in r.stdout, r
