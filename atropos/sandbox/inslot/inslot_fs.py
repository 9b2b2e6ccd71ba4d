"""Descriptor-relative reading of trees a hostile process may be changing: a depth-first walk
(``DirWalk``) and a bounded read (``read_at_most``).

One copy for both sides: the in-slot tools (``inslot_archive``, ``inslot_files``, ``verifier``)
import it from the host's lib dir (it is in ``atropos.sandbox.inslot.LIB_FILES``), the host's own tree code
(``trees.py``) as ``atropos.sandbox.inslot.inslot_fs``. So: standard library only, and no import of
another in-slot module.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
CHUNK = 1 << 20

T = TypeVar("T")


def identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class TreeMoved(OSError):
    """A directory was moved while a walk was below it (found on the way back up through ``..``)."""

    def __init__(self) -> None:
        super().__init__(errno.ESTALE, "a directory was moved during the walk")


def up(fd: int, expected: tuple[int, int]) -> int:
    """The parent of directory ``fd``, checked to be the directory ``expected`` the walk came from;
    TreeMoved otherwise. ``fd`` stays open either way."""
    parent = os.open("..", DIR_FLAGS, dir_fd=fd)
    if identity(os.fstat(parent)) != expected:
        os.close(parent)
        raise TreeMoved
    return parent


class DirWalk(Generic[T]):
    """A depth-first walk of a directory tree, safe against whoever changes the tree meanwhile.

    Iterative (any depth, far past PATH_MAX and the recursion limit), one directory descriptor open
    at a time: ``fd``, the directory being visited. A visitor opens each subdirectory to enter
    relative to ``fd`` (never by path); the walk leaves it by reopening ``..`` and checks that is
    the directory it entered from, otherwise the tree moved under the walk and it raises TreeMoved
    rather than go on in a different place.
    """

    def __init__(self, root_fd: int) -> None:
        self.fd = root_fd

    def run(self, visit: Callable[[T], Iterator[tuple[int, T]]], root: T) -> None:
        """Walk from the root. ``visit(state)`` is called with ``fd`` at that directory and yields
        ``(descriptor, state)`` for each subdirectory to enter, one at a time: the walk takes the
        descriptor over and visits that subtree before it resumes the generator, ``fd`` back at its
        directory (reopened, so read ``self.fd`` afresh after each yield). ``fd`` is closed at the
        end however the walk ends."""
        try:
            levels: list[tuple[Iterator[tuple[int, T]], tuple[int, int]]] = [
                (visit(root), identity(os.fstat(self.fd)))]
            while levels:
                child = next(levels[-1][0], None)
                if child is None:
                    levels.pop()
                    if levels:
                        parent = up(self.fd, levels[-1][1])
                        os.close(self.fd)
                        self.fd = parent
                    continue
                os.close(self.fd)
                self.fd, state = child
                levels.append((visit(state), identity(os.fstat(self.fd))))
        finally:
            os.close(self.fd)


def read_at_most(fd: int, limit: int) -> bytes:
    """Up to ``limit`` bytes from ``fd``'s offset, fewer only at end of file; read in chunks, so a
    file that grows meanwhile costs no more than ``limit``."""
    chunks: list[bytes] = []
    got = 0
    while got < limit:
        chunk = os.read(fd, min(CHUNK, limit - got))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
