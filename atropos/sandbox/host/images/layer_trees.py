"""Whole-tree operations on layer dirs of the store: their disk use, and moving an owner (a slot's
uid back to the image's 0, for a layer made from a slot's writable layer), and stacking layers
into one (an image with more layers than an overlay takes)."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path


def tree_bytes(path: Path) -> int:
    """Disk blocks under ``path`` (hard links counted once), without following symlinks."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in (*dirnames, *filenames):
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def shift_owner(tree: Path, old: int, new: int) -> None:
    """Files of ``tree`` owned by ``old`` (uid and gid apart) become ``new``'s; each inode once, modes
    kept (a chown clears setuid and setgid bits), symlinks not followed."""
    seen: set[int] = set()
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in (".", *dirnames, *filenames):
            path = os.path.join(dirpath, name) if name != "." else dirpath
            st = os.lstat(path)
            if st.st_ino in seen or (st.st_uid != old and st.st_gid != old):
                continue
            seen.add(st.st_ino)
            os.chown(path, new if st.st_uid == old else st.st_uid, new if st.st_gid == old else st.st_gid,
                     follow_symlinks=False)
            if not os.path.islink(path):
                os.chmod(path, st.st_mode & 0o7777)



_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPAQUE = ("trusted.overlay.opaque", "user.overlay.opaque")


def merge_layers(layers: list[Path], into: Path, *, owners: bool) -> None:
    """``layers`` (store layer dirs, bottom first) stacked into the one new dir ``into``, as
    overlayfs would show them: a whiteout (a 0/0 character device) removes what is below it, an
    opaque directory hides what is below it, anything else replaces what is below it. The result is
    a bottom layer (nothing below it: no whiteout or opaque marker is kept). Files are hard links to
    the layers' own (a layer never changes), so a merge costs directories, not data. Nothing is
    followed: every directory is opened with ``O_NOFOLLOW`` relative to its parent. ``owners``:
    directories keep the layer's owner (a store that keeps owners)."""
    os.mkdir(into, 0o755)
    top = os.open(into, _DIR)
    try:
        for layer in layers:
            src = os.open(layer, _DIR)
            try:
                _apply(src, top, owners)
                _copy_dir_meta(src, top, owners)
            finally:
                os.close(src)
    finally:
        os.close(top)


def _remove(dir_fd: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        fd = os.open(name, _DIR, dir_fd=dir_fd)
        try:
            _clear(fd)
        finally:
            os.close(fd)
        os.rmdir(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)


def _clear(dir_fd: int) -> None:
    for name in os.listdir(dir_fd):
        _remove(dir_fd, name)


def _copy_dir_meta(src: int, dst: int, owners: bool) -> None:
    st = os.fstat(src)
    for attr in os.listxattr(src):
        if attr.startswith("user.") and not attr.startswith("user.overlay."):
            with contextlib.suppress(OSError):
                os.setxattr(dst, attr, os.getxattr(src, attr))
    if owners:
        os.fchown(dst, st.st_uid, st.st_gid)
    os.fchmod(dst, stat.S_IMODE(st.st_mode))
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


def _opaque(fd: int) -> bool:
    for attr in _OPAQUE:
        with contextlib.suppress(OSError):
            if os.getxattr(fd, attr) == b"y":
                return True
    return False


def _apply(src: int, dst: int, owners: bool) -> None:
    for name in os.listdir(src):
        st = os.stat(name, dir_fd=src, follow_symlinks=False)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # a whiteout: what is below goes
            _remove(dst, name)
            continue
        if not stat.S_ISDIR(st.st_mode):
            _remove(dst, name)
            os.link(name, name, src_dir_fd=src, dst_dir_fd=dst, follow_symlinks=False)
            continue
        sub = os.open(name, _DIR, dir_fd=src)
        try:
            try:
                below = os.stat(name, dir_fd=dst, follow_symlinks=False)
                if not stat.S_ISDIR(below.st_mode):
                    os.unlink(name, dir_fd=dst)
                    os.mkdir(name, 0o700, dir_fd=dst)
            except FileNotFoundError:
                os.mkdir(name, 0o700, dir_fd=dst)
            out = os.open(name, _DIR, dir_fd=dst)
            try:
                if _opaque(sub):
                    _clear(out)
                _apply(sub, out, owners)
                _copy_dir_meta(sub, out, owners)
            finally:
                os.close(out)
        finally:
            os.close(sub)
