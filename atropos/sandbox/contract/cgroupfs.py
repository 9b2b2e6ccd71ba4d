"""The cgroup filesystem as both the host and the Docker backend (which prepares a container's
cgroup directory on the engine machine) see it: controllers, mounts and removal."""

from __future__ import annotations

import logging
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
