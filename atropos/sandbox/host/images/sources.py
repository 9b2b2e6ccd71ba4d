"""Where task images come from, read into the layer store: the local Docker engine (the image as the
engine holds it, exported by its API, no container started) and an OCI image layout on disk (what
``skopeo copy docker://REF oci:DIR:TAG`` writes, so a registry image arrives through the
distribution's well-kept tool rather than hand-written registry code).

Both give the same result: the image's config as ``docker run`` applies it (``Env``, ``WorkingDir``,
``User``) and its layers, bottom first, by DiffID, each unpacked once into the store.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import http.client
import io
import json
import os
import shutil
import socket
import stat
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field

from atropos.errors import ImageRejected
from atropos.sandbox.contract.imageref import ImageRef
from atropos.sandbox.host.images.layer_store import ImportBudget, LayerStore, Staging

DOCKER_SOCKET = "/var/run/docker.sock"


def engine_socket(environ: dict[str, str] | None = None) -> str:
    """The local engine's socket, found as the docker CLI finds it: ``DOCKER_HOST=unix://PATH``
    (a rootless engine, or a node's own), else the default. Another scheme is not a local engine's
    socket: the default then."""
    url = (os.environ if environ is None else environ).get("DOCKER_HOST", "")
    return url[len("unix://"):] if url.startswith("unix://") and len(url) > len("unix://") else DOCKER_SOCKET
MAX_JSON = 4 << 20  # a manifest or config larger than this is not an image's


class ImageConfig(BaseModel):
    """What of an image's config a slot applies, as ``docker run`` would."""

    model_config = ConfigDict(frozen=True)

    reference: str
    diff_ids: tuple[str, ...] = Field(description="layers, bottom first")
    env: tuple[str, ...] = ()
    working_dir: str = "/"
    user: str = ""
    layers: tuple[str, ...] = Field((), description="the store's layers, bottom first, when not the diff_ids "
                                    "(an image with more layers than an overlay takes: its bottom ones merged)")

    @property
    def store_layers(self) -> tuple[str, ...]:
        return self.layers or self.diff_ids

    @classmethod
    def from_config(cls, reference: str, raw: dict[str, Any]) -> ImageConfig:
        conf = raw.get("config") or raw.get("Config") or {}
        rootfs = raw.get("rootfs") or {}
        diff_ids = rootfs.get("diff_ids")
        if rootfs.get("type") != "layers" or not isinstance(diff_ids, list) or not diff_ids:
            raise ImageRejected(f"{reference}: the image config has no rootfs.diff_ids")
        env, working_dir, user = conf.get("Env") or [], conf.get("WorkingDir") or "/", conf.get("User") or ""
        if not isinstance(env, list) or not all(isinstance(e, str) for e in env):
            raise ImageRejected(f"{reference}: the image config's Env is not a list of strings")
        if not isinstance(working_dir, str) or not isinstance(user, str):
            raise ImageRejected(f"{reference}: the image config's WorkingDir and User must be strings")
        if not all(isinstance(d, str) for d in diff_ids):
            raise ImageRejected(f"{reference}: the image config's rootfs.diff_ids are not strings")
        return cls(reference=reference, diff_ids=tuple(diff_ids), env=tuple(env), working_dir=working_dir, user=user)


class ImportedImage(BaseModel):
    config: ImageConfig
    layers: list[str]  # paths in the store, bottom first
    unpacked: int  # layers unpacked by this import (0: all were already in the store)
    image_id: str = ""  # sha256 of the config, the engine's image id (set by import_docker_archive)
    written: int = 0  # bytes charged to the import's budget (ImportBudget)
    entries: int = 0  # layer members unpacked


def _json(data: bytes, what: str) -> Any:
    if len(data) > MAX_JSON:
        raise ImageRejected(f"{what} is larger than {MAX_JSON} bytes")
    try:
        return json.loads(data)
    except ValueError as exc:
        raise ImageRejected(f"{what} is not JSON: {exc}") from None


@contextlib.contextmanager
def _staged(store: LayerStore, staging: Staging | None) -> Iterator[tuple[Staging, bool]]:
    """The caller's staging, or one of our own committed when the import is done (True)."""
    if staging is not None:
        yield staging, False
    else:
        with store.staging() as own:
            yield own, True


def _import(store: LayerStore, config: ImageConfig,
            open_layer: Callable[[int], contextlib.AbstractContextManager[IO[bytes]]], *,
            staging: Staging | None = None, budget: ImportBudget | None = None) -> ImportedImage:
    """Unpack the layers of ``config`` the store lacks (``open_layer(i)`` opens the i-th, bottom
    first) into ``staging`` (the caller checks and commits the image), or, without one, into the
    store at once."""
    budget = budget if budget is not None else ImportBudget()
    with _staged(store, staging) as (stage, own):
        unpacked = 0
        for i, diff_id in enumerate(config.diff_ids):
            if store.has(diff_id) or diff_id in stage.layers:
                continue
            with open_layer(i) as stream:
                try:  # refused unless the bytes hash to this DiffID
                    store.add(stream, diff_id=diff_id, staging=stage, budget=budget)
                except ImageRejected as exc:
                    raise type(exc)(f"{config.reference}: layer {i + 1} of {len(config.diff_ids)}: {exc}") \
                        from None
            unpacked += 1
        layers = [str(store.located(d, stage)) for d in config.diff_ids]
        if own:
            store.commit(stage)
            layers = [str(store.path(d)) for d in config.diff_ids]
        return ImportedImage(config=config, layers=layers, unpacked=unpacked, written=budget.written,
                             entries=budget.entries)


def import_docker_archive(store: LayerStore, archive: Path, reference: str, *, staging: Staging | None = None,
                          budget: ImportBudget | None = None) -> ImportedImage:
    """An image from a ``docker save`` archive (the legacy layout, or Docker >= 25's OCI blobs with
    Docker's ``manifest.json``). The archive itself is never extracted: its members are read by name."""
    try:
        tar = tarfile.open(archive, mode="r:")
    except tarfile.TarError as exc:
        raise ImageRejected(f"{reference}: not an image archive ({exc})") from None
    with tar:
        def read(name: str) -> bytes:
            try:
                m = tar.getmember(name)
            except KeyError:
                raise ImageRejected(f"{reference}: the archive has no {name!r}") from None
            f = tar.extractfile(m) if m.isfile() and m.size <= MAX_JSON else None
            if f is None:
                raise ImageRejected(f"{reference}: {name!r} in the archive is not a small regular file")
            return f.read()

        manifest = _json(read("manifest.json"), "manifest.json")
        if not isinstance(manifest, list) or len(manifest) != 1 or not isinstance(manifest[0], dict):
            raise ImageRejected(f"{reference}: the archive must hold exactly one image")
        raw_config = read(manifest[0].get("Config", ""))
        config = ImageConfig.from_config(reference, _json(raw_config, "the config"))
        paths = list(manifest[0].get("Layers") or [])
        if len(paths) != len(config.diff_ids):
            raise ImageRejected(f"{reference}: manifest and config disagree on the layers")

        @contextlib.contextmanager
        def open_layer(i: int) -> Iterator[IO[bytes]]:
            try:
                m = tar.getmember(paths[i])
            except KeyError:
                raise ImageRejected(f"{reference}: the archive has no layer {paths[i]!r}") from None
            f = tar.extractfile(m) if m.isfile() else None
            if f is None:
                raise ImageRejected(f"{reference}: layer {paths[i]!r} is not a regular file")
            yield f

        imported = _import(store, config, open_layer, staging=staging, budget=budget)
        return imported.model_copy(update={"image_id": f"sha256:{hashlib.sha256(raw_config).hexdigest()}"})


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.socket_path)
        self.sock = sock


