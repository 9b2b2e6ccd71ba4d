"""Workspace templates and copy-on-write forks of them (see docs/templates.md).

A *template* is an immutable directory tree on the host (``<data>/templates/<id>/tree``): made
from a slot after its setup, from a host directory, a tar stream or a git repository. A slot
*forked* from a template sees it through kernel overlayfs: the template is the lower layer (a
read-only, and on root hosts idmapped, clone), the slot gets a private upper layer. Writes stay
in the upper layer; resetting the slot drops it. Where overlays cannot be mounted the host falls
back to copying the template into a fresh directory (``cp -a --reflink=auto``).

All overlays of a host live in the private mount namespace of one helper process
(``mounthelper.py``); sandboxes of forked slots are started inside it with ``nsenter``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import secrets
import shutil
import stat
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from atropos.errors import AtroposSandboxError, InfrastructureError
from atropos.sandbox.protocol import TemplateInfo

log = logging.getLogger(__name__)

WorkspaceMode = Literal["overlay", "copy"]
WorkspaceKind = Literal["plain", "overlay", "copy"]
HELPER = Path(__file__).with_name("mounthelper.py")
TOOL_PATH = "/usr/local/bin:/usr/bin:/bin"


# -- errors ------------------------------------------------------------------------------------
class TemplateError(AtroposSandboxError):
    """A template request that cannot be served; ``code``/``status`` map onto the HTTP error."""

    code = "template_error"
    status = 400


class UnknownTemplate(TemplateError):
    code, status = "unknown_template", 404


class TemplateInUse(TemplateError):
    code, status = "template_in_use", 409


class TemplateSourceError(TemplateError):
    code, status = "template_source_invalid", 400


class TemplateBuildFailed(TemplateError):
    """The source could not be turned into a tree (git clone failed, corrupt archive, ...)."""

    code, status = "template_failed", 400


class WorkspaceError(InfrastructureError):
    """Mounting, unmounting or copying a workspace failed (the slot is quarantined)."""


# -- trees -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TreeSummary:
    tree_hash: str
    files: int
    dirs: int
    others: int
    bytes: int


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _up(fd: int, expected: tuple[int, int]) -> int:
    """The parent of directory ``fd``, checked to be the directory we came from."""
    parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
    if _identity(parent) != expected:
        os.close(parent)
        raise OSError(errno.ESTALE, "a directory was moved during the walk")
    return parent


def walk_tree(root: Path, *, chown_to: int | None = None) -> TreeSummary:
    """Hash a tree's manifest (and, with ``chown_to``, give every entry to that uid/gid).

    The manifest is, per entry below ``root`` in sorted order: relative path, type, permission
    bits, and for regular files size and mtime (whole seconds), for symlinks the target, for
    devices the device number. Contents are not read: a copy made by ``cp -a`` or ``tar`` carries
    size and mtime along, so a partial copy, a leftover file or a file modified afterwards
    changes the hash, at the cost of one ``lstat`` per entry. Owners are not part of it (each
    slot sees the tree as its own). Symlinks are never followed; ``lchown`` is used.

    Iterative and relative to directory descriptors (one open at a time, ``..`` to come back):
    a slot's tree may be any depth, far past PATH_MAX and the recursion limit.
    """
    h = hashlib.sha256()
    files = dirs = others = size = 0

    def visit(fd: int, rel_dir: bytes) -> list[bytes]:
        """Hash the entries of one directory; its subdirectories, in order."""
        nonlocal files, dirs, others, size
        subdirs: list[bytes] = []
        for name in sorted(os.fsencode(n) for n in os.listdir(fd)):
            rel = rel_dir + b"/" + name if rel_dir else name
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if chown_to is not None and (st.st_uid != chown_to or st.st_gid != chown_to):
                os.chown(name, chown_to, chown_to, dir_fd=fd, follow_symlinks=False)
                if st.st_mode & (stat.S_ISUID | stat.S_ISGID) and not stat.S_ISLNK(st.st_mode):
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)  # chown clears set-id bits
            mode = st.st_mode
            perms = stat.S_IMODE(mode)
            if stat.S_ISDIR(mode):
                dirs += 1
                line = b"d %o" % perms
                subdirs.append(name)
            elif stat.S_ISREG(mode):
                files += 1
                size += st.st_size
                line = b"f %o %d %d" % (perms, st.st_size, int(st.st_mtime))
            elif stat.S_ISLNK(mode):
                others += 1
                line = b"l " + os.readlink(name, dir_fd=fd)
            else:
                others += 1
                line = b"o %o %o %d" % (stat.S_IFMT(mode), perms, st.st_rdev)
            h.update(rel + b"\0" + line + b"\n")
        return subdirs

    fd = os.open(root, _DIR_FLAGS)
    try:
        levels: list[tuple[bytes, Iterator[bytes], tuple[int, int]]] = [(b"", iter(visit(fd, b"")), _identity(fd))]
        while levels:
            rel_dir, subdirs, _ = levels[-1]
            name = next(subdirs, None)
            if name is None:
                levels.pop()
                if levels:
                    parent = _up(fd, levels[-1][2])
                    os.close(fd)
                    fd = parent
                continue
            child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
            rel = rel_dir + b"/" + name if rel_dir else name
            levels.append((rel, iter(visit(fd, rel)), _identity(fd)))
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    return TreeSummary(h.hexdigest(), files, dirs, others, size)


def remove_tree(path: Path) -> None:
    """Delete ``path`` and everything below it, never following a symlink. Iterative and relative
    to directory descriptors (one open at a time): any depth, far past PATH_MAX and the recursion
    limit. Gets through directories without write or search permission (a non-root host owns but
    cannot enter overlay's 000 work dirs). Best effort: what cannot be removed is logged and left,
    the rest goes."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    try:
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path)
            return
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _empty_dir(parent, path.name)
            os.rmdir(path.name, dir_fd=parent)
        finally:
            os.close(parent)
    except OSError as exc:
        log.warning("could not remove all of %s: %s", path, exc)


