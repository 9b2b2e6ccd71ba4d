"""Trees of files as the host handles them: a manifest hash (``walk_tree``), deletion and copies
that never follow a symlink and reach any depth (a slot's tree is hostile: see docs/templates.md),
and the helper programs (cp, tar, git) run on them."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import stat
from collections.abc import AsyncIterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atropos.errors import WorkspaceError
from atropos.sandbox.contract.hostdirs import remove_tree
from atropos.sandbox.host.child_process import killed_if_left
from atropos.sandbox.host.workspace import TOOL_PATH
from atropos.sandbox.inslot.inslot_fs import DIR_FLAGS, DirWalk, identity, up

log = logging.getLogger(__name__)


# -- trees -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TreeSummary:
    tree_hash: str
    files: int
    dirs: int
    others: int
    bytes: int


def _identity(fd: int) -> tuple[int, int]:
    return identity(os.fstat(fd))


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
    walk: DirWalk[bytes] = DirWalk(os.open(root, DIR_FLAGS))

    def visit(rel_dir: bytes) -> Iterator[tuple[int, bytes]]:
        """Hash the entries of one directory, then enter its subdirectories, in order."""
        nonlocal files, dirs, others, size
        fd = walk.fd
        subdirs: list[tuple[bytes, bytes]] = []
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
                subdirs.append((name, rel))
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
        for name, rel in subdirs:  # walk.fd: this directory again (reopened through .. after each)
            yield os.open(name, DIR_FLAGS, dir_fd=walk.fd), rel

    walk.run(visit, b"")
    return TreeSummary(h.hexdigest(), files, dirs, others, size)


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

    async with killed_if_left(proc):
        try:
            feeder = asyncio.ensure_future(feed()) if stdin is not None else None
            out, err = await asyncio.wait_for(proc.communicate() if stdin is None else _wait_out(proc), timeout)
            if feeder is not None:
                await feeder
        except asyncio.TimeoutError:
            raise WorkspaceError(f"{argv[0]} took longer than {timeout:g}s") from None
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
    s = os.open(src, DIR_FLAGS)
    d = -1
    try:
        if not into_empty:
            os.mkdir(dst, 0o700)
        d = os.open(dst, DIR_FLAGS)
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
                    sp = up(s, levels[-1][1])
                    os.close(s)
                    s = sp
                    dp = up(d, levels[-1][2])
                    os.close(d)
                    d = dp
                continue
            st = os.stat(name, dir_fd=s, follow_symlinks=False)
            mode = st.st_mode
            if stat.S_ISDIR(mode):
                os.mkdir(name, 0o700, dir_fd=d)
                cs = os.open(name, DIR_FLAGS, dir_fd=s)
                try:
                    cd = os.open(name, DIR_FLAGS, dir_fd=d)
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


def delete_trash(trash: Path) -> None:
    """Remove discarded trees (remove_tree never follows symlinks, so a planted link cannot redirect
    it); one tree that resists never keeps the others, or the next pass, from being removed."""
    if not trash.exists():
        return
    for entry in trash.iterdir():
        try:
            remove_tree(entry)
        except Exception:  # a background sweep: log and go on with the next tree
            log.exception("trash: could not remove %s", entry)