def _engine_image(reference: str, socket_path: str, timeout: float = 30.0) -> dict[str, Any]:
    """The local Docker engine's record of ``reference`` (Engine API ``GET /images/{name}/json``)."""
    conn = _UnixHTTPConnection(socket_path, timeout)
    try:
        try:
            conn.request("GET", f"/images/{quote(reference, safe='')}/json")
            resp = conn.getresponse()
            body = resp.read(MAX_JSON + 1)
        except OSError as exc:
            raise ImageRejected(f"cannot ask the Docker engine for {reference!r}: {exc}") from None
        if resp.status != 200:
            raise ImageRejected(f"the Docker engine has no image {reference!r} ({resp.status}: "
                                f"{body[:300].decode('utf-8', 'replace').strip()})")
        record = _json(body, "the engine's image record")
        if not isinstance(record, dict):
            raise ImageRejected(f"the Docker engine's record of {reference!r} is not an object")
        return record
    finally:
        conn.close()


def docker_image_id(reference: str, *, socket_path: str = DOCKER_SOCKET, timeout: float = 30.0) -> str:
    """The id the local Docker engine gives ``reference`` now."""
    image_id = _engine_image(reference, socket_path, timeout).get("Id")
    if not isinstance(image_id, str) or not image_id:
        raise ImageRejected(f"the Docker engine gave no id for {reference!r}")
    return image_id


