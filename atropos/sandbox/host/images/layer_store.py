"""The host's layer store: each image layer unpacked once, keyed by its DiffID, as an overlayfs lower
layer that any number of images and slots share read-only (docs/task-images.md).

A layer is untrusted input, like the agent's code. A tar can name ``../x`` or ``/etc/x``, write
through a symlink an earlier member planted, hard-link a host file, create device nodes, carry
setuid bits, file capabilities or overlayfs' own xattrs (``trusted.overlay.redirect`` would make
the merged view read another path). So:

- every path is checked (no absolute names, no ``..``) and created descriptor-relative, one
  component at a time with ``O_NOFOLLOW``: a symlink in the layer is stored as a symlink and never
  followed here (it is resolved later, inside the sandbox, whose root is the image); a member whose
  parent is a symlink refuses the whole layer;
- a hard link must name a file of the same layer, reached the same way;
- character and block devices are dropped (a whiteout is the one device we make: 0/0);
- xattrs: only ``user.*`` outside ``user.overlay.*`` are kept; ``security.capability`` and every
  ``trusted.*`` are dropped;
- setuid and setgid bits are kept (``ls -l`` shows what ``docker run`` shows) but give nothing: the
  store is readable by its owner only, and a slot's root is mounted ``nosuid``;
- whiteouts become overlayfs' own: ``.wh.NAME`` a 0/0 character device, ``.wh..wh..opq`` the
  opaque xattr on its directory (in both the ``trusted.`` and ``user.`` namespaces, so the layer
  serves a root-mounted and a ``userxattr`` overlay alike).

A layer is unpacked into a temporary directory and renamed into place only when complete and its
DiffID (the sha256 of the uncompressed tar, computed while unpacking) is the one expected: a
refused or interrupted layer leaves nothing behind.

**Bounded while unpacking.** A 2 MB gzip layer can expand to gigabytes, or to millions of empty
files. So an import carries an ``ImportBudget``: every member is charged (a regular file its
declared size in whole blocks, before a byte of it is written; a directory one block) and every
layer may hold at most ``entries_per_layer`` members; past either, the layer stops and is refused
with the numbers. An image's layers are unpacked into one staging directory (``Staging``) and
move into the store together when the whole image is accepted (``commit``): a refused image leaves
nothing, and no other import sees a layer of an image not yet accepted.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import secrets
import shutil
import stat
import subprocess
import tarfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from atropos.errors import ImageOverBudget, ImageRejected
from atropos.sandbox.contract.hostdirs import owned_dir, remove_tree
from atropos.sandbox.host.images.layer_trees import tree_bytes

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")
DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
BLOCK = 4096  # what a file or directory costs on disk at least (tree_bytes counts blocks)
DEFAULT_LAYER_ENTRIES = 1_000_000  # members of one layer (a large SWE image's biggest: ~200k)
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@dataclass
class LayerInfo:
    diff_id: str
    path: Path
    entries: int = 0
    bytes: int = 0
    dropped: list[str] = field(default_factory=list)  # what the layer held that the store refused


def blocks(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


@dataclass
class ImportBudget:
    """What one import may write into the store (see the module doc). ``bytes_left`` None: no byte
    accounting (the benchmark's baseline); ``context`` ends a refusal (the store's budget and what
    images in use hold of it)."""

    bytes_left: int | None = None
    entries_per_layer: int = DEFAULT_LAYER_ENTRIES
    context: str = ""
    written: int = 0  # bytes charged so far, every layer of the import
    entries: int = 0  # members so far, every layer of the import

    def charge(self, nbytes: int, what: str) -> None:
        self.written += nbytes
        if self.bytes_left is not None and self.written > self.bytes_left:
            raise ImageOverBudget(f"unpacking would pass the image store's budget: {self.written} bytes at {what!r} "
                                f"({self.entries} entries so far), over the {self.bytes_left} bytes this import may "
                                f"take{'; ' + self.context if self.context else ''}")


class _Hashing(io.RawIOBase):
    """Passes a stream through, hashing and counting every byte read."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.sha = hashlib.sha256()
        self.size = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self.raw.read(len(b))
        n = len(data)
        b[:n] = data
        self.sha.update(data)
        self.size += n
        return n