def _open_dir_for_removal(parent: int, name: str) -> int:
    """``name`` in ``parent`` opened as a directory we may empty (made 0700 if it was not)."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except PermissionError:
        # Made searchable through an O_PATH descriptor: the chmod reaches this very directory,
        # never what a symlink swapped in meanwhile would point at.
        pfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=parent)
        try:
            os.chmod(f"/proc/self/fd/{pfd}", 0o700)
        finally:
            os.close(pfd)
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    if stat.S_IMODE(os.fstat(fd).st_mode) & 0o700 != 0o700:
        os.fchmod(fd, 0o700)
    return fd


def _empty_dir(parent: int, name: str) -> None:
    fd = _open_dir_for_removal(parent, name)
    # per level: names still to remove, identity, name in its parent, relists left
    levels: list[tuple[Iterator[str], tuple[int, int], str, int]] = [(iter(os.listdir(fd)), _identity(fd), name, 3)]
    try:
        while levels:
            names, ident, here, relists = levels[-1]
            entry = next(names, None)
            if entry is None:
                left = os.listdir(fd)  # what appeared meanwhile (a writer still running)
                if left and relists:
                    levels[-1] = (iter(left), ident, here, relists - 1)
                    continue
                levels.pop()
                if levels:
                    parent = _up(fd, levels[-1][1])
                    os.close(fd)
                    fd = parent
                    try:
                        os.rmdir(here, dir_fd=fd)
                    except OSError as exc:
                        log.warning("could not remove directory %r: %s", here, exc)
                continue
            try:
                st = os.stat(entry, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(entry, dir_fd=fd)
                    continue
                child = _open_dir_for_removal(fd, entry)
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("could not remove %r: %s", entry, exc)
                continue
            os.close(fd)
            fd = child
            levels.append((iter(os.listdir(fd)), _identity(fd), entry, 3))
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


async def run_tool(argv: list[str], *, timeout: float, user: int | None = None, cwd: Path | None = None,
                   stdin: AsyncIterable[bytes] | None = None, env: dict[str, str] | None = None) -> str:
    """Run a helper program (cp, tar, git); raise WorkspaceError with its stderr on failure."""
    ids: dict[str, Any] = {"user": user, "group": user, "extra_groups": []} if user is not None else {}
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=cwd,
        env=env if env is not None else {"PATH": TOOL_PATH, "LANG": "C.UTF-8"}, umask=0o022, **ids,
    )

    async def feed() -> None:
        assert proc.stdin is not None and stdin is not None
        try:
            async for chunk in stdin:
                proc.stdin.write(chunk)
                await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            proc.stdin.close()

    try:
        feeder = asyncio.ensure_future(feed()) if stdin is not None else None
        out, err = await asyncio.wait_for(proc.communicate() if stdin is None else _wait_out(proc), timeout)
        if feeder is not None:
            await feeder
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise WorkspaceError(f"{argv[0]} took longer than {timeout:g}s") from None
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    if proc.returncode != 0:
        text = err.decode(errors="replace").strip()[-2000:]
        raise WorkspaceError(f"{os.path.basename(argv[0])} failed (exit {proc.returncode}): {text}")
    return out.decode(errors="replace")


async def _wait_out(proc: asyncio.subprocess.Process) -> tuple[bytes, bytes]:
    assert proc.stdout is not None and proc.stderr is not None
    out, err = await asyncio.gather(proc.stdout.read(), proc.stderr.read())
    await proc.wait()
    return out, err


async def copy_tree(src: str | Path, dst: Path, *, timeout: float = 3600, into_empty: bool = False) -> None:
    """``cp -a --reflink=auto src dst`` into a path that must not exist yet (never into a tree),
    or with ``into_empty`` into an empty directory (a freshly mounted tmpfs).

    ``cp`` creates by full path: a tree deeper than PATH_MAX (a slot can build one) fails there with
    ENAMETOOLONG, and is then copied again by ``copy_tree_fds`` (descriptor-relative, any depth)."""
    if into_empty:
        if os.listdir(dst):
            raise WorkspaceError(f"refusing to copy into non-empty {dst}")
    elif os.path.lexists(dst):  # noqa: ASYNC240 - one lstat
        raise WorkspaceError(f"refusing to copy into existing {dst}")
    try:
        await run_tool(["cp", "-a", "--reflink=auto", "-T", "--", str(src), str(dst)], timeout=timeout)
    except WorkspaceError as exc:
        if os.strerror(errno.ENAMETOOLONG) not in str(exc):
            raise
        log.info("copy of %s: too deep for cp, copying by descriptors", src)
        await asyncio.to_thread(_clear_copy, dst, into_empty)
        try:
            await asyncio.wait_for(asyncio.to_thread(copy_tree_fds, Path(src), dst, into_empty=into_empty), timeout)
        except (OSError, asyncio.TimeoutError) as again:
            raise WorkspaceError(f"copy of {src} failed: {again!r}") from again


def _clear_copy(dst: Path, into_empty: bool) -> None:
    if not into_empty:
        remove_tree(dst)
        return
    for entry in os.listdir(dst):
        remove_tree(dst / entry)


def copy_tree_fds(src: Path, dst: Path, *, into_empty: bool = False) -> None:
    """What ``cp -a`` makes of ``src`` (types, modes, mtimes, link targets; owners when root), by
    descriptors: iterative, one directory of each side open at a time, never following a link."""
    s = os.open(src, _DIR_FLAGS)
    d = -1
    try:
        if not into_empty:
            os.mkdir(dst, 0o700)
        d = os.open(dst, _DIR_FLAGS)
        # per level: names to copy, both sides' identities, the source directory's stat
        levels: list[tuple[Iterator[str], tuple[int, int], tuple[int, int], os.stat_result]] = [
            (iter(sorted(os.listdir(s))), _identity(s), _identity(d), os.fstat(s))]
        while levels:
            names, _, _, st_dir = levels[-1]
            name = next(names, None)
            if name is None:
                levels.pop()
                _copy_attrs(d, st_dir)
                if levels:
                    sp = _up(s, levels[-1][1])
                    os.close(s)
                    s = sp
                    dp = _up(d, levels[-1][2])
                    os.close(d)
                    d = dp
                continue
            st = os.stat(name, dir_fd=s, follow_symlinks=False)
            mode = st.st_mode
            if stat.S_ISDIR(mode):
                os.mkdir(name, 0o700, dir_fd=d)
                cs = os.open(name, _DIR_FLAGS, dir_fd=s)
                try:
                    cd = os.open(name, _DIR_FLAGS, dir_fd=d)
                except OSError:
                    os.close(cs)
                    raise
                os.close(s)
                s = cs
                os.close(d)
                d = cd
                levels.append((iter(sorted(os.listdir(s))), _identity(s), _identity(d), os.fstat(s)))
            elif stat.S_ISREG(mode):
                _copy_file(s, d, name)
            elif stat.S_ISLNK(mode):
                os.symlink(os.readlink(name, dir_fd=s), name, dir_fd=d)
                if os.geteuid() == 0:
                    os.chown(name, st.st_uid, st.st_gid, dir_fd=d, follow_symlinks=False)
                os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=d, follow_symlinks=False)
            else:  # FIFOs, sockets, devices (as root): recreated, as cp -a does
                os.mknod(name, mode, st.st_rdev, dir_fd=d)
                if os.geteuid() == 0:
                    os.chown(name, st.st_uid, st.st_gid, dir_fd=d, follow_symlinks=False)
                os.chmod(name, stat.S_IMODE(mode), dir_fd=d)
                os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=d, follow_symlinks=False)
    finally:
        os.close(s)
        if d >= 0:
            os.close(d)


def _copy_attrs(fd: int, st: os.stat_result) -> None:
    if os.geteuid() == 0:
        os.fchown(fd, st.st_uid, st.st_gid)
    os.fchmod(fd, stat.S_IMODE(st.st_mode))
    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))


def _copy_file(s: int, d: int, name: str) -> None:
    sfd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=s)
    try:
        st = os.fstat(sfd)
        dfd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=d)
        try:
            try:
                while os.copy_file_range(sfd, dfd, 1 << 30):
                    pass
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                while chunk := os.read(sfd, 1 << 20):  # the offsets both moved on together
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(dfd, view):]
            _copy_attrs(dfd, st)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


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


# -- the mount namespace -----------------------------------------------------------------------
class MountNamespace:
    """Client of the mount helper process (one per host)."""

    def __init__(self, mode: Literal["root", "userns"], nsenter: str, python: str, script: Path) -> None:
        self.mode = mode
        self.nsenter = nsenter
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

    def mounts(self, under: str | None = None) -> list[MountEntry]:
        """The namespace's mounts (with ``under``: only those whose mount point starts with it)."""
        return read_mountinfo(self.pid, under)

    def proc_path(self, path: Path) -> str:
        """The path as seen inside the namespace (for the host, which lives outside it)."""
        return f"/proc/{self.pid}/root{path}"

    def launcher(self, uid: int | None) -> list[str]:
        """argv prefix that starts a program inside the namespace (dropping to ``uid`` as root)."""
        if self.mode == "root":
            assert uid is not None, "a root host always runs slots as their own uid"
            return [self.nsenter, f"--mount=/proc/{self.pid}/ns/mnt", f"--setuid={uid}", f"--setgid={uid}", "--"]
        return [self.nsenter, f"--user=/proc/{self.pid}/ns/user", f"--mount=/proc/{self.pid}/ns/mnt",
                "--preserve-credentials", "--"]

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


