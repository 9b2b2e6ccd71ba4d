"""The cgroup filesystem as both the host and the Docker backend (which prepares a container's
cgroup directory on the engine machine) see it: controllers, mounts and removal."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


V1_CONTROLLERS = ("memory", "pids", "cpu")


V2_CONTROLLERS = ("memory", "pids", "cpu")


CFS_PERIOD_US = 100_000


@dataclass(frozen=True)
class Mountinfo:
    mountpoint: str
    root: str
    fstype: str
    super_options: frozenset[str]


def mountinfo() -> list[Mountinfo]:
    out = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            pre, _, post = line.partition(" - ")
            f, p = pre.split(), post.split()
            out.append(Mountinfo(mountpoint=f[4].replace("\\040", " "), root=f[3], fstype=p[0],
                                 super_options=frozenset(p[2].split(",")) if len(p) > 2 else frozenset()))
    return out


def own_cgroups(pid: str = "self") -> dict[str, str]:
    """Controller (``""`` for v2) -> this process's cgroup path, from /proc/<pid>/cgroup."""
    out: dict[str, str] = {}
    with open(f"/proc/{pid}/cgroup") as fh:
        for line in fh:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c.removeprefix("name=")] = path
    return out


def rmdir_tree(d: Path) -> None:
    """rmdir a cgroup and its child cgroups (a cgroup directory holds only kernel files)."""
    if not d.is_dir():
        return
    for child in d.iterdir():
        if child.is_dir() and not child.is_symlink():
            rmdir_tree(child)
    for _ in range(50):  # a killed process may take a moment to leave
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)
    log.warning("could not remove cgroup %s", d)


def remove_stale_slot_cgroups() -> None:
    """Remove the slot cgroups of dead hosts that were started from this process's own cgroup (a
    host nests its slots' cgroups there, ``_nested``): what a Ray actor runs now and then on its
    node, so a killed pool's or a lost node's leftovers do not wait for the next host's start."""
    mounts = mountinfo()
    own = own_cgroups()
    bases = [v1_dir(mounts, own, c) for c in V1_CONTROLLERS] + [v2_dir(mounts, own)]
    for base in {b for b in bases if b is not None}:
        remove_stale(base)


def remove_stale(base: Path) -> None:
    """Slot cgroups of hosts that died without cleaning up (SIGKILL): ``atropos-<pid>`` of a dead pid."""
    for d in base.glob("atropos-*"):
        pid = d.name.removeprefix("atropos-").removesuffix("-host")
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        # Best effort: hosts starting at the same moment sweep the same leftovers, so a cgroup
        # may vanish under us (ENOENT, or ENODEV from a file of a cgroup being removed); what one
        # host cannot remove now the next one will, and it never stops this host's own start.
        try:
            for child in d.iterdir() if d.is_dir() else []:
                if (child / "cgroup.procs").exists():
                    kill_cgroup(child)
            rmdir_tree(d)
        except OSError as exc:
            log.debug("stale cgroup %s not removed: %s", d, exc)


def v1_dir(mounts: list[Mountinfo], own: dict[str, str], controller: str) -> Path | None:
    """Where this process's own v1 cgroup of ``controller`` is visible (None: not mounted)."""
    path = own.get(controller)
    if path is None:
        return None
    for m in mounts:
        if m.fstype == "cgroup" and controller in m.super_options:
            rel = os.path.relpath(path, m.root) if m.root != "/" else path.lstrip("/")
            if rel.startswith(".."):
                continue
            d = Path(m.mountpoint) / rel
            if (d / "cgroup.procs").exists():
                return d
    return None


def v2_dir(mounts: list[Mountinfo], own: dict[str, str]) -> Path | None:
    path = own.get("")
    if path is None:
        return None
    for m in mounts:
        if m.fstype == "cgroup2":
            rel = os.path.relpath(path, m.root) if m.root != "/" else path.lstrip("/")
            d = Path(m.mountpoint) / rel
            if not rel.startswith("..") and (d / "cgroup.controllers").exists():
                controllers = set(read_file(d / "cgroup.controllers").split())
                if set(V2_CONTROLLERS) <= controllers or read_file(d / "cgroup.subtree_control").strip():
                    return d
    return None


def read_file(path: Path) -> str:
    """One cgroup (or /proc) file's text."""
    with open(path) as fh:
        return fh.read()


def write_file(path: Path, value: object) -> None:
    """Write ``value`` to a cgroup control file in one write(2) (the kernel takes a control file's
    value from a single write; ``str`` of a number is its decimal text)."""
    with open(path, "w") as fh:
        fh.write(str(value))


def enable_controllers(d: Path) -> None:
    """Delegate the v2 controllers to ``d``'s children (only those not delegated yet)."""
    enabled = set(read_file(d / "cgroup.subtree_control").split())
    missing = [c for c in V2_CONTROLLERS if c not in enabled]
    if missing:
        write_file(d / "cgroup.subtree_control", " ".join(f"+{c}" for c in missing))


def cgroup_pids(d: Path) -> list[int]:
    """The processes in the cgroup ``d`` (none if it is gone)."""
    try:
        return [int(p) for p in read_file(d / "cgroup.procs").split()]
    except FileNotFoundError:
        return []


def kill_cgroup(d: Path, deadline_s: float = 30.0) -> list[int]:
    """SIGKILL every process in the cgroup ``d`` until it is empty; survivors (none, normally).

    The limit is time, not rounds, and generous: a killed process leaves the cgroup only once it
    is reaped, which on a starved machine took over the 2.6 s a fixed number of rounds gave it (a
    slot quarantined for processes that were already dying). A true survivor (one the kernel
    cannot kill) still ends in quarantine, just later."""
    kill_all(d)
    deadline = time.monotonic() + deadline_s
    i = 0
    while True:
        left = kill_round(d)
        if not left or time.monotonic() > deadline:
            return left
        i += 1
        time.sleep(kill_pause(i))


def kill_all(d: Path) -> None:
    """The first blow: on v2 one write kills the whole cgroup (v1 has no such file: the rounds do)."""
    if (d / "cgroup.kill").exists():
        write_file(d / "cgroup.kill", "1")


def kill_round(d: Path) -> list[int]:
    """One round of ``kill_cgroup``: what is still in ``d``, each sent SIGKILL (again)."""
    left = cgroup_pids(d)
    for pid in left:
        with contextlib.suppress(OSError):
            fd = os.pidfd_open(pid)
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            finally:
                os.close(fd)
    return left


def kill_pause(i: int) -> float:
    """The wait before round ``i`` + 1: a killed process leaves cgroup.procs once it is reaped (its
    parent, often in the cgroup too, dies with it; init reaps the rest); short first waits: a
    sandbox's processes are normally gone within a millisecond or two."""
    return min(0.0005 * i, 0.02)
