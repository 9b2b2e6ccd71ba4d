"""The upper layer of a verification root: the agent's changes to one repository, and nothing else
(docs/verification.md, "A fresh root").

Run by the mount helper (standard library only, loaded by its file path) after the seal, when no
process of the slot is left: it reads the slot's own upper layer (what overlayfs wrote for the
agent) and writes a new, small upper layer holding

* every change under the repository (files, symlinks, directories, deletions as whiteouts, opaque
  directories), without byte-code and test caches (``__pycache__``, ``*.pyc``, ``.pytest_cache``)
  and without the repository's ``.git`` (the image's history stays, as a patch applied to it
  leaves it);
* over that, the task's test files and test settings (``from_image``) exactly as the image has
  them, read from the image alone (its read-only overlay, ``pristine``): a path the image lacks is
  absent, and every directory on the way to one is a real directory of the new layer.

The slot's tree is hostile input: nothing is opened through a link (every step is ``O_NOFOLLOW``
from a directory descriptor), devices, fifos and sockets are dropped, set-id bits are cleared, and a
symlink of the agent whose target leaves the repository (an absolute target, or one whose ``..``
climbs above it) is dropped and named in the result. Everything outside the repository, whatever
the agent did there (``/etc/ld.so.preload``, the env's interpreter, the standard library, name
service modules), is the image's in the new root, because nothing of it is copied.

A directory overlayfs moved (``redirect`` xattr, a rename of a directory the image has) is copied
whole from the agent's merged root and made opaque: its content is then the agent's view of it.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any

CACHE_DIRS = frozenset({"__pycache__", ".pytest_cache"})
CACHE_SUFFIXES = (".pyc", ".pyo")
MAX_DEPTH = 128
# a file of the agent whose size exceeds its allocated blocks by more than this is dropped: copying a
# sparse terabyte would hold the mount helper (every slot's resets) for minutes
SPARSE_SLACK = 1 << 20
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _xattr_names(userns: bool) -> tuple[str, str]:
    prefix = "user.overlay." if userns else "trusted.overlay."
    return prefix + "opaque", prefix + "redirect"


def _getxattr_at(fd: int, name: str, attr: str) -> bytes | None:
    """An xattr of the directory ``name`` in ``fd`` (os.getxattr takes no dir_fd: open it)."""
    sub = os.open(name, DIR_FLAGS, dir_fd=fd)
    try:
        return os.getxattr(sub, attr)
    except OSError:
        return None
    finally:
        os.close(sub)


def _is_cache(name: str) -> bool:
    return name in CACHE_DIRS or name.endswith(CACHE_SUFFIXES)


def _rel_parts(path: str) -> list[str]:
    parts = [p for p in path.split("/") if p and p != "."]
    if not parts or any(p == ".." or "\0" in p for p in parts):
        raise ValueError(f"not a relative path inside the repository: {path!r}")
    return parts


class DiffBuilder:
    """One new upper layer (``upper``, an empty directory) from the slot's upper (``source``), its
    merged root (``merged``) and the image (``pristine``), for the repository at ``repo`` (an
    absolute path of the slot's root)."""

    def __init__(self, *, source: str, merged: str, pristine: str, upper: str, repo: str, userns: bool) -> None:
        self.source, self.merged, self.pristine, self.upper = source, merged, pristine, upper
        self.repo = _rel_parts(repo)
        self.opaque_attr, self.redirect_attr = _xattr_names(userns)
        self.dropped: list[str] = []
        self.files = 0  # the agent's files and links
        self.image_files = 0  # taken from the image
        self.bytes = 0
        self.whiteouts = 0

    # -- the agent's changes --------------------------------------------------------------
    def copy_changes(self) -> None:
        """The agent's changes under the repository into ``upper``."""
        src = os.open(self.source, DIR_FLAGS)
        dst = self._repo_dir()
        try:
            opaque = False
            for part in self.repo:
                try:
                    st = os.stat(part, dir_fd=src, follow_symlinks=False)
                except FileNotFoundError:
                    return  # the agent changed nothing under the repository
                if not stat.S_ISDIR(st.st_mode):  # the repository deleted or replaced by a file or link
                    self._set_opaque(dst)
                    return
                opaque = opaque or _getxattr_at(src, part, self.opaque_attr) == b"y"
                if _getxattr_at(src, part, self.redirect_attr) is not None:
                    opaque = True  # moved here from elsewhere: the merged view is what the agent has
                    self._set_opaque(dst)
                    self._copy_merged("/".join(self.repo), dst, "")
                    return
                nxt = os.open(part, DIR_FLAGS, dir_fd=src)
                os.close(src)
                src = nxt
            if opaque:
                self._set_opaque(dst)
            self._copy_upper(src, dst, "", depth=0, top=True)
        finally:
            os.close(src)
            os.close(dst)

    def _copy_upper(self, src: int, dst: int, rel: str, *, depth: int, top: bool = False) -> None:
        if depth > MAX_DEPTH:
            raise OSError(errno.ELOOP, f"the repository's changes nest deeper than {MAX_DEPTH} directories")
        for name in sorted(os.listdir(src)):
            if _is_cache(name) or (top and name == ".git"):
                continue
            path = f"{rel}/{name}" if rel else name
            st = os.stat(name, dir_fd=src, follow_symlinks=False)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # overlayfs' whiteout: the agent deleted it
                os.mknod(name, stat.S_IFCHR | 0o000, 0, dir_fd=dst)
                self.whiteouts += 1
            elif stat.S_ISDIR(st.st_mode):
                redirect = _getxattr_at(src, name, self.redirect_attr) is not None
                sub_dst = self._mkdir(dst, name, st)
                try:
                    if redirect:
                        self._set_opaque(sub_dst)
                        self._copy_merged("/".join([*self.repo, path]), sub_dst, path)
                        continue
                    if _getxattr_at(src, name, self.opaque_attr) == b"y":
                        self._set_opaque(sub_dst)
                    sub_src = os.open(name, DIR_FLAGS, dir_fd=src)
                    try:
                        self._copy_upper(sub_src, sub_dst, path, depth=depth + 1)
                    finally:
                        os.close(sub_src)
                finally:
                    os.close(sub_dst)
            else:
                self._copy_leaf(src, dst, name, st, path)

    def _copy_merged(self, abs_rel: str, dst: int, rel: str) -> None:
        """A directory as the agent's merged root shows it (caches left out), into ``dst``."""
        src = os.open(self.merged, DIR_FLAGS)
        try:
            for part in abs_rel.split("/"):
                nxt = os.open(part, DIR_FLAGS, dir_fd=src)
                os.close(src)
                src = nxt
            self._copy_plain(src, dst, rel, depth=0)
        finally:
            os.close(src)

    def _copy_plain(self, src: int, dst: int, rel: str, *, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise OSError(errno.ELOOP, f"the repository nests deeper than {MAX_DEPTH} directories")
        for name in sorted(os.listdir(src)):
            if _is_cache(name) or (not rel and name == ".git"):
                continue
            path = f"{rel}/{name}" if rel else name
            st = os.stat(name, dir_fd=src, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                sub_dst = self._mkdir(dst, name, st)
                sub_src = os.open(name, DIR_FLAGS, dir_fd=src)
                try:
                    self._copy_plain(sub_src, sub_dst, path, depth=depth + 1)
                finally:
                    os.close(sub_src)
                    os.close(sub_dst)
            else:
                self._copy_leaf(src, dst, name, st, path)

    def _copy_leaf(self, src: int, dst: int, name: str, st: os.stat_result, path: str, *,
                   trusted: bool = False) -> None:
        if stat.S_ISREG(st.st_mode) and not trusted and st.st_size > st.st_blocks * 512 + SPARSE_SLACK:
            self.dropped.append(f"{path} (sparse: {st.st_size} bytes in {st.st_blocks * 512})")
        elif stat.S_ISREG(st.st_mode):
            fd_in = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src)
            try:
                fd_out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 0o600, dir_fd=dst)
                try:
                    while True:
                        chunk = os.read(fd_in, 1 << 20)
                        if not chunk:
                            break
                        os.write(fd_out, chunk)
                        self.bytes += len(chunk)
                    os.fchown(fd_out, st.st_uid, st.st_gid)
                    os.fchmod(fd_out, stat.S_IMODE(st.st_mode) & 0o1777)  # no set-id bits
                finally:
                    os.close(fd_out)
            finally:
                os.close(fd_in)
            self._count(trusted)
        elif stat.S_ISLNK(st.st_mode):
            target = os.readlink(name, dir_fd=src)
            if not trusted and not self._link_stays_inside(path, target):
                self.dropped.append(f"{path} -> {target}"[:300])
                return
            os.symlink(target, name, dir_fd=dst)
            os.chown(name, st.st_uid, st.st_gid, dir_fd=dst, follow_symlinks=False)
            self._count(trusted)
        else:  # devices, fifos, sockets: nothing a repository holds
            self.dropped.append(path)

    def _count(self, from_image: bool) -> None:
        if from_image:
            self.image_files += 1
        else:
            self.files += 1

    def _link_stays_inside(self, path: str, target: str) -> bool:
        """A symlink of the agent at ``path`` (relative to the repository) resolves, lexically,
        inside the repository."""
        if not target or target.startswith("/") or "\0" in target:
            return False
        depth = len(path.split("/")) - 1  # directories between the repository and the link
        for part in target.split("/"):
            if part == "..":
                depth -= 1
                if depth < 0:
                    return False
            elif part not in ("", "."):
                depth += 1
        return True

    # -- the task's files from the image --------------------------------------------------
    def put_from_image(self, paths: list[str]) -> None:
        """Each path (relative to the repository) exactly as the image has it, or absent."""
        for path in paths:
            parts = _rel_parts(path)
            dst = self._repo_dir()
            try:
                dst = self._real_dirs(dst, parts[:-1], [*self.repo])
                self._remove(dst, parts[-1])
                self._copy_from_image([*self.repo, *parts], dst, parts[-1])
            finally:
                os.close(dst)

    def _real_dirs(self, dst: int, parts: list[str], where: list[str]) -> int:
        """Walk ``parts`` below ``dst`` in the new layer, making each a real directory (a link, a
        file or a whiteout the agent left in its place goes); returns the last one's descriptor."""
        for part in parts:
            where = [*where, part]
            try:
                st = os.stat(part, dir_fd=dst, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(part, dir_fd=dst)
                    raise FileNotFoundError
            except FileNotFoundError:
                self._mkdir_like_image(dst, part, where)
            nxt = os.open(part, DIR_FLAGS, dir_fd=dst)
            os.close(dst)
            dst = nxt
        return dst

    def _mkdir_like_image(self, dst: int, name: str, where: list[str]) -> None:
        st = self._image_stat(where)
        if st is not None and stat.S_ISDIR(st.st_mode):
            self._mkdir(dst, name, st, close=True)
        else:
            os.mkdir(name, 0o755, dir_fd=dst)

    def _image_stat(self, parts: list[str]) -> os.stat_result | None:
        fd = os.open(self.pristine, DIR_FLAGS)
        try:
            for part in parts[:-1]:
                nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nxt
            return os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        except OSError:
            return None
        finally:
            os.close(fd)

    def _copy_from_image(self, parts: list[str], dst: int, name: str) -> None:
        fd = os.open(self.pristine, DIR_FLAGS)
        try:
            for part in parts[:-1]:
                nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nxt
            st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        except OSError:
            os.close(fd)
            return  # the image has no such path: absent in the new root too
        try:
            if stat.S_ISDIR(st.st_mode):
                sub_dst = self._mkdir(dst, name, st)
                sub_src = os.open(name, DIR_FLAGS, dir_fd=fd)
                try:
                    self._set_opaque(sub_dst)  # the image's directory and nothing else
                    self._copy_image_tree(sub_src, sub_dst, depth=0)
                finally:
                    os.close(sub_src)
                    os.close(sub_dst)
            else:
                self._copy_leaf(fd, dst, name, st, "/".join(parts), trusted=True)
        finally:
            os.close(fd)

    def _copy_image_tree(self, src: int, dst: int, *, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise OSError(errno.ELOOP, "the image's test tree nests too deep")
        for name in sorted(os.listdir(src)):
            st = os.stat(name, dir_fd=src, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                sub_dst = self._mkdir(dst, name, st)
                sub_src = os.open(name, DIR_FLAGS, dir_fd=src)
                try:
                    self._copy_image_tree(sub_src, sub_dst, depth=depth + 1)
                finally:
                    os.close(sub_src)
                    os.close(sub_dst)
            else:
                self._copy_leaf(src, dst, name, st, name, trusted=True)

    # -- helpers ----------------------------------------------------------------------------
    def _repo_dir(self) -> int:
        """The repository's directory in the new layer (and its parents, as the image has them)."""
        return self._real_dirs(os.open(self.upper, DIR_FLAGS), self.repo, [])

    def _mkdir(self, dst: int, name: str, st: os.stat_result, *, close: bool = False) -> int:
        try:
            os.mkdir(name, 0o700, dir_fd=dst)
        except FileExistsError:
            if not stat.S_ISDIR(os.stat(name, dir_fd=dst, follow_symlinks=False).st_mode):
                raise
        os.chown(name, st.st_uid, st.st_gid, dir_fd=dst, follow_symlinks=False)
        fd = os.open(name, DIR_FLAGS, dir_fd=dst)
        os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o1777)
        if close:
            os.close(fd)
            return -1
        return fd

    def _set_opaque(self, fd: int) -> None:
        os.setxattr(fd, self.opaque_attr, b"y")

    def _remove(self, dst: int, name: str) -> None:
        try:
            st = os.stat(name, dir_fd=dst, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            sub = os.open(name, DIR_FLAGS, dir_fd=dst)
            try:
                for child in os.listdir(sub):
                    self._remove(sub, child)
            finally:
                os.close(sub)
            os.rmdir(name, dir_fd=dst)
        else:
            os.unlink(name, dir_fd=dst)

    def summary(self) -> dict[str, Any]:
        return {"files": self.files, "image_files": self.image_files, "bytes": self.bytes,
                "whiteouts": self.whiteouts, "dropped": self.dropped[:50]}


def build(req: dict[str, Any], *, upper: str, pristine: str, userns: bool) -> dict[str, Any]:
    """The mount helper's entry: ``req`` is the ``diff`` part of its ``image_root`` request."""
    builder = DiffBuilder(source=str(req["source"]), merged=str(req["merged"]), pristine=pristine, upper=upper,
                          repo=str(req["repo"]), userns=userns)
    builder.copy_changes()
    builder.put_from_image([str(p) for p in req.get("from_image") or []])
    return builder.summary()
