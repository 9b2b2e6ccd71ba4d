"""One slot of a host: its workspace, its lease, its sandbox processes, and its reset."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import stat
import time
from pathlib import Path
from typing import Any

from atropos.sandbox.bwrap import LIB_DIR, RUN_DIR, SANDBOX_ENV, SandboxPaths, bwrap_argv
from atropos.sandbox.config import HostConfig
from atropos.sandbox.protocol import LeaseInfo, SlotInfo, SlotState
from atropos.sandbox.sandbox_process import SandboxDied, SandboxProcess

log = logging.getLogger(__name__)


class Slot:
    """State machine: free -> leased -> resetting -> free (or quarantined when a reset fails)."""

    def __init__(self, index: int, cfg: HostConfig, root: Path, uid: int | None, seccomp_path: str | None):
        self.index = index
        self.cfg = cfg
        self.uid = uid
        self.seccomp_path = seccomp_path
        self.dir = root / "slots" / str(index)
        self.paths = SandboxPaths(
            workspace=self.dir / "ws", run_dir=self.dir / "run", lib_dir=root / "lib", etc_dir=root / "etc"
        )
        self.trash = root / "trash"
        self.state: SlotState = "free"
        self.generation = 0
        self.lease_token: str | None = None
        self.trajectory_id: str | None = None
        self.network = False
        self.leased_at: float | None = None
        self.calls = 0
        self.detail = ""
        self.term_offset = 0
        self.lock = asyncio.Lock()  # one call at a time per slot, in arrival order
        self.sandbox: SandboxProcess | None = None
        self.terminal: SandboxProcess | None = None

    # -- layout ----------------------------------------------------------------------------
    def create_dirs(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o711)
        for d in (self.paths.workspace, self.paths.run_dir):
            if d.exists() or d.is_symlink():
                self._discard(d)
            self._fresh_dir(d)

    def _fresh_dir(self, d: Path) -> None:
        d.mkdir(mode=0o700)
        if self.uid is not None:
            os.chown(d, self.uid, self.uid)
        os.chmod(d, 0o700)

    def _discard(self, d: Path) -> None:
        """Move a dirty tree aside (never copy into or walk it here); deleted in the background."""
        self.trash.mkdir(exist_ok=True)
        os.rename(d, self.trash / f"{self.index}-{d.name}-{self.generation}-{secrets.token_hex(4)}")

    # -- leases ----------------------------------------------------------------------------
    def grant(self, trajectory_id: str, network: bool) -> LeaseInfo:
        self.lease_token = secrets.token_urlsafe(24)
        self.state = "leased"
        self.trajectory_id = trajectory_id
        self.network = network
        self.leased_at = time.monotonic()
        self.calls = 0
        return self.lease_info()

    def lease_info(self) -> LeaseInfo:
        assert self.lease_token is not None and self.trajectory_id is not None
        return LeaseInfo(slot=self.index, lease=self.lease_token, generation=self.generation,
                         trajectory_id=self.trajectory_id, network=self.network)

    def info(self) -> SlotInfo:
        return SlotInfo(
            slot=self.index, state=self.state, generation=self.generation, trajectory_id=self.trajectory_id,
            network=self.network, calls=self.calls, detail=self.detail,
            leased_for_s=None if self.leased_at is None else round(time.monotonic() - self.leased_at, 3),
            sandbox_running=self.sandbox is not None and self.sandbox.alive,
        )

    # -- sandboxes -------------------------------------------------------------------------
    def _argv(self, extra: dict[str, Any]) -> list[str]:
        sup_cfg = {"limits": self.cfg.limits.rlimits(), "env": SANDBOX_ENV, **extra}
        if self.cfg.unsafe_no_isolation:
            sup_cfg.update(workspace=str(self.paths.workspace), run_dir=str(self.paths.run_dir),
                           isolated=False, env={**SANDBOX_ENV, "HOME": str(self.paths.workspace)})
            return [self.cfg.python, "-I", "-S", str(self.paths.lib_dir / "supervisor.py"), json.dumps(sup_cfg)]
        argv = bwrap_argv(self.cfg.bwrap, self.paths, self.cfg.limits, network=self.network,
                          seccomp_fd=-1)
        argv[argv.index("-1")] = "{seccomp_fd}"
        return [*argv, self.cfg.python, "-I", "-S", f"{LIB_DIR}/supervisor.py", json.dumps(sup_cfg)]

    async def _start(self, extra: dict[str, Any], label: str, protocol: bool = True) -> SandboxProcess:
        return await SandboxProcess.start(
            self._argv(extra), uid=self.uid, protocol=protocol,
            seccomp_path=None if self.cfg.unsafe_no_isolation else self.seccomp_path, label=label,
        )

    async def ensure_sandbox(self) -> SandboxProcess:
        if self.sandbox is None or not self.sandbox.alive:
            self.sandbox = await self._start({}, f"slot {self.index}")
        return self.sandbox

    async def ensure_terminal(self) -> None:
        if self.terminal is not None and self.terminal.alive:
            return
        run_dir = RUN_DIR if not self.cfg.unsafe_no_isolation else str(self.paths.run_dir)
        lib_dir = LIB_DIR if not self.cfg.unsafe_no_isolation else str(self.paths.lib_dir)
        sock = self.paths.run_dir / "tmux.sock"
        if sock.exists():
            sock.unlink()
        exec_argv = ["tmux", "-D", "-S", f"{run_dir}/tmux.sock", "-f", f"{lib_dir}/tmux.conf"]
        self.terminal = await self._start({"exec": exec_argv}, f"slot {self.index} terminal", protocol=False)
        deadline = time.monotonic() + 5.0
        while not sock.exists():
            if not self.terminal.alive or time.monotonic() > deadline:
                await self.terminal.kill()
                self.terminal = None
                raise SandboxDied(f"slot {self.index}: terminal did not start")
            await asyncio.sleep(0.01)

    async def request(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        if payload.get("op") == "terminal":
            await self.ensure_terminal()
            payload = {**payload, "offset": self.term_offset}
        sandbox = await self.ensure_sandbox()
        frame = await sandbox.request(payload, timeout)
        if payload.get("op") == "terminal" and frame.get("ok"):
            self.term_offset = int(frame["result"]["offset"])
        return frame

    async def stop_sandboxes(self) -> None:
        for proc in (self.sandbox, self.terminal):
            if proc is not None:
                await proc.kill()
        self.sandbox = self.terminal = None

    # -- reset -----------------------------------------------------------------------------
    async def reset(self) -> tuple[bool, str]:
        """Kill everything of the lease, restore the pristine workspace, and check the result."""
        self.state = "resetting"
        await self.stop_sandboxes()
        try:
            if self.uid is not None:
                survivors = await asyncio.to_thread(_kill_uid, self.uid)
                if survivors:
                    raise RuntimeError(f"processes of uid {self.uid} survived: {survivors}")
            for d in (self.paths.workspace, self.paths.run_dir):
                self._discard(d)
                self._fresh_dir(d)
            problem = self._verify()
            if problem:
                raise RuntimeError(problem)
        except (OSError, RuntimeError) as exc:
            self.quarantine(f"reset failed: {exc}")
            return False, self.detail
        self.generation += 1
        self.lease_token = None
        self.trajectory_id = None
        self.network = False
        self.leased_at = None
        self.term_offset = 0
        self.state = "free"
        self.detail = ""
        return True, ""

    def _verify(self) -> str:
        for d in (self.paths.workspace, self.paths.run_dir):
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode):
                return f"{d} is not a directory after reset"
            if self.uid is not None and st.st_uid != self.uid:
                return f"{d} has owner {st.st_uid}, expected {self.uid}"
            if os.listdir(d):
                return f"{d} is not empty after reset"
        return ""

    def quarantine(self, why: str) -> None:
        log.error("slot %d quarantined: %s", self.index, why)
        self.state = "quarantined"
        self.lease_token = None
        self.detail = why


def _kill_uid(uid: int) -> list[int]:
    """SIGKILL every process of ``uid`` (a per-slot uid owns nothing else) and report survivors."""
    import signal

    survivors: list[int] = []
    for attempt in range(20):
        pids = [pid for pid in _pids_of_uid(uid)]
        if not pids:
            return []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        survivors = pids
        time.sleep(0.005 * (attempt + 1))
    return [pid for pid in _pids_of_uid(uid) if pid in survivors]


def _pids_of_uid(uid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as fh:
                for line in fh:
                    if line.startswith(b"Uid:"):
                        if int(line.split()[1]) == uid and not _is_zombie(name):
                            found.append(int(name))
                        break
        except OSError:
            continue
    return found


def _is_zombie(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return True


def delete_trash(trash: Path) -> None:
    """Remove discarded trees; rmtree never follows symlinks, so a planted link cannot redirect it."""
    if not trash.exists():
        return
    for entry in trash.iterdir():
        shutil.rmtree(entry, ignore_errors=True)
