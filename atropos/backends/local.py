"""The embedded default: sandbox hosts as child processes of this machine (no Docker, no Nomad)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Literal

from pydantic import Field

from atropos.backends.base import PREWARM_DESCRIPTION, Backend, HostInfo, new_token, pid_alive, user_pool_id
from atropos.backends.slot_caps import SlotCaps
from atropos.errors import HostUnavailable, IsolationUnavailable
from atropos.sandbox.contract.hostdirs import (
    ISOLATION_FAILED,
    default_data_dir,
    kill_processes_naming,
    owned_dir,
    remove_tree,
)
from atropos.sandbox.contract.launch import HostLaunch, start_host_process

log = logging.getLogger(__name__)
KEPT_HOST_LOGS = 20  # logs of hosts of ended runs kept under the pool's data root (the newest)


class LocalBackendConfig(SlotCaps):
    """Slot caps (``SlotCaps``): 4 GiB, 1024 pids, equal CPU shares per slot."""

    kind: Literal["local"] = "local"
    data_root: Path = Field(default_factory=lambda: default_data_dir() / "local")
    pool_id: str = Field(default_factory=user_pool_id, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    port: int = Field(0, ge=0, le=65535, description="port each host listens on (127.0.0.1); 0 = any free port. "
                                                     "A fixed port allows one host at a time")
    prewarm: bool = Field(True, description=PREWARM_DESCRIPTION)
    start_timeout_s: float = 60.0
    unsafe_no_isolation: bool = Field(False, description="DEVELOPMENT ONLY: no bubblewrap")
    unsafe_no_cgroups: bool = Field(False, description="DEVELOPMENT ONLY: no per-slot cgroup (no slot-wide caps)")
    python: str = Field(default_factory=lambda: sys.executable, description="interpreter running the hosts")
    image_store: Path | None = Field(None, description="task images' layer store, shared by this machine's hosts "
                                     "(docs/task-images.md); default: images/ under data_root")
    image_store_bytes: int | None = Field(None, ge=0, description="the image store's disk budget (default: the "
                                          "host's, 64 GiB); an import that would pass it is refused")

    def build(self) -> LocalBackend:
        return LocalBackend(self)


class LocalBackend(Backend):
    name = "local"

    def __init__(self, cfg: LocalBackendConfig | None = None) -> None:
        self.cfg = cfg or LocalBackendConfig()
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._dirs: dict[str, Path] = {}
        self._counter = 0

    @property
    def root(self) -> Path:
        return self.cfg.data_root / self.cfg.pool_id

    async def start_host(self) -> HostInfo:
        self._counter += 1
        host_id = f"{self.cfg.pool_id}-{os.getpid()}-{self._counter}"
        data_dir = self.root / host_id
        self.cfg.data_root.parent.mkdir(parents=True, exist_ok=True)
        for d in (self.cfg.data_root, self.root):
            owned_dir(d, 0o711)
        token = new_token()
        launch = HostLaunch(port=self.cfg.port, slots=self.cfg.slots_per_host, data_dir=str(data_dir),
                            limits=self.cfg.slot_limits(), prewarm=False,  # the pool asks (Backend.prewarm)
                            parent_pid=os.getpid(), unsafe_no_isolation=self.cfg.unsafe_no_isolation,
                            unsafe_no_cgroups=self.cfg.unsafe_no_cgroups,
                            image_store=str(self.cfg.image_store or self.cfg.data_root / "images"),
                            image_store_bytes=self.cfg.image_store_bytes)
        log_path = self.root / f"{host_id}.log"
        with open(log_path, "ab") as log_file:  # noqa: ASYNC230 - a local file, opened once per host
            proc = await start_host_process(launch, token, log_file, self.cfg.python)
        self._procs[host_id] = proc
        self._dirs[host_id] = data_dir
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), self.cfg.start_timeout_s)
            ready = json.loads(line) if line else {}
        except (asyncio.TimeoutError, ValueError):
            ready = {}
        if ready.get("event") != "ready":
            await self.stop_host(host_id)
            raise self._start_error(_tail(log_path), log_path)
        log.info("local host %s ready on port %s (%d slots)", host_id, ready["port"], self.cfg.slots_per_host)
        return HostInfo(id=host_id, address=f"http://127.0.0.1:{ready['port']}", token=token,
                        slots=self.cfg.slots_per_host, labels={"backend": "local", "pid": str(proc.pid)},
                        log=str(log_path))

    def _start_error(self, tail: str, log_path: Path | None = None) -> IsolationUnavailable | HostUnavailable:
        """Why a host did not come up, from the end of its log.

        Only the line ``__main__`` prints for an isolation failure (``error: isolation unavailable:
        ...``, see ``ISOLATION_FAILED``) means "cannot confine here"; anything else (a port in use,
        a crash) is a host that failed to start, said as such."""
        lines = tail.splitlines()
        marker = f"error: {ISOLATION_FAILED}"
        for i, line in enumerate(lines):
            if line.startswith(marker):
                # the message may span lines (bwrap's own stderr is quoted in it)
                return IsolationUnavailable("\n".join([line.removeprefix("error: "), *lines[i + 1:]]).strip())
        if self.cfg.port and ("Address already in use" in tail or "[Errno 98]" in tail):
            return HostUnavailable(f"local sandbox host failed to start: port {self.cfg.port} on 127.0.0.1 is "
                                   "already in use (LocalBackendConfig.port; 0 picks a free one)")
        where = f" (host log: {log_path})" if log_path is not None else ""
        return HostUnavailable(f"local sandbox host failed to start{where}: {tail}")

    async def stop_host(self, host_id: str) -> None:
        proc = self._procs.get(host_id)
        if proc is not None and proc.returncode is None:
            try:
                proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:  # frozen or stuck: SIGKILL works on stopped processes too
                proc.kill()
                await proc.wait()
            except ProcessLookupError:
                pass
            except asyncio.CancelledError:  # never leave a host behind because our caller gave up
                if proc.returncode is None:
                    proc.kill()
                raise
        self._procs.pop(host_id, None)
        data_dir = self._dirs.pop(host_id, None)
        if data_dir is not None:
            await asyncio.to_thread(kill_processes_naming, data_dir)
            await asyncio.to_thread(remove_tree, data_dir)  # iterative: any depth a slot built

    async def alive(self, host_id: str) -> bool:
        proc = self._procs.get(host_id)
        if proc is None or proc.returncode is not None:
            return False
        # A killed child is a zombie until asyncio reaps it; do not wait for that to notice.
        try:
            with open(f"/proc/{proc.pid}/stat", "rb") as fh:  # noqa: ASYNC230 - procfs, never blocks
                return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
        except (OSError, IndexError):
            return False

    def pid(self, host_id: str) -> int | None:
        proc = self._procs.get(host_id)
        return None if proc is None else proc.pid

    async def reap_orphans(self) -> int:
        """Remove data dirs of hosts whose owning pool process is gone (hosts die with their pool)."""
        if not self.root.exists():
            return 0
        reaped = 0
        old_logs: list[Path] = []
        for entry in self.root.iterdir():
            parts = entry.name.removesuffix(".log").split("-")
            if len(parts) < 3 or not parts[-2].isdigit() or entry.name in self._dirs:
                continue
            if int(parts[-2]) != os.getpid() and not pid_alive(int(parts[-2])):
                if entry.suffix == ".log" and not entry.is_dir():
                    old_logs.append(entry)  # why the last run's host died is read after the next start
                    continue
                await asyncio.to_thread(kill_processes_naming, entry)
                await asyncio.to_thread(remove_tree, entry)
                reaped += 1
        old_logs.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        for stale in old_logs[KEPT_HOST_LOGS:]:
            stale.unlink(missing_ok=True)
            reaped += 1
        return reaped

    async def close(self) -> None:
        await asyncio.gather(*(self.stop_host(h) for h in list(self._procs)))


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip()
    except OSError:
        return "(no log)"