def import_from_engine_dirs(store: LayerStore, reference: str, *, socket_path: str = DOCKER_SOCKET,
                            staging: Staging | None = None, budget: ImportBudget | None = None
                            ) -> ImportedImage | None:
    """The image as the engine on this machine has it unpacked (its overlay2 layer dirs, named by
    its own record): only the layers the store lacks are copied, where an export would stream the
    whole image (a 2 GB SWE image to add its one small layer). None when that cannot be done here
    (not root, another storage driver, a record that does not pair dirs and layers): the caller
    exports instead. The engine's pairing of a layer dir with its DiffID is trusted as its export
    is; the dir's contents are not (``LayerStore.add_dir``)."""
    if os.geteuid() != 0:
        return None
    record = _engine_image(reference, socket_path)
    driver = record.get("GraphDriver") or {}
    data = driver.get("Data") or {}
    if driver.get("Name") != "overlay2" or not isinstance(data.get("UpperDir"), str):
        return None
    dirs = [data["UpperDir"], *(d for d in str(data.get("LowerDir") or "").split(":") if d)]  # top first
    config = ImageConfig.from_config(reference, {"config": record.get("Config") or {},
                                                 "rootfs": record.get("RootFS") and {
                                                     "type": "layers", "diff_ids": record["RootFS"].get("Layers")}})
    if len(dirs) != len(config.diff_ids) or not all(os.path.isdir(d) for d in dirs):
        return None
    budget = budget if budget is not None else ImportBudget()
    with _staged(store, staging) as (stage, own):
        unpacked = 0
        for diff_id, layer_dir in zip(reversed(config.diff_ids), dirs, strict=True):
            if not store.has(diff_id) and diff_id not in stage.layers:
                store.add_dir(Path(layer_dir), diff_id, staging=stage, budget=budget)
                unpacked += 1
        layers = [str(store.located(d, stage)) for d in config.diff_ids]
        if own:  # committed: the layers are in the store now, no longer where they were staged
            store.commit(stage)
            layers = [str(store.path(d)) for d in config.diff_ids]
        return ImportedImage(config=config, layers=layers, unpacked=unpacked, written=budget.written,
                             entries=budget.entries)


def import_from_docker(store: LayerStore, reference: str, *, socket_path: str = DOCKER_SOCKET,
                       timeout: float = 600.0, staging: Staging | None = None,
                       budget: ImportBudget | None = None) -> ImportedImage:
    """The image ``reference`` as the local Docker engine holds it (Engine API ``GET /images/{name}/get``,
    the bytes of ``docker save``): nothing is run, nothing pulled."""
    conn = _UnixHTTPConnection(socket_path, timeout)
    try:
        conn.request("GET", f"/images/{quote(reference, safe='')}/get")
        resp = conn.getresponse()
        if resp.status != 200:
            body = resp.read(4096).decode("utf-8", "replace").strip()
            raise ImageRejected(f"the Docker engine has no image {reference!r} ({resp.status}: {body})")
        with tempfile.NamedTemporaryFile(dir=store.root / "tmp", suffix=".tar") as spool:
            shutil.copyfileobj(resp, spool, 1 << 20)
            spool.flush()
            return import_docker_archive(store, Path(spool.name), reference, staging=staging, budget=budget)
    finally:
        conn.close()


