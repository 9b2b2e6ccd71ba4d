"""The host the path and tool fuzz of tests/test_fuzz.py attack: a local sandbox host in a private
directory, or a Docker container host (tests/docker_host.py), with the names of its files both as
the host process sees them (what a slot's symlink names) and from this machine (where the test
plants canaries and watches for changes).

On a local host both are the same path. In a container the host's data dir is ``/slots/data`` on the
container's ``/slots`` tmpfs; this machine reaches it through ``/proc/<host pid>/root``, so a canary
planted there is a file the container's host process could really read or overwrite.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conftest import slot_path, start_host, stop_host

from tests.docker_host import CONTAINER_DATA_DIR, host_of_kind, in_docker


@dataclass
class FuzzHost:
    kind: str
    host: Any  # conftest.RunningHost or tests.docker_host.DockerHost
    root: Path  # the directory holding the host's data dir, from this machine
    inside_root: Path  # the same directory as the host process names it

    @property
    def data(self) -> Path:
        return self.root / "data"

    def inside(self, path: Path) -> Path:
        """``path`` (under ``root``) as the host process, and a slot's symlink, names it."""
        return self.inside_root / path.relative_to(self.root)

    def workspace(self, slot: int) -> Path:
        """What slot ``slot`` sees as its workspace (its capped tmpfs), from this machine."""
        if in_docker(self.host):
            return Path(self.host.slot_path(slot))
        return slot_path(self.data, slot)

    def plant(self, path: Path, text: str) -> None:
        """A file owned like the data dir: one the host process could overwrite if it were fooled."""
        path.write_text(text)
        owner = self.data.stat()
        os.chown(path, owner.st_uid, owner.st_gid)

    def host_reads(self, path: Path) -> str:
        """``path`` (under ``root``) read by the host's own side (in a container: as its user, by its
        name in there), the premise that a planted canary is real where the host looks."""
        if not in_docker(self.host):
            return path.read_text()
        owner = self.data.stat()
        code, out = self.host.proc.container.exec_run(["cat", str(self.inside(path))], user=f"{owner.st_uid}")
        assert code == 0, out
        return bytes(out).decode()

    def describe(self) -> str:
        if in_docker(self.host):
            return (f"docker container {self.host.host_id} (host pid {self.host.proc.pid} on this machine) "
                    f"at {self.host.address}")
        return f"local host pid {self.host.proc.pid} at {self.host.address}"


@contextmanager
def started_fuzz_host(kind: str, slots: int) -> Iterator[FuzzHost]:
    """A fresh host of ``kind`` ("local" or "docker"; the latter skips, with the reason, when this
    machine has no Docker engine or image, and fails in CI)."""
    if kind != "local":
        with contextmanager(host_of_kind)(kind, None, slots=slots) as running:
            yield FuzzHost(kind, running, running.data_dir.parent, Path(CONTAINER_DATA_DIR).parent)
        return
    root = Path(f"/tmp/atropos-fuzz-{os.getpid()}-{secrets.token_hex(4)}")
    root.mkdir(mode=0o711)
    local = start_host(root / "data", slots=slots, extra=["--log-level", "WARNING"])
    try:
        yield FuzzHost(kind, local, root, root)
    finally:
        stop_host(local)
        shutil.rmtree(root, ignore_errors=True)
