"""The ``archive`` tool inside a slot: a tar.gz of a workspace directory, built by a walk that the
slot's own processes cannot steer outside the tree (see ``_TarWalk``).

Standard library only; copied into the host's lib dir beside ``supervisor.py`` (see there).
"""

from __future__ import annotations

import base64
import errno
import io
import os
import stat
import tarfile
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from atropos.sandbox.inslot_files import SlotFiles, ToolFailure
else:  # run from the host's lib dir beside inslot_files.py (see supervisor.py)
    from inslot_files import SlotFiles, ToolFailure


def archive(files: SlotFiles, req: dict[str, Any]) -> dict[str, Any]:
    path = req.get("path") or "."
    max_bytes = int(req["max_bytes"])
    fd = files._open(path, os.O_RDONLY | os.O_DIRECTORY)
    buf = _BoundedBuffer(max_bytes)
    try:
        with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT, encoding="utf-8",
                          errors="surrogateescape") as tar:
            walk = _TarWalk(tar, fd)
            fd = -1  # the walk owns it now
            walk.run()
    except _ArchiveTooLarge:
        raise ToolFailure("too_large", f"{path}: archive exceeds the limit of {max_bytes} bytes") from None
    finally:
        if fd >= 0:
            os.close(fd)
    return {"content": base64.b64encode(buf.getvalue()).decode(), "encoding": "base64",
            "format": "tar.gz", "size": len(buf.getvalue()), "members": walk.members,
            "skipped": walk.skipped[:_SKIPPED_SHOWN], "skipped_total": len(walk.skipped)}



class _ArchiveTooLarge(Exception):
    pass