# -- templates ---------------------------------------------------------------------------------
@dataclass
class Template:
    id: str
    name: str
    source: str
    tree: Path
    summary: TreeSummary
    created_at: float
    prepare_ms: float
    users: set[int] = field(default_factory=set)  # slot indices whose workspace is built on it
    readers: int = 0  # archive downloads in progress

    def info(self) -> TemplateInfo:
        s = self.summary
        return TemplateInfo(id=self.id, name=self.name, source=self.source, created_at=self.created_at,
                            files=s.files, dirs=s.dirs, others=s.others, bytes=s.bytes, tree_hash=s.tree_hash,
                            prepare_ms=round(self.prepare_ms, 3), users=sorted(self.users))


class TemplateStore:
    """Templates of one host. The directory is private to the host user (0700): on a root host
    no slot uid can even reach it; overlays read it with the mounter's credentials."""

    def __init__(self, root: Path, owner: int | None, trash: Path) -> None:
        self.dir = root / "templates"
        self.owner = owner
        self.trash = trash
        self.templates: dict[str, Template] = {}

    def prepare(self) -> None:
        self.dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.dir, 0o700)
        for entry in self.dir.iterdir():  # templates never survive a host restart
            self.trash.mkdir(exist_ok=True)
            os.rename(entry, self.trash / f"template-{entry.name}-{secrets.token_hex(4)}")

    def new_dir(self) -> tuple[str, Path]:
        tid = f"tpl-{secrets.token_hex(6)}"
        d = self.dir / tid
        d.mkdir(mode=0o700)
        return tid, d

    def abandon(self, d: Path) -> None:
        if d.exists():
            self.trash.mkdir(exist_ok=True)
            os.rename(d, self.trash / f"template-{d.name}-{secrets.token_hex(4)}")

    def get(self, tid: str) -> Template:
        try:
            return self.templates[tid]
        except KeyError:
            raise UnknownTemplate(f"unknown template {tid!r}") from None

    def delete(self, tid: str) -> None:
        t = self.get(tid)
        if t.users or t.readers:
            who = f"slot(s) {sorted(t.users)}" if t.users else f"{t.readers} archive download(s)"
            raise TemplateInUse(f"template {tid} is in use by {who}; reset or release them first")
        del self.templates[tid]
        self.abandon(t.tree.parent)