@contextlib.contextmanager
def uncompressed(stream: IO[bytes]) -> Iterator[IO[bytes]]:
    """The layer's tar bytes, whatever its compression: told by its magic bytes, not by a media
    type (some tools label an uncompressed blob ``+gzip``)."""
    head = stream.read(4)
    rest = _Prefixed(head, stream)
    if head[:2] == GZIP_MAGIC:
        with gzip.GzipFile(fileobj=rest) as gz:
            yield gz  # type: ignore[misc]
    elif head == ZSTD_MAGIC:
        if shutil.which("zstd") is None:
            raise ImageRejected("a zstd-compressed layer needs the zstd program on the host")
        proc = subprocess.Popen(["zstd", "-dcq"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdin is not None and proc.stdout is not None
        def feed() -> None:
            assert proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                while chunk := rest.read(1 << 20):
                    proc.stdin.write(chunk)
            proc.stdin.close()

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        try:
            yield proc.stdout
        finally:
            proc.stdout.close()
            proc.kill()
            proc.wait()
            feeder.join()
    else:
        yield rest  # type: ignore[misc]


class _Prefixed(io.RawIOBase):
    def __init__(self, head: bytes, raw: IO[bytes]) -> None:
        self.head = head
        self.raw = raw

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        if self.head:
            n = min(len(b), len(self.head))
            b[:n] = self.head[:n]
            self.head = self.head[n:]
            return n
        data = self.raw.read(len(b))
        b[: len(data)] = data
        return len(data)


def member_parts(name: str) -> list[str]:
    """A member's path as components, or ImageRejected: no absolute names, no ``..``, nothing empty."""
    if name.startswith("/"):
        raise ImageRejected(f"layer member {name!r} has an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise ImageRejected(f"layer member {name!r} climbs out of the layer (..)")
    if any("\0" in p for p in parts):
        raise ImageRejected(f"layer member {name!r} has a NUL byte")
    return parts


class _Unpacker:
    def __init__(self, root_fd: int, uid_shift: int, info: LayerInfo, owners: bool, budget: ImportBudget) -> None:
        self.root = root_fd
        self.shift = uid_shift
        self.info = info
        self.dirs: dict[tuple[str, ...], tarfile.TarInfo] = {}
        self.as_root = owners
        self.budget = budget

    @contextlib.contextmanager
    def parent(self, parts: list[str], create: bool = True) -> Iterator[int]:
        """An fd of the directory holding ``parts[-1]``, reached component by component without
        following a symlink; missing directories are made (the layer's own entry, if any, later
        sets their mode and owner)."""
        fd = os.dup(self.root)
        try:
            for part in parts[:-1]:
                try:
                    nxt = os.open(part, DIR, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        where = "/".join(parts)
                        raise ImageRejected(f"layer member {where!r}: no such directory in the layer") from None
                    os.mkdir(part, 0o755, dir_fd=fd)
                    nxt = os.open(part, DIR, dir_fd=fd)
                except (NotADirectoryError, OSError) as exc:
                    # ELOOP/ENOTDIR: the component is a symlink or a file; never write through it
                    raise ImageRejected(f"layer member {'/'.join(parts)!r} goes through a non-directory "
                                        f"({part!r}: {exc.strerror})") from None
                os.close(fd)
                fd = nxt
            yield fd
        finally:
            os.close(fd)

    def clear(self, fd: int, name: str) -> None:
        """Remove what an earlier member of the same layer left at ``name`` (a later entry wins)."""
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            return  # a directory entry over a directory: keep its contents
        os.unlink(name, dir_fd=fd)

    def owner(self, fd: int, name: str | None, m: tarfile.TarInfo) -> None:
        if self.as_root:
            if name is None:
                os.fchown(fd, m.uid + self.shift, m.gid + self.shift)
            else:
                os.chown(name, m.uid + self.shift, m.gid + self.shift, dir_fd=fd, follow_symlinks=False)

    def xattrs(self, target: int, m: tarfile.TarInfo) -> None:
        for key, value in m.pax_headers.items():
            if not key.startswith("SCHILY.xattr."):
                continue
            name = key.removeprefix("SCHILY.xattr.")
            if name.startswith("user.") and not name.startswith("user.overlay."):
                with contextlib.suppress(OSError):
                    os.setxattr(target, name, value.encode("utf-8", "surrogateescape"))
            else:
                self.info.dropped.append(f"{m.name}: xattr {name}")

    def add(self, tar: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        parts = member_parts(m.name)
        if not parts:
            return  # the layer's root itself
        name = parts[-1]
        self.info.entries += 1
        self.budget.entries += 1
        if self.info.entries > self.budget.entries_per_layer:
            raise ImageRejected(f"a layer holds more than {self.budget.entries_per_layer} entries (the per-layer cap; "
                                f"{self.budget.written} bytes unpacked so far)")
        # charged before anything is written: a member declaring gigabytes is refused whole
        self.budget.charge(blocks(m.size) if m.isreg() else BLOCK if m.isdir() else 0, m.name)
        if name == OPAQUE:
            with self.parent(parts) as fd:
                for attr in OPAQUE_XATTRS:
                    with contextlib.suppress(OSError):  # trusted.* needs CAP_SYS_ADMIN
                        os.setxattr(fd, attr, b"y")
            return
        if name.startswith(WHITEOUT):
            hidden = name.removeprefix(WHITEOUT)
            member_parts(hidden)  # the name it hides follows the same rules
            if not hidden or "/" in hidden:
                raise ImageRejected(f"layer member {m.name!r} is not a valid whiteout")
            with self.parent(parts) as fd:
                self.clear(fd, hidden)
                os.mknod(hidden, stat.S_IFCHR | 0o000, os.makedev(0, 0), dir_fd=fd)
            return
        if m.ischr() or m.isblk():
            self.info.dropped.append(f"{m.name}: device node")
            return
        with self.parent(parts) as fd:
            if m.isdir():
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                except FileExistsError:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    if not stat.S_ISDIR(st.st_mode):
                        os.unlink(name, dir_fd=fd)
                        os.mkdir(name, 0o700, dir_fd=fd)
                self.dirs[tuple(parts)] = m  # mode, owner and times once its contents are in
                return
            self.clear(fd, name)
            if m.isreg():
                out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                              dir_fd=fd)
                try:
                    src = tar.extractfile(m)
                    assert src is not None
                    while chunk := src.read(1 << 20):
                        os.write(out, chunk)
                    self.info.bytes += m.size
                    self.xattrs(out, m)
                    self.owner(out, None, m)
                    os.fchmod(out, m.mode & 0o7777)  # after chown, which clears setuid/setgid
                    os.utime(out, (m.mtime, m.mtime))
                finally:
                    os.close(out)
            elif m.issym():
                os.symlink(m.linkname, name, dir_fd=fd)
                self.owner(fd, name, m)
                with contextlib.suppress(NotImplementedError, OSError):
                    os.utime(name, (m.mtime, m.mtime), dir_fd=fd, follow_symlinks=False)
            elif m.islnk():
                target = member_parts(m.linkname)
                if not target:
                    raise ImageRejected(f"layer member {m.name!r} hard-links the layer's root")
                with self.parent(target, create=False) as src_fd:
                    try:
                        st = os.stat(target[-1], dir_fd=src_fd, follow_symlinks=False)
                    except FileNotFoundError:
                        raise ImageRejected(f"layer member {m.name!r} hard-links {m.linkname!r}, which is not "
                                            "in this layer") from None
                    if stat.S_ISDIR(st.st_mode):
                        raise ImageRejected(f"layer member {m.name!r} hard-links a directory")
                    os.link(target[-1], name, src_dir_fd=src_fd, dst_dir_fd=fd, follow_symlinks=False)
            elif m.isfifo():
                os.mkfifo(name, m.mode & 0o777, dir_fd=fd)
                self.owner(fd, name, m)
            else:
                self.info.dropped.append(f"{m.name}: unsupported tar type {m.type!r}")

    def finish_dirs(self) -> None:
        # deepest first: a read-only parent must not stop its children being set
        for parts, m in sorted(self.dirs.items(), key=lambda kv: -len(kv[0])):
            with self.parent(list(parts)) as fd:
                d = os.open(parts[-1], DIR, dir_fd=fd)
                try:
                    self.xattrs(d, m)
                    self.owner(d, None, m)
                    os.fchmod(d, m.mode & 0o7777)
                    os.utime(d, (m.mtime, m.mtime))
                finally:
                    os.close(d)


class LayerStore:
    """Unpacked layers under ``root/layers/<hex of the DiffID>``; the store is its owner's only."""

    def __init__(self, root: Path, *, uid_shift: int = 0, owners: bool | None = None) -> None:
        self.root = root
        self.uid_shift = uid_shift
        # keep the layers' file owners (default: when uid 0); off in a user namespace that maps
        # only our own uid (atropos/sandbox/host/images/userns_import.py), where every file is ours
        self.owners = os.geteuid() == 0 if owners is None else owners
        owned_dir(root, 0o700)
        for sub in ("layers", "tmp", "sizes"):
            owned_dir(root / sub, 0o700)

    def path(self, diff_id: str) -> Path:
        algo, _, hexdigest = diff_id.partition(":")
        if algo != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
            raise ImageRejected(f"not a sha256 DiffID: {diff_id!r}")
        return self.root / "layers" / hexdigest

    def has(self, diff_id: str) -> bool:
        return self.path(diff_id).is_dir()

    def layers(self) -> list[str]:
        return sorted(f"sha256:{p.name}" for p in (self.root / "layers").iterdir())

    def layer_bytes(self, layer: Path) -> int:
        """Disk used by a layer dir of the store (cached beside it: a layer never changes)."""
        cache = self.root / "sizes" / layer.name
        with contextlib.suppress(OSError, ValueError):
            return int(cache.read_text())
        size = tree_bytes(layer)
        with contextlib.suppress(OSError):
            tmp = cache.with_name(f"{layer.name}.{secrets.token_hex(4)}")
            tmp.write_text(str(size))
            os.replace(tmp, cache)
        return size

    def forget_size(self, layer: Path) -> None:
        (self.root / "sizes" / layer.name).unlink(missing_ok=True)

    @contextlib.contextmanager
    def staging(self) -> Iterator[Staging]:
        """A staging dir for one image's new layers: ``commit`` moves them into the store; whatever
        is still staged when the block ends (a refused image) is removed with it."""
        stage = Staging(self.root / "tmp" / f"stage-{secrets.token_hex(8)}")
        stage.dir.mkdir(mode=0o700)
        try:
            yield stage
        finally:
            remove_tree(stage.dir)

    def located(self, diff_id: str, staging: Staging | None) -> Path:
        """Where the layer ``diff_id`` is: staged by this import, else in the store."""
        if staging is not None and diff_id in staging.layers:
            return staging.layers[diff_id]
        return self.path(diff_id)

    def commit(self, staging: Staging) -> None:
        """Move an accepted image's staged layers into the store (a layer another import put there
        meanwhile stays: the same DiffID is the same content)."""
        for diff_id, path in list(staging.layers.items()):
            final = self.path(diff_id)
            try:
                os.rename(path, final)
            except OSError:
                if not final.is_dir():
                    raise
            del staging.layers[diff_id]

    def add_dir(self, source: Path, diff_id: str, *, staging: Staging | None = None,
                budget: ImportBudget | None = None) -> LayerInfo:
        """A layer the local engine has unpacked (its overlay2 dir: the same form as ours, 0/0
        whiteouts and opaque xattrs), copied rather than re-read from a tar, and made what ``add``
        makes of a tar (``_sanitize_dir``). The DiffID is the engine's word for what the dir holds.
        The copy is charged to ``budget`` once made (the engine's own disk held it already)."""
        final = self.path(diff_id)
        if final.is_dir():
            return LayerInfo(diff_id, final)
        if staging is not None:
            if diff_id in staging.layers:
                return LayerInfo(diff_id, staging.layers[diff_id])
            final = staging.dir / final.name
        tmp = self.root / "tmp" / secrets.token_hex(8)
        try:
            subprocess.run(["cp", "-a", "--", str(source), str(tmp)], check=True, capture_output=True, timeout=3600)
            info = LayerInfo(diff_id, final, dropped=_sanitize_dir(tmp))
            if budget is not None:
                budget.charge(tree_bytes(tmp), f"the engine's layer {diff_id}")
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():
                    raise
                remove_tree(tmp)
            os.chmod(final, 0o755)
            if staging is not None:
                staging.layers[diff_id] = final
            return info
        except subprocess.CalledProcessError as exc:
            remove_tree(tmp)
            raise ImageRejected(f"copying the engine's layer {diff_id}: {exc.stderr.decode(errors='replace')[:300]}") \
                from None
        except BaseException:
            remove_tree(tmp)
            raise

    def add(self, stream: IO[bytes], *, diff_id: str | None = None, staging: Staging | None = None,
            budget: ImportBudget | None = None) -> LayerInfo:
        """Unpack one layer (plain, gzip or zstd tar) unless a layer of that DiffID is already here.
        ``diff_id``, when given, must match what the bytes hash to; the layer is refused otherwise.
        ``staging``: the layer goes there (``commit`` moves it into the store), not into the store.
        ``budget``: what the import may still write (default: the entry cap alone)."""
        if diff_id is not None and (self.has(diff_id) or (staging is not None and diff_id in staging.layers)):
            return LayerInfo(diff_id, self.located(diff_id, staging))
        budget = budget if budget is not None else ImportBudget()
        tmp = self.root / "tmp" / secrets.token_hex(8)
        tmp.mkdir(mode=0o700)
        info = LayerInfo("", tmp)
        try:
            with uncompressed(stream) as raw:
                hashing = _Hashing(raw)
                reader = io.BufferedReader(hashing, 1 << 20)
                root_fd = os.open(tmp, DIR)
                try:
                    unpacker = _Unpacker(root_fd, self.uid_shift, info, self.owners, budget)
                    try:
                        with tarfile.open(fileobj=reader, mode="r|") as tar:
                            for member in tar:
                                unpacker.add(tar, member)
                    except tarfile.TarError as exc:
                        raise ImageRejected(f"not a valid layer tar: {exc}") from None
                    unpacker.finish_dirs()
                finally:
                    os.close(root_fd)
                while reader.read(1 << 20):  # the tar's end padding belongs to the digest too
                    pass
            digest = f"sha256:{hashing.sha.hexdigest()}"
            if diff_id is not None and digest != diff_id:
                raise ImageRejected(f"layer content hashes to {digest}, not the expected {diff_id}")
            final = self.path(digest)
            if staging is not None:
                final = staging.layers[digest] = staging.dir / final.name
            info.diff_id, info.path = digest, final
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():
                    raise
                remove_tree(tmp)  # unpacked twice at once: the first one stays
            os.chmod(final, 0o755)  # an image's / (the store above it is its owner's only)
            return info
        except BaseException:
            remove_tree(tmp)
            raise


@dataclass
class Staging:
    """One import's layers not yet in the store, by DiffID (``LayerStore.staging``)."""

    dir: Path
    layers: dict[str, Path] = field(default_factory=dict)


# What a layer dir the engine unpacked may keep: the opaque marker (overlayfs' own, as the store's
# layers carry it) and the user.* xattrs a tar layer may carry too.
_KEPT_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")


def _sanitize_dir(root: Path) -> list[str]:
    """A copied engine layer made what ``add`` makes of a tar: device nodes dropped (a 0/0
    whiteout kept), xattrs but the opaque marker and ``user.*`` dropped (``trusted.overlay.*``
    redirects, file capabilities), the opaque marker in both namespaces. Nothing followed."""
    dropped = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames, "."):
            path = os.path.join(dirpath, name) if name != "." else dirpath
            st = os.lstat(path)
            if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                if not (stat.S_ISCHR(st.st_mode) and st.st_rdev == 0):
                    os.unlink(path)
                    dropped.append(f"{os.path.relpath(path, root)}: device node")
                    continue
            if stat.S_ISSOCK(st.st_mode):
                os.unlink(path)
                continue
            if stat.S_ISLNK(st.st_mode):
                continue  # xattrs of a symlink: trusted/security only, set by root; none come from a tar
            for attr in os.listxattr(path, follow_symlinks=False):
                if attr in _KEPT_XATTRS:
                    continue
                if attr.startswith("user.") and not attr.startswith("user.overlay."):
                    continue
                os.removexattr(path, attr, follow_symlinks=False)
                dropped.append(f"{os.path.relpath(path, root)}: xattr {attr}")
            if stat.S_ISDIR(st.st_mode):
                try:
                    opaque = os.getxattr(path, "trusted.overlay.opaque", follow_symlinks=False)
                except OSError:
                    opaque = b""
                if opaque == b"y":
                    with contextlib.suppress(OSError):
                        os.setxattr(path, "user.overlay.opaque", b"y", follow_symlinks=False)
    return dropped
