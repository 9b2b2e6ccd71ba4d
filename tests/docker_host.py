"""A sandbox host in a Docker container (DockerBackend), seen from this machine like a local one.

The adversarial catalogue (tests/test_isolation.py) inspects a host from outside: its process, its
data dir, a slot's workspace. For a container on this machine's engine those are the container's
host process (a pid of this machine) and paths under ``/proc/<pid>/root`` (the container's own
filesystem, and the mount helper's namespace for the capped workspaces).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atropos.sandbox.contract.client import HostClient

CONTAINER_DATA_DIR = "/slots/data"


@dataclass
class ContainerProcess:
    """The sandbox host process of a container, with the two methods the catalogue uses."""

    pid: int
    container: Any

    def poll(self) -> int | None:
        self.container.reload()
        return None if self.container.status == "running" else 1


@dataclass
class DockerHost:
    address: str
    token: str
    proc: ContainerProcess
    backend: Any
    host_id: str
    inside_data_dir: Path = field(default=Path(CONTAINER_DATA_DIR))

    @property
    def root(self) -> Path:
        """The container's filesystem, from this machine."""
        return Path(f"/proc/{self.proc.pid}/root")

    @property
    def data_dir(self) -> Path:
        return self.root / CONTAINER_DATA_DIR.lstrip("/")

    def slot_pids(self, slot: int) -> list[int]:
        """Processes in the slot's cgroup (pids of this machine)."""
        base = Path("/sys/fs/cgroup/pids/atropos") / self.host_id / "slots"
        if not base.exists():  # cgroup v2
            base = Path("/sys/fs/cgroup/atropos") / self.host_id / "slots"
        return [int(p) for f in base.glob(f"atropos-*/slot-{slot}/cgroup.procs") for p in f.read_text().split()]

    def client(self, **kw: Any) -> HostClient:
        return HostClient(self.address, self.token, **kw)

    def pids(self) -> list[tuple[int, list[bytes]]]:
        """(pid, argv) of every process in the container, as pids of this machine."""
        top = self.proc.container.top(ps_args="-eo pid")
        out = []
        for (pid,) in top["Processes"]:
            try:
                out.append((int(pid), Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")))
            except OSError:
                continue
        return out

    def slot_path(self, slot: int, sub: str = "ws") -> Path:
        """A slot's workspace (or run dir) through the slot's own mount namespace (a fork of the
        container's mount helper: tests/conftest.py ``slot_ns_among``)."""
        from conftest import slot_ns_among

        helpers = [pid for pid, argv in self.pids() if any(a.endswith(b"/mounthelper.py") for a in argv)]
        holder = slot_ns_among(helpers, slot)
        assert holder is not None, f"no mount namespace for slot {slot} in the container"
        return Path(f"/proc/{holder}/root{CONTAINER_DATA_DIR}/slots/{slot}/{sub}")


async def start_docker_host(image: str, slots: int, slot_workspace_bytes: int, **config: Any) -> DockerHost:
    """A container host of ``image``; ``config`` sets other DockerBackendConfig fields."""
    from atropos.backends.docker import DockerBackend, DockerBackendConfig

    backend = DockerBackend(DockerBackendConfig(**{
        "image": image, "slots_per_host": slots, "pool_id": f"iso{secrets.token_hex(3)}", "cpus": 2.0,
        "memory_bytes": 6 << 30, "workspace_bytes": max(4 << 30, slot_workspace_bytes),
        "slot_workspace_bytes": slot_workspace_bytes, "slot_memory_bytes": 3 << 30, "max_timeout_s": 600, **config}))
    info = await backend.start_host()
    container = await asyncio.to_thread(backend.client.containers.get, info.id)
    top = await asyncio.to_thread(container.top, ps_args="-eo pid,args")
    pid = next(int(p[0]) for p in top["Processes"] if "atropos.sandbox" in p[-1] and "tini" not in p[-1])
    return DockerHost(info.address, info.token, ContainerProcess(pid, container), backend, info.id)


async def stop_docker_host(host: DockerHost) -> None:
    await host.backend.stop_host(host.host_id)
    await host.backend.close()


def in_docker(host: object) -> bool:
    return isinstance(host, DockerHost)


def host_of_kind(kind: str, local: Any, slots: int = 8, slot_workspace_bytes: int = 1536 << 20) -> Iterator[Any]:
    """A module fixture's host: ``local`` (the session's host) or a Docker container host of the
    same shape (the catalogue modules override conftest's ``host`` with this, parametrized over
    tests.pool_backends.BACKENDS); the container is removed afterwards."""
    if kind == "local":
        yield local
        return
    from tests.pool_backends import DOCKER_IMAGE, require_docker

    require_docker()
    running = asyncio.run(start_docker_host(DOCKER_IMAGE, slots=slots, slot_workspace_bytes=slot_workspace_bytes))
    try:
        yield running
    finally:
        asyncio.run(stop_docker_host(running))
