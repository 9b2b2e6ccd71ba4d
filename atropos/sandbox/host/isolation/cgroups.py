"""Per-slot control groups: one memory, process-count and CPU budget for everything a slot runs.

RLIMIT_AS bounds one process; a slot of many processes, or one that parks pages in tmpfs or memfds
(shared memory: charged to the memory cgroup of the process that first touched the page, and
invisible in any process's RSS), needs a bound for the slot as a whole. That is a cgroup per slot:
every sandbox of the slot starts inside it (``launcher``: placed before bwrap runs, so no child
can be forked outside), and a reset kills everything in it and checks it is empty.

Both hierarchies are supported:

* cgroup v2 (unified, what systemd hosts and most users have): ``memory.max`` (and
  ``memory.swap.max`` 0), ``pids.max``, ``cpu.weight`` / ``cpu.max``; ``cgroup.kill`` empties a slot.
* cgroup v1 (per-controller hierarchies): ``memory.limit_in_bytes`` (and ``memsw`` when swap is
  accounted), ``pids.max``, ``cpu.shares`` / ``cpu.cfs_quota_us``; emptied by a kill loop, which
  ends because ``pids.max`` bounds what a fork bomb can add between two rounds.

Where the slot cgroups live: a delegated directory (``HostConfig.cgroup_dir``: what the Docker
backend bind-mounts into the container, see sandbox_image/README.md), else a subtree created
under the host's own cgroup, so whatever bounds the host also bounds its slots.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from atropos.errors import CgroupUnavailable as CgroupUnavailable  # defined there since issue 18
from atropos.sandbox.contract.cgroupfs import (
    CFS_PERIOD_US,
    V1_CONTROLLERS,
    V2_CONTROLLERS,
    cgroup_pids,
    enable_controllers,
    kill_all,
    kill_cgroup,
    kill_pause,
    kill_round,
    mountinfo,
    own_cgroups,
    read_file,
    remove_stale,
    rmdir_tree,
    v1_dir,
    v2_dir,
    write_file,
)
from atropos.sandbox.contract.launch import SlotLimits

log = logging.getLogger(__name__)

SH = "/bin/sh"
# Moves the shell into every cgroup.procs file named before "--", then execs the rest: the
# sandbox, and every process it will ever fork, starts inside the slot's cgroup.
# The shell exports PWD (the host's working directory): unset it so bwrap's init, whose environment the
# slot can read at /proc/1/environ, starts with the empty environment the host gave it.
_PLACE_INTO = 'for f do [ "$f" = -- ] && break; echo $$ >"$f" || exit 125; shift; done; shift; '
_PLACE_EXEC = 'unset PWD OLDPWD; exec "$@"'
_PLACE = _PLACE_INTO + _PLACE_EXEC
# With ``launcher(oom_score_adj)`` it raises the process's OOM score between the two (what choom did
# as one more program per sandbox start: ~1 ms of CPU of the slot cycle's ~4 ms launch chain, issue 38
# item 4). Written by root, the kernel also makes it the floor the process and its children may lower
# it to.
_RAISE_OOM = 'echo {adj} >/proc/self/oom_score_adj || exit 125; '
PLACEMENT_FAILED = 125


@dataclass
class SlotCgroup:
    """One slot's cgroup: a directory per hierarchy (one on v2, one per controller on v1)."""

    name: str
    version: int
    dirs: dict[str, Path]  # controller (or "" on v2) -> directory
    # The caps as the kernel reported them once applied: the cgroup lives as long as its slot (made
    # once, emptied at every reset), so every reset checks they still hold (``drift``).
    applied: dict[str, str] = field(default_factory=dict)

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    @property
    def main(self) -> Path:
        return self.dirs[""] if self.version == 2 else self.dirs["pids"]

    def launcher(self, oom_score_adj: int | None = None) -> list[str]:
        """Prefix of a sandbox's argv that runs it inside this cgroup (exit 125 if it cannot);
        ``oom_score_adj``: set that OOM score on it too."""
        if oom_score_adj is None:
            return [SH, "-c", _PLACE, "atropos-cgroup", *self.procs_files, "--"]
        script = _PLACE_INTO + _RAISE_OOM.format(adj=int(oom_score_adj)) + _PLACE_EXEC
        return [SH, "-c", script, "atropos-cgroup", *self.procs_files, "--"]

    def pids(self) -> list[int]:
        return cgroup_pids(self.main)

    def apply(self, caps: SlotLimits) -> None:
        if self.version == 2:
            d = self.dirs[""]
            if caps.memory_bytes:
                write_file(d / "memory.max", str(caps.memory_bytes))
                if (d / "memory.swap.max").exists():
                    write_file(d / "memory.swap.max", "0")
            if caps.pids:
                write_file(d / "pids.max", str(caps.pids))
            write_file(d / "cpu.max", f"{int(caps.cpus * CFS_PERIOD_US)} {CFS_PERIOD_US}" if caps.cpus else "max")
            return
        mem, pids, cpu = self.dirs["memory"], self.dirs["pids"], self.dirs["cpu"]
        if caps.memory_bytes:
            write_file(mem / "memory.limit_in_bytes", str(caps.memory_bytes))
            if (mem / "memory.memsw.limit_in_bytes").exists():  # swap accounted: no escape into swap
                write_file(mem / "memory.memsw.limit_in_bytes", str(caps.memory_bytes))
        if caps.pids:
            write_file(pids / "pids.max", str(caps.pids))
        write_file(cpu / "cpu.cfs_period_us", str(CFS_PERIOD_US))
        write_file(cpu / "cpu.cfs_quota_us", str(int(caps.cpus * CFS_PERIOD_US)) if caps.cpus else "-1")

    def caps_in_force(self) -> dict[str, str]:
        """The limits as the kernel reports them (for tests and status)."""
        if self.version == 2:
            d = self.dirs[""]
            names = {"memory": "memory.max", "pids": "pids.max", "cpu": "cpu.max"}
            return {k: read_file(d / f).strip() for k, f in names.items() if (d / f).exists()}
        return {"memory": read_file(self.dirs["memory"] / "memory.limit_in_bytes").strip(),
                "pids": read_file(self.dirs["pids"] / "pids.max").strip(),
                "cpu": read_file(self.dirs["cpu"] / "cpu.cfs_quota_us").strip()}

    def drift(self) -> str:
        """What differs from the caps applied when the slot was made ('' when they all hold, or when
        none were recorded); a cgroup directory that is gone reads as a drift too."""
        if not self.applied:
            return ""
        try:
            now = self.caps_in_force()
        except OSError as exc:
            return f"cgroup {self.main} unreadable: {exc}"
        changed = [f"{k} {was} -> {now.get(k, 'missing')}" for k, was in self.applied.items() if now.get(k) != was]
        return f"caps of cgroup {self.main} changed: {', '.join(changed)}" if changed else ""

    def memory_bytes(self) -> int:
        """Memory charged to the slot now (RSS, page cache, tmpfs and memfd pages, kernel memory)."""
        if self.version == 2:
            return int(read_file(self.dirs[""] / "memory.current"))
        return int(read_file(self.dirs["memory"] / "memory.usage_in_bytes"))

    def kill(self, deadline_s: float = 30.0) -> list[int]:
        """SIGKILL every process in the cgroup until it is empty; survivors (none, normally)."""
        return kill_cgroup(self.main, deadline_s)

    async def empty(self, deadline_s: float = 30.0) -> list[int]:
        """``kill`` on the event loop: the rounds are a read of cgroup.procs and a signal each, the
        waits between them ``asyncio.sleep``. A thread that slept through them held one of the
        loop's few worker threads for as long as the kernel took to tear the sandboxes down, so
        16 resets at once queued for threads behind each other's teardown."""
        kill_all(self.main)
        deadline = time.monotonic() + deadline_s
        i = 0
        while True:
            left = kill_round(self.main)
            if not left or time.monotonic() > deadline:
                return left
            i += 1
            await asyncio.sleep(kill_pause(i))

    def remove(self) -> None:
        """Kill what is left and remove the directories (children first)."""
        self.kill()
        for d in self.dirs.values():
            rmdir_tree(d)


