"""A host's directories on its machine, as both the host and the backends that start hosts there
see them: where data dirs live, who may own them, and clearing what a dead host left (its
processes, its trees of any depth)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from atropos.errors import IsolationUnavailable
from atropos.sandbox.inslot.inslot_fs import DIR_FLAGS, identity, up

log = logging.getLogger(__name__)


# Every IsolationUnavailable leaving SandboxHost.start() begins with this, so a parent reading the
# host's stderr (`error: <message>`, printed by __main__) can tell "cannot confine here" from any
# other start failure (a port in use, a bad flag) without guessing from words in a traceback.
ISOLATION_FAILED = "isolation unavailable: "


def default_data_dir() -> Path:
    # Not under $HOME: slot uids must traverse to their workspace, and /root is 0700. Root uses a
    # directory no other user can pre-create; others use their own name in the temp dir (the host
    # refuses a data dir it does not own).
    if os.geteuid() == 0:
        return Path("/var/lib/atropos-sandbox")
    return Path(tempfile.gettempdir()) / f"atropos-sandbox-{os.getuid()}"


def owned_dir(path: Path, mode: int) -> None:
    """Create or accept ``path`` only if it is a real directory we own that no one else can write.

    A data dir that another user owns or planted as a symlink would let them redirect what a
    root host writes, chmods and deletes.
    """
    import stat as stat_mod

    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat_mod.S_ISDIR(st.st_mode):
        raise IsolationUnavailable(f"data dir {path} is not a directory (a symlink?); refusing to use it")
    if st.st_uid != os.geteuid():
        raise IsolationUnavailable(f"data dir {path} is owned by uid {st.st_uid}, not by this host; refusing")
    if st.st_mode & 0o022 and not (st.st_mode & stat_mod.S_ISVTX):
        raise IsolationUnavailable(f"data dir {path} is writable by others; refusing")
    os.chmod(path, mode)


def kill_processes_naming(data_dir: Path) -> int:
    """SIGKILL every process whose argv names ``data_dir``: what a SIGKILLed host may leave.

    A bwrap killed (with its host) between clone() and releasing its child leaves that child blocked
    for good, reparented to init, before --die-with-parent applies to it; its argv is bwrap's."""
    needle = str(data_dir).encode() + b"/"
    killed = 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                if needle not in fh.read():
                    continue
            os.kill(int(name), signal.SIGKILL)
            killed += 1
        except (OSError, ValueError):
            continue
    if killed:
        log.warning("killed %d leftover process(es) of %s", killed, data_dir)
    return killed


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
        fd = os.open(name, DIR_FLAGS, dir_fd=parent)
    except PermissionError:
        # Made searchable through an O_PATH descriptor: the chmod reaches this very directory,
        # never what a symlink swapped in meanwhile would point at.
        pfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=parent)
        try:
            os.chmod(f"/proc/self/fd/{pfd}", 0o700)
        finally:
            os.close(pfd)
        fd = os.open(name, DIR_FLAGS, dir_fd=parent)
    if stat.S_IMODE(os.fstat(fd).st_mode) & 0o700 != 0o700:
        os.fchmod(fd, 0o700)
    return fd


def _empty_dir(parent: int, name: str) -> None:
    fd = _open_dir_for_removal(parent, name)
    # per level: names still to remove, identity, name in its parent, relists left
    levels: list[tuple[Iterator[str], tuple[int, int], str, int]] = [
        (iter(os.listdir(fd)), identity(os.fstat(fd)), name, 3)]
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
                    parent = up(fd, levels[-1][1])
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
            levels.append((iter(os.listdir(fd)), identity(os.fstat(fd)), entry, 3))
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
