"""Whole-tree operations on layer dirs of the store: their disk use, and moving an owner (a slot's
uid back to the image's 0, for a layer made from a slot's writable layer)."""

from __future__ import annotations

import os
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

