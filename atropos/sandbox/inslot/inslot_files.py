"""The supervisor's file tools (read, write, edit, list, stat) inside a slot: every path is opened
strictly beneath the workspace with openat2(2), so a file tool reaches exactly the files bash in the
slot would reach under the workspace, never a file outside it (symlinks, ``..``, magic links).

Standard library only; copied into the host's lib dir beside ``supervisor.py`` (see there).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import stat
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from atropos.sandbox.inslot.inslot_file_replies import (
        ToolFailure,
        edited_path,
        escape_failure,
        failure,
        list_entry,
        os_failure,
        read_result,
        shown_path,
        stat_result,
        write_content,
    )
    from atropos.sandbox.inslot.inslot_fs import read_at_most
else:  # run from the host's lib dir beside inslot_fs.py (see supervisor.py)
    from inslot_file_replies import (
        ToolFailure,
        edited_path,
        escape_failure,
        failure,
        list_entry,
        os_failure,
        read_result,
        shown_path,
        stat_result,
        write_content,
    )
    from inslot_fs import read_at_most

__all__ = ["SlotFiles", "ToolFailure"]  # ToolFailure: the in-slot tools import it from here

RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10
SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(os.uname().machine)
MAX_OFFSET = (1 << 63) - 1  # off_t


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _openat2(dir_fd: int, path: str, flags: int, mode: int = 0o644, resolve: int = RESOLVE_BENEATH) -> int:
    """Open ``path`` strictly beneath ``dir_fd``: an absolute path or symlink, or a ``..`` that
    climbs above ``dir_fd``, fails with EXDEV. Refusing (rather than re-rooting them at ``dir_fd``)
    keeps the file tools' view identical to the shell's: a path either names the same file bash
    would open, or is an error."""
    # os.fsencode: a path the kernel gave (edit's resolved parent) may hold a name that is not
    # UTF-8, which its str keeps as surrogates; "replace" turned each into "?", another name
    raw = os.fsencode(path)
    if b"\0" in raw:
        raise failure("nul", path)
    if SYS_OPENAT2 is None:
        raise ToolFailure("unsupported", "openat2 is not available on this architecture")
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, resolve | RESOLVE_NO_MAGICLINKS)
    for _ in range(64):
        fd = _libc.syscall(SYS_OPENAT2, dir_fd, raw, ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        # EAGAIN: a rename anywhere on the machine raced a ``..`` step; the kernel asks for a retry
        if err != errno.EAGAIN:
            break
    raise OSError(err, os.strerror(err), path)


class SlotFiles:
    """File tools on the workspace at ``workspace`` (the path the slot's processes see it at)."""

    def __init__(self, workspace: str, cwd: str | None = None) -> None:
        self.workspace = workspace
        # Beneath the workspace, an absolute symlink leaves it: refused. A workspace of "/" (an
        # image root) is the whole root, where an absolute symlink means what it means to bash.
        self.resolve = RESOLVE_IN_ROOT if workspace == "/" else RESOLVE_BENEATH
        # Where relative paths start (an image's WorkingDir, under a workspace of "/"); default:
        # the workspace itself.
        self.cwd = cwd

    def _root_fd(self) -> int:
        return os.open(self.workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def _rel(self, path: str) -> str:
        """``path`` relative to the workspace, read as bash in the slot reads it: ``/workspace/x``
        (the workspace as the slot's processes see it) is ``x``; any other absolute path is outside
        the workspace and refused, never re-rooted into it."""
        if not isinstance(path, str) or not path:
            raise failure("empty", "")
        if not path.startswith("/"):
            if self.cwd is None:
                return path
            path = f"{self.cwd}/{path}"
        root = self.workspace.rstrip("/") or "/"
        norm = re.sub("/+", "/", path)
        if norm == root or norm == root + "/":
            return "."
        inside = root if root.endswith("/") else root + "/"
        if norm.startswith(inside):
            return norm[len(inside):]
        raise escape_failure(path, self.workspace)

    def _shown(self, fd: int, rel: str) -> str:
        """The path bash would use for the file open at ``fd``: what a result reports as written."""
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            real = ""
        return shown_path(real, rel, self.workspace)

    def _open(self, path: str, flags: int, mode: int = 0o644) -> int:
        return self._open_rel(self._rel(path), flags, mode, shown=path)

    def _open_rel(self, rel: str, flags: int, mode: int = 0o644, shown: str | None = None) -> int:
        """Open ``rel``, already relative to the workspace (see ``_rel``)."""
        root = self._root_fd()
        try:
            fd = _openat2(root, rel, flags, mode, self.resolve)
        except OSError as exc:
            raise os_failure(exc, rel if shown is None else shown) from None
        finally:
            os.close(root)
        if self.workspace == "/" and not flags & os.O_PATH:
            # A workspace of "/" (an image root) reaches /proc, where "self" is this supervisor, not
            # the tool's caller as it is for `cat /proc/self/...`: its memory, its descriptors.
            # Nothing there is a file a file tool needs; bash reaches it as itself.
            try:
                real = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                real = ""
            if real == "/proc" or real.startswith("/proc/"):
                os.close(fd)
                raise failure("proc", rel if shown is None else shown)
        return fd

    def _resolve_dir(self, path: str) -> str:
        fd = self._open(path, os.O_PATH | os.O_DIRECTORY)
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)

    def _make_parents(self, rel: str) -> None:
        """Make the missing directories above ``rel`` (relative to the workspace, see ``_rel``)."""
        parts = [p for p in rel.split("/") if p not in ("", ".")][:-1]
        prefix = ""
        for part in parts:
            prefix = f"{prefix}/{part}" if prefix else part
            try:
                fd = self._open_rel(prefix, os.O_PATH | os.O_DIRECTORY)
                os.close(fd)
                continue
            except ToolFailure as exc:
                if exc.code != "not_found":
                    raise
            parent = prefix.rsplit("/", 1)[0] if "/" in prefix else "."
            pfd = self._open_rel(parent, os.O_PATH | os.O_DIRECTORY)
            try:
                os.mkdir(part, 0o755, dir_fd=pfd)
            except FileExistsError:
                pass
            except OSError as exc:
                raise os_failure(exc, prefix) from None
            finally:
                os.close(pfd)

    def _read_regular(self, path: str, offset: int, limit: int, max_bytes: int) -> tuple[bytes, int]:
        if not 0 <= offset <= MAX_OFFSET or limit < 0:
            raise ToolFailure("invalid_arguments", f"offset must be 0..{MAX_OFFSET} and limit >= 0")
        fd = self._open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise failure("is_directory", path)
            if not stat.S_ISREG(st.st_mode):
                raise failure("not_regular", path)
            want = max(st.st_size - offset, 0) if limit <= 0 else limit
            if want > max_bytes:
                raise failure("too_large", path, st.st_size, max_bytes)
            os.lseek(fd, offset, os.SEEK_SET)
            return read_at_most(fd, want), st.st_size
        finally:
            os.close(fd)

    def read_file(self, req: dict[str, Any]) -> dict[str, Any]:
        data, size = self._read_regular(
            req["path"], int(req.get("offset") or 0), int(req.get("limit") or 0), int(req["max_bytes"])
        )
        return read_result(data, size, req["encoding"])

    def write_file(self, req: dict[str, Any]) -> dict[str, Any]:
        path = req["path"]
        data = write_content(req)
        rel = self._rel(path)
        self._make_parents(rel)
        flags = os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY
        flags |= os.O_APPEND if req.get("append") else os.O_TRUNC
        fd = self._open(path, flags)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise failure("not_regular", path)
            view = memoryview(data)
            while view:
                try:
                    n = os.write(fd, view)
                except OSError as exc:
                    raise os_failure(exc, path) from None
                view = view[n:]
            return {"path": self._shown(fd, rel), "bytes_written": len(data), "size": os.fstat(fd).st_size}
        finally:
            os.close(fd)

    def edit_file(self, req: dict[str, Any]) -> dict[str, Any]:
        path, old, new = req["path"], req["old_string"], req["new_string"]
        if old == "":
            raise ToolFailure("invalid_arguments", "old_string must not be empty")
        data, _ = self._read_regular(path, 0, 0, int(req["max_bytes"]))
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise failure("not_text", path) from None
        count = text.count(old)
        if count == 0:
            raise failure("no_match", path)
        if count > 1 and not req.get("replace_all"):
            raise failure("ambiguous_match", path, count)
        updated = text.replace(old, new) if req.get("replace_all") else text.replace(old, new, 1)
        shown = self._replace_file(path, updated.encode())
        return {"path": shown, "replacements": count if req.get("replace_all") else 1}

    def _replace_file(self, path: str, data: bytes) -> str:
        """Give ``path`` the content ``data`` all at once: written in full to a new file beside it,
        then renamed over it (mode kept). A failure (no space, file size limit, a short write)
        leaves the original untouched, where truncating first would lose it. Returns the path
        (as bash sees it) of the file replaced."""
        rel_in = self._rel(path)
        root = self._root_fd()
        tmp_name: str | None = None
        dir_fd = -1
        try:
            try:
                # opened for writing only to be refused a file we may not write, as in place editing was
                fd = _openat2(root, rel_in, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY, resolve=self.resolve)
            except OSError as exc:
                raise os_failure(exc, path) from None
            try:
                st = os.fstat(fd)
                # Where `path` really is (a symlink is edited at its target, as in place editing
                # did); openat2 guaranteed that this is inside the workspace.
                real = os.readlink(f"/proc/self/fd/{fd}")
            finally:
                os.close(fd)
            if not stat.S_ISREG(st.st_mode):
                raise failure("not_regular", path)
            rel = os.path.relpath(real, os.readlink(f"/proc/self/fd/{root}"))
            parent, name = os.path.split(rel)
            if rel.startswith("..") or not name:
                raise failure("resolved_escape", path)
            try:
                dir_fd = _openat2(root, parent or ".", os.O_PATH | os.O_DIRECTORY, resolve=self.resolve)
                tmp_name = f".{name[:200]}.edit-{os.getpid()}-{time.monotonic_ns()}"
                tfd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                              0o600, dir_fd=dir_fd)
                try:
                    view = memoryview(data)
                    while view:  # os.write may write less than asked (a short write): loop
                        view = view[os.write(tfd, view):]
                    os.fchmod(tfd, stat.S_IMODE(st.st_mode))
                finally:
                    os.close(tfd)
                os.rename(tmp_name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                tmp_name = None
                return edited_path(rel, self.workspace)
            except OSError as exc:
                raise os_failure(exc, path) from None
        finally:
            if tmp_name is not None and dir_fd >= 0:
                try:
                    os.unlink(tmp_name, dir_fd=dir_fd)
                except OSError:
                    pass
            if dir_fd >= 0:
                os.close(dir_fd)
            os.close(root)

    def list_dir(self, req: dict[str, Any]) -> dict[str, Any]:
        path = req.get("path") or "."
        limit = int(req.get("max_entries") or 1000)
        fd = self._open(path, os.O_RDONLY | os.O_DIRECTORY)
        entries = []
        try:
            shown = self._shown(fd, self._rel(path))
            names = sorted(os.listdir(fd))
            for name in names[:limit]:
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    continue
                entries.append(list_entry(name, st.st_mode, st.st_size))
        finally:
            os.close(fd)
        return {"path": shown, "entries": entries, "truncated": len(names) > limit, "total": len(names)}

    def stat(self, req: dict[str, Any]) -> dict[str, Any]:
        path = req["path"]
        fd = self._open(path, os.O_PATH | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            shown = self._shown(fd, self._rel(path))
        finally:
            os.close(fd)
        return stat_result(shown, st.st_mode, st.st_size, st.st_mtime)