OCI_REF_NAME = "org.opencontainers.image.ref.name"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
_DIR_NOFOLLOW = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class OciLayout:
    """An OCI image layout read as hostile input: every blob opened relative to the layout's own
    directory without following a link (``blobs``, ``sha256`` and the blob itself), refused unless a
    regular file of a bounded size, and checked against its digest (a JSON blob before it is parsed;
    a layer as it streams, before its layers are accepted)."""

    def __init__(self, reference: ImageRef) -> None:
        self.reference = reference
        path, self.tag = reference.oci_layout()  # oci:DIR or oci:DIR:TAG (atropos/sandbox/contract/imageref.py)
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the operator's path: may be a link
        except OSError as exc:
            raise ImageRejected(f"{reference}: no OCI image layout at {str(path)!r} ({exc.strerror})") from None

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> OciLayout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, parts: list[str], what: str) -> tuple[int, int]:
        """(fd, size) of a regular file of the layout, reached without following a link."""
        fd = os.dup(self.fd)
        part = parts[0]
        try:
            for part in parts[:-1]:
                nxt = os.open(part, _DIR_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = nxt
            part = parts[-1]
            f = os.open(part, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        except OSError as exc:
            why = exc.strerror
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                with contextlib.suppress(OSError):
                    if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                        why = f"{part!r} is a symlink (not followed)"
            raise ImageRejected(f"{self.reference}: {what} ({'/'.join(parts)}): {why}") from None
        finally:
            os.close(fd)
        st = os.fstat(f)
        if not stat.S_ISREG(st.st_mode):
            os.close(f)
            raise ImageRejected(f"{self.reference}: {what} ({'/'.join(parts)}) is not a regular file")
        return f, st.st_size

    def _read_small(self, parts: list[str], what: str, digest: str | None) -> Any:
        fd, size = self._open(parts, what)
        try:
            if size > MAX_JSON:  # refused on its size: never read whole
                raise ImageRejected(f"{self.reference}: {what} is {size} bytes, more than {MAX_JSON}")
            with os.fdopen(fd, "rb", closefd=False) as fh:
                data = fh.read(MAX_JSON + 1)
        finally:
            os.close(fd)
        if digest is not None:
            got = f"sha256:{hashlib.sha256(data).hexdigest()}"
            if got != digest:
                raise ImageRejected(f"{self.reference}: {what} hashes to {got}, not its digest {digest}")
        return _json(data, f"{self.reference}: {what}")

    @staticmethod
    def _blob_parts(digest: object) -> list[str]:
        if not isinstance(digest, str):
            raise ImageRejected(f"not a sha256 digest: {digest!r}")
        algo, _, hexdigest = digest.partition(":")
        if algo != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
            raise ImageRejected(f"not a sha256 digest: {digest[:100]!r}")
        return ["blobs", "sha256", hexdigest]

    def manifest_digest(self) -> str:
        """The digest of the manifest the reference names (the image's id for the store)."""
        index = self._read_small(["index.json"], "index.json", None)
        manifests = index.get("manifests") if isinstance(index, dict) else None
        if not isinstance(manifests, list) or not all(isinstance(m, dict) for m in manifests):
            raise ImageRejected(f"{self.reference}: index.json has no list of manifests")
        tags = [str((m.get("annotations") or {}).get(OCI_REF_NAME, "")) for m in manifests
                if isinstance(m.get("annotations") or {}, dict)]
        if self.tag is not None:
            chosen = [m for m in manifests if isinstance(m.get("annotations"), dict)
                      and m["annotations"].get(OCI_REF_NAME) == self.tag]
            if len(chosen) != 1:
                raise ImageRejected(f"{self.reference}: the layout has {len(chosen)} images tagged {self.tag!r} "
                                    f"(its tags: {', '.join(repr(t) for t in tags[:20] if t) or 'none'})")
        else:
            chosen = manifests
            if len(chosen) != 1:
                raise ImageRejected(f"{self.reference}: the layout holds {len(chosen)} images; name one as "
                                    f"oci:DIR:TAG (its tags: {', '.join(repr(t) for t in tags[:20] if t) or 'none'})")
        if chosen[0].get("mediaType") == OCI_INDEX:
            raise ImageRejected(f"{self.reference}: names an index of several platforms, not one image (copy one "
                                "platform's image into the layout)")
        digest = chosen[0].get("digest")
        self._blob_parts(digest)
        return str(digest)

    def json_blob(self, desc: object, what: str) -> Any:
        if not isinstance(desc, dict):
            raise ImageRejected(f"{self.reference}: the {what} descriptor is not an object")
        digest = desc.get("digest")
        return self._read_small(self._blob_parts(digest), what, str(digest))

    @contextlib.contextmanager
    def layer_blob(self, desc: object, what: str) -> Iterator[IO[bytes]]:
        """A layer blob as a stream; after the block, the whole blob must have hashed to its
        digest and have its descriptor's size (refused otherwise: the caller's staging drops it)."""
        if not isinstance(desc, dict):
            raise ImageRejected(f"{self.reference}: the {what} descriptor is not an object")
        digest, want_size = desc.get("digest"), desc.get("size")
        fd, size = self._open(self._blob_parts(digest), what)
        with os.fdopen(fd, "rb") as fh:
            if isinstance(want_size, int) and size != want_size:
                raise ImageRejected(f"{self.reference}: {what} is {size} bytes, its descriptor says {want_size}")
            hashing = _Digesting(fh, size)
            yield hashing  # type: ignore[misc]
            while hashing.read(1 << 20):
                pass
            got = f"sha256:{hashing.sha.hexdigest()}"
            if got != digest:
                raise ImageRejected(f"{self.reference}: {what} hashes to {got}, not its digest {digest}")


class _Digesting(io.RawIOBase):
    """Reads a file up to ``limit`` bytes (its size when opened: a file growing meanwhile is not
    read past it), hashing every byte."""

    def __init__(self, raw: IO[bytes], limit: int) -> None:
        self.raw, self.left, self.sha = raw, limit, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self.raw.read(min(len(b), self.left))
        n = len(data)
        b[:n] = data
        self.left -= n
        self.sha.update(data)
        return n


def oci_image_id(reference: ImageRef) -> str:
    """The store's id of an ``oci:`` reference: its manifest's digest (refused if the reference names none)."""
    with OciLayout(reference) as layout:
        return f"oci:{layout.manifest_digest()}"


def import_oci_layout(store: LayerStore, reference: ImageRef, *, staging: Staging | None = None,
                      budget: ImportBudget | None = None) -> ImportedImage:
    """An image from an OCI image layout directory (``index.json``, ``blobs/sha256/...``), named
    ``oci:DIR`` (its one image) or ``oci:DIR:TAG`` (the image whose ``org.opencontainers.image.ref.name``
    is TAG, as ``skopeo copy ... oci:DIR:TAG`` writes it). Read as hostile input (``OciLayout``)."""
    with OciLayout(reference) as layout:
        manifest_digest = layout.manifest_digest()
        manifest = layout.json_blob({"digest": manifest_digest}, "manifest")
        if not isinstance(manifest, dict):
            raise ImageRejected(f"{reference}: the manifest is not an object")
        config = ImageConfig.from_config(reference, _object(layout.json_blob(manifest.get("config"), "config"),
                                                            reference))
        layer_descs = manifest.get("layers")
        if not isinstance(layer_descs, list) or len(layer_descs) != len(config.diff_ids):
            raise ImageRejected(f"{reference}: manifest and config disagree on layers")

        @contextlib.contextmanager
        def open_layer(i: int) -> Iterator[IO[bytes]]:
            with layout.layer_blob(layer_descs[i], f"layer {i + 1}") as fh:
                yield fh

        imported = _import(store, config, open_layer, staging=staging, budget=budget)
        return imported.model_copy(update={"image_id": f"oci:{manifest_digest}"})


def _object(raw: Any, reference: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ImageRejected(f"{reference}: the image config is not an object")
    return raw