class SlotCgroups:
    """The host's slot cgroups: a parent per hierarchy, a child per slot."""

    def __init__(self, version: int, parents: dict[str, Path], *, owned: bool) -> None:
        self.version = version
        self.parents = parents
        self.owned = owned  # we created the parents (and remove them at the end)
        self.slots: dict[str, SlotCgroup] = {}

    @property
    def where(self) -> str:
        return ", ".join(str(p) for p in self.parents.values())

    @classmethod
    def setup(cls, cgroup_dir: Path | None) -> SlotCgroups:
        """Find or make a writable place for slot cgroups; CgroupUnavailable (with what to do) if none.

        The host's slots get a subtree of their own (``atropos-<pid>``; in a delegated directory,
        which hosts of several containers may share, ``atropos-<hostname>-<pid>``)."""
        try:
            if cgroup_dir is not None:
                return cls._delegated(cgroup_dir, f"atropos-{socket.gethostname()}-{os.getpid()}")
            return cls._nested(f"atropos-{os.getpid()}")
        except OSError as exc:
            raise CgroupUnavailable(f"cannot create per-slot cgroups: {exc}. {HINT}") from exc

    @classmethod
    def _delegated(cls, d: Path, label: str) -> SlotCgroups:
        if (d / "cgroup.controllers").exists():
            enable_controllers(d)
            (d / label).mkdir(exist_ok=True)
            enable_controllers(d / label)
            return cls(2, {"": d / label}, owned=True)
        parents = {c: d / c for c in V1_CONTROLLERS}
        missing = [str(p) for p in parents.values() if not (p / "cgroup.procs").exists()]
        if missing:
            raise CgroupUnavailable(f"--cgroup-dir {d}: neither a cgroup v2 directory nor one holding v1 "
                                    f"controller directories ({', '.join(missing)} missing). {HINT}")
        for p in parents.values():
            if not os.access(p, os.W_OK):
                raise CgroupUnavailable(f"--cgroup-dir {d}: {p} is not writable by this host. {HINT}")
        for c in parents:
            parents[c] = parents[c] / label
            parents[c].mkdir(exist_ok=True)
        return cls(1, parents, owned=True)

    @classmethod
    def _nested(cls, label: str) -> SlotCgroups:
        mounts = mountinfo()
        own = own_cgroups()
        v1 = {c: v1_dir(mounts, own, c) for c in V1_CONTROLLERS}
        if all(v1.values()):
            parents: dict[str, Path] = {}
            for c, base in v1.items():
                assert base is not None
                remove_stale(base)
                parents[c] = base / label
                parents[c].mkdir(exist_ok=True)
            return cls(1, parents, owned=True)
        v2 = v2_dir(mounts, own)
        if v2 is None:
            found = [c for c, p in v1.items() if p] if any(v1.values()) else []
            raise CgroupUnavailable(
                "no cgroup hierarchy with the memory, pids and cpu controllers is mounted here"
                + (f" (v1 has only {found})" if found else "") + f". {HINT}")
        return cls._nested_v2(v2, label)

    @classmethod
    def _nested_v2(cls, base: Path, label: str) -> SlotCgroups:
        """v2 forbids processes in a cgroup that hands controllers to children: the host moves
        itself into a leaf of its own cgroup first, which works when nothing else lives there
        (a systemd service or scope with Delegate=yes, a container's own cgroup)."""
        available = set(read_file(base / "cgroup.controllers").split())
        if not set(V2_CONTROLLERS) <= available:
            raise CgroupUnavailable(f"cgroup {base} does not offer {sorted(set(V2_CONTROLLERS) - available)} "
                                    f"to its children. {HINT}")
        enabled = set(read_file(base / "cgroup.subtree_control").split())
        if not set(V2_CONTROLLERS) <= enabled:
            others = [p for p in read_file(base / "cgroup.procs").split() if _tgid(p) != os.getpid()]
            if others:
                raise CgroupUnavailable(
                    f"cgroup {base} holds other processes ({len(others)}) besides this host, so it cannot "
                    f"hand controllers to slot cgroups. {HINT}")
            leaf = base / f"{label}-host"
            leaf.mkdir(exist_ok=True)
            write_file(leaf / "cgroup.procs", str(os.getpid()))
            enable_controllers(base)
        remove_stale(base)
        parent = base / label
        parent.mkdir(exist_ok=True)
        enable_controllers(parent)
        return cls(2, {"": parent}, owned=True)

    def slot(self, name: str, caps: SlotLimits) -> SlotCgroup:
        """The slot's cgroup, created (or emptied, if a previous host left it) with ``caps``."""
        dirs = {c: p / name for c, p in self.parents.items()}
        for d in dirs.values():
            d.mkdir(exist_ok=True)
        cg = SlotCgroup(name, self.version, dirs)
        survivors = cg.kill()
        if survivors:
            raise CgroupUnavailable(f"cgroup {cg.main} still holds processes {survivors} left by an earlier host")
        cg.apply(caps)
        cg.applied = cg.caps_in_force()
        self.slots[name] = cg
        return cg

    def close(self) -> None:
        for cg in self.slots.values():
            cg.remove()
        self.slots.clear()
        if self.owned:
            for p in self.parents.values():
                rmdir_tree(p)


def _tgid(pid: str) -> int:
    try:
        for line in read_file(Path(f"/proc/{pid}/status")).splitlines():
            if line.startswith("Tgid:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


HINT = ("Slots need a cgroup each for their memory, process and CPU caps: run the host as root, in a "
        "delegated cgroup (systemd: Delegate=yes), or with --cgroup-dir naming a writable cgroup subtree "
        "(the Docker backend mounts one, see sandbox_image/README.md). DEVELOPMENT ONLY: --unsafe-no-cgroups "
        "runs without per-slot caps (one slot can then take the whole machine's memory).")
