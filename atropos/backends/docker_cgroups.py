"""A delegated cgroup subtree for each Docker sandbox host: where its slot cgroups live.

The host inside the container (uid 1000, no capability) caps each slot with a cgroup of its own
(atropos.sandbox.host.isolation.cgroups), so it needs a cgroup directory it may write. Docker mounts the
container's own cgroup read-only, so this backend prepares one on the engine's machine, before
the container exists:

    <hierarchy>/atropos/<host id>/          the container's budget (memory, pids, CPU): root-owned
    <hierarchy>/atropos/<host id>/<cid>/    the container itself (--cgroup-parent; Docker's limits)
    <hierarchy>/atropos/<host id>/slots/    owned by uid 1000, bind-mounted at CONTAINER_CGROUP_DIR

The slots' subtree is a child of the container's budget, so whatever the host inside writes there
(it may make child cgroups and set their limits) stays bounded by the parent it cannot write: one
slot is bounded against its neighbours, and the container as a whole against the machine. Needs
the engine on this machine (the backend writes its cgroupfs), the cgroupfs cgroup driver, and
the right to write /sys/fs/cgroup (root). See sandbox_image/README.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from atropos.errors import DockerCgroupUnavailable as DockerCgroupUnavailable  # defined there since issue 18
from atropos.errors import IsolationUnavailable
from atropos.sandbox.contract.cgroupfs import (
    CFS_PERIOD_US,
    V1_CONTROLLERS,
    V2_CONTROLLERS,
    enable_controllers,
    mountinfo,
    rmdir_tree,
    write_file,
)

CONTAINER_CGROUP_DIR = "/run/atropos/cgroup"
TOP = "atropos"


HINT = ("the Docker backend prepares each container's slot cgroups on the engine's machine: run it there as root, "
        "with the engine's cgroupfs cgroup driver (daemon.json \"exec-opts\": [\"native.cgroupdriver=cgroupfs\"]), "
        "or set slot_cgroups=False (DEVELOPMENT ONLY: no per-slot memory, process or CPU caps)")


@dataclass(frozen=True)
class HostCgroup:
    version: int
    parents: dict[str, Path]  # hierarchy (controller on v1, "" on v2) -> <hierarchy>/atropos/<host id>

    @property
    def cgroup_parent(self) -> str:
        return f"/{TOP}/{next(iter(self.parents.values())).name}"

    def binds(self) -> dict[str, dict[str, str]]:
        if self.version == 2:
            return {str(self.parents[""] / "slots"): {"bind": CONTAINER_CGROUP_DIR, "mode": "rw"}}
        return {str(p / "slots"): {"bind": f"{CONTAINER_CGROUP_DIR}/{c}", "mode": "rw"}
                for c, p in self.parents.items()}

    def remove(self) -> None:
        for p in self.parents.values():
            rmdir_tree(p)


def hierarchies() -> tuple[int, dict[str, Path]]:
    """This machine's cgroup roots: (2, {"": root}) or (1, {controller: mount})."""
    mounts = mountinfo()
    for m in mounts:
        if m.fstype == "cgroup2" and m.root == "/" and (Path(m.mountpoint) / "cgroup.subtree_control").exists():
            available = set((Path(m.mountpoint) / "cgroup.controllers").read_text().split())
            if set(V2_CONTROLLERS) <= available:
                return 2, {"": Path(m.mountpoint)}
    roots: dict[str, Path] = {}
    for c in V1_CONTROLLERS:
        for m in mounts:
            if m.fstype == "cgroup" and c in m.super_options and m.root == "/":
                roots[c] = Path(m.mountpoint)
                break
    missing = [c for c in V1_CONTROLLERS if c not in roots]
    if missing:
        raise DockerCgroupUnavailable(f"no cgroup hierarchy with {missing} is mounted here; {HINT}")
    return 1, roots


def prepare(host_id: str, *, memory_bytes: int, pids: int, cpus: float, uid: int) -> HostCgroup:
    """Create the container's budget cgroup and the slots' subtree ``uid`` may write."""
    version, roots = hierarchies()
    parents = {h: root / TOP / host_id for h, root in roots.items()}
    try:
        if version == 2:
            root = roots[""]
            enable_controllers(root)
            (root / TOP).mkdir(exist_ok=True)
            enable_controllers(root / TOP)
            p = parents[""]
            p.mkdir()
            write_file(p / "memory.max", memory_bytes)
            if (p / "memory.swap.max").exists():
                write_file(p / "memory.swap.max", 0)
            write_file(p / "pids.max", pids)
            write_file(p / "cpu.max", f"{int(cpus * CFS_PERIOD_US)} {CFS_PERIOD_US}")
            enable_controllers(p)
            (p / "slots").mkdir()
            # v2 moves a process only for a writer of the common ancestor's cgroup.procs: the
            # container's cgroup and the slots' subtree meet here. No process can live in this
            # cgroup itself (it hands controllers down), so that write moves nothing out of it.
            os.chown(p / "cgroup.procs", uid, -1)
            for name in ("", "cgroup.procs", "cgroup.subtree_control", "cgroup.threads"):
                os.chown(p / "slots" / name if name else p / "slots", uid, -1)
        else:
            for p in parents.values():
                p.mkdir(parents=True)
            mem, pid, cpu = parents["memory"], parents["pids"], parents["cpu"]
            write_file(mem / "memory.limit_in_bytes", memory_bytes)
            if (mem / "memory.memsw.limit_in_bytes").exists():
                write_file(mem / "memory.memsw.limit_in_bytes", memory_bytes)
            write_file(pid / "pids.max", pids)
            write_file(cpu / "cpu.cfs_period_us", CFS_PERIOD_US)
            write_file(cpu / "cpu.cfs_quota_us", int(cpus * CFS_PERIOD_US))
            for p in parents.values():
                (p / "slots").mkdir()
                for name in ("", "cgroup.procs", "tasks"):
                    os.chown(p / "slots" / name if name else p / "slots", uid, -1)
    except OSError as exc:
        HostCgroup(version, parents).remove()
        raise DockerCgroupUnavailable(f"cannot prepare cgroups for container {host_id}: {exc}; {HINT}") from exc
    return HostCgroup(version, parents)


def existing(host_id: str) -> HostCgroup | None:
    """The subtree of a host prepared earlier (by this process or one that died), if any."""
    try:
        version, roots = hierarchies()
    except IsolationUnavailable:
        return None
    parents = {h: root / TOP / host_id for h, root in roots.items()}
    return HostCgroup(version, parents) if any(p.exists() for p in parents.values()) else None


def leftover_hosts(prefix: str) -> set[str]:
    """Names of prepared subtrees starting with ``prefix`` (a pool's hosts)."""
    try:
        _, roots = hierarchies()
    except IsolationUnavailable:
        return set()
    names: set[str] = set()
    for root in roots.values():
        top = root / TOP
        if top.is_dir():
            names |= {d.name for d in top.iterdir() if d.is_dir() and d.name.startswith(prefix)}
    return names