def source_dir_allowed(path: str, allowed: list[Path]) -> Path:
    """Resolve a host path and require it under one of the configured source directories."""
    if not allowed:
        raise TemplateSourceError("this host accepts no host directories as template sources "
                                  "(start it with --template-source-dir)")
    real = Path(os.path.realpath(path))
    for root in allowed:
        root_real = Path(os.path.realpath(root))
        if real == root_real or root_real in real.parents:
            return real
    raise TemplateSourceError(f"{path} is not under an allowed template source directory")


# -- the host's workspace service --------------------------------------------------------------
class Workspaces:
    """Decides overlay vs copy mode, owns the mount namespace and the template store, and makes
    templates from host-side sources. Slot-side fork/reset logic lives in ``slot.py``."""

    def __init__(self, cfg: Any, root: Path, *, owner: int | None, probe_uid: int | None, trash: Path) -> None:
        self.cfg = cfg
        self.root = root
        self.owner = owner  # uid owning template files on a root host (no slot runs as it)
        self.probe_uid = probe_uid
        self.store = TemplateStore(root, owner, trash)
        self.trash = trash
        # where the mount helper moves a reset slot's old mounts until its background unmount
        self.mount_trash = root / "mtrash"
        self.mode: WorkspaceMode = "copy"
        self.detail = ""
        self.ns: MountNamespace | None = None
        self.fork_probe_ms: float | None = None
        self.capped = False  # plain and copied workspaces are capped tmpfs mounts in the namespace
        self.fork_capped = False  # forks' upper layers are too
        self.cap_detail = ""
        # each slot's run dir, /tmp and /dev/shm are tmpfs mounts in the namespace, capped in size and inodes
        self.scratch_capped = False

    async def start(self) -> None:
        await asyncio.to_thread(self.store.prepare)
        await asyncio.to_thread(self._prepare_mount_trash)
        for leftover in self.root.glob("probe-*"):  # of a host that died while probing
            await asyncio.to_thread(remove_tree, leftover)
        wanted = self.cfg.workspace_mode
        quota = self.cfg.limits.workspace_quota(None)
        if self.cfg.unsafe_no_isolation:
            self._uncapped("no workspace cap without isolation (--unsafe-no-isolation)", warn=False)
            self._fallback("no overlays without isolation (--unsafe-no-isolation)", warn=False)
            return
        if quota is None:
            self._uncapped("workspaces uncapped by configuration (--workspace-bytes 0)", warn=False)
        # Started even without a workspace cap: /tmp, /dev/shm and the run dir are capped there.
        try:
            ns = await self._start_namespace()
        except (WorkspaceError, OSError, ValueError) as exc:
            if wanted == "overlay":
                raise WorkspaceError(f"overlay workspaces unavailable (--workspace-mode overlay): {exc}") from exc
            if quota is not None:
                self._uncapped(f"the mount helper cannot run: {exc}", warn=True)
            log.warning("workspace: /tmp and /dev/shm are capped in size only, NOT in inodes (a slot can pin "
                        "kernel memory with empty files): the mount helper cannot run: %s", exc)
            self._fallback(f"overlayfs unavailable: {exc}" if wanted != "copy"
                           else "copy mode forced by configuration (--workspace-mode copy)", warn=wanted != "copy")
            return
        self.ns = ns
        await self._probe_cap(quota)
        if wanted == "copy":
            self._fallback("copy mode forced by configuration (--workspace-mode copy)", warn=False)
        else:
            await self._probe_overlay(wanted)
        if not self.capped and not self.scratch_capped and self.mode != "overlay":
            await ns.stop()  # nothing left for it to hold
            self.ns = None

    def _prepare_mount_trash(self) -> None:
        """Empty directories a dead host's helper left (their mounts died with its namespace)."""
        if self.mount_trash.exists():
            self.trash.mkdir(exist_ok=True)
            os.rename(self.mount_trash, self.trash / f"mtrash-{secrets.token_hex(4)}")
        self.mount_trash.mkdir(mode=0o700)

    async def _start_namespace(self) -> MountNamespace:
        nsenter = shutil.which("nsenter", path=TOOL_PATH)
        if nsenter is None:
            raise WorkspaceError("nsenter (util-linux) not found")
        # The helper is stdlib-only: run it with the sandbox's system python from a copy in the
        # data dir, both reachable by whatever uid the host runs as.
        script = self.root / "mounthelper.py"
        tmp = script.with_name(script.name + ".tmp")
        tmp.write_bytes(HELPER.read_bytes())
        os.chmod(tmp, 0o644)
        os.replace(tmp, script)
        ns = MountNamespace("root" if os.geteuid() == 0 else "userns", nsenter, self.cfg.python, script)
        await ns.start()
        return ns

    async def _probe_cap(self, quota: dict[str, Any] | None) -> None:
        """Mount and drop one capped tmpfs the way every slot will (its workspace, or without a
        workspace cap its /tmp)."""
        assert self.ns is not None
        probe_dir = self.root / f"probe-{secrets.token_hex(4)}"
        probe_dir.mkdir(mode=0o700)
        try:
            uid = self.probe_uid if self.ns.mode == "root" else None
            probe = quota if quota is not None else self.cfg.limits.scratch_quotas(None)[1]
            await self.ns.call({"op": "tmpfs", "target": str(probe_dir), "quota": {**probe, "uid": uid}})
            await self.ns.call({"op": "umount", "targets": [str(probe_dir)]})
        except WorkspaceError as exc:
            if quota is not None:
                self._uncapped(f"a capped tmpfs cannot be mounted: {exc}", warn=True)
            log.warning("workspace: /tmp and /dev/shm are capped in size only, NOT in inodes: %s", exc)
            return
        finally:
            await asyncio.to_thread(remove_tree, probe_dir)
        self.scratch_capped = True
        if quota is None:
            return
        self.capped = self.fork_capped = True
        self.cap_detail = (f"each slot's workspace is its own tmpfs of {quota['bytes'] >> 20} MiB, "
                           f"{quota['inodes']} inodes (RAM-backed)")

    async def _probe_overlay(self, wanted: str) -> None:
        assert self.ns is not None
        ns = self.ns
        idmap = [self.owner, self.probe_uid] if ns.mode == "root" else None
        quota = self.cfg.limits.workspace_quota(None) if self.capped else None
        result: dict[str, Any] | None = None
        failure = ""
        for q in ([quota, None] if quota is not None else [None]):
            try:
                probe_dir = self.root / f"probe-{secrets.token_hex(4)}"
                result = await ns.call({"op": "probe", "dir": str(probe_dir), "idmap": idmap, "quota": q})
            except WorkspaceError as exc:
                failure = failure or str(exc)
                continue
            if q is None and quota is not None:
                # e.g. tmpfs without user xattrs (kernels before 6.6) under an unprivileged host
                self.fork_capped = False
                log.warning("workspace: overlays on a capped tmpfs fail (%s); forked workspaces are NOT "
                            "size-capped (their writes go to the data dir's disk)", failure)
                self.cap_detail += f"; forks uncapped: {failure}"
            break
        if result is None:
            if wanted == "overlay":
                raise WorkspaceError(f"overlay workspaces unavailable (--workspace-mode overlay): {failure}")
            self._fallback(f"overlayfs unavailable: {failure}", warn=True)
            return
        self.mode = "overlay"
        self.fork_probe_ms = float(result.get("fork_ms", 0.0))
        how = ("idmapped template layers in a private mount namespace" if ns.mode == "root"
               else "unprivileged user+mount namespace, userxattr")
        self.detail = f"overlayfs copy-on-write forks ({how}); probe fork {self.fork_probe_ms} ms"
        log.info("workspace: %s", self.detail)

    def _uncapped(self, why: str, *, warn: bool) -> None:
        self.capped = self.fork_capped = False
        self.cap_detail = why
        if warn:
            log.warning("workspace: slots' workspaces are NOT size-capped (a slot can fill the data dir's disk): %s",
                        why)

    def _fallback(self, why: str, *, warn: bool) -> None:
        self.mode, self.detail = "copy", why
        (log.warning if warn else log.info)(
            "workspace: %s; template forks are full copies (cp -a --reflink=auto into a fresh dir), "
            "slower and using disk per fork", why)

    async def stop(self) -> None:
        if self.ns is not None:
            await self.ns.stop()

    def problem(self) -> str:
        """Non-empty when forks cannot work any more (the mount helper died)."""
        if (self.mode == "overlay" or self.capped or self.scratch_capped) and (self.ns is None or not self.ns.alive):
            return "the workspace mount helper died; slots' workspaces cannot be reset"
        return ""

    def mount_count(self) -> int | None:
        """Mounts below the data dir in the workspace namespace: a capped tmpfs for each slot's
        workspace (when capped), run dir, /tmp and /dev/shm, plus the template layer and the
        overlay per forked slot; no more."""
        if self.ns is None or not self.ns.alive:
            return None
        prefix = os.path.realpath(self.root) + "/"
        leaving = os.path.realpath(self.mount_trash) + "/"  # a reset's old mounts, being unmounted
        try:
            return sum(1 for m in self.ns.mounts(prefix) if not m.mountpoint.startswith(leaving))
        except OSError:
            return None

    # -- building templates ----------------------------------------------------------------
    async def build(self, source: str, name: str, fill: Any) -> Template:
        """Make a template: ``fill(tree)`` creates ``tree`` (which does not exist yet)."""
        t0 = time.perf_counter()
        tid, d = self.store.new_dir()
        tree = d / "tree"
        try:
            try:
                await fill(tree)
            except WorkspaceError as exc:
                if source == "slot":
                    raise
                raise TemplateBuildFailed(str(exc)) from exc
            summary = await asyncio.to_thread(self._seal, tree)
        except BaseException:
            await asyncio.to_thread(self.store.abandon, d)
            raise
        template = Template(tid, name, source, tree, summary, time.time(), (time.perf_counter() - t0) * 1000)
        self.store.templates[tid] = template
        log.info("template %s (%s%s): %d files, %d dirs, %.1f MB, hash %s, %.0f ms", tid, source,
                 f" {name!r}" if name else "", summary.files, summary.dirs, summary.bytes / 1e6,
                 summary.tree_hash[:12], template.prepare_ms)
        return template

    def _seal(self, tree: Path) -> TreeSummary:
        st = os.lstat(tree)
        if not stat.S_ISDIR(st.st_mode):
            raise TemplateSourceError("the template source is not a directory")
        summary = walk_tree(tree, chown_to=self.owner)
        if self.owner is not None:
            os.chown(tree, self.owner, self.owner)
        os.chmod(tree, 0o755)
        return summary

    def _new_tree(self, tree: Path) -> None:
        tree.mkdir(mode=0o755)
        if self.owner is not None:
            os.chown(tree, self.owner, self.owner)

    async def from_dir(self, path: str, name: str) -> Template:
        src = source_dir_allowed(path, self.cfg.template_source_dirs)
        if not src.is_dir():
            raise TemplateSourceError(f"{path} is not a directory")

        async def fill(tree: Path) -> None:
            await copy_tree(src, tree, timeout=self.cfg.max_timeout_s * 6)

        return await self.build("dir", name, fill)

    async def from_git(self, url: str, ref: str | None, depth: int | None, name: str) -> Template:
        local = url.startswith("/") or url.startswith("file://")
        if local:
            src = source_dir_allowed(url.removeprefix("file://"), self.cfg.template_source_dirs)
            url, user = str(src), None  # an operator-allowed directory: read it as the host user
        else:
            scheme = url.split("://", 1)[0].lower() if "://" in url else ""
            if scheme not in ("https", "http", "git"):
                raise TemplateSourceError("git URLs must be https://, http://, git:// or an allowed local path")
            user = self.owner  # untrusted remote content: clone as the unprivileged template uid
        if ref is not None and ref.startswith("-"):
            raise TemplateSourceError("invalid git ref")
        config = ["-c", "protocol.allow=never", "-c", "protocol.https.allow=always", "-c", "protocol.http.allow=always",
                  "-c", "protocol.git.allow=always", "-c", "safe.directory=*", "-c", "core.hooksPath=/dev/null"]
        if local:
            config += ["-c", "protocol.file.allow=always"]
        clone = ["git", *config, "clone", "--quiet", "--no-hardlinks"]
        if depth is not None:
            clone += ["--depth", str(depth)]
            if ref is not None:
                clone += ["--branch", ref]
        env = {"PATH": TOOL_PATH, "LANG": "C.UTF-8", "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1",
               "GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "/bin/false", "GIT_SSH_COMMAND": "/bin/false"}
        timeout = self.cfg.max_timeout_s

        async def fill(tree: Path) -> None:
            self._new_tree(tree)
            await run_tool([*clone, "--", url, "."], timeout=timeout, user=user, cwd=tree, env=env)
            if ref is not None and depth is None:
                await run_tool(["git", *config, "checkout", "--quiet", "--detach", ref, "--"], timeout=timeout,
                               user=user, cwd=tree, env=env)

        return await self.build("git", name, fill)

    async def from_tar(self, stream: AsyncIterable[bytes], name: str, *, gzip: bool) -> Template:
        async def fill(tree: Path) -> None:
            self._new_tree(tree)
            # Extracted as an unprivileged uid (root hosts) with GNU tar's defaults: no absolute
            # or `..` member names, links that point out are created last.
            argv = ["tar", "-x", "-f", "-", "--same-permissions", "--no-same-owner", "--delay-directory-restore"]
            if gzip:
                argv.insert(2, "-z")
            await run_tool(argv, timeout=self.cfg.max_timeout_s * 6, user=self.owner, cwd=tree, stdin=stream)

        return await self.build("tar", name, fill)

    async def archive(self, template: Template) -> AsyncIterator[bytes]:
        """Stream the template as an uncompressed POSIX tar (for shipping it to another host)."""
        template.readers += 1
        try:
            proc = await asyncio.create_subprocess_exec(
                "tar", "-c", "-f", "-", "--format=posix", "--numeric-owner", "-C", str(template.tree), ".",
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env={"PATH": TOOL_PATH, "LANG": "C.UTF-8"},
            )
            assert proc.stdout is not None and proc.stderr is not None
            try:
                while chunk := await proc.stdout.read(1 << 20):
                    yield chunk
                err = await proc.stderr.read()
                if await proc.wait() != 0:
                    raise WorkspaceError(f"tar of template {template.id} failed: {err.decode(errors='replace')}")
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
        finally:
            template.readers -= 1
