"""A task image as a slot root takes it: its layers in the store and its config applied as
``docker run`` applies it (``Env``, ``WorkingDir``, ``User`` resolved through the image's own
``/etc/passwd`` and ``/etc/group``; docs/task-images.md)."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from atropos.errors import ImageRejected
from atropos.sandbox.host.images.sources import ImageConfig

# What ``docker run`` puts in a process's environment when the image does not say (its default PATH).
DOCKER_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class ImageRoot:
    """An image ready to be a slot root: its config and its layers in the store, bottom first."""

    image_id: str
    config: ImageConfig
    lowers: tuple[Path, ...]
    imported_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    users: set[int] = field(default_factory=set)  # slots whose root is this image now
    pin_fd: int | None = None  # the shared lock that keeps other hosts from evicting it (see module doc)
    _ids: tuple[int, int] | None = None
    _env: dict[str, str] | None = None

    @property
    def reference(self) -> str:
        return self.config.reference

    def env(self) -> dict[str, str]:
        """The environment of every process of the slot, as ``docker run`` gives it (without
        ``-t``): the image's ``Env`` over a default ``PATH``, ``HOME`` the user's unless set. Made
        once (it reads the image's passwd from the layers); a copy each call."""
        if self._env is None:
            self._env = self._make_env()
        return dict(self._env)

    def _make_env(self) -> dict[str, str]:
        env = {"PATH": DOCKER_DEFAULT_PATH, "HOSTNAME": "sandbox"}
        for item in self.config.env:
            key, sep, value = item.partition("=")
            if sep and key:
                env[key] = value
        if "HOME" not in env:  # the user's home in the image's passwd, as docker run sets it
            uid = self.user_ids()[0]
            entry = find_entry(image_file(self.lowers, "etc/passwd"), lambda f: f[2] == str(uid))
            env["HOME"] = entry[5] if entry is not None and len(entry) > 5 and entry[5] else (
                "/root" if uid == 0 else "/")
        return env

    @property
    def working_dir(self) -> str:
        wd = os.path.normpath(self.config.working_dir or "/")
        return wd if wd.startswith("/") else "/" + wd

    def user_ids(self) -> tuple[int, int]:
        """The image's ``User`` as ``docker run`` resolves it: ``uid``, ``uid:gid``, ``name`` or
        ``name:group``, names from the image's own ``/etc/passwd`` and ``/etc/group``; a uid
        without a passwd entry gets gid 0. Cached: an image never changes."""
        if self._ids is None:
            self._ids = resolve_user(self.config.user, lambda path: image_file(self.lowers, path))
        return self._ids


def _id(text: str) -> int | None:
    """A decimal uid or gid as passwd writes it (ASCII digits only: ``'٣'.isdigit()`` is true), or
    None; anything past ten digits is out of any range (and ``int`` refuses thousands of digits)."""
    if not text.isascii() or not text.isdigit():
        return None
    return int(text) if len(text) <= 10 else 1 << 40


def resolve_user(user: str, read: Callable[[str], bytes | None]) -> tuple[int, int]:
    name, _, group = (user or "").partition(":")
    if not name or name == "root":
        uid, gid = 0, 0
    elif (num := _id(name)) is not None:
        uid = num
        entry = find_entry(read("etc/passwd"), lambda f: f[2] == name)
        gid = (_id(entry[3]) if entry is not None else None) or 0
    else:
        entry = find_entry(read("etc/passwd"), lambda f: f[0] == name)
        ids = None if entry is None else (_id(entry[2]), _id(entry[3]))
        if ids is None or ids[0] is None or ids[1] is None:
            raise ImageRejected(f"the image's User {user!r} is not in its /etc/passwd")
        uid, gid = ids[0], ids[1]
    if group:
        if (num := _id(group)) is not None:
            gid = num
        else:
            found = find_entry(read("etc/group"), lambda f: f[0] == group)
            gnum = None if found is None else _id(found[2])
            if gnum is None:
                raise ImageRejected(f"the image's User {user!r}: no group {group!r} in its /etc/group")
            gid = gnum
    if uid >= 1 << 31 or gid >= 1 << 31:
        raise ImageRejected(f"the image's User {user!r} is out of range (uid {uid}, gid {gid})")
    return uid, gid


def find_entry(data: bytes | None, match: Callable[[list[str]], bool]) -> list[str] | None:
    for line in (data or b"").decode("utf-8", "replace").splitlines():
        fields = line.split(":")
        if len(fields) >= 4 and match(fields):
            return fields
    return None


def image_file(lowers: tuple[Path, ...], path: str, limit: int = 1 << 20) -> bytes | None:
    """A small regular file of the image as its layers stack it (top layer first; a whiteout ends
    the search), read with no symlink followed: an image's ``/etc/passwd`` may be a link anywhere."""
    for layer in reversed(lowers):
        fd = -1
        try:
            fd = os.open(layer, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            parts = path.split("/")
            for part in parts[:-1]:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = nxt
            st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
            if stat.S_ISCHR(st.st_mode):
                return None  # a whiteout: deleted in this layer
            if not stat.S_ISREG(st.st_mode):
                return None
            f = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            try:
                return os.read(f, limit)
            finally:
                os.close(f)
        except OSError:
            continue  # not in this layer (or not reachable without following a link)
        finally:
            if fd >= 0:
                os.close(fd)
    return None