class _BoundedBuffer(io.BytesIO):
    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def write(self, data: Any) -> int:
        if self.tell() + len(data) > self.limit:
            raise _ArchiveTooLarge
        return super().write(data)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_SKIPPED_SHOWN = 100


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class _TarWalk:
    """Adds a directory's tree to a tar, safe against the slot that owns the tree (see docs/containment.md).

    Iterative (any depth), one directory descriptor open at a time: every entry is opened relative to
    its directory's descriptor with O_NOFOLLOW, so a symlink is stored as a link and never followed,
    whatever is swapped in meanwhile. Going back up reopens ``..`` and checks it is the directory that
    was left; otherwise the tree moved under the walk and the call fails (no archive of a mixture).
    Member names are the walked names joined by ``/``: relative, never ``.``/``..``/absolute. Each
    regular file is read through the one descriptor its member describes, exactly ``st_size`` bytes;
    one that shrinks meanwhile fails the call. Sockets, FIFOs and devices are skipped and reported,
    as are entries that vanished, changed type or cannot be read.
    """

    def __init__(self, tar: tarfile.TarFile, root_fd: int) -> None:
        self.tar = tar
        self.fd = root_fd
        self.skipped: list[dict[str, str]] = []
        self.members = 0
        self.links: dict[tuple[int, int], str] = {}  # hard links: (dev, ino) -> first member name

    def run(self) -> None:
        try:
            st = os.fstat(self.fd)
            # per open level: member-name prefix, names still to visit, identity of the directory
            stack: list[tuple[str, Any, tuple[int, int]]] = [("", iter(sorted(os.listdir(self.fd))), _identity(st))]
            while stack:
                prefix, names, _ = stack[-1]
                name = next(names, None)
                if name is None:
                    stack.pop()
                    if stack:
                        self._up(stack[-1][2])
                    continue
                child = self._entry(prefix + name, name)
                if child is not None:
                    stack.append(child)
        finally:
            os.close(self.fd)

    def _up(self, expected: tuple[int, int]) -> None:
        parent = os.open("..", _DIR_FLAGS, dir_fd=self.fd)
        os.close(self.fd)
        self.fd = parent
        if _identity(os.fstat(parent)) != expected:
            raise ToolFailure("changed_during_archive", "a directory was moved while it was being archived; "
                                                        "archive again once the tree is still")

    def _skip(self, rel: str, why: str) -> None:
        self.skipped.append({"path": rel, "reason": why})

    def _info(self, rel: str, st: os.stat_result, kind: bytes) -> tarfile.TarInfo:
        info = tarfile.TarInfo(rel)
        info.type = kind
        info.mode = stat.S_IMODE(st.st_mode)
        info.mtime = int(st.st_mtime)
        info.uid, info.gid = st.st_uid, st.st_gid
        return info

    def _add(self, info: tarfile.TarInfo, data: Any = None) -> None:
        self.tar.addfile(info, data)
        self.members += 1

    def _entry(self, rel: str, name: str) -> tuple[str, Any, tuple[int, int]] | None:
        """Add one entry; for a directory, enter it and return its stack level."""
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None  # removed since the listing: as if listed a moment later
        except OSError as exc:
            self._skip(rel, f"unreadable: {exc.strerror}")
            return None
        mode = st.st_mode
        if stat.S_ISLNK(mode):
            try:
                target = os.readlink(name, dir_fd=self.fd)
            except OSError as exc:
                self._skip(rel, f"changed while archived: {exc.strerror}")
                return None
            info = self._info(rel, st, tarfile.SYMTYPE)
            info.linkname = target
            self._add(info)
            return None
        if stat.S_ISDIR(mode):
            return self._enter(rel, name, st)
        if stat.S_ISREG(mode):
            self._file(rel, name, st)
            return None
        kind = ("socket" if stat.S_ISSOCK(mode) else "fifo" if stat.S_ISFIFO(mode)
                else "device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "other")
        self._skip(rel, kind)
        return None

    def _open_at(self, rel: str, name: str, flags: int, st: os.stat_result) -> tuple[int, os.stat_result] | None:
        """Open ``name`` without following a link; None (reported) unless it is still what was listed."""
        try:
            fd = os.open(name, flags, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._skip(rel, "changed while archived" if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO)
                       else f"unreadable: {exc.strerror}")
            return None
        now = os.fstat(fd)
        if _identity(now) != _identity(st) or stat.S_IFMT(now.st_mode) != stat.S_IFMT(st.st_mode):
            os.close(fd)
            self._skip(rel, "changed while archived")
            return None
        return fd, now

    def _enter(self, rel: str, name: str, st: os.stat_result) -> tuple[str, Any, tuple[int, int]] | None:
        opened = self._open_at(rel, name, _DIR_FLAGS, st)
        if opened is None:
            return None
        fd, st = opened
        try:
            names = sorted(os.listdir(fd))
            # The walk comes back up through `..`: a directory it could not leave is not entered.
            os.close(os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd))
        except OSError as exc:
            os.close(fd)
            self._add(self._info(rel, st, tarfile.DIRTYPE))
            self._skip(rel + "/", f"contents unreadable: {exc.strerror}")
            return None
        try:
            self._add(self._info(rel, st, tarfile.DIRTYPE))
        except BaseException:
            os.close(fd)
            raise
        os.close(self.fd)
        self.fd = fd
        return rel + "/", iter(names), _identity(st)

    def _file(self, rel: str, name: str, st: os.stat_result) -> None:
        opened = self._open_at(rel, name, _FILE_FLAGS, st)
        if opened is None:
            return
        fd, st = opened
        try:
            if st.st_nlink > 1:
                first = self.links.get(_identity(st))
                if first is not None:
                    info = self._info(rel, st, tarfile.LNKTYPE)
                    info.linkname = first
                    self._add(info)
                    return
                self.links[_identity(st)] = rel
            info = self._info(rel, st, tarfile.REGTYPE)
            info.size = st.st_size
            self._add(info, _ExactReader(fd, st.st_size, rel))
        finally:
            os.close(fd)


class _ExactReader:
    """A file's first ``size`` bytes (what its tar header announced), or a tool error if it shrank."""

    def __init__(self, fd: int, size: int, rel: str) -> None:
        self.fd, self.left, self.rel = fd, size, rel

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        parts: list[bytes] = []
        got = 0
        while got < n:
            chunk = os.read(self.fd, min(n - got, 1 << 20))
            if not chunk:
                raise ToolFailure("changed_during_archive", f"{self.rel}: shrank while it was being archived; "
                                                            "archive again once it is still")
            parts.append(chunk)
            got += len(chunk)
        self.left -= got
        return b"".join(parts)

