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
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from atropos.sandbox.inslot.inslot_files import SlotFiles, ToolFailure
    from atropos.sandbox.inslot.inslot_fs import DIR_FLAGS, DirWalk, TreeMoved, identity, read_at_most
else:  # run from the host's lib dir beside inslot_files.py (see supervisor.py)
    from inslot_files import SlotFiles, ToolFailure
    from inslot_fs import DIR_FLAGS, DirWalk, TreeMoved, identity, read_at_most


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
            walk.add_tree()
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


_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_SKIPPED_SHOWN = 100
# a directory's member-name prefix and its names to visit, listed before entering it (None: list on visit)
_Level = tuple[str, list[str] | None]


class _TarWalk(DirWalk[_Level]):
    """Adds a directory's tree to a tar, safe against the slot that owns the tree (see docs/containment.md).

    The walk is a ``DirWalk`` (see there): iterative, one directory descriptor open at a time, every
    entry opened relative to its directory's descriptor with O_NOFOLLOW, so a symlink is stored as a
    link and never followed, whatever is swapped in meanwhile; a tree moved under the walk fails the
    call (no archive of a mixture).
    Member names are the walked names joined by ``/``: relative, never ``.``/``..``/absolute. Each
    regular file is read through the one descriptor its member describes, exactly ``st_size`` bytes;
    one that shrinks meanwhile fails the call. Sockets, FIFOs and devices are skipped and reported,
    as are entries that vanished, changed type or cannot be read.
    """

    def __init__(self, tar: tarfile.TarFile, root_fd: int) -> None:
        super().__init__(root_fd)
        self.tar = tar
        self.skipped: list[dict[str, str]] = []
        self.members = 0
        self.links: dict[tuple[int, int], str] = {}  # hard links: (dev, ino) -> first member name

    def add_tree(self) -> None:
        try:
            self.run(self._visit, ("", None))
        except TreeMoved:
            raise ToolFailure("changed_during_archive", "a directory was moved while it was being archived; "
                                                        "archive again once the tree is still") from None

    def _visit(self, level: _Level) -> Iterator[tuple[int, _Level]]:
        prefix, names = level
        for name in sorted(os.listdir(self.fd)) if names is None else names:
            child = self._entry(prefix + name, name)
            if child is not None:
                yield child

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

    def _entry(self, rel: str, name: str) -> tuple[int, _Level] | None:
        """Add one entry; for a directory, its descriptor and level for the walk to enter."""
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
        if identity(now) != identity(st) or stat.S_IFMT(now.st_mode) != stat.S_IFMT(st.st_mode):
            os.close(fd)
            self._skip(rel, "changed while archived")
            return None
        return fd, now

    def _enter(self, rel: str, name: str, st: os.stat_result) -> tuple[int, _Level] | None:
        opened = self._open_at(rel, name, DIR_FLAGS, st)
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
        return fd, (rel + "/", names)

    def _file(self, rel: str, name: str, st: os.stat_result) -> None:
        opened = self._open_at(rel, name, _FILE_FLAGS, st)
        if opened is None:
            return
        fd, st = opened
        try:
            if st.st_nlink > 1:
                first = self.links.get(identity(st))
                if first is not None:
                    info = self._info(rel, st, tarfile.LNKTYPE)
                    info.linkname = first
                    self._add(info)
                    return
                self.links[identity(st)] = rel
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
        data = read_at_most(self.fd, n)
        if len(data) < n:
            raise ToolFailure("changed_during_archive", f"{self.rel}: shrank while it was being archived; "
                                                        "archive again once it is still")
        self.left -= n
        return data

