"""The workspace mount namespaces as the host sees them: ``/proc/PID/mountinfo`` parsed, and the
client of the mount helper process (``mounthelper.py``) that makes every slot's mounts, each slot's
in a mount namespace of its own (``SlotMountNamespace``)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from atropos.errors import WorkspaceError
from atropos.sandbox.host.workspace import TOOL_PATH

log = logging.getLogger(__name__)

HELPER = Path(__file__).with_name("mounthelper.py")
REPO_DIFF = Path(__file__).with_name("repo_diff.py")  # loaded by the helper from beside its copy


# -- mountinfo ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class MountEntry:
    mount_id: int
    root: str
    mountpoint: str
    options: str
    fstype: str
    super_options: str

    def super_option(self, key: str) -> str | None:
        for item in self.super_options.split(","):
            k, _, v = item.partition("=")
            if k == key:
                return v
        return None


def _unescape(s: str) -> str:
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 3 < len(s) and s[i + 1:i + 4].isdigit():
            out.append(chr(int(s[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def _escape(path: str) -> str:
    """A path as mountinfo spells it (space, tab, newline and backslash in octal)."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in path)


def read_mountinfo(pid: int | str = "self", under: str | None = None) -> list[MountEntry]:
    """Parsed ``/proc/PID/mountinfo``; with ``under``, only mount points starting with that path
    (lines are filtered before they are parsed: a reset reads this with every slot's mounts in it)."""
    entries = []
    needle = None if under is None else f" {_escape(under)}"
    with open(f"/proc/{pid}/mountinfo") as fh:
        for line in fh:
            if needle is not None and needle not in line:
                continue
            left, _, right = line.partition(" - ")
            a, b = left.split(), right.split()
            entry = MountEntry(int(a[0]), _unescape(a[3]), _unescape(a[4]), a[5], b[0], b[2] if len(b) > 2 else "")
            if under is None or entry.mountpoint.startswith(under):
                entries.append(entry)
    return entries


# -- the mount namespaces ----------------------------------------------------------------------
class NamespaceView:
    """A mount namespace as the host reaches it: through a process inside it (``pid``)."""

    mode: Literal["root", "userns"]
    nsenter: str
    pid: int

    def mounts(self, under: str | None = None) -> list[MountEntry]:
        """The namespace's mounts (with ``under``: only those whose mount point starts with it)."""
        return read_mountinfo(self.pid, under) if self.pid else []

    def proc_path(self, path: Path) -> str:
        """The path as seen inside the namespace (for the host, which lives outside it)."""
        if not self.pid:
            raise WorkspaceError("the mount namespace is not made yet")
        return f"/proc/{self.pid}/root{path}"

    def launcher(self, uid: int | None) -> list[str]:
        """argv prefix that starts a program inside the namespace (dropping to ``uid`` as root)."""
        if not self.pid:
            raise WorkspaceError("the mount namespace is not made yet")
        if self.mode == "root":
            assert uid is not None, "a root host always runs slots as their own uid"
            return [self.nsenter, f"--mount=/proc/{self.pid}/ns/mnt", f"--setuid={uid}", f"--setgid={uid}", "--"]
        return [self.nsenter, f"--user=/proc/{self.pid}/ns/user", f"--mount=/proc/{self.pid}/ns/mnt",
                "--preserve-credentials", "--"]


class MountNamespace(NamespaceView):
    """Client of the mount helper process (one per host)."""

    def __init__(self, mode: Literal["root", "userns"], nsenter: str, python: str, script: Path) -> None:
        self.mode = mode
        self.nsenter = nsenter
        self.slots: dict[int, SlotMountNamespace] = {}
        self.python = python
        self.script = script
        self.proc: asyncio.subprocess.Process | None = None
        self.pid = 0
        self._stderr = b""
        self._stderr_task: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next_id = 0
        self._dead = ""

    async def start(self) -> None:
        # Spawned from the event-loop thread: the helper's parent-death signal follows that thread.
        self.proc = await asyncio.create_subprocess_exec(
            self.python, "-I", "-S", str(self.script), self.mode, str(os.getpid()),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={"PATH": TOOL_PATH, "LANG": "C.UTF-8"},
        )
        self._stderr_task = asyncio.create_task(self._drain())
        ready = await self._read(10.0)
        if not ready.get("ok"):
            await self.stop()
            raise WorkspaceError(f"mount helper: {ready.get('error')}")
        self.pid = int(ready["result"]["pid"])
        self._reader = asyncio.create_task(self._read_replies())

    async def _read_replies(self) -> None:
        """Requests are pipelined (the helper answers in order, each carrying its id)."""
        try:
            while True:
                reply = await self._read(None)
                future = self._waiting.pop(int(reply.get("id", -1)), None)
                if future is not None and not future.done():
                    future.set_result(reply)
        except (WorkspaceError, ValueError) as exc:
            self._dead = str(exc)
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(WorkspaceError(self._dead))
            self._waiting.clear()

    async def _drain(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while chunk := await self.proc.stderr.read(4096):
            self._stderr = (self._stderr + chunk)[-4096:]

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and not self._dead

    async def _read(self, timeout: float | None) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        except asyncio.TimeoutError:
            raise WorkspaceError(f"mount helper did not answer within {timeout:g}s") from None
        if not line:
            await asyncio.sleep(0.01)
            raise WorkspaceError(f"mount helper exited: {self._stderr.decode(errors='replace').strip()}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    async def call(self, req: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        if not self.alive or self._dead:
            raise WorkspaceError(f"the mount helper is not running {self._dead}".strip())
        assert self.proc is not None and self.proc.stdin is not None
        self._next_id += 1
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[self._next_id] = future
        self.proc.stdin.write(json.dumps({**req, "id": self._next_id}).encode() + b"\n")
        try:
            await self.proc.stdin.drain()
            reply = await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            raise WorkspaceError(f"mount helper did not answer within {timeout:g}s") from None
        except ConnectionError as exc:
            raise WorkspaceError(f"mount helper pipe closed: {exc}") from None
        if not reply.get("ok"):
            raise WorkspaceError(f"mount helper: {reply.get('error')}")
        result: dict[str, Any] = reply["result"]
        return result

    def slot(self, index: int) -> SlotMountNamespace:
        """Slot ``index``'s own mount namespace (where its workspace, scratch and root are mounted)."""
        ns = self.slots.get(index)
        if ns is None:
            ns = self.slots[index] = SlotMountNamespace(self, index)
        return ns

    async def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                await asyncio.wait_for(self.proc.wait(), 5)
            except (asyncio.TimeoutError, ConnectionError):
                self.proc.kill()
                await self.proc.wait()
        for task in (self._stderr_task, self._reader):
            if task is not None:
                task.cancel()


class SlotMountNamespace(NamespaceView):
    """One slot's own mount namespace, made by the helper on the slot's first request: it holds the
    host's mounts and that slot's, never another slot's (mounthelper.SlotNamespace)."""

    def __init__(self, helper: MountNamespace, index: int) -> None:
        self.helper = helper
        self.index = index
        self.mode = helper.mode
        self.nsenter = helper.nsenter
        self.pid = 0  # known from the first reply

    @property
    def alive(self) -> bool:
        return self.helper.alive

    async def call(self, req: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        result = await self.helper.call({**req, "slot": self.index}, timeout)
        self.pid = int(result.get("ns_pid", self.pid))
        return result
