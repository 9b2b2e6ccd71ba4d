"""Where task images come from, read into the layer store: the local Docker engine (the image as the
engine holds it, exported by its API, no container started) and an OCI image layout on disk (what
``skopeo copy docker://REF oci:DIR:TAG`` writes, so a registry image arrives through the
distribution's well-kept tool rather than hand-written registry code).

Both give the same result: the image's config as ``docker run`` applies it (``Env``, ``WorkingDir``,
``User``) and its layers, bottom first, by DiffID, each unpacked once into the store.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import shutil
import socket
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field

from atropos.errors import ImageRejected
from atropos.sandbox.host.images.layer_store import LayerStore

DOCKER_SOCKET = "/var/run/docker.sock"
MAX_JSON = 4 << 20  # a manifest or config larger than this is not an image's


class ImageConfig(BaseModel):
    """What of an image's config a slot applies, as ``docker run`` would."""

    model_config = ConfigDict(frozen=True)

    reference: str
    diff_ids: tuple[str, ...] = Field(description="layers, bottom first")
    env: tuple[str, ...] = ()
    working_dir: str = "/"
    user: str = ""

    @classmethod
    def from_config(cls, reference: str, raw: dict[str, Any]) -> ImageConfig:
        conf = raw.get("config") or raw.get("Config") or {}
        rootfs = raw.get("rootfs") or {}
        diff_ids = rootfs.get("diff_ids")
        if rootfs.get("type") != "layers" or not isinstance(diff_ids, list) or not diff_ids:
            raise ImageRejected(f"{reference}: the image config has no rootfs.diff_ids")
        return cls(reference=reference, diff_ids=tuple(diff_ids), env=tuple(conf.get("Env") or ()),
                   working_dir=conf.get("WorkingDir") or "/", user=conf.get("User") or "")


class ImportedImage(BaseModel):
    config: ImageConfig
    layers: list[str]  # paths in the store, bottom first
    unpacked: int  # layers unpacked by this import (0: all were already in the store)
    image_id: str = ""  # sha256 of the config, the engine's image id (set by import_docker_archive)


def _json(data: bytes, what: str) -> Any:
    if len(data) > MAX_JSON:
        raise ImageRejected(f"{what} is larger than {MAX_JSON} bytes")
    try:
        return json.loads(data)
    except ValueError as exc:
        raise ImageRejected(f"{what} is not JSON: {exc}") from None


def _import(store: LayerStore, config: ImageConfig,
            open_layer: Callable[[int], contextlib.AbstractContextManager[IO[bytes]]]) -> ImportedImage:
    """Unpack the layers of ``config`` the store lacks (``open_layer(i)`` opens the i-th, bottom first)."""
    unpacked = 0
    for i, diff_id in enumerate(config.diff_ids):
        if store.has(diff_id):
            continue
        with open_layer(i) as stream:
            store.add(stream, diff_id=diff_id)  # refused unless the bytes hash to this DiffID
        unpacked += 1
    return ImportedImage(config=config, layers=[str(store.path(d)) for d in config.diff_ids], unpacked=unpacked)


def import_docker_archive(store: LayerStore, archive: Path, reference: str) -> ImportedImage:
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

        imported = _import(store, config, open_layer)
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


def import_from_engine_dirs(store: LayerStore, reference: str, *,
                            socket_path: str = DOCKER_SOCKET) -> ImportedImage | None:
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
    unpacked = 0
    for diff_id, layer_dir in zip(reversed(config.diff_ids), dirs, strict=True):
        if not store.has(diff_id):
            store.add_dir(Path(layer_dir), diff_id)
            unpacked += 1
    return ImportedImage(config=config, layers=[str(store.path(d)) for d in config.diff_ids], unpacked=unpacked)


def import_from_docker(store: LayerStore, reference: str, *, socket_path: str = DOCKER_SOCKET,
                       timeout: float = 600.0) -> ImportedImage:
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
            return import_docker_archive(store, Path(spool.name), reference)
    finally:
        conn.close()


def import_oci_layout(store: LayerStore, layout: Path, reference: str | None = None) -> ImportedImage:
    """An image from an OCI image layout directory (``index.json``, ``blobs/sha256/...``): the one
    manifest of the index, or the one whose ``org.opencontainers.image.ref.name`` is ``reference``."""
    index = _json((layout / "index.json").read_bytes(), "index.json")
    manifests = index.get("manifests") or []
    if reference is not None:
        manifests = [m for m in manifests
                     if (m.get("annotations") or {}).get("org.opencontainers.image.ref.name") == reference]
    if len(manifests) != 1:
        raise ImageRejected(f"{layout}: expected one image{f' named {reference!r}' if reference else ''}, "
                            f"found {len(manifests)}")

    def blob(digest: str) -> Path:
        algo, _, hexdigest = digest.partition(":")
        if algo != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
            raise ImageRejected(f"not a sha256 digest: {digest!r}")
        return layout / "blobs" / "sha256" / hexdigest

    manifest = _json(blob(manifests[0]["digest"]).read_bytes(), "manifest")
    ref = reference or str(layout)
    config = ImageConfig.from_config(ref, _json(blob(manifest["config"]["digest"]).read_bytes(), "config"))
    layer_descs = manifest.get("layers") or []
    if len(layer_descs) != len(config.diff_ids):
        raise ImageRejected(f"{ref}: manifest and config disagree on layers")

    @contextlib.contextmanager
    def open_layer(i: int) -> Iterator[IO[bytes]]:
        with open(blob(layer_descs[i]["digest"]), "rb") as fh:
            yield fh

    return _import(store, config, open_layer)
